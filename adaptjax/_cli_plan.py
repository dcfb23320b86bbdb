"""``adaptjax plan RUN_DIR``: configurations ranked by predicted goodput.

Reads the run's ``costs.json`` (written by an attached
:class:`adaptjax.costs.Planner`: timed collectives, measured step times and the
collectives of each compiled step) and the noise scale of its last metrics,
and prints every configuration of replicas x batch x micro-batches x codec it
can predict, best predicted goodput first (samples per second x statistical
efficiency, Pollux). ``--devices``/``--bandwidth``/``--latency`` ask the same
of another cluster, whose replicas each have their own processor.
"""

from __future__ import annotations

import argparse
import json
import os


def add_parser(sub) -> None:
    """Registers the ``plan`` subcommand on the ``adaptjax`` parser's subparsers."""
    p = sub.add_parser(
        "plan",
        help="rank configurations by predicted step time and goodput (reads RUN_DIR/costs.json)",
        description="Rank configurations (replicas, batch, micro-batches, codec) by predicted "
        "goodput from the cost model a costs.Planner recorded in RUN_DIR/costs.json.",
    )
    p.add_argument("run_dir", help="the run directory (a script is not accepted: run it first)")
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
      >>> from adaptjax._cli_plan import plan
      >>> plan(tempfile.mkdtemp())
      Traceback (most recent call last):
      ...
      SystemExit: adaptjax plan: ... is not a run directory (no metrics.jsonl)
    """
    if run_dir.endswith(".py") and os.path.isfile(run_dir):
        raise SystemExit(
            f"adaptjax plan: {run_dir} is a script; run it with a costs.Planner attached and "
            "pass its run directory"
        )
    if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        raise SystemExit(f"adaptjax plan: {run_dir} is not a run directory (no metrics.jsonl)")
    from adaptjax._cost_model import CannotPredict
    from adaptjax._cost_planner import Planner
    from adaptjax._cost_simulate import Cluster, wire_for
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
    lines = [head, f"{'#':>3s} {'dev':>3s} {'batch':>5s} {'mb':>2s} {'step ms':>9s} "
             f"{'bytes/dev':>11s} {'samples/s':>10s} {'goodput':>9s}  codec"]
    for i, (g, c, p) in enumerate(out[:top], 1):
        lines.append(f"{i:3d} {c.devices:3d} {c.batch_size:5d} {c.microbatches:2d} "
                     f"{p.step_time * 1e3:9.2f} {p.bytes:11.0f} {c.batch_size / p.step_time:10.1f} "
                     f"{g:9.1f}  {c.codec or 'none'}")
    if unknown:
        lines.append(f"{len(unknown)} configuration(s) not predicted, e.g.: {unknown[0]}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    print(plan(args.run_dir, devices=args.devices, bandwidth=args.bandwidth,
               latency=args.latency, top=args.top))
    return 0
