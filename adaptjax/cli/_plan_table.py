"""The table ``adaptjax plan`` prints: configurations ranked by predicted goodput.

Reads a run's ``costs.json`` (a :class:`adaptjax.costs.Planner`'s model, its
measured step times and the collectives of each compiled step) and the last
noise scale of its metrics. It imports the cost model, hence jax: the
``adaptjax`` command imports it only for ``plan`` (see ``_plan.py``).

A run on a sharded mesh is ranked over mesh shapes: every factorisation of
the device count into the run's axes whose ``"data"`` size divides the batch
(``mesh_shapes``), each with the parameter and optimizer
bytes a device would hold there (``state/dev``, from :attr:`Planner.memory`).
"""

from __future__ import annotations

import json
import os

from adaptjax._run_config import RunConfig
from adaptjax.costs._meshes import mesh_shapes
from adaptjax.costs._model import CannotPredict, Prediction, StepTimeModel
from adaptjax.costs._planner import Planner, shape_label
from adaptjax.costs._simulate import Cluster, wire_for
from adaptjax.policies._goodput import statistical_efficiency


def ranked_table(run_dir: str, *, devices: int | None, bandwidth: float | None,
                 latency: float, top: int) -> str:
    """:func:`adaptjax.cli._plan.plan` on a run directory it has checked."""
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
    top_devices = devices or max(c.device_count for c in seen)
    phi = _last_noise_scale(run_dir)
    ranked, unknown = _rank(planner, model, seen, top_devices, phi)
    return "\n".join(_table(planner, seen, ranked, unknown, phi, top))


def _last_noise_scale(run_dir: str) -> float | None:
    """The run's last logged ``noise_scale`` (``None``: none logged)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return next((r["noise_scale"] for r in reversed(rows)
                 if isinstance(r.get("noise_scale"), int | float)), None)


def _rank(planner: Planner, model: StepTimeModel, seen: list[RunConfig], top_devices: int,
          phi: float | None) -> tuple[list[tuple[float, RunConfig, Prediction]], list[str]]:
    """``(goodput, config, prediction)`` best first, and why the others cannot be predicted.

    Every replica count up to ``top_devices`` (on a sharded run: every mesh
    shape of ``top_devices``) x the batches, micro-batches and codecs the run
    measured; goodput is samples per second x statistical efficiency at the
    noise scale ``phi`` (Pollux) against the first batch.
    """
    base = seen[0].batch_size
    batches = sorted({c.batch_size for c in seen})
    micros = sorted({c.microbatches for c in seen})
    codecs = list(dict.fromkeys(c.codec for c in seen))
    out, unknown = [], []
    for b in batches:
        for k in micros:
            for target in _meshes(seen[0], top_devices, b, k):
                for codec in codecs:
                    config = seen[0].replace(**target, batch_size=b, microbatches=k, codec=codec)
                    try:
                        wire = planner._wires.get(config) or wire_for(planner.model, config)
                        p = model.predict(config, wire)
                    except CannotPredict as e:
                        unknown.append(str(e))
                        continue
                    eff = 1.0 if phi is None else statistical_efficiency(phi, b, base)
                    out.append((b / p.step_time * eff, config, p))
    out.sort(key=lambda r: -r[0])
    return out, unknown


def _meshes(config: RunConfig, top_devices: int, batch: int, micro: int) -> list[dict]:
    """``RunConfig`` fields of each mesh to rank: replica counts, or a sharded run's shapes."""
    if config.mesh_shape is None:
        return [{"devices": n} for n in range(1, top_devices + 1)
                if batch % (n * micro) == 0 and batch >= n]
    return [{"devices": s["data"], "mesh_shape": s}
            for s in mesh_shapes(top_devices, tuple(config.axes), batch, micro)]


def _table(planner: Planner, seen: list[RunConfig], ranked, unknown: list[str],
           phi: float | None, top: int) -> list[str]:
    """The printed lines: a heading, the ``top`` rows, how many could not be predicted."""
    codecs = list(dict.fromkeys(c.codec for c in seen))
    # A codec's key is its repr; its name reads better where it is unambiguous.
    names = {k: k.split("(", 1)[0].lstrip("_").lower() for k in codecs if k is not None}
    label = {k: (v if list(names.values()).count(v) == 1 else k) for k, v in names.items()}
    what = (f"noise scale {phi:.4g}" if phi is not None
            else "no noise scale recorded: goodput = throughput")
    head = (f"configurations ranked by predicted goodput ({what}; base batch "
            f"{seen[0].batch_size}; {len(seen)} measured)")
    head += "; meas ms: measured, - : predicted only"
    sharded = seen[0].mesh_shape is not None
    mesh = f" {'mesh':>18s} {'state/dev':>11s}" if sharded else ""
    lines = [head, f"{'#':>3s} {'dev':>3s}{mesh} {'batch':>5s} {'mb':>2s} {'step ms':>9s} "
             f"{'meas ms':>9s} {'bytes/dev':>11s} {'samples/s':>10s} {'goodput':>9s}  codec"]
    for i, (g, c, p) in enumerate(ranked[:top], 1):
        measured = planner._times.get(c)
        meas = "-" if measured is None else f"{measured * 1e3:.2f}"
        if sharded:
            state = planner.memory.get(shape_label(c.axes))
            mesh = f" {shape_label(c.axes):>18s} {'-' if state is None else state:>11}"
        lines.append(f"{i:3d} {c.devices:3d}{mesh} {c.batch_size:5d} {c.microbatches:2d} "
                     f"{p.step_time * 1e3:9.2f} {meas:>9s} {p.bytes:11.0f} "
                     f"{c.batch_size / p.step_time:10.1f} {g:9.1f}  {label.get(c.codec, 'none')}")
    if unknown:
        lines.append(f"{len(unknown)} configuration(s) not predicted, e.g.: {unknown[0]}")
    return lines
