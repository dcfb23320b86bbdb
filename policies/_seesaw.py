"""``Seesaw``: where a step-decay schedule halves the rate, grow the batch instead."""

import dataclasses
import math
from collections.abc import Mapping, Sequence

from adaptjax.policies._actions import Action, SetBatchSize, SetHyperparams
from adaptjax.policies._checks import check_float, check_int, check_optional_int
from adaptjax.policies._context import Context
from adaptjax.policies._policy import StatefulPolicy


@dataclasses.dataclass(frozen=True, eq=False)
class Seesaw(StatefulPolicy):
    """Turns each decay of a step-decay learning-rate schedule into a larger batch.

    Where the user's schedule multiplies the rate by ``decay`` (½ for a
    halving), Seesaw multiplies the batch by ``1 / decay`` and lets the rate
    fall only by ``√decay`` (÷√2 instead of ÷2): at equal samples, the same loss
    in fewer serial steps (Meterez et al. 2025 report about 36% fewer). The
    policy runs over the user's own schedule: at the first evaluation at or
    after each milestone, when the schedule has already decayed the rate it
    sees, it asks for that rate × ``1/√decay`` and the larger batch. Once
    ``growths`` milestones have grown the batch, or the batch would pass
    ``max_batch_size``, a milestone is left to the schedule (the rate decays as
    the schedule says and the batch stays).

    Args:
      milestones: the steps at which the schedule decays the rate (e.g. the
        boundaries of ``optax.piecewise_constant_schedule``), >= 0.
      decay: the schedule's factor at each milestone, in (0, 1); ``1 / decay``
        must be an integer (the batch's factor).
      max_batch_size: the largest global batch to ask for, or None.
      growths: how many milestones may grow the batch (the first ones), or
        None (every one). The default, 1, is what the frontier benchmark
        chose (the docs' benchmarks page says why).

    Example:
      >>> from adaptjax.policies import Context, Seesaw
      >>> policy = Seesaw(milestones=(100,))
      >>> ctx = Context(step=100, batch_size=64, microbatches=1, devices=8, max_devices=8,
      ...               hyperparams={"learning_rate": 0.05})  # the schedule halved 0.1
      >>> batch, rate = policy.decide({}, ctx)
      >>> batch.batch_size, round(rate.values["learning_rate"], 4)  # 0.1 / sqrt(2)
      (128, 0.0707)

    References:
      Meterez et al., "Seesaw: Accelerating Training by Balancing Learning
      Rate and Batch Size Scheduling", arXiv 2510.14717, 2025.
    """

    milestones: Sequence[int]
    decay: float = 0.5
    max_batch_size: int | None = None
    growths: int | None = 1

    def __post_init__(self) -> None:
        owner = "Seesaw"
        steps = tuple(sorted(check_int(m, owner=owner, name="every milestone", minimum=0)
                             for m in self.milestones))
        if not steps:
            raise ValueError(f"{owner}: milestones must name at least one step, got ()")
        decay = check_float(self.decay, owner=owner, name="decay")
        growth = round(1.0 / decay) if 0.0 < decay < 1.0 else 0
        if growth < 2 or not math.isclose(growth * decay, 1.0):
            raise ValueError(f"{owner}: decay must be 1/n for an integer n >= 2 (0.5: the "
                             f"batch doubles), got {self.decay!r}")
        check_optional_int(self.max_batch_size, owner=owner, name="max_batch_size", minimum=1)
        check_optional_int(self.growths, owner=owner, name="growths", minimum=0)
        object.__setattr__(self, "milestones", steps)
        object.__setattr__(self, "decay", decay)
        super().__post_init__()

    def _initial_state(self) -> dict:
        # milestones acted on (or left to the schedule), and how many grew the batch
        return {"done": [], "grown": 0}

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        """At a milestone just passed: the batch × 1/decay and the rate it sees × 1/√decay."""
        del metrics
        due = [m for m in self.milestones if m <= ctx.step and m not in self._state["done"]]
        if not due:
            return []
        self._state["done"].extend(due)
        grown = self._state.get("grown", 0)
        due = due[:len(due) if self.growths is None else max(0, self.growths - grown)]
        growth = round(1.0 / self.decay) ** len(due)
        batch = ctx.batch_size * growth
        rate = ctx.hyperparams.get("learning_rate")
        too_large = self.max_batch_size is not None and batch > self.max_batch_size
        if not due or rate is None or too_large:
            return []
        self._state["grown"] = grown + len(due)
        why = f"Seesaw: milestone {due[-1]}, the batch x{growth} instead of the rate x{self.decay}"
        return [SetBatchSize(batch, reason=why),
                SetHyperparams({"learning_rate": rate / math.sqrt(self.decay) ** len(due)},
                               reason=why)]
