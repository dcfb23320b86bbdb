"""Host time of ``GrainDataset.next_batch`` per step: read ahead vs read when asked.

A ``grain.MapDataset`` whose elements each take ``--read-ms`` to read (a sleep:
the latency of a record read from storage, which releases the GIL as file
reads do) and a little decoding (a 4 KB record to float32), fed in batches of
``--batch`` to a loop whose step takes ``--step-ms`` of device time (a sleep:
the host waits for the device, as it does while a dispatched step runs). The
time spent inside ``next_batch`` is what the step loop loses to reading:

* ``plain``: one thread, nothing read ahead (``num_threads=1, prefetch=0``);
* ``threads``: 16 reading threads, nothing read ahead (``prefetch=0``);
* ``prefetch``: 16 reading threads and the next 2 batches read while the step
  runs (the defaults).

Usage:
  python benchmarks/grain_next_batch.py [--steps 100] [--batch 64] [--read-ms 0.2]
      [--step-ms 30]

The last line is ``grain_next_batch_ms plain=<median> threads=<median>
prefetch=<median>``.
"""

from __future__ import annotations

import argparse
import time

import grain
import numpy as np

import adaptjax


def pipeline(read_ms: float) -> grain.MapDataset:
    records = grain.MapDataset.source([bytes(4096)] * 4096)

    def read(record):
        time.sleep(read_ms / 1e3)
        return {"x": np.frombuffer(record, np.uint8).astype(np.float32)}

    return records.shuffle(seed=0).map(read)


def next_batch_ms(data, steps: int, batch: int, step_ms: float) -> np.ndarray:
    """Milliseconds inside each ``next_batch`` of a loop whose step sleeps ``step_ms``."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        data.next_batch(batch)
        times.append(time.perf_counter() - start)
        time.sleep(step_ms / 1e3)  # the device runs the step
    data.close()
    return np.asarray(times[1:]) * 1e3  # the first read has nothing ahead of it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--read-ms", type=float, default=0.2)
    parser.add_argument("--step-ms", type=float, default=30.0)
    args = parser.parse_args()
    variants = {
        "plain": dict(num_threads=1, prefetch=0),
        "threads": dict(num_threads=16, prefetch=0),
        "prefetch": dict(num_threads=16, prefetch=2),
    }
    medians = {}
    print(f"batch={args.batch} read_ms={args.read_ms} step_ms={args.step_ms} steps={args.steps}")
    for name, options in variants.items():
        data = adaptjax.GrainDataset(pipeline(args.read_ms), **options)
        ms = next_batch_ms(data, args.steps, args.batch, args.step_ms)
        medians[name] = float(np.median(ms))
        print(f"{name:9s} next_batch median {medians[name]:8.3f} ms  p90 "
              f"{np.percentile(ms, 90):8.3f} ms  max {ms.max():8.3f} ms")
    print("grain_next_batch_ms " + " ".join(f"{k}={v:.3f}" for k, v in medians.items()))


if __name__ == "__main__":
    main()
