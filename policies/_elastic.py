"""``ElasticScale``: change the number of devices on a schedule or when a predicate says so."""

import dataclasses
from collections.abc import Callable, Mapping

from adaptjax.policies._actions import Action, Rescale
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
    """Emits ``Rescale(devices=n)`` at scheduled steps or when ``predicate`` asks for it.

    Each schedule entry ``{step: devices}`` fires once, at the first evaluation
    with ``ctx.step >= step`` (the state remembers which fired, so a resume
    does not repeat them); when several are due at once only the latest
    counts. ``predicate(metrics, ctx)`` is asked at every evaluation where no
    entry fired and returns a device count or ``None`` (a ``KeyError`` from it,
    a metric not available yet, counts as ``None``). A request is capped at
    ``ctx.max_devices`` and dropped when it equals ``ctx.devices``.

    With a ``planner`` (e.g. ``adaptjax.costs.Planner``), at an evaluation
    where neither asked for a count, the policy asks for the predicted step
    time at every device count up to ``ctx.max_devices`` that divides the
    batch (same global batch, so goodput follows throughput) and moves to the
    fastest when it beats the current one by at least ``min_gain`` — fewer
    devices when a slow link makes more of them slower. Counts it cannot
    predict are left out.

    Args:
      schedule: ``{step: devices}``, steps >= 0, devices >= 1.
      predicate: ``(metrics, ctx) -> int | None``. Give ``schedule``, ``predicate``,
        ``planner`` or several.
      planner: an object following :class:`adaptjax.policies.Predictor`, or ``None``.
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
    """

    schedule: Mapping[int, int] | None = None
    predicate: Callable[[Mapping[str, float], Context], int | None] | None = dataclasses.field(
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
                check_int(step, owner=owner, name="every schedule step", minimum=0): check_int(
                    devices, owner=owner, name=f"schedule[{step!r}]", minimum=1
                )
                for step, devices in self.schedule.items()
            }
            object.__setattr__(self, "schedule", FrozenMapping(dict(sorted(clean.items()))))
        if self.predicate is not None:
            check_callable(
                self.predicate, owner=owner, name="predicate",
                signature="(metrics, ctx) -> int | None",
            )
        super().__post_init__()

    def _initial_state(self) -> dict:
        return {"fired": []}  # schedule steps already acted on

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        """Returns ``[Rescale(devices=n)]`` when a due entry or the predicate asks for n."""
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
                if isinstance(wanted, bool) or not hasattr(type(wanted), "__index__"):
                    raise ValueError(
                        f"ElasticScale: predicate must return an int device count or None, "
                        f"got {short_repr(wanted)}"
                    )
                wanted = check_int(
                    wanted, owner="ElasticScale", name="the predicate's device count", minimum=1
                )
                why = f"ElasticScale: the predicate asked for {wanted} devices"
        if wanted is None and self.planner is not None:
            wanted = self._planned(metrics, ctx)
            why = f"ElasticScale: the planner predicts a faster step on {wanted} devices"
        if wanted is None:
            return []
        wanted = min(wanted, ctx.max_devices)
        if wanted == ctx.devices:
            return []
        return [Rescale(devices=wanted, reason=f"{why}: {ctx.devices} -> {wanted} devices")]

    def upcoming(self, ctx: Context) -> list[Action]:
        """``[Rescale(devices=n)]`` for the next schedule entry that will change the count."""
        fired = self._state["fired"]
        for step, devices in (self.schedule or {}).items():
            if step in fired:
                continue
            devices = min(devices, ctx.max_devices)
            if devices != ctx.devices:
                return [Rescale(devices=devices, reason=f"ElasticScale: schedule entry at {step}")]
        return []

    def _planned(self, metrics: Mapping[str, float], ctx: Context) -> int | None:
        """The device count with the fastest predicted step, if it pays; else None."""
        observe(self.planner, metrics, ctx)
        here = current(ctx)
        now = predict(self.planner, here)
        if now is None:
            return None
        best, best_time = None, now
        for n in range(1, ctx.max_devices + 1):
            if n == ctx.devices or ctx.batch_size % (n * ctx.microbatches):
                continue
            t = predict(self.planner, here._replace(devices=n))
            if t is not None and t * (1.0 + self.min_gain) <= now and t < best_time:
                best, best_time = n, t
        return best
