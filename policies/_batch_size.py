"""``AdaptiveBatchSize``: grow or shrink the batch where Pollux's goodput model says it pays."""

import dataclasses
import math
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
    check_planner,
    check_str,
    read_metric,
)
from adaptjax.policies._context import Context
from adaptjax.policies._goodput import (
    LR_RULES,
    OPTIMIZER_KINDS,
    fit_throughput,
    goodput,
    statistical_efficiency,
)
from adaptjax.policies._planner import current, observe, predict


@dataclasses.dataclass(frozen=True, eq=False)
class AdaptiveBatchSize(BatchSizePolicy):
    """Proposes the batch size with the best predicted goodput, and rescales the LR with it.

    At every evaluation the policy

    1. records the step time at the current configuration (``step_time``, or
       ``batch_size / throughput``), keeping the last ``window`` values per
       batch size for each (devices, micro-batches, compressed or not)
       configuration — a change of devices or codec starts a fresh model;
    2. models the step time as T(M) = α + β·M: a non-negative least-squares fit
       of the median step time at each batch size measured in this
       configuration (``fit_throughput``). While only one batch size M₁
       has been measured (step time T₁) it uses a prior: a fraction
       ``prior_overhead`` of T₁ is fixed per-step cost, the rest grows with M
       (α = f·T₁, β = (1−f)·T₁/M₁), and only half and double the current
       batch are considered, so the policy explores one step at a time;
    3. reads the noise scale φ (``noise_scale``, else
       ``grad_variance / grad_sqnorm``) and scores candidates by goodput
       M/T(M) · (φ + M₀)/(φ + M) (:func:`goodput`); a reading flagged
       ``noise_scale_valid = 0`` (see ``adaptjax.GradientNoiseScale``) is not
       acted on. Candidates are multiples of
       ``multiple_of`` in [min, max]; goodput is unimodal with its peak at
       M* = √(αφ/β), so the two multiples around M* (clipped) are the best;
    4. proposes ``SetBatchSize`` only when the predicted goodput gain over the
       current batch is at least ``gain_threshold``, together with
       ``SetHyperparams({lr_key: base_lr × rule(S)})``, S = M/M₀.

    **The cost of a change.** A batch size not yet run in this configuration
    waits for XLA to compile its step: C seconds (``compile_seconds``, which
    the controller gives as the median wait of the run's compiles so far). With
    ``count_compiles`` the policy assumes the run lasts at least as long again
    as it has run (``train_seconds`` A; Pollux's re-allocation penalty reads
    the job's age the same way), so a move to such a batch keeps only A − C of
    the next A seconds: its goodput counts × (A − C)/A, and a batch already run
    in this configuration (which the candidates then include) costs nothing.
    The configuration is (devices, micro-batches, compressed or not), as for
    the step-time model: a switch between two codecs or sync strategies is not
    told apart, so a batch run under one counts as compiled under the other.
    Early in a run, when a compile is a large part of the time so far, the
    policy moves only for a large gain; hours in, the factor is ~1. Without the
    two metrics (e.g. outside the controller) nothing is discounted.

    **Moves that wait for no compile.** :meth:`upcoming` announces half and
    double the current batch, the moves the one-size model proposes first and
    the neighbours of a fitted peak, so the controller compiles them in the
    background. A batch the context reports compiled (``ctx.compiled_batch_sizes``:
    the controller lists those run, compiled ahead or compiled in the background
    in the current configuration) counts as compiled here too: a candidate at
    no compile cost; so does a multiple of one of ``ctx.micro_batch_sizes``,
    which the controller runs in accumulated micro-steps of that compiled step
    (``RunSpec.micro_batch_size``).

    With a ``planner`` (e.g. ``adaptjax.costs.Planner``) step 2 asks it for the
    step time T(M) of each candidate instead of fitting α + βM from this run's
    noisy neighbouring batch sizes, and the candidates are every power-of-two
    multiple of the current batch in [min, max] (plus both ends); where it
    cannot predict the current batch, the fit above decides.

    M₀ is ``ctx.base_batch_size`` (else the batch size) and base_lr is
    ``ctx.hyperparams[lr_key]`` at the first decision; both are kept in the
    state. If something else changed the learning rate since this policy last
    set it (e.g. ``ReduceLROnPlateau``), the base is rescaled by that change
    first, so the other policy's decision is kept. Does nothing while
    ``noise_scale`` (or the variance pair) or a step time is missing, or while
    ``noise_scale_valid`` is present and not 1 (step times are still recorded).

    Args:
      max_batch_size: the largest global batch to propose, >= 1.
      min_batch_size: the smallest; default M₀ (never below the starting batch).
      lr_rule: ``"adascale"`` (gain r from σ² = grad_variance/M₀ and
        μ² = grad_sqnorm, or from φ alone), ``"sqrt"``, ``"linear"`` or ``"none"``
        (leave the learning rate alone).
      optimizer_kind: ``"adam"`` (AdaScale factor √r) or ``"sgd"`` (factor r).
      gain_threshold: the smallest predicted relative goodput gain worth a
        change, >= 0 (Pollux: 0.05).
      lr_key: the hyperparameter holding the learning rate.
      multiple_of: proposals are multiples of this and of
        ``ctx.devices * ctx.microbatches`` (the default), so they stay divisible.
      prior_overhead: the fixed-cost fraction assumed before two batch sizes
        are measured, in [0, 1).
      window: step times kept per batch size (the median is used), >= 1.
      planner: an :class:`adaptjax.costs.Planner` (or any object with
        ``step_time(candidate)``), or ``None``.
      count_compiles: discount batch sizes not yet run in this configuration
        (devices, micro-batches, compressed or not) by the compile's share of
        the run so far (see above).

    References:
      Qiao et al., "Pollux", OSDI 2021; Johnson et al., "AdaScale SGD", ICML 2020.

    Example:
      >>> from adaptjax.policies import AdaptiveBatchSize, Context
      >>> policy = AdaptiveBatchSize(max_batch_size=1024, lr_rule="linear")
      >>> ctx = Context(step=100, batch_size=64, microbatches=1, devices=8, max_devices=8,
      ...               hyperparams={"learning_rate": 0.1})
      >>> policy.decide({"loss": 2.3}, ctx)  # no noise scale or step time yet
      []
      >>> policy.decide({"noise_scale": 10_000.0, "step_time": 0.2}, ctx)
      [SetBatchSize(batch_size=128, microbatches=None), SetHyperparams(values={'learning_rate': 0.2})]
    """  # noqa: E501

    max_batch_size: int
    min_batch_size: int | None = dataclasses.field(default=None, kw_only=True)
    lr_rule: str = dataclasses.field(default="adascale", kw_only=True)
    optimizer_kind: str = dataclasses.field(default="adam", kw_only=True)
    gain_threshold: float = dataclasses.field(default=0.05, kw_only=True)
    lr_key: str = dataclasses.field(default="learning_rate", kw_only=True)
    multiple_of: int | None = dataclasses.field(default=None, kw_only=True)
    prior_overhead: float = dataclasses.field(default=0.5, kw_only=True)
    window: int = dataclasses.field(default=16, kw_only=True)
    planner: object = dataclasses.field(default=None, kw_only=True)
    count_compiles: bool = dataclasses.field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        owner = "AdaptiveBatchSize"
        check_planner(self.planner, owner)
        check_batch_range(self, owner)
        check_choice(self.lr_rule, LR_RULES, owner=owner, name="lr_rule")
        check_choice(self.optimizer_kind, OPTIMIZER_KINDS, owner=owner, name="optimizer_kind")
        object.__setattr__(
            self,
            "gain_threshold",
            check_float(self.gain_threshold, owner=owner, name="gain_threshold", low=0.0),
        )
        check_str(self.lr_key, owner=owner, name="lr_key", allow_empty=False)
        object.__setattr__(
            self,
            "multiple_of",
            check_optional_int(self.multiple_of, owner=owner, name="multiple_of", minimum=1),
        )
        object.__setattr__(
            self,
            "prior_overhead",
            check_float(
                self.prior_overhead, owner=owner, name="prior_overhead", low=0.0, high=1.0,
                high_open=True,
            ),
        )
        object.__setattr__(
            self, "window", check_int(self.window, owner=owner, name="window", minimum=1)
        )
        if not isinstance(self.count_compiles, bool):
            raise TypeError(
                f"{owner}: count_compiles must be True or False, got {self.count_compiles!r}"
            )
        super().__post_init__()

    def _initial_state(self) -> dict:
        return {
            **self._lr_state(),
            "observations": [],  # [{"devices", "microbatches", "compressed", "batch_size",
            #                        "step_times": [...]}]
        }

    # --- helpers -------------------------------------------------------------------------

    def _record(self, metrics: Mapping[str, float], ctx: Context) -> None:
        step_time = read_metric(metrics, "step_time")
        if step_time is None:
            throughput = read_metric(metrics, "throughput")
            if throughput is not None and throughput > 0.0:
                step_time = ctx.batch_size / throughput
        if step_time is None or step_time <= 0.0:
            return
        key = self._config(ctx)
        for entry in self._state["observations"]:
            if _config_of(entry) == key and entry["batch_size"] == ctx.batch_size:
                times = entry["step_times"]
                break
        else:
            times = []
            self._state["observations"].append(
                {
                    "devices": key[0],
                    "microbatches": key[1],
                    "compressed": key[2],
                    "batch_size": ctx.batch_size,
                    "step_times": times,
                }
            )
        times.append(step_time)
        del times[: max(len(times) - self.window, 0)]

    def _compiled(self, ctx: Context) -> set[int]:
        """Batch sizes whose step is compiled in the current configuration.

        Those this policy saw run here, and those the controller reports
        compiled in ``ctx.compiled_batch_sizes`` (run, compiled ahead, or
        compiled in the background after :meth:`upcoming`).
        """
        key = self._config(ctx)
        ran = {e["batch_size"] for e in self._state["observations"] if _config_of(e) == key}
        return ran | set(ctx.compiled_batch_sizes)

    def _compiled_candidates(self, ctx: Context, low: int, high: int, step: int) -> set[int]:
        """The valid batch sizes already compiled here, candidates at no compile cost."""
        if not self.count_compiles:
            return set()
        return {m for m in self._compiled(ctx) if low <= m <= high and m % step == 0}

    def _compile_discount(self, metrics: Mapping[str, float], ctx: Context):
        """``m -> factor`` on a candidate's goodput for the compile a move to it waits for."""
        seconds = read_metric(metrics, "compile_seconds")
        age = read_metric(metrics, "train_seconds")
        if not self.count_compiles or seconds is None or age is None or seconds <= 0.0:
            return lambda m: 1.0
        compiled = self._compiled(ctx) | {ctx.batch_size}
        kept = max(age - seconds, 0.0) / age if age > 0.0 else 0.0
        return lambda m: 1.0 if m in compiled or _accumulated(m, ctx) else kept

    def _compile_words(self, m: int, discount, metrics: Mapping[str, float],
                       ctx: Context) -> str:
        """The reason's words on the compile a move to ``m`` waits for, if any."""
        factor = discount(m)
        if factor < 1.0 or not self.count_compiles:
            return _compile_note(factor, metrics)
        if m in self._compiled(ctx):
            return "; its step is compiled: no compile to wait for"
        if _accumulated(m, ctx):
            return "; it runs in micro-steps of a compiled step: no compile to wait for"
        return _compile_note(factor, metrics)

    @staticmethod
    def _config(ctx: Context) -> tuple[int, int, bool]:
        return (ctx.devices, ctx.microbatches, ctx.codec is not None)

    def _model(self, ctx: Context) -> tuple[float, float, bool] | None:
        """(α, β, is_prior) for the current configuration, or None without data."""
        key = self._config(ctx)
        points = sorted(
            (entry["batch_size"], statistics.median(entry["step_times"]))
            for entry in self._state["observations"]
            if _config_of(entry) == key and entry["step_times"]
        )
        if not points:
            return None
        if len(points) == 1:
            batch, step_time = points[0]
            f = self.prior_overhead
            return f * step_time, (1.0 - f) * step_time / batch, True
        alpha, beta = fit_throughput([p[0] for p in points], [p[1] for p in points])
        return alpha, beta, False

    def _bounds(self, ctx: Context) -> tuple[int, int, int]:
        base = self._state["base_batch_size"] or ctx.base_batch_size or ctx.batch_size
        return batch_bounds(
            ctx, low=self.min_batch_size or base, high=self.max_batch_size,
            multiple_of=self.multiple_of,
        )

    def upcoming(self, ctx: Context) -> list[Action]:
        """Half and double the current batch (within the bounds), once a step time is known.

        The moves a one-size model proposes first and a fitted one passes
        through; the controller compiles them in the background, so that when
        one comes its step is ready and (the context then reports it in
        ``ctx.compiled_batch_sizes``) no compile discount holds it back.
        Nothing before a step time was measured: the policy cannot move yet.
        """
        if self._model(ctx) is None:
            return []
        step, low, high = self._bounds(ctx)
        sizes = (ctx.batch_size // 2 // step * step, 2 * ctx.batch_size // step * step)
        return [
            SetBatchSize(m, reason="AdaptiveBatchSize: a likely next batch")
            for m in dict.fromkeys(sizes) if low <= m <= high and m != ctx.batch_size
        ]

    # --- decision ------------------------------------------------------------------------

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        """Returns ``[SetBatchSize, SetHyperparams]`` when a change pays, else ``[]``."""
        self._begin(ctx)
        self._record(metrics, ctx)
        if self.planner is not None:
            observe(self.planner, metrics, ctx)
        phi = noise_reading(metrics)
        model = self._model(ctx)
        base = self._state["base_batch_size"]
        step, low, high = self._bounds(ctx)
        discount = self._compile_discount(metrics, ctx)
        if phi is not None and low <= high and self.planner is not None:
            planned = self._planned(ctx, phi, low, high, step, discount)
            if planned == 0:
                return []
            if planned is not None:
                why = (
                    f"AdaptiveBatchSize: noise scale {phi:.4g}: the planner predicts a higher "
                    f"goodput at batch {planned} than at {ctx.batch_size}"
                    f"{self._compile_words(planned, discount, metrics, ctx)}"
                )
                return self._propose(planned, phi, metrics, ctx, why)
        if phi is None or model is None:
            return []
        alpha, beta, is_prior = model
        if low > high:
            return []

        def clip(m: float) -> int:
            return min(max(int(m), low), high)

        current = ctx.batch_size
        if is_prior:
            candidates = {clip(current // 2 // step * step), clip(2 * current)}
        else:
            if beta == 0.0:
                peak = math.inf
            elif alpha == 0.0 or phi == 0.0:
                peak = 0.0
            else:
                peak = math.sqrt(alpha * phi / beta)
            below = high if math.isinf(peak) else int(peak // step * step)
            candidates = {low, high, clip(below), clip(below + step)}
            candidates |= self._compiled_candidates(ctx, low, high, step)
        candidates.discard(current)
        if not candidates:
            return []

        def score(m: int) -> float:
            return goodput(m, noise_scale=phi, alpha=alpha, beta=beta, base_batch_size=base)

        best = min(candidates, key=lambda m: (-score(m) * discount(m), m))
        if score(best) * discount(best) < (1.0 + self.gain_threshold) * score(current):
            return []
        gain = score(best) * discount(best) / score(current) - 1.0
        fit = "prior" if is_prior else "fit"
        why = (
            f"AdaptiveBatchSize: noise scale {phi:.4g}, step time T(M) = {alpha:.3g} + "
            f"{beta:.3g}*M s ({fit}): predicted goodput at batch {best} is {gain:+.0%} vs "
            f"{current}{self._compile_words(best, discount, metrics, ctx)}"
        )
        return self._propose(best, phi, metrics, ctx, why)

    def _planned(self, ctx: Context, phi: float, low: int, high: int, step: int,
                 discount) -> int | None:
        """The planner's best batch (0: stay), or None when it cannot predict the current one."""
        here = current(ctx)
        base = self._state["base_batch_size"]

        def score(m: int) -> float | None:
            t = predict(self.planner, here._replace(batch_size=m))
            if t is None:
                return None
            return m / t * statistical_efficiency(phi, m, base) * discount(m)

        now = score(ctx.batch_size)
        if now is None:
            return None
        candidates = {low, high} | self._compiled_candidates(ctx, low, high, step)
        for k in range(-12, 13):
            m = int(round(ctx.batch_size * 2.0**k / step)) * step
            if low <= m <= high:
                candidates.add(m)
        candidates.discard(ctx.batch_size)
        scored = [(s, m) for m in candidates if (s := score(m)) is not None]
        if not scored:
            return 0
        best_score, best = max(scored, key=lambda sm: (sm[0], -sm[1]))
        return best if best_score >= (1.0 + self.gain_threshold) * now else 0


def _compile_note(factor: float, metrics: Mapping[str, float]) -> str:
    """The reason's words on the compile a move waits for ('' when it costs nothing)."""
    if factor >= 1.0:
        return ""
    return (
        f" after its compile (~{read_metric(metrics, 'compile_seconds'):.3g} s of a run "
        f"{read_metric(metrics, 'train_seconds'):.3g} s old: x{factor:.2f})"
    )


def _accumulated(m: int, ctx: Context) -> bool:
    """Whether a batch of ``m`` runs as micro-steps of a compiled step (no compile)."""
    return any(m % p == 0 for p in ctx.micro_batch_sizes)


def _config_of(entry: Mapping) -> tuple[int, int, bool]:
    return (entry["devices"], entry["microbatches"], entry["compressed"])
