"""``ElasticScale``: change the number of devices on a schedule or when a predicate says so."""

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping

from adaptjax.policies._actions import Action, Rescale, _named_shape
from adaptjax.policies._checks import (
    check_callable,
    check_float,
    check_int,
    check_mapping,
    check_planner,
    short_repr,
)
from adaptjax.policies._context import Context
from adaptjax.policies._mapping import FrozenMapping
from adaptjax.policies._planner import current, observe, predict
from adaptjax.policies._policy import StatefulPolicy


@dataclasses.dataclass(frozen=True, eq=False)
class ElasticScale(StatefulPolicy):
    """Emits ``Rescale`` at scheduled steps or when ``predicate`` asks for it.

    Each schedule entry ``{step: devices}`` fires once, at the first evaluation
    with ``ctx.step >= step`` (the state remembers which fired, so a resume
    does not repeat them); when several are due at once only the latest
    counts. ``predicate(metrics, ctx)`` is asked at every evaluation where no
    entry fired and returns a device count or ``None`` (a ``KeyError`` from it,
    a metric not available yet, counts as ``None``). A request is capped at
    ``ctx.max_devices`` and dropped when it equals ``ctx.devices``.

    On a sharded mesh (``ctx.mesh_shape``) a device count is a replica count:
    ``Rescale(devices=n)`` keeps the model axes. A schedule entry (or a
    predicate's answer) may instead name a whole mesh shape,
    ``{"data": 2, "fsdp": 4}``, which becomes ``Rescale(mesh_shape=...)``
    (dropped when it is the current shape; the controller refuses one its
    devices or the model's shardings cannot take).

    With a ``planner`` (e.g. ``adaptjax.costs.Planner``), at an evaluation
    where neither asked for a count, the policy asks for the predicted step
    time at every device count up to ``ctx.max_devices`` that divides the
    batch (same global batch, so goodput follows throughput) and moves to the
    fastest when it beats the current one by at least ``min_gain`` — fewer
    devices when a slow link makes more of them slower. Counts it cannot
    predict are left out. On a sharded mesh it compares mesh shapes instead:
    every shape with the same axes whose device count divides the most the
    job has (``ctx.max_devices`` replicas at the current model axes) and
    whose ``"data"`` size divides the batch.

    Args:
      schedule: ``{step: devices}`` (steps >= 0, devices >= 1) or
        ``{step: {"data": d, "fsdp": f}}`` (a mesh shape).
      predicate: ``(metrics, ctx) -> int | mesh shape | None``. Give ``schedule``,
        ``predicate``, ``planner`` or several.
      planner: an :class:`adaptjax.costs.Planner` (or any object with
        ``step_time(candidate)``), or ``None``.
      min_gain: with a planner, the smallest predicted relative speed-up worth a rescale.

    Example:
      >>> from adaptjax.policies import Context, ElasticScale
      >>> policy = ElasticScale({500: 4, 900: 8})
      >>> ctx = Context(step=500, batch_size=64, microbatches=1, devices=2, max_devices=8,
      ...               hyperparams={})
      >>> policy.decide({}, ctx)
      [Rescale(devices=4, mesh_shape=None)]
      >>> policy.decide({}, ctx)  # fired already
      []
      >>> sharded = Context(step=0, batch_size=64, microbatches=1, devices=2, max_devices=2,
      ...                   hyperparams={}, mesh_shape={"data": 2, "fsdp": 4})
      >>> ElasticScale({0: {"data": 4, "fsdp": 2}}).decide({}, sharded)
      [Rescale(devices=None, mesh_shape={'data': 4, 'fsdp': 2})]
    """

    schedule: Mapping[int, int | Mapping[str, int]] | None = None
    predicate: Callable[[Mapping[str, float], Context], object] | None = dataclasses.field(
        default=None, kw_only=True
    )
    planner: object = dataclasses.field(default=None, kw_only=True)
    min_gain: float = dataclasses.field(default=0.05, kw_only=True)

    def __post_init__(self) -> None:
        owner = "ElasticScale"
        if self.schedule is None and self.predicate is None and self.planner is None:
            raise ValueError(
                f"{owner}: give a schedule {{step: devices}}, a predicate, a planner, or several"
            )
        check_planner(self.planner, owner)
        object.__setattr__(
            self, "min_gain", check_float(self.min_gain, owner=owner, name="min_gain", low=0.0)
        )
        if self.schedule is not None:
            check_mapping(self.schedule, owner=owner, name="schedule")
            clean = {
                check_int(step, owner=owner, name="every schedule step", minimum=0): _target(
                    devices, owner, f"schedule[{step!r}]"
                )
                for step, devices in self.schedule.items()
            }
            object.__setattr__(self, "schedule", FrozenMapping(dict(sorted(clean.items()))))
        if self.predicate is not None:
            check_callable(
                self.predicate, owner=owner, name="predicate",
                signature="(metrics, ctx) -> int | None",
            )  # (or a mesh shape)
        super().__post_init__()

    def _initial_state(self) -> dict:
        return {"fired": []}  # schedule steps already acted on

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        """Returns ``[Rescale(...)]`` when a due entry, the predicate or the planner asks."""
        wanted = None
        fired = self._state["fired"]
        why = ""
        for step, devices in (self.schedule or {}).items():
            if step <= ctx.step and step not in fired:
                fired.append(step)
                wanted = devices  # the schedule is sorted: the latest due entry wins
                why = f"ElasticScale: schedule entry {{{step}: {devices}}} is due"
        if wanted is None and self.predicate is not None:
            try:
                wanted = self.predicate(metrics, ctx)
            except KeyError:  # a metric the predicate reads is not available yet
                wanted = None
            if wanted is not None:
                if not isinstance(wanted, Mapping) and (
                    isinstance(wanted, bool) or not hasattr(type(wanted), "__index__")
                ):
                    raise ValueError(
                        f"ElasticScale: predicate must return an int device count or None, "
                        f"got {short_repr(wanted)} (or a mesh shape {{'data': d, ...}})"
                    )
                wanted = _target(wanted, "ElasticScale", "the predicate's device count")
                why = f"ElasticScale: the predicate asked for {_said(wanted)}"
        if wanted is None and self.planner is not None:
            wanted = self._planned(metrics, ctx)
            why = f"ElasticScale: the planner predicts a faster step on {_said(wanted)}"
        return _rescale(wanted, ctx, why)

    def upcoming(self, ctx: Context) -> list[Action]:
        """``[Rescale(devices=n)]`` for the next schedule entry that will change the count."""
        fired = self._state["fired"]
        for step, devices in (self.schedule or {}).items():
            if step in fired:
                continue
            actions = _rescale(devices, ctx, f"ElasticScale: schedule entry at {step}")
            if actions:
                return actions
        return []

    def _planned(self, metrics: Mapping[str, float], ctx: Context):
        """The device count (or mesh shape) with the fastest predicted step, if it pays."""
        observe(self.planner, metrics, ctx)
        here = current(ctx)
        now = predict(self.planner, here)
        if now is None:
            return None
        best, best_time = None, now
        for target, candidate in _candidates(ctx, here):
            t = predict(self.planner, candidate)
            if t is not None and t * (1.0 + self.min_gain) <= now and t < best_time:
                best, best_time = target, t
        return best


def _target(value, owner: str, name: str):
    """A device count (int >= 1) or a checked mesh shape (a read-only mapping)."""
    if isinstance(value, Mapping):
        return _named_shape(value, f"{owner}: {name}")
    return check_int(value, owner=owner, name=name, minimum=1)


def _said(target) -> str:
    return f"{target} devices" if not isinstance(target, Mapping) else f"mesh {dict(target)}"


def _rescale(wanted, ctx: Context, why: str) -> list[Action]:
    """``[Rescale]`` to ``wanted`` (a count, capped at ``ctx.max_devices``, or a mesh shape),
    or ``[]`` when that is where the run is."""
    if wanted is None:
        return []
    if isinstance(wanted, Mapping):
        here = ctx.mesh_shape if ctx.mesh_shape is not None else {"data": ctx.devices}
        if list(wanted.items()) == list(here.items()):
            return []
        return [Rescale(mesh_shape=wanted, reason=f"{why}: {dict(here)} -> {dict(wanted)}")]
    wanted = min(wanted, ctx.max_devices)
    if wanted == ctx.devices:
        return []
    return [Rescale(devices=wanted, reason=f"{why}: {ctx.devices} -> {wanted} devices")]


def _candidates(ctx: Context, here):
    """``(target, Candidate)`` of every configuration the planner compares with ``here``.

    On a 1-D mesh: each replica count up to ``ctx.max_devices`` that divides
    the batch. On a sharded mesh: each shape of the same axes whose device
    count divides the most the job has and whose ``"data"`` size divides the
    batch (every size a divisor of that most).
    """
    unit = ctx.microbatches
    if ctx.mesh_shape is None:
        for n in range(1, ctx.max_devices + 1):
            if n != ctx.devices and ctx.batch_size % (n * unit) == 0:
                yield n, here._replace(devices=n)
        return
    axes = list(ctx.mesh_shape)
    most = ctx.max_devices * math.prod(s for a, s in ctx.mesh_shape.items() if a != "data")
    sizes = [d for d in range(1, most + 1) if most % d == 0]
    for combo in itertools.product(sizes, repeat=len(axes)):
        shape = dict(zip(axes, combo, strict=True))
        data = shape["data"]
        if most % math.prod(combo) or ctx.batch_size % (data * unit) or shape == ctx.mesh_shape:
            continue
        yield shape, here._replace(devices=data, mesh_shape=shape)
