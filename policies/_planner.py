"""What a policy may ask a cost model: predicted step times, and what is worth probing.

A planner is any object with ``step_time(candidate) -> float | None``
(``None``: the model cannot tell) and optionally ``observe(candidate,
step_time)`` (a measured step time, for online refits) and
``explore(candidates) -> Candidate | None`` (the candidate worth probing);
policies take one as ``planner=`` and never import it, so this layer stays
plain Python. ``adaptjax.costs.Planner`` is the library's, the one
planner class, calibrated from timed collectives and the run's own step times.
"""

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from adaptjax.policies._checks import read_metric
from adaptjax.policies._context import Context


class Candidate(NamedTuple):
    """A configuration a policy may move to.

    Attributes:
      devices: replicas (the ``"data"`` axis).
      batch_size: the global batch.
      microbatches: micro-batches per replica.
      codec: the codec object (opaque), or ``None`` for a dense sync.
      mesh_shape: a sharded mesh's axes, ``{"data": devices, "fsdp": f, ...}``,
        or ``None`` for the 1-D mesh of ``devices``.
      sync: the synchronisation strategy (opaque), or ``None`` for S-SGD.
      precision: the compute precision (its key or an opaque precision), or
        ``None`` for float32. A step's time depends on both, so a planner
        keeps the times measured under each apart.

    Example:
      >>> from adaptjax.policies import Candidate
      >>> Candidate(8, 64)._replace(devices=4)[:3]
      (4, 64, 1)
    """

    devices: int
    batch_size: int
    microbatches: int = 1
    codec: object = None
    mesh_shape: object = None
    sync: object = None
    precision: object = None


def current(ctx: Context) -> Candidate:
    """The :class:`Candidate` a context is in."""
    return Candidate(ctx.devices, ctx.batch_size, ctx.microbatches, ctx.codec, ctx.mesh_shape,
                     ctx.sync, ctx.precision)


def predict(planner, candidate: Candidate) -> float | None:
    """``planner.step_time(candidate)`` as a positive float, or ``None`` when unknown."""
    value = planner.step_time(candidate)
    if value is None:
        return None
    value = float(value)
    return value if value > 0.0 else None


def observe(planner, metrics: Mapping[str, float], ctx: Context) -> None:
    """Passes the measured step time of the current configuration to ``planner.observe``."""
    hook = getattr(planner, "observe", None)
    if hook is None:
        return
    step_time = read_metric(metrics, "step_time")
    if step_time is not None and step_time > 0.0:
        hook(current(ctx), step_time)


def explore(planner, candidates: Sequence[Candidate]) -> Candidate | None:
    """``planner.explore(candidates)`` when the planner searches, else ``None``."""
    hook = getattr(planner, "explore", None)
    if hook is None or not candidates:
        return None
    return hook(list(candidates))
