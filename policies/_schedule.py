"""``Schedule``: at step s, do a."""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import cast

from adaptjax.policies._actions import ACTION_TYPES, Action, with_reason
from adaptjax.policies._checks import check_int, check_mapping
from adaptjax.policies._context import Context
from adaptjax.policies._mapping import FrozenMapping
from adaptjax.policies._policy import StatefulPolicy, validate_actions


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule(StatefulPolicy):
    """Emits fixed actions at fixed steps, each entry once.

    An entry ``{step: action_or_list}`` fires at the first evaluation with
    ``ctx.step >= step``; entries due together fire in step order. The state
    remembers which fired, so a resume does not repeat them.

    Args:
      actions: ``{step: action}`` or ``{step: [action, ...]}``, steps >= 0.

    Example:
      >>> from adaptjax.policies import Checkpoint, Context, Schedule, SetHyperparams
      >>> policy = Schedule({1000: SetHyperparams({"learning_rate": 0.01}), 2000: Checkpoint()})
      >>> ctx = Context(step=1000, batch_size=64, microbatches=1, devices=8, max_devices=8,
      ...               hyperparams={"learning_rate": 0.1})
      >>> policy.decide({}, ctx)
      [SetHyperparams(values={'learning_rate': 0.01})]
      >>> policy.decide({}, ctx)
      []
    """

    actions: Mapping[int, Action | Sequence[Action]]

    def __post_init__(self) -> None:
        owner = "Schedule"
        check_mapping(self.actions, owner=owner, name="actions")
        clean = {}
        for step, entry in self.actions.items():
            step = check_int(step, owner=owner, name="every step", minimum=0)
            entry = [entry] if isinstance(entry, ACTION_TYPES) else entry
            try:
                clean[step] = tuple(validate_actions(entry))
            except ValueError as error:
                raise ValueError(f"{owner}: entry at step {step}: {error}") from None
        object.__setattr__(self, "actions", FrozenMapping(dict(sorted(clean.items()))))
        super().__post_init__()

    def _entries(self) -> Mapping[int, tuple[Action, ...]]:
        """``actions`` as __post_init__ left them: every entry a tuple, in step order."""
        return cast(Mapping[int, tuple[Action, ...]], self.actions)

    def _initial_state(self) -> dict:
        return {"fired": []}  # steps already acted on

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        """Returns the actions of every entry that is due and has not fired."""
        out: list[Action] = []
        fired = self._state["fired"]
        for step, entry in self._entries().items():
            if step <= ctx.step and step not in fired:
                fired.append(step)
                out.extend(
                    a if a.reason else with_reason(a, f"Schedule: entry for step {step}")
                    for a in entry
                )
        return out

    def upcoming(self, ctx: Context) -> list[Action]:
        """The actions of the next entry that has not fired."""
        del ctx
        fired = self._state["fired"]
        return next((list(e) for step, e in self._entries().items() if step not in fired), [])
