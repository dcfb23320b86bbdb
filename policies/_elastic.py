"""``ElasticScale``: change the number of devices on a schedule or when a predicate says so."""

import dataclasses
from collections.abc import Callable, Mapping

from adaptjax.policies._actions import Action, Rescale
from adaptjax.policies._checks import check_callable, check_int, check_mapping, short_repr
from adaptjax.policies._context import Context
from adaptjax.policies._mapping import FrozenMapping
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

    Args:
      schedule: ``{step: devices}``, steps >= 0, devices >= 1.
      predicate: ``(metrics, ctx) -> int | None``. Give ``schedule``, ``predicate`` or both.

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

    def __post_init__(self) -> None:
        owner = "ElasticScale"
        if self.schedule is None and self.predicate is None:
            raise ValueError(f"{owner}: give a schedule {{step: devices}}, a predicate, or both")
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
        if wanted is None:
            return []
        wanted = min(wanted, ctx.max_devices)
        if wanted == ctx.devices:
            return []
        return [Rescale(devices=wanted, reason=f"{why}: {ctx.devices} -> {wanted} devices")]
