"""How a growing batch is carried: compiled whole, in fixed micro-steps, or as "auto" chooses.

The byte-level LM (``examples/lm.py``, the workload of ``adaptive_batch.py`` and
``frontier_run.py``) under the controller, ``--devices`` simulated CPU devices,
Adam, one seed. A schedule doubles the batch from ``--batch`` three times, every
``--steps`` optimizer steps (a batch-size warm-up, or Seesaw's doublings), in
four runs over the same samples:

* ``whole``: ``RunSpec(micro_batch_size=None)``: each new batch compiles its step;
* ``fixed``: ``micro_batch_size=--batch``: one compiled step, ``k`` micro-steps;
* ``auto``: ``micro_batch_size="auto"``: at each change the controller compiles
  the new batch or accumulates micro-steps of a compiled step, whichever its
  measurements say pays (``carry_batch`` events: printed with their reasons);
* ``auto-foreground``: ``"auto"`` with ``CompileOptions(precompile_upcoming=False)``:
  no compile in the background (neither the schedule's announced batches nor
  the ones ``"auto"`` would compile off the path), so every compile is waited for;
* ``auto-memory``: ``"auto"`` with ``CompileOptions(device_memory=...)`` set to
  what the controller estimates a step of ``2 x --batch`` needs: larger batches
  would not fit, so they must run as micro-steps of a program that does.

Per run: training seconds (compiles included, the first step's too), the
programs it ran, the compiles it waited for and their seconds (a program
compiled ahead in the background, from the schedule's announced next batch,
is not waited for, but it takes a core while it compiles), steps, the final
validation loss, and the largest per-device bytes (XLA's memory analysis) of a
program it ran. The runs take the same samples in the same order, so their
losses agree up to float32 rounding (an accumulated step sums its
micro-batches' gradients in another order).

Usage:
  python benchmarks/auto_micro_batch.py [--steps 40] [--batch 16] [--devices 2]

Last line: ``auto_seconds_vs_whole=<x> auto_seconds_vs_fixed=<x> foreground_vs_fixed=<x>
programs=<whole>/<fixed>/<auto> memory_bounded=<largest bytes>/<device_memory>``.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import adaptive_batch as ab  # noqa: E402

import adaptjax  # noqa: E402
from adaptjax import policies as ajp  # noqa: E402

MODES = ("whole", "fixed", "auto", "auto-foreground", "auto-memory")


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per batch size")
    parser.add_argument("--batch", type=int, default=16, help="the first batch (doubled 3x)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--devices", type=int, default=2)
    ab.add_workload_args(parser)
    return parser


def run(mode, data, cfg, args, device_memory, evaluate):
    """One run of ``mode``: what the table prints."""
    micro = {"whole": None, "fixed": args.batch}.get(mode, "auto")
    background = mode != "auto-foreground"
    sched = {args.steps * i: ajp.SetBatchSize(args.batch * 2**i) for i in (1, 2, 3)}
    spec = adaptjax.RunSpec(
        run_dir=tempfile.mkdtemp(prefix="auto_micro_"), devices=args.devices,
        batch_size=args.batch, micro_batch_size=micro, policy_every=1,
        policies=[ajp.Schedule(sched)],
        compile=adaptjax.CompileOptions(
            cache_dir=None, precompile_upcoming=background,
            device_memory=device_memory if mode == "auto-memory" else None))
    ctrl = adaptjax.Controller(
        ab.ByteLM(cfg, nnx.Rngs(params=0, dropout=1)), ab.loss_fn, optax.adam(args.lr),
        adaptjax.ArrayDataset({"tokens": data}, seed=0), spec, hooks=[])
    try:
        t0 = time.perf_counter()
        ctrl.run(4 * args.steps)
        seconds = time.perf_counter() - t0
        compiles = [e for e in ctrl.log.events if e["kind"] == "compile"]
        # every program that ran: its first call is a compile event (compiled ahead or not)
        programs = {ctrl.steps.compiled(adaptjax.RunConfig(**e["config"])) for e in compiles}
        largest = max(ctrl.steps.memory(c, ctrl.data)[0] for c in programs)
        waited = [e for e in compiles if not e.get("compiled_ahead")]
        out = {"seconds": seconds, "compiles": len(compiles), "waited": len(waited),
               "compile_s": sum(e["latency_s"] for e in waited), "steps": ctrl.step,
               "loss": evaluate(ctrl.model)["loss"], "bytes": largest,
               "carried": [e for e in ctrl.log.events if e["kind"] == "carry_batch"]}
        ctrl.close()
    finally:
        shutil.rmtree(spec.run_dir, ignore_errors=True)
    return out


def estimate_limit(data, cfg, args) -> int:
    """What the controller estimates a step of ``2 x --batch`` needs per device (from the
    compiled step of ``--batch``: its fixed bytes plus its temporaries doubled)."""
    spec = adaptjax.RunSpec(run_dir=tempfile.mkdtemp(prefix="auto_micro_"), devices=args.devices,
                            batch_size=args.batch, micro_batch_size="auto",
                            compile=adaptjax.CompileOptions(cache_dir=None))
    ctrl = adaptjax.Controller(
        ab.ByteLM(cfg, nnx.Rngs(params=0, dropout=1)), ab.loss_fn, optax.adam(args.lr),
        adaptjax.ArrayDataset({"tokens": data}, seed=0), spec, hooks=[])
    try:
        total, temp = ctrl.steps.memory(ctrl.config, ctrl.data)
        ctrl.close()
    finally:
        shutil.rmtree(spec.run_dir, ignore_errors=True)
    return total + temp


def main(argv=None):
    args = build_parser().parse_args(argv)
    cfg = ab.LMConfig(layers=args.layers, width=args.width, heads=4, context=args.context,
                      dropout=0.0)
    train_w, val_w, _ = ab.lm_data.load_corpus(context=cfg.context,
                                               max_train_bytes=args.max_train_bytes)
    evaluate = ab.make_eval(ab.lm_data.evenly_spaced(val_w, args.val_windows),
                            ab.ByteLM(cfg, nnx.Rngs(0)))
    args.devices = min(args.devices, len(jax.devices()))
    limit = estimate_limit(train_w, cfg, args)
    print(f"model {cfg}; devices={args.devices}; batches {args.batch}..{args.batch * 8}, "
          f"{args.steps} steps each; auto-memory's device_memory {limit} bytes", flush=True)
    runs = {}
    for mode in MODES:
        runs[mode] = r = run(mode, train_w, cfg, args, limit, evaluate)
        print(f"{mode:>12}: {r['seconds']:6.1f} s, {r['compiles']} programs, "
              f"{r['waited']} compiles waited for ({r['compile_s']:.1f} s), {r['steps']} "
              f"steps, validation loss {r['loss']:.4f}, largest program {r['bytes']} bytes "
              "per device", flush=True)
        for e in r["carried"]:
            print(f"{'':>14}batch {e['batch_size']}: {e['micro_steps']} x {e['micro_batch']}"
                  f"{', compiled' if e['compiles'] else ''}: {e['reason']}")
    whole, fixed, auto, fore, mem = (runs[m] for m in MODES)
    print(f"auto_seconds_vs_whole={auto['seconds'] / whole['seconds']:.3f} "
          f"auto_seconds_vs_fixed={auto['seconds'] / fixed['seconds']:.3f} "
          f"foreground_vs_fixed={fore['seconds'] / fixed['seconds']:.3f} "
          f"programs={whole['compiles']}/{fixed['compiles']}/{auto['compiles']} "
          f"memory_bounded={mem['bytes']}/{limit}")
    return runs


if __name__ == "__main__":
    main()
