"""Controller overhead: ``Controller.run`` vs a bare loop of the same compiled step.

8 simulated CPU devices, the ~2M-parameter MLP of ``monitor_overhead.py``, 32
samples per device by default (global batch 256), Adam. Both loops call the *same*
:class:`DataParallelStep` (the controller's own compiled step for its
configuration, so the same optimizer chain, monitors and executable) on
batches from the same kind of source (an :class:`adaptjax.ArrayDataset` over
the same arrays, each loop with its own cursor):

* ``bare``: ``state, _ = step(state, data.next_batch(b))`` in a Python loop;
  metrics are never read.
* ``controller``: ``Controller.run`` as a user runs it: metrics read one step
  behind, ``metrics.jsonl``/``events.jsonl`` written, a cheap policy asked
  every 10 steps (``ReduceLROnPlateau(patience=10**9)`` on the loss: it reads
  the metric and never acts), no periodic checkpoints and no evaluation. The
  progress bar and TensorBoard are measured both ways: ``user`` (on, the
  defaults) and ``quiet`` (off); each variant is its own controller, measured
  against its own interleaved bare blocks.

Blocks of ``--block-steps`` steps alternate, bare and controller, in one
process: the controller's ``on_step`` hook, at every block boundary, waits for
the controller's last step, then runs one block of the bare loop (blocked
until ready) and returns. Each block starts with an idle device and ends when
its last step's result is ready. The first ``--warmup-blocks`` pairs
(compilation, caches) are dropped. A controller block's ratio is its time over
the mean of the bare blocks just before and just after it (cancels linear
drift from other load on the machine); the reported ratio is the median of
these, with their interquartile range. The ratio of median block times is
printed as a cross-check.

On 2 cores the simulated devices' compute and the host's Python share the same
CPUs, and other processes add noise to wall time. Two CPU-time figures are
printed per variant as well: process CPU time per step (all threads) and the
main thread's CPU time per step, whose difference between the loops is the
controller's own host work (reading metrics, logs, policy, progress bar).

Minor page faults per step are printed for both loops, and ``--steady-malloc``
restarts with glibc's malloc kept in one untrimmed arena, as in
``monitor_overhead.py`` (whose docstring says why).

Usage:
  python benchmarks/controller_overhead.py [--blocks 90] [--block-steps 5]
      [--variants user,quiet] [--per-device-batch 32] [--steady-malloc]

The last line is ``controller_overhead_ratio=<x> se=<its standard error>
iqr=<q25>-<q75> malloc=<default or steady>`` for the first variant (default
``user``: progress bar and TensorBoard on). ``se`` is the bootstrap standard
error of the median paired ratio, how far the ratio moves between runs from
the sampling of blocks alone (0.003-0.005 at 90 blocks here);
the interquartile range is the spread of single blocks. Target: <= 1.02.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

# The ~2.1M-parameter MLP of monitor_overhead.py (this folder is sys.path[0] when run).
from monitor_overhead import (  # noqa: E402
    bootstrap_standard_error,
    init_params,
    loss_fn,
    make_arrays,
    malloc_setting,
    minor_faults,
    restart_with_steady_malloc,
)

import adaptjax  # noqa: E402
from adaptjax import policies as ajp  # noqa: E402

DEVICES = 8
PER_DEVICE = 32
VARIANTS = {"user": True, "quiet": False}  # progress bar and TensorBoard on / off


class Alternate:
    """The ``on_step`` hook: at each block boundary, time the controller's block, run a bare one."""

    def __init__(self, block_steps, data):
        self.block_steps = block_steps
        self.data = data
        self.step_fn = None
        self.state = None
        self.t_start = None
        self.t_cpu = None
        self.ctrl_times, self.bare_times = [], []
        self.ctrl_cpu, self.bare_cpu = [], []
        self.ctrl_host, self.bare_host = [], []
        self.ctrl_faults, self.bare_faults = [], []

    def __call__(self, ctrl):
        if ctrl.step % self.block_steps:
            return
        jax.block_until_ready(ctrl.state)  # the controller's block ends with its last result
        now, cpu, host = time.perf_counter(), time.process_time(), time.thread_time()
        if self.t_start is not None:
            self.ctrl_times.append(now - self.t_start)
            self.ctrl_cpu.append(cpu - self.t_cpu)
            self.ctrl_host.append(host - self.t_host)
            self.ctrl_faults.append(minor_faults() - self.t_faults)
        if self.step_fn is None:
            # The controller's own compiled step for its configuration, and a
            # private copy of its (donated) state for the bare loop.
            self.step_fn = ctrl.steps.step(ctrl.config)
            self.batch_size = ctrl.config.batch_size
            self.state = jax.tree.map(lambda x: jax.device_put(np.array(x), x.sharding), ctrl.state)
        f0 = minor_faults()
        t0, c0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
        state = self.state
        for _ in range(self.block_steps):
            state, _ = self.step_fn(state, self.data.next_batch(self.batch_size))
        jax.block_until_ready(state)
        self.bare_times.append(time.perf_counter() - t0)
        self.bare_cpu.append(time.process_time() - c0)
        self.bare_host.append(time.thread_time() - h0)
        self.bare_faults.append(minor_faults() - f0)
        self.state = state
        self.t_faults = minor_faults()
        self.t_start, self.t_cpu = time.perf_counter(), time.process_time()
        self.t_host = time.thread_time()


def measure(variant, args, arrays):
    per_device = args.per_device_batch
    show = VARIANTS[variant]
    hook = Alternate(args.block_steps, adaptjax.ArrayDataset(arrays, seed=0))
    with tempfile.TemporaryDirectory() as run_dir:
        spec = adaptjax.RunSpec(run_dir=run_dir, devices=DEVICES, batch_size=DEVICES * per_device,
                                learning_rate=1e-3, policy_every=10,
                                policies=[ajp.ReduceLROnPlateau("loss", patience=10**9)])
        ctrl = adaptjax.Controller(
            init_params(), loss_fn, optax.adam(1e-3), adaptjax.ArrayDataset(arrays, seed=0), spec,
            hooks=[*(adaptjax.default_hooks() if show else []), adaptjax.Hook(hook)],
        )
        ctrl.run((args.warmup_blocks + args.blocks + 1) * args.block_steps)
        compilations = ctrl.compilations
        ctrl.close()
    w = args.warmup_blocks
    out = {"compilations": compilations}
    out["faults"] = {  # per step, over the measured blocks
        kind: float(np.mean(x[w:])) / args.block_steps
        for kind, x in (("ctrl", hook.ctrl_faults), ("bare", hook.bare_faults))
    }
    for kind, ctrl_x, bare_x in (
        ("wall", hook.ctrl_times, hook.bare_times),
        ("cpu", hook.ctrl_cpu, hook.bare_cpu),
        ("host", hook.ctrl_host, hook.bare_host),
    ):
        # ctrl_x[k] lies between bare_x[k] and bare_x[k + 1].
        ctrl_t = np.array(ctrl_x[w:])
        bare_t = np.array(bare_x[w:])
        ratios = ctrl_t / ((bare_t[:-1] + bare_t[1:]) / 2)
        out[kind] = {
            "ratio": float(np.median(ratios)),
            "q25": float(np.percentile(ratios, 25)),
            "q75": float(np.percentile(ratios, 75)),
            "se": bootstrap_standard_error(np.median, ratios),
            "ratio_of_medians": float(np.median(ctrl_t) / np.median(bare_t)),
            "ctrl_ms": float(np.median(ctrl_t)) / args.block_steps * 1e3,
            "bare_ms": float(np.median(bare_t)) / args.block_steps * 1e3,
            "blocks": len(ratios),
        }
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=90, help="measured block pairs per variant")
    parser.add_argument("--block-steps", type=int, default=5, help="steps per block")
    parser.add_argument("--warmup-blocks", type=int, default=2, help="block pairs dropped first")
    parser.add_argument(
        "--per-device-batch", type=int, default=PER_DEVICE, help="samples per device per step"
    )
    parser.add_argument(
        "--variants",
        default="user,quiet",
        help="comma list of user (progress bar + TensorBoard, the defaults) and quiet (both off); "
        "the last line reports the first",
    )
    parser.add_argument("--steady-malloc", action="store_true",
                        help="restart with glibc's malloc kept in one untrimmed arena "
                        "(see monitor_overhead.py)")
    args = parser.parse_args()
    if args.steady_malloc:
        restart_with_steady_malloc()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants takes a comma list of {sorted(VARIANTS)}, got {args.variants!r}")
    if min(args.blocks, args.block_steps, args.warmup_blocks, args.per_device_batch) < 1:
        parser.error("--blocks, --block-steps, --warmup-blocks and --per-device-batch must be >= 1")

    arrays = make_arrays()
    n_params = sum(x.size for x in jax.tree.leaves(init_params()))
    print(
        f"params={n_params} devices={DEVICES} per_device_batch={args.per_device_batch} "
        f"block_steps={args.block_steps} blocks={args.blocks} warmup_blocks={args.warmup_blocks} "
        f"policy=ReduceLROnPlateau(never acts) every 10 steps, checkpoints off, eval off, "
        f"malloc {malloc_setting()}"
    )
    results = {}
    for variant in variants:
        r = results[variant] = measure(variant, args, arrays)
        print(
            f"{variant} (progress bar + TensorBoard {'on' if VARIANTS[variant] else 'off'}), "
            f"{r['wall']['blocks']} block pairs, compilations {r['compilations']}:",
            flush=True,
        )
        for kind, label in (
            ("wall", "wall time"),
            ("cpu", "process CPU"),
            ("host", "main-thread CPU"),
        ):
            m = r[kind]
            print(
                f"  {label:>16}: bare {m['bare_ms']:7.2f} ms/step, controller "
                f"{m['ctrl_ms']:7.2f} ms/step; paired ratio median {m['ratio']:.4f} "
                f"± {m['se']:.4f} (IQR {m['q25']:.4f}-{m['q75']:.4f}), ratio of medians "
                f"{m['ratio_of_medians']:.4f}",
                flush=True,
            )
        print(f"  page faults/step: bare {r['faults']['bare']:.0f}, "
              f"controller {r['faults']['ctrl']:.0f}", flush=True)
        extra = r["host"]["ctrl_ms"] - r["host"]["bare_ms"]
        print(
            f"  controller host work: {extra:+.2f} ms/step on the main thread = "
            f"{extra / r['wall']['bare_ms']:+.2%} of a bare step if none of it overlapped",
            flush=True,
        )
    first = results[variants[0]]["wall"]
    print(f"controller_overhead_ratio={first['ratio']:.4f} se={first['se']:.4f} "
          f"iqr={first['q25']:.4f}-{first['q75']:.4f} malloc={malloc_setting()}")


if __name__ == "__main__":
    main()
