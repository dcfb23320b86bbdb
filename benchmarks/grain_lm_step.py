"""The LM's step time fed by a grain pipeline vs by an ArrayDataset, side by side in one run.

Two controllers train ``examples/lm.py``'s ``ByteLM`` (``--size``, a fixed
batch, no policies) on the same windows of the standard library's sources:

* ``array``: ``adaptjax.ArrayDataset({"tokens": windows, "idx": ...})``;
* ``grain``: ``adaptjax.GrainDataset`` over ``grain.MapDataset.source`` of the
  same rows with the same structure (its elements read on host threads, the
  next batches read ahead while the step runs).

They run alternately, ``--block`` steps at a time (each block waited for), in
``--rounds`` rounds, the order drawn anew each round; a round's ratio is grain's
seconds per step over the ArrayDataset's. The host time inside ``next_batch`` is
timed for both. The consumed ``idx`` of the grain run are counted: per complete
epoch, the windows never read (``skipped``) and, in every epoch, those read twice
(``repeated``); the default corpus (``--max-train-bytes 8000``, 499 windows of
the tiny model's context) makes the run read more than two whole epochs.

The simulated devices share the machine's cores with everything else running:
on a loaded machine the ratio is noisy; the paired median is the steadier one.

Usage:
  python benchmarks/grain_lm_step.py [--size tiny] [--batch 32] [--rounds 8] [--block 5]
      [--max-train-bytes 8000]

The last line is ``grain_step_ratio=<paired median> skipped=<n> repeated=<n>``.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import grain  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import lm  # noqa: E402
import lm_data  # noqa: E402

import adaptjax  # noqa: E402


class Timed:
    """Passes the controller's calls to a dataset; times ``next_batch`` and keeps ``idx``."""

    def __init__(self, data):
        self.data, self.ms, self.idx = data, [], []

    def __getattr__(self, name):
        return getattr(self.data, name)

    def next_batch(self, batch_size):
        t0 = time.perf_counter()
        batch = self.data.next_batch(batch_size)
        self.ms.append((time.perf_counter() - t0) * 1e3)
        self.idx.extend(np.asarray(batch["idx"]).tolist())
        return batch


def counts(idx: list, n: int) -> tuple[int, int]:
    """(skipped, repeated): per epoch of ``n`` positions, indices missing and read twice."""
    skipped = repeated = 0
    for start in range(0, len(idx), n):
        epoch = idx[start:start + n]
        repeated += len(epoch) - len(set(epoch))
        if len(epoch) == n:
            skipped += n - len(set(epoch))
    return skipped, repeated


def controller(cfg, data, batch: int, run_dir: str):
    model = lm.ByteLM(cfg, nnx.Rngs(params=0, dropout=1))
    spec = adaptjax.RunSpec(run_dir=run_dir, devices=8, batch_size=batch, learning_rate=1e-3,
                            checkpoint=adaptjax.CheckpointOptions(every=None))
    return adaptjax.Controller(model, lm.loss_fn, optax.adam(1e-3), data, spec,
                               hooks=[])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--max-train-bytes", type=int, default=8000)  # ~500 windows
    args = parser.parse_args()
    cfg = lm.model_config(lm.build_parser().parse_args(["--size", args.size]))
    windows, _, _ = lm_data.load_corpus(None, context=cfg.context,
                                        max_train_bytes=args.max_train_bytes)
    n = len(windows)
    rows = {"tokens": windows, "idx": np.arange(n, dtype=np.int32)}
    source = grain.MapDataset.source([{k: v[i] for k, v in rows.items()} for i in range(n)])
    datasets = {"array": Timed(adaptjax.ArrayDataset(rows, seed=0)),
                "grain": Timed(adaptjax.GrainDataset(source.shuffle(seed=0)))}
    root = tempfile.mkdtemp(prefix="grain_lm_step_")
    ctrls = {k: controller(cfg, d, args.batch, os.path.join(root, k)) for k, d in datasets.items()}
    for ctrl in ctrls.values():  # compile and warm up outside the timing
        ctrl.run(ctrl.step + 2)
        jax.block_until_ready(ctrl.state.params)
    rng = np.random.default_rng(0)
    seconds = {k: [] for k in ctrls}
    for _ in range(args.rounds):
        for name in rng.permutation(list(ctrls)):
            ctrl = ctrls[name]
            t0 = time.perf_counter()
            ctrl.run(ctrl.step + args.block)
            jax.block_until_ready(ctrl.state.params)
            seconds[name].append((time.perf_counter() - t0) / args.block)
    ratios = np.array(seconds["grain"]) / np.array(seconds["array"])
    print(f"size={args.size} batch={args.batch} windows={n} rounds={args.rounds} "
          f"block={args.block} devices=8 (simulated)")
    for name, data in datasets.items():
        print(f"{name:6s} step median {np.median(seconds[name]) * 1e3:8.2f} ms  "
              f"next_batch median {np.median(data.ms[2:]):7.3f} ms  p90 "
              f"{np.percentile(data.ms[2:], 90):7.3f} ms")
    median_ratio = np.median(seconds["grain"]) / np.median(seconds["array"])
    print(f"ratio of medians {median_ratio:.3f}  paired median {np.median(ratios):.3f}  "
          f"rounds' ratios min {ratios.min():.3f} max {ratios.max():.3f}")
    skipped, repeated = counts(datasets["grain"].idx, n)
    for ctrl in ctrls.values():
        ctrl.close()
    datasets["grain"].data.close()
    shutil.rmtree(root, ignore_errors=True)
    print(f"grain_step_ratio={np.median(ratios):.3f} skipped={skipped} repeated={repeated}")


if __name__ == "__main__":
    main()
