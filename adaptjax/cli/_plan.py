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
unmodified, as a short probe (``adaptjax.controller._plan_probe``): in a fresh plan
directory (its working directory is ``cwd/`` there, so relative paths it writes
land there), with ``ADAPTJAX_PLAN_DIR`` set so that its :class:`adaptjax.Controller`
writes only there and times a few steps at each configuration the cost model
needs; then it prints the table of that directory and deletes it (``--keep
DIR`` keeps it).

Given a catalogue of device kinds and prices instead (``adaptjax plan
--catalogue prices.json --deadline H --remaining-steps N``, or ``--budget
DOLLARS``, or ``--remaining-samples``), it prints the cheapest deployment (kind,
devices, mesh shape, batch) that finishes the job by the deadline, or the
fastest within the budget, from the catalogue's step-time models
(:func:`adaptjax.costs.search_deployment`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from adaptjax.controller._plan_probe import DEFAULT_STEPS, PLAN_DIR_ENV, PLAN_STEPS_ENV


def add_parser(sub) -> None:
    """Registers the ``plan`` subcommand on the ``adaptjax`` parser's subparsers."""
    p = sub.add_parser(
        "plan",
        help="rank configurations by predicted step time and goodput (a run directory's "
        "costs.json, or a script probed for a few steps)",
        usage="adaptjax plan [options] RUN_DIR_OR_SCRIPT [-- SCRIPT_ARGS ...]\n"
        "       adaptjax plan --catalogue FILE (--deadline H | --budget DOLLARS) "
        "(--remaining-steps N | --remaining-samples N)",
        description="Rank configurations (replicas, batch, micro-batches, codec) by predicted\n"
        "goodput from the cost model a costs.Planner recorded in RUN_DIR/costs.json,\n"
        "or, given a script, from a short probe of it: the script runs unmodified in a\n"
        "fresh directory, where its Controller writes (never into the script's own run\n"
        "directory), times --steps steps at each configuration the cost model needs\n"
        "and exits. Arguments after -- go to the script. With --catalogue (device kinds,\n"
        "prices and step-time models), print the cheapest deployment that meets\n"
        "--deadline, or the fastest within --budget.",
        epilog="examples:\n  adaptjax plan runs/digits\n  adaptjax plan examples/digits.py "
        "--steps 5 -- --no-progress\n  adaptjax plan runs/digits --devices 64 --bandwidth 1.25e9\n"
        "  adaptjax plan --catalogue prices.json --deadline 24 --remaining-steps 100000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR_OR_SCRIPT", nargs="?", default=None,
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
    p.add_argument("--catalogue", default=None, metavar="FILE", help="device kinds with "
                   "prices and step-time models (JSON; see adaptjax.costs.Catalogue)")
    p.add_argument("--deadline", type=float, default=None, metavar="H", help="with "
                   "--catalogue: hours the job may take (the cheapest deployment meeting it)")
    p.add_argument("--budget", type=float, default=None, metavar="DOLLARS", help="with "
                   "--catalogue: dollars the job may cost (the fastest deployment within it)")
    p.add_argument("--remaining-steps", type=int, default=None, metavar="N",
                   help="with --catalogue: the job's remaining steps")
    p.add_argument("--remaining-samples", type=int, default=None, metavar="N",
                   help="with --catalogue: the job's remaining samples (steps = N / batch)")


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
    # the cost model imports jax (through RunConfig): kept out of the command's other subcommands
    from adaptjax.cli._plan_table import ranked_table

    return ranked_table(run_dir, devices=devices, bandwidth=bandwidth, latency=latency, top=top)


def probe_script(script: str, script_args: Sequence[str] = (), *, steps: int = DEFAULT_STEPS,
                 keep: str | None = None) -> str:
    """Runs ``script`` as a probe in a fresh plan directory; returns that directory.

    The script runs unmodified (as ``python SCRIPT ARGS``, through
    ``adaptjax.cli._plan_child``, which installs the probe) in ``DIR/cwd`` (so the
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
        result = subprocess.run(  # the child installs the probe, then runs the script
            [sys.executable, "-m", "adaptjax.cli._plan_child", os.path.abspath(script),
             *script_args], cwd=cwd, env=env,
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


def deploy(catalogue: str, *, deadline: float | None = None, budget: float | None = None,
           steps: int | None = None, samples: int | None = None) -> str:
    """What ``adaptjax plan --catalogue`` prints: the deployment the cost model picks.

    Example:
      >>> from adaptjax.cli._plan import deploy
      >>> deploy("no_such_prices.json", deadline=1.0, steps=10)
      Traceback (most recent call last):
      ...
      SystemExit: adaptjax plan: catalogue no_such_prices.json: cannot read it as JSON (...)
    """
    from adaptjax.costs import Catalogue, search_deployment

    try:
        best = search_deployment(Catalogue.from_json(catalogue), steps=steps, samples=samples,
                                 deadline=deadline, budget=budget)
    except ValueError as e:
        raise SystemExit(f"adaptjax plan: {e}") from None
    job = f"{steps} steps" if steps is not None else f"{samples} samples"
    goal = (f"the cheapest deployment finishing {job} in {deadline:g} h" if deadline is not None
            else f"the fastest deployment finishing {job} within ${budget:g}")
    return f"{goal} (the cost model's prediction):\n  {best}"


def run(args: argparse.Namespace, script_args: Sequence[str] = ()) -> int:
    target = args.run_dir
    job = (args.deadline, args.budget, args.remaining_steps, args.remaining_samples)
    if args.catalogue is not None:
        if target is not None or script_args:
            raise SystemExit("adaptjax plan: --catalogue plans from prices alone; drop "
                             f"{target or 'the script arguments'} (or --catalogue)")
        print(deploy(args.catalogue, deadline=args.deadline, budget=args.budget,
                     steps=args.remaining_steps, samples=args.remaining_samples))
        return 0
    if any(v is not None for v in job):
        raise SystemExit("adaptjax plan: --deadline, --budget and --remaining-steps/samples "
                         "need --catalogue FILE")
    if target is None:
        raise SystemExit("adaptjax plan: give a RUN_DIR_OR_SCRIPT, or --catalogue FILE with "
                         "--deadline or --budget")
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
