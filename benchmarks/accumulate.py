"""Accumulated micro-steps against one compiled step of the same global batch, on the LM.

The byte-level LM (``examples/lm.py``'s ``ByteLM``, ``--size``, dropout off),
``--devices`` simulated CPU devices, Adam after ``sync_gradients`` with the
noise-scale monitors, global batch ``k × --micro`` windows:

* ``one step``: :func:`adaptjax.data_parallel_step` compiled for the whole
  global batch (what a batch change costs today: a compile per batch size);
* ``accumulated``: :func:`adaptjax.accumulate` around the same chain, compiled
  once for a ``--micro`` batch, ``k`` calls per optimizer step, ``k`` set in the
  state (:func:`adaptjax.set_micro_steps`).

Both run interleaved over the same windows, ``--rounds`` rounds of one
optimizer step each after a warm-up; the figure is the median over rounds of
the ratio of the two (accumulated seconds per optimizer step over the one
step's). A batch change is timed too: building and compiling the one step for
the next batch size, against setting ``k`` (and the compiles that caused,
counted from the jitted step's cache).

Usage:
  python benchmarks/accumulate.py [--size small] [--devices 8] [--micro 32] [--k 2 4]

The last line is ``accumulate_overhead=<median ratio at the largest k>
compile_s_per_change_one_step=<s> compile_s_per_change_accumulated=<s>
recompiles_per_change=<n>``. Target: overhead <= 1.05, 0 recompiles.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import adaptjax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from lm import SIZES, ByteLM, loss_fn  # noqa: E402


def _chain():
    monitors = (adaptjax.GradientNoiseScale(), adaptjax.GradientSNR(), adaptjax.GradientNorm())
    return optax.chain(adaptjax.sync_gradients("data", monitors=monitors), optax.adam(1e-3))


def _windows(rows, context, seed):
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, 256, size=(rows, context + 1)).astype(np.int32)}


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return out, time.perf_counter() - t0


def _rounds(one, state, whole, run_acc, acc, rounds):
    """Interleaved rounds after two warm-up ones: the times of each and their ratios."""
    t_one, t_acc, ratios = [], [], []
    for r in range(rounds + 2):
        state, a = _timed(lambda state=state: one(state, whole)[0])
        acc, b = _timed(lambda acc=acc: run_acc(acc))
        if r >= 2:
            t_one.append(a)
            t_acc.append(b)
            ratios.append(b / a)
    return state, acc, t_one, t_acc, ratios


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--micro", type=int, default=32, help="global windows per micro-step")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args(argv)
    cfg = dataclasses.replace(SIZES[args.size], dropout=0.0)
    mesh = adaptjax.make_mesh(args.devices)
    model = ByteLM(cfg, nnx.Rngs(0))

    acc_tx = adaptjax.accumulate(_chain())
    acc_step = adaptjax.data_parallel_step(loss_fn, acc_tx, mesh)
    acc = adaptjax.init_state(model, acc_tx, mesh)
    acc, first = _timed(lambda: acc_step(acc, _windows(args.micro, cfg.context, seed=99))[0])
    print(f"LM {args.size}, {args.devices} devices, micro-step {args.micro} windows "
          f"of {cfg.context}; Adam after sync_gradients with the noise-scale monitors; "
          f"the accumulated step compiled once, {first:.1f} s")
    last = {}
    for k in args.k:
        micro = [_windows(args.micro, cfg.context, seed=j) for j in range(k)]
        whole = {"tokens": np.concatenate([m["tokens"] for m in micro])}
        tx = _chain()
        state = adaptjax.init_state(model, tx, mesh)
        one = adaptjax.data_parallel_step(loss_fn, tx, mesh)
        state, compile_one = _timed(lambda: one(state, whole)[0])  # noqa: B023 (called here)
        before = acc_step.jitted._cache_size()
        acc = dataclasses.replace(acc, opt_state=adaptjax.set_micro_steps(acc.opt_state, k))

        def run_acc(acc, micro=micro):
            for mb in micro:
                acc, _ = acc_step(acc, mb)
            return acc

        acc, change_acc = _timed(lambda acc=acc: run_acc(acc))
        recompiles = acc_step.jitted._cache_size() - before
        state, acc, t_one, t_acc, ratios = _rounds(one, state, whole, run_acc, acc, args.rounds)
        ratio = statistics.median(ratios)
        print(f"k={k}: global batch {k * args.micro}; one step {statistics.median(t_one) * 1e3:.1f}"
              f" ms, {k} micro-steps {statistics.median(t_acc) * 1e3:.1f} ms, ratio {ratio:.3f}"
              f" (min {min(ratios):.3f}, max {max(ratios):.3f}); a batch change: one step "
              f"{compile_one:.1f} s to compile and run, accumulated {change_acc:.2f} s to run "
              f"({recompiles} compiles)")
        last = {"ratio": ratio, "one": compile_one, "acc": change_acc, "recompiles": recompiles}
    print(f"accumulate_overhead={last['ratio']:.3f} "
          f"compile_s_per_change_one_step={last['one']:.1f} "
          f"compile_s_per_change_accumulated={last['acc']:.2f} "
          f"recompiles_per_change={last['recompiles']}")
    return last


if __name__ == "__main__":
    main()
