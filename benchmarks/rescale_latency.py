"""Rescale latency: an in-process 8 -> 4 device rescale vs a cold process restart.

8 simulated CPU devices, the ~2M-parameter MLP of ``monitor_overhead.py``
(Adam; parameters, optimizer and monitor state ≈ 26 MB), global batch 256,
TensorBoard on as by default, progress bar off, no policies. This script
starts, per repeat, a *training process* and then a *restarted process* (both
this file, run as new Python processes, one after the other, so each repeat
starts from cold caches as a real job does), and compares:

* ``in-process 8->4`` (training process): after a few steps of
  ``Controller.run`` on 8 devices and with the device idle,
  ``ctrl.apply([Rescale(devices=4)])`` (drain, Orbax checkpoint, new mesh, restore with the new
  shardings) and then the first step on 4 devices (compilation included), until
  its result is ready. This is the controller's ``on_step`` hook calling
  ``rescale`` between two steps of ``Controller.run``, as an action would.
* ``return 4->8`` and ``return 8->4``: the same, back to a mesh whose step is
  already compiled (checkpoint, restore, first step; no compilation of the
  step). ``return 4->8`` is also the first checkpoint written from the
  4-device mesh; ``return 8->4`` repeats a transition seen before.
* ``cold restart`` (restarted process): imports everything, builds the model
  and data, calls
  ``Controller.resume(run_dir, ...)`` and runs one step. It resumes from the
  checkpoint the in-process run wrote last (a copy in its own run_dir), whose
  configuration is the 4-device one, so it restores onto the same 4-device
  mesh and compiles the same step as the in-process rescale. Timed from just
  before the process is created to the first step's result (wall clock shared
  by both processes), with the child's own breakdown.

The first rescale in a process also pays one-time costs a process pays once
(the first Orbax save from each mesh compiles JAX slicing ops); they are
counted, since a job meets them on its first rescale. ``--precompile`` calls
``Controller.precompile(devices=4)`` before the rescale (AOT from abstract
shapes, what a job does ahead of a scheduled rescale); the rescale then finds
the step compiled. The restart is charged no checkpoint
save (the brief's definition: from the checkpoint to the first step), though a
restart-based rescale must write one in the old process first.

Usage:
  python benchmarks/rescale_latency.py [--repeats 3] [--warm-steps 5] [--precompile]

Prints the time to return to the 8-device mesh, already compiled (target
<= 1 s), as ``return_to_compiled_mesh_s=<median of return 4->8>`` and ends with
``rescale_vs_restart_ratio=<median in-process 8->4 / median cold restart>``
(target <= 0.2).
"""

import time

_T_PYTHON = time.time()  # this process's start, before the heavy imports

import os  # noqa: E402
import sys  # noqa: E402

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import adaptjax  # noqa: E402
from adaptjax import policies as ajp  # noqa: E402

_T_IMPORTED = time.time()

# The ~2.1M-parameter MLP of monitor_overhead.py (this folder is sys.path[0] when run).
from monitor_overhead import init_params, loss_fn, make_arrays  # noqa: E402

BATCH = 256
RESULT_TAG = "BENCH_RESULT "


def controller_kwargs(on_step):
    """What the training and the restarted process both pass (code can't come from disk;
    the restarted process reads the spec from the run directory)."""
    return dict(
        model=init_params(),
        loss_fn=loss_fn,
        optimizer=optax.adam(1e-3),
        data=adaptjax.ArrayDataset(make_arrays(), seed=0),
        hooks=[adaptjax.TensorBoard(), adaptjax.Hook(on_step)],
    )


def spec(run_dir):
    """The training's :class:`adaptjax.RunSpec`."""
    return adaptjax.RunSpec(run_dir=run_dir, devices=8, batch_size=BATCH,
                            checkpoint=adaptjax.CheckpointOptions(max_to_keep=None))


def launch(role, run_dir, *flags):
    """Runs this file as a new process in ``role``; returns (its JSON result, launch time)."""
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--role", role, run_dir, *flags],
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        sys.exit(f"the {role} process failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT_TAG) :]), t0


# ------------------------------------------------------------------ the cold restart
def restart_role(run_dir):
    """Resumes the run in ``run_dir`` and takes one step; prints timestamps as JSON."""
    marks = {}

    def on_step(ctrl):
        if "first_step" not in marks:
            jax.block_until_ready(ctrl.state)
            marks["first_step"] = time.time()

    t_build = time.time()
    ctrl = adaptjax.Controller.resume(run_dir, **controller_kwargs(on_step))
    t_resumed = time.time()
    start_step = ctrl.step
    ctrl.run(ctrl.step + 1)
    compile_s = [e["latency_s"] for e in ctrl.log.events if e["kind"] == "compile"]
    result = {
        "python_start": _T_PYTHON,
        "imported": _T_IMPORTED,
        "build": t_build,
        "resumed": t_resumed,
        "first_step": marks["first_step"],
        "devices": ctrl.config.devices,
        "resumed_at_step": start_step,
        "compile_dispatch_s": compile_s[0] if compile_s else None,
    }
    print(RESULT_TAG + json.dumps(result), flush=True)
    ctrl.close()


def cold_restart(run_dir):
    r, t0 = launch("restart", run_dir)
    return {
        "total": r["first_step"] - t0,
        "python_and_imports": r["imported"] - t0,
        "resume": r["resumed"] - r["build"],
        "first_step": r["first_step"] - r["resumed"],
        "devices": r["devices"],
        "compile_dispatch_s": r["compile_dispatch_s"],
    }


# ------------------------------------------------------------------ the in-process rescales
class Rescaler:
    """The ``on_step`` hook: at chosen steps, rescale with the device idle; time to next result."""

    def __init__(self, plan, precompile_devices=None):
        self.plan = dict(plan)  # {step: (label, devices)}
        self.open = None  # (label, t0) of the rescale whose first step is pending
        self.results = {}
        self.precompile_devices = precompile_devices
        self.precompile_s = None

    def __call__(self, ctrl):
        if self.precompile_devices is not None and self.precompile_s is None:
            self.precompile_s = ctrl.precompile(devices=self.precompile_devices)
        if self.open is not None:
            jax.block_until_ready(ctrl.state)
            label, t0 = self.open
            self.results[label] = time.perf_counter() - t0
            self.open = None
        if ctrl.step in self.plan:
            label, devices = self.plan[ctrl.step]
            jax.block_until_ready(ctrl.state)
            t0 = time.perf_counter()
            ctrl.apply([ajp.Rescale(devices=devices)])
            self.open = (label, t0)


def train_role(run_dir, warm_steps, gap, with_precompile):
    """The training process: 8 devices, then rescales in-process; prints the timings as JSON."""
    plan = {
        warm_steps: ("in-process 8->4", 4),
        warm_steps + gap: ("return 4->8", 8),
        warm_steps + 2 * gap: ("return 8->4", 4),
    }
    hook = Rescaler(plan, 4 if with_precompile else None)
    ctrl = adaptjax.Controller(spec=spec(run_dir), **controller_kwargs(hook))
    ctrl.run(warm_steps + 2 * gap + 2)  # ends with a checkpoint on 4 devices
    events = ctrl.log.events
    ctrl.close()
    ckpt = [e["latency_s"] for e in events if e["kind"] == "rescale"]
    compiles = [
        (e["step"], e["config"]["devices"], e["latency_s"])
        for e in events
        if e["kind"] == "compile"
    ]
    result = {
        "times": hook.results,
        "ckpt": ckpt,
        "compiles": compiles,
        "precompile_s": hook.precompile_s,
    }
    print(RESULT_TAG + json.dumps(result), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="in-process + restart pairs")
    parser.add_argument("--warm-steps", type=int, default=5, help="steps on 8 devices first")
    parser.add_argument("--gap", type=int, default=3, help="steps between rescales")
    parser.add_argument(
        "--precompile",
        action="store_true",
        help="what-if: compile the 4-device step ahead of time (AOT, after the first step; "
        "its time is reported, not counted in the rescale)",
    )
    parser.add_argument("--role", nargs=2, metavar=("ROLE", "RUN_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        role, run_dir = args.role
        if role == "train":
            train_role(run_dir, args.warm_steps, args.gap, args.precompile)
        else:
            restart_role(run_dir)
        return
    if args.repeats < 1 or args.warm_steps < 2 or args.gap < 2:
        parser.error("need --repeats >= 1, --warm-steps >= 2 and --gap >= 2")

    print(
        f"devices 8->4, params={sum(x.size for x in jax.tree.leaves(init_params()))}, "
        f"batch={BATCH}, repeats={args.repeats}, persistent compilation cache: "
        f"{jax.config.jax_compilation_cache_dir or 'off'}",
        flush=True,
    )
    rows = []
    root = tempfile.mkdtemp(prefix="rescale_latency_")
    try:
        for rep in range(args.repeats):
            run_dir = os.path.join(root, f"run{rep}")
            flags = ["--warm-steps", str(args.warm_steps), "--gap", str(args.gap)]
            r, _ = launch("train", run_dir, *flags, *(["--precompile"] if args.precompile else []))
            times, ckpt, compiles, pre_s = r["times"], r["ckpt"], r["compiles"], r["precompile_s"]
            # The restart gets its own run_dir holding a copy of the last checkpoint.
            restart_dir = os.path.join(root, f"restart{rep}")
            last = max(
                int(s) for s in os.listdir(os.path.join(run_dir, "checkpoints")) if s.isdigit()
            )
            shutil.copytree(
                os.path.join(run_dir, "checkpoints", str(last)),
                os.path.join(restart_dir, "checkpoints", str(last)),
            )
            cold = cold_restart(restart_dir)
            row = dict(times, restart=cold["total"])
            rows.append(row)
            compiled = [(s, d, round(t, 2)) for s, d, t in compiles]
            print(
                f"repeat {rep}: "
                + ", ".join(f"{k} {v:.2f}s" for k, v in times.items())
                + f"; checkpoint+restore inside those {', '.join(f'{c:.2f}s' for c in ckpt)}; "
                f"compiles (step, devices, dispatch s) {compiled}"
                + (f"; 4-device step precompiled ahead in {pre_s:.2f}s" if pre_s else ""),
                flush=True,
            )
            print(
                f"          cold restart {cold['total']:.2f}s on {cold['devices']} devices = "
                f"python+imports {cold['python_and_imports']:.2f}s + build model/data and "
                f"resume {cold['resume']:.2f}s + first step {cold['first_step']:.2f}s "
                f"(of which dispatch incl. compile {cold['compile_dispatch_s']:.2f}s)",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(key):
        return float(np.median([r[key] for r in rows]))

    def span(key):
        values = [r[key] for r in rows]
        return f"median {np.median(values):.2f}s (min {min(values):.2f}, max {max(values):.2f})"

    for key in ("in-process 8->4", "return 4->8", "return 8->4", "restart"):
        print(f"{key:>16}: {span(key)}")
    per_repeat = [r["in-process 8->4"] / r["restart"] for r in rows]
    print(f"per-repeat ratios: {', '.join(f'{x:.3f}' for x in per_repeat)}")
    print(f"return_to_compiled_mesh_s={med('return 4->8'):.3f}")
    print(f"rescale_vs_restart_ratio={med('in-process 8->4') / med('restart'):.4f}")


if __name__ == "__main__":
    main()
