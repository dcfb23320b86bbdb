"""``BatchSizeWarmup``: the batch follows the measured noise scale, doubling as it grows."""

import dataclasses
import statistics
from collections.abc import Mapping

from adaptjax.policies._actions import Action, SetBatchSize
from adaptjax.policies._batch_rules import (
    BatchSizePolicy,
    batch_bounds,
    check_batch_range,
    noise_reading,
)
from adaptjax.policies._checks import (
    check_choice,
    check_float,
    check_int,
    check_optional_int,
    check_str,
)
from adaptjax.policies._context import Context
from adaptjax.policies._goodput import LR_RULES, OPTIMIZER_KINDS


@dataclasses.dataclass(frozen=True, eq=False)
class BatchSizeWarmup(BatchSizePolicy):
    """Doubles the batch while the measured noise scale says a larger one costs few samples.

    McCandlish et al.'s model of a step, ΔL(B) = ΔL_max / (1 + B_noise / B),
    says a batch well below the noise scale B_noise wastes optimizer steps
    (each step makes ~B/B_noise of the progress it could) and one well above it
    wastes samples. The noise scale is small early in training and grows, so
    the batch should grow with it: a batch-size warm-up that follows the
    measurement instead of a schedule (Merrill et al. 2025 reach an equal loss
    with 43% fewer steps by warming the batch up on OLMo-1B). Unlike
    :class:`AdaptiveBatchSize` it needs no step-time model: it saves steps at
    equal samples, which is time on hardware whose step time is nearly flat in
    the batch (GPUs, TPUs), and costs nothing measurable where it is not.

    At every evaluation the policy

    1. keeps the last ``window`` valid readings of ``metric`` (a reading
       flagged ``<metric>_valid = 0`` is skipped, see
       ``adaptjax.GradientNoiseScale``) taken at the current batch size —
       the readings start afresh after each change, because the noise scale
       measured depends on the batch the run trains at;
    2. once it has ``window`` of them, sets the target T = ``fraction`` ×
       their median;
    3. doubles the batch M when 2M ≤ T (at most to ``max_batch_size``) and,
       with ``shrink``, halves it when T < M/2 (never below
       ``min_batch_size``), one step at a time: a reading taken at M says
       little about 4M, so the next move waits for ``window`` readings at the
       new batch. Each batch holds while M/2 ≤ T < 2M, a band a factor 4
       wide, so a reading wandering around a threshold does not move the batch
       back and forth;
    4. moves the learning rate with the batch by ``lr_rule``: base_lr ×
       rule(M/M₀), M₀ the batch of the first decision.

    **Defaults, from the adaptive-batch benchmark** (``examples/lm.py``'s
    byte-level LM, 135k parameters, Adam at 2e-3 from batch 8, 3.2M tokens, two
    seeds): ``fraction=0.5``, ``window=5``, ``lr_rule="none"``, no shrinking.
    There the noise scale measured at batch 8 rises to 30-50 in the first few
    hundred steps and the batch doubles to 32 (one seed later to 64); the
    runs ended 0.4% above the best fixed batch (16) in half its steps. Once a
    run sits in its learning rate's noise ball, the simple noise scale
    measures the iterate's own noise: it tracks the batch over the learning
    rate (B_simple ≈ 1.7 × M at 2e-3 for every M from 8 to 64) rather than the
    critical batch, so it neither keeps growing nor means "smaller" when it
    dips. Following it further does harm: with ``fraction=1`` the batch ran
    to 128 (+1.5% loss); with ``shrink`` a dip cascaded the batch from 64 back
    to 8, where Adam's second moment, averaged at the large batch, made the
    steps too long (+6%); the square-root rule, whose rising learning rate
    lowers B_simple / M, stopped the warm-up at 16 (0.3% below the best fixed
    loss, but 6% fewer steps only). For the critical batch itself, follow
    ``"critical_batch"`` from :class:`CriticalBatchProbe`, which measures it
    by branching.

    Args:
      max_batch_size: the largest global batch to propose, >= 1.
      min_batch_size: the smallest; default M₀ (never below the starting batch).
      fraction: the target batch as a multiple of the noise scale, > 0.
      window: valid readings per decision (their median is used), >= 1.
      metric: the noise-scale metric to follow (``"noise_scale"``,
        ``"precond_noise_scale"``, or ``"critical_batch"`` from
        :class:`CriticalBatchProbe`).
      lr_rule: ``"none"`` (keep the learning rate), ``"sqrt"``, ``"linear"``
        or ``"adascale"`` (see ``lr_scale``).
      optimizer_kind: ``"adam"`` or ``"sgd"`` (for ``"adascale"``).
      lr_key: the hyperparameter holding the learning rate.
      multiple_of: proposals are multiples of this and of
        ``ctx.devices * ctx.microbatches`` (the default).
      shrink: halve the batch when the target falls below half of it (off by
        default: see above).

    References:
      McCandlish et al., "An Empirical Model of Large-Batch Training", 2018;
      Merrill et al., "Critical Batch Size Revisited", 2025; Smith et al.,
      "Don't Decay the Learning Rate, Increase the Batch Size", ICLR 2018.

    Example:
      >>> from adaptjax.policies import BatchSizeWarmup, Context
      >>> policy = BatchSizeWarmup(max_batch_size=512, window=2)
      >>> ctx = Context(step=100, batch_size=32, microbatches=1, devices=8, max_devices=8,
      ...               hyperparams={"learning_rate": 1e-3})
      >>> policy.decide({"noise_scale": 150.0}, ctx)  # one reading of the two
      []
      >>> policy.decide({"noise_scale": 170.0}, ctx)  # 0.5 x median 160 >= 2 x 32
      [SetBatchSize(batch_size=64, microbatches=None)]
    """

    max_batch_size: int
    min_batch_size: int | None = dataclasses.field(default=None, kw_only=True)
    fraction: float = dataclasses.field(default=0.5, kw_only=True)
    window: int = dataclasses.field(default=5, kw_only=True)
    metric: str = dataclasses.field(default="noise_scale", kw_only=True)
    lr_rule: str = dataclasses.field(default="none", kw_only=True)
    optimizer_kind: str = dataclasses.field(default="adam", kw_only=True)
    lr_key: str = dataclasses.field(default="learning_rate", kw_only=True)
    multiple_of: int | None = dataclasses.field(default=None, kw_only=True)
    shrink: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        owner = "BatchSizeWarmup"
        check_batch_range(self, owner)
        fraction = check_float(self.fraction, owner=owner, name="fraction", low=0.0)
        if fraction <= 0.0:
            raise ValueError(f"{owner}: fraction must be > 0, got {fraction}; try 1.0")
        object.__setattr__(self, "fraction", fraction)
        object.__setattr__(
            self, "window", check_int(self.window, owner=owner, name="window", minimum=1)
        )
        check_str(self.metric, owner=owner, name="metric", allow_empty=False)
        check_choice(self.lr_rule, LR_RULES, owner=owner, name="lr_rule")
        check_choice(self.optimizer_kind, OPTIMIZER_KINDS, owner=owner, name="optimizer_kind")
        check_str(self.lr_key, owner=owner, name="lr_key", allow_empty=False)
        object.__setattr__(
            self,
            "multiple_of",
            check_optional_int(self.multiple_of, owner=owner, name="multiple_of", minimum=1),
        )
        if not isinstance(self.shrink, bool):
            raise TypeError(f"{owner}: shrink must be True or False, got {self.shrink!r}")
        super().__post_init__()

    def _initial_state(self) -> dict:
        # readings: valid noise-scale readings at batch ``readings_batch``
        return {**self._lr_state(), "readings": [], "readings_batch": None}

    def required_metrics(self) -> frozenset[str]:
        """The metric followed: without it the policy never acts."""
        return frozenset({self.metric})

    def _bounds(self, ctx: Context) -> tuple[int, int, int]:
        base = self._state["base_batch_size"] or ctx.base_batch_size or ctx.batch_size
        return batch_bounds(
            ctx, low=self.min_batch_size or base, high=self.max_batch_size,
            multiple_of=self.multiple_of,
        )

    def _next_batch(self, target: float, ctx: Context) -> int:
        """One doubling when 2M <= T, one halving (``shrink``) when T < M/2, else M."""
        step, low, high = self._bounds(ctx)
        batch = ctx.batch_size
        if 2 * batch <= target and 2 * batch <= high:
            return 2 * batch // step * step
        if self.shrink and target < batch / 2 and batch // 2 >= low:
            return max(batch // 2 // step * step, low)
        return batch

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        """``[SetBatchSize, SetHyperparams]`` when the target leaves the band, else ``[]``."""
        self._begin(ctx)
        state = self._state
        if state["readings_batch"] != ctx.batch_size:
            state["readings"], state["readings_batch"] = [], ctx.batch_size
        phi = noise_reading(metrics, self.metric)
        if phi is None:
            return []
        state["readings"] = (state["readings"] + [phi])[-self.window :]
        if len(state["readings"]) < self.window:
            return []
        step, low, high = self._bounds(ctx)
        if low > high:
            return []
        median = statistics.median(state["readings"])
        target = self.fraction * median
        batch = self._next_batch(target, ctx)
        if batch == ctx.batch_size:
            return []
        why = (
            f"BatchSizeWarmup: {self.metric} {median:.4g} (median of the last {self.window} "
            f"valid readings) x {self.fraction:g} = {target:.4g} "
            f"{'>= 2' if batch > ctx.batch_size else '< 1/2'} x batch {ctx.batch_size}"
        )
        return self._propose(batch, median, metrics, ctx, why)

    def upcoming(self, ctx: Context) -> list[Action]:
        """The next doubling (and halving, with ``shrink``), compiled ahead by the controller."""
        step, low, high = self._bounds(ctx)
        sizes = (2 * ctx.batch_size // step * step,
                 ctx.batch_size // 2 // step * step if self.shrink else 0)
        return [
            SetBatchSize(m, reason="BatchSizeWarmup: a likely next batch")
            for m in dict.fromkeys(sizes) if low <= m <= high and m != ctx.batch_size
        ]
