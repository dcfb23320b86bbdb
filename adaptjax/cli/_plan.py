"""``adaptjax plan RUN_DIR_OR_SCRIPT``: configurations ranked by predicted goodput.

Reads the run's ``costs.json`` (written by an attached
:class:`adaptjax.costs.Planner`: timed collectives, measured step times and the
collectives of each compiled step) and the noise scale of its last metrics,
and prints every configuration of replicas x batch x micro-batches x codec it
can predict, best predicted goodput first (samples per second x statistical
efficiency, Pollux), with the measured step time of those that ran.
``--devices``/``--bandwidth``/``--latency`` ask the same of another cluster,
whose replicas each have their own processor.

Given a script (``adaptjax plan train.py -- ARGS``), it first runs the script,
unmodified, as a short probe (:mod:`adaptjax.controller._plan_probe`): in a fresh plan
directory (its working directory is ``cwd/`` there, so relative paths it writes
land there), with ``ADAPTJAX_PLAN_DIR`` set so that its :class:`adaptjax.Controller`
writes only there and times a few steps at each configuration the cost model
needs; then it prints the table of that directory and deletes it (``--keep
DIR`` keeps it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from adaptjax.controller._plan_probe import DEFAULT_STEPS, PLAN_DIR_ENV, PLAN_STEPS_ENV


def add_parser(sub) -> None:
    """Registers the ``plan`` subcommand on the ``adaptjax`` parser's subparsers."""
    p = sub.add_parser(
        "plan",
        help="rank configurations by predicted step time and goodput (a run directory's "
        "costs.json, or a script probed for a few steps)",
        usage="adaptjax plan [options] RUN_DIR_OR_SCRIPT [-- SCRIPT_ARGS ...]",
        description="Rank configurations (replicas, batch, micro-batches, codec) by predicted\n"
        "goodput from the cost model a costs.Planner recorded in RUN_DIR/costs.json,\n"
        "or, given a script, from a short probe of it: the script runs unmodified in a\n"
        "fresh directory, where its Controller writes (never into the script's own run\n"
        "directory), times --steps steps at each configuration the cost model needs\n"
        "and exits. Arguments after -- go to the script.",
        epilog="examples:\n  adaptjax plan runs/digits\n  adaptjax plan examples/digits.py "
        "--steps 5 -- --no-progress\n  adaptjax plan runs/digits --devices 64 --bandwidth 1.25e9",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR_OR_SCRIPT",
                   help="a run directory, or a training script (arguments for it after --)")
    p.add_argument("--steps", type=int, default=None, help="with a script: timed steps per "
                   f"probed configuration (default {DEFAULT_STEPS})")
    p.add_argument("--keep", default=None, metavar="DIR", help="with a script: probe in DIR "
                   "(new or empty) and keep it, instead of a temporary directory")
    p.add_argument("--devices", type=int, default=None, help="replicas available (default: as "
                   "recorded); implies a cluster whose replicas have their own processors")
    p.add_argument("--bandwidth", type=float, default=None, help="link bytes/s for every "
                   "collective (default: the calibrated links)")
    p.add_argument("--latency", type=float, default=0.0, help="seconds per message step")
    p.add_argument("--top", type=int, default=20, help="rows to print (default 20)")


def plan(run_dir: str, *, devices: int | None = None, bandwidth: float | None = None,
         latency: float = 0.0, top: int = 20) -> str:
    """The ranked table ``adaptjax plan`` prints.

    Example:
      >>> import tempfile
      >>> from adaptjax.cli._plan import plan
      >>> plan(tempfile.mkdtemp())
      Traceback (most recent call last):
      ...
      SystemExit: adaptjax plan: ... is not a run directory (no metrics.jsonl)
    """
    if os.path.isfile(run_dir):
        raise SystemExit(
            f"adaptjax plan: {run_dir} is a file, not a run directory; probe a script with "
            "probe_script() (the command does it: adaptjax plan SCRIPT -- ARGS)"
        )
    if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        raise SystemExit(f"adaptjax plan: {run_dir} is not a run directory (no metrics.jsonl)")
    from adaptjax.costs._model import CannotPredict
    from adaptjax.costs._planner import Planner
    from adaptjax.costs._simulate import Cluster, wire_for
    from adaptjax.policies import statistical_efficiency

    try:
        planner = Planner.load(run_dir)
    except ValueError as e:
        raise SystemExit(f"adaptjax plan: {e}") from None
    model = planner.model
    seen = list(planner._times)
    if not seen:
        raise SystemExit(f"adaptjax plan: {run_dir}/costs.json holds no measured step")
    if devices is not None or bandwidth is not None:
        model = Cluster(devices=devices, bandwidth=bandwidth, latency=latency).apply(model)
    top_devices = devices or max(c.devices for c in seen)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    phi = next((r["noise_scale"] for r in reversed(rows)
                if isinstance(r.get("noise_scale"), int | float)), None)
    base = seen[0].batch_size
    batches = sorted({c.batch_size for c in seen})
    micros = sorted({c.microbatches for c in seen})
    codecs = list(dict.fromkeys(c.codec for c in seen))
    # A codec's key is its repr; its name reads better where it is unambiguous.
    names = {k: k.split("(", 1)[0].lstrip("_").lower() for k in codecs if k is not None}
    label = {k: (v if list(names.values()).count(v) == 1 else k) for k, v in names.items()}
    out, unknown = [], []
    for n in range(1, top_devices + 1):
        for b in batches:
            for k in micros:
                if b % (n * k) or b < n:
                    continue
                for codec in codecs:
                    config = seen[0].replace(devices=n, batch_size=b, microbatches=k, codec=codec)
                    try:
                        wire = planner._wires.get(config) or wire_for(planner.model, config)
                        p = model.predict(config, wire)
                    except CannotPredict as e:
                        unknown.append(str(e))
                        continue
                    eff = 1.0 if phi is None else statistical_efficiency(phi, b, base)
                    out.append((b / p.step_time * eff, config, p))
    out.sort(key=lambda r: -r[0])
    what = (f"noise scale {phi:.4g}" if phi is not None
            else "no noise scale recorded: goodput = throughput")
    head = (f"configurations ranked by predicted goodput ({what}; base batch {base}; "
            f"{len(seen)} measured)")
    head += "; meas ms: measured, - : predicted only"
    lines = [head, f"{'#':>3s} {'dev':>3s} {'batch':>5s} {'mb':>2s} {'step ms':>9s} "
             f"{'meas ms':>9s} {'bytes/dev':>11s} {'samples/s':>10s} {'goodput':>9s}  codec"]
    for i, (g, c, p) in enumerate(out[:top], 1):
        measured = planner._times.get(c)
        meas = "-" if measured is None else f"{measured * 1e3:.2f}"
        lines.append(f"{i:3d} {c.devices:3d} {c.batch_size:5d} {c.microbatches:2d} "
                     f"{p.step_time * 1e3:9.2f} {meas:>9s} {p.bytes:11.0f} "
                     f"{c.batch_size / p.step_time:10.1f} {g:9.1f}  {label.get(c.codec, 'none')}")
    if unknown:
        lines.append(f"{len(unknown)} configuration(s) not predicted, e.g.: {unknown[0]}")
    return "\n".join(lines)


def probe_script(script: str, script_args: list[str] = (), *, steps: int = DEFAULT_STEPS,
                 keep: str | None = None) -> str:
    """Runs ``script`` as a probe in a fresh plan directory; returns that directory.

    The script runs unmodified (``python SCRIPT ARGS``) in ``DIR/cwd`` (so the
    relative paths it writes land there; pass absolute paths to its inputs),
    with ``ADAPTJAX_PLAN_DIR`` set to the plan directory ``DIR``: its
    :class:`adaptjax.Controller` writes only there (``DIR/run``) and its
    ``run`` times ``steps`` steps at each configuration the cost model needs,
    saves ``DIR/run/costs.json`` and exits. Read the directory with
    :func:`plan` (``plan(os.path.join(DIR, "run"))``).

    Args:
      script: the training script (it builds an ``adaptjax.Controller`` and calls ``run``).
      script_args: its command-line arguments.
      steps: timed steps per probed configuration (>= 1).
      keep: probe in this new or empty directory (default: a temporary one,
        removed when the probe fails).

    Example:
      >>> from adaptjax.cli._plan import probe_script
      >>> probe_script("no_such_train.py")
      Traceback (most recent call last):
      ...
      SystemExit: adaptjax plan: no script or run directory at no_such_train.py
    """
    if not os.path.isfile(script):
        raise SystemExit(f"adaptjax plan: no script or run directory at {script}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise SystemExit(
            f"adaptjax plan: --steps must be >= 1 (timed steps per configuration), got {steps}"
        )
    if keep is not None:
        if os.path.exists(keep) and (not os.path.isdir(keep) or os.listdir(keep)):
            raise SystemExit(f"adaptjax plan: --keep {keep} must be a new or empty directory")
        os.makedirs(keep, exist_ok=True)
        directory = os.path.abspath(keep)
    else:
        directory = tempfile.mkdtemp(prefix="adaptjax-plan-")
    env = dict(os.environ, **{PLAN_DIR_ENV: directory, PLAN_STEPS_ENV: str(steps)})
    if env.get("PYTHONPATH"):  # the script runs elsewhere: keep relative entries meaning the same
        env["PYTHONPATH"] = os.pathsep.join(
            os.path.abspath(p) if p else p for p in env["PYTHONPATH"].split(os.pathsep)
        )
    try:
        cwd = os.path.join(directory, "cwd")  # relative paths the script writes land here
        os.makedirs(cwd)
        result = subprocess.run(
            [sys.executable, os.path.abspath(script), *script_args], cwd=cwd, env=env,
            stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False,
        )
        if result.returncode != 0:
            last = next((line.strip() for line in reversed(result.stderr.splitlines())
                         if line.strip()), "(no output on stderr)")
            raise SystemExit(
                f"adaptjax plan: {script} exited with status {result.returncode}: {last}"
            )
        if not os.path.isfile(os.path.join(directory, "run", "costs.json")):
            raise SystemExit(
                f"adaptjax plan: {script} finished without running an adaptjax.Controller (no "
                "costs.json written); the script must build one and call its run()"
            )
    except BaseException:
        if keep is None:
            shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory


def run(args: argparse.Namespace, script_args: list[str] = ()) -> int:
    target = args.run_dir
    kw = dict(devices=args.devices, bandwidth=args.bandwidth, latency=args.latency, top=args.top)
    if not os.path.isfile(target) and not target.endswith(".py"):
        if args.steps is not None or args.keep is not None or script_args:
            raise SystemExit(
                f"adaptjax plan: --steps, --keep and arguments after -- are for a script; "
                f"{target} is not a file"
            )
        print(plan(target, **kw))
        return 0
    t0 = time.perf_counter()
    steps = DEFAULT_STEPS if args.steps is None else args.steps
    if os.path.isfile(target) and isinstance(steps, int) and steps >= 1:
        print(f"adaptjax plan: probing {target}: {steps} timed steps per configuration...",
              file=sys.stderr, flush=True)
    directory = probe_script(target, list(script_args), steps=steps, keep=args.keep)
    try:
        table = plan(os.path.join(directory, "run"), **kw)
    finally:
        if args.keep is None:
            shutil.rmtree(directory, ignore_errors=True)
    print(table)
    where = f"kept in {directory}" if args.keep is not None else "removed; --keep DIR keeps it"
    print(f"adaptjax plan: probed {target} in {time.perf_counter() - t0:.1f} s (plan directory "
          f"{where})", file=sys.stderr)
    return 0
