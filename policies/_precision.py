"""``PrecisionPolicy``: compute in a low precision while the run is stable, back when it is not."""

import dataclasses
import math
from collections.abc import Mapping

from adaptjax.policies._actions import Action, SetPrecision, precision_name
from adaptjax.policies._checks import (
    check_float,
    check_int,
    check_metric_gate,
    read_metric,
)
from adaptjax.policies._context import Context
from adaptjax.policies._policy import StatefulPolicy

HIGH, LOW = "high", "low"


@dataclasses.dataclass(frozen=True, eq=False)
class PrecisionPolicy(StatefulPolicy):
    """Moves the step to ``low`` precision once the run is stable, and back on trouble.

    The run starts in ``high``. It moves to ``low`` (``SetPrecision(low)``)
    when all of these hold: ``ctx.step >= warmup``; no incident for
    ``stable_steps`` steps; and, with ``metric``, the threshold rule (e.g.
    ``metric="grad_snr", below=1.0``: the batch gradient is mostly sampling
    noise, far above bfloat16's relative rounding error of ``2**-8``). An
    incident is a non-finite step (``nonfinite`` > 0, ``nonfinite_count``
    grown since the last evaluation, or a non-finite loss) or a loss spike
    (``loss > spike`` times its running average over evaluations, which
    spikes do not enter). After an incident in ``low`` it moves back to
    ``high`` (``SetPrecision(high)``) and stays there for at least ``window``
    steps and until the run is stable again; an incident in ``high`` extends
    the window. Steps are ``ctx.step``, so the rules do not depend on how
    often the controller evaluates.

    Under dynamic loss scaling (float16: the step reports the metric
    ``loss_scale``), a skipped step with a finite loss is the loss scale
    finding its range, not an incident: the scale starts high (``2**15``)
    and halves on each overflow until the scaled gradients fit (settling),
    and each later growth that overflows halves it back (one skip per
    ``period`` finite steps, by design). Such skips are ignored while the
    reported ``loss_scale`` is above ``loss_scale_floor`` (the scale's
    ``min_scale``): at the floor the scale cannot fall further, so a skip
    there is an incident, as is a non-finite loss (a forward overflow,
    which no scale cures). The skipped steps moved no parameter, so nothing
    is lost by waiting for the scale.

    The precisions are opaque values: ``adaptjax.Precision`` objects the user
    built, or their keys (``"bfloat16"``). The policy remembers which one it
    asked for (its state is checkpointed with the run); when the context
    carries the running precision (``ctx.precision``), that wins.

    Args:
      low: the precision to move to when stable.
      high: the precision to start in and to return to.
      warmup: steps in ``high`` before the first move, >= 0.
      stable_steps: incident-free steps needed before moving to ``low``, >= 1.
      window: steps in ``high`` after an incident, at least, >= 1.
      spike: a loss above ``spike`` times its running average is a spike, > 1.
      decay: the running average's decay per evaluation, in (0, 1).
      metric: an optional metric that must pass the threshold too.
      below: with ``metric``: move only when ``metrics[metric] < below``.
      above: with ``metric``: move only when ``metrics[metric] > above``.
      loss_scale_floor: skips with a finite loss while ``loss_scale`` is above
        it are the loss scale's, not incidents, > 0.

    Example:
      >>> from adaptjax.policies import Context, PrecisionPolicy
      >>> policy = PrecisionPolicy(warmup=100, stable_steps=50, window=200)
      >>> def ctx(step):
      ...     return Context(step=step, batch_size=64, microbatches=1, devices=8,
      ...                    max_devices=8, hyperparams={})
      >>> policy.decide({"loss": 2.0}, ctx(50)), policy.decide({"loss": 1.9}, ctx(100))
      ([], [SetPrecision(precision='bfloat16')])
      >>> policy.decide({"loss": 1.8, "nonfinite_count": 1.0}, ctx(110))
      [SetPrecision(precision='float32')]
      >>> policy.decide({"loss": 1.7, "nonfinite_count": 1.0}, ctx(300))
      []
      >>> policy.decide({"loss": 1.6, "nonfinite_count": 1.0}, ctx(310))
      [SetPrecision(precision='bfloat16')]

      In float16, a skip while the loss scale halves from ``2**15`` is settling:

      >>> fp16 = PrecisionPolicy("float16", warmup=0, stable_steps=10, window=100)
      >>> fp16.decide({"loss": 2.0}, ctx(0)), fp16.decide({"loss": 2.0}, ctx(10))
      ([], [SetPrecision(precision='float16')])
      >>> fp16.decide({"loss": 1.9, "nonfinite_count": 3.0, "loss_scale": 4096.0}, ctx(20))
      []
      >>> fp16.decide({"loss": 1.9, "nonfinite_count": 4.0, "loss_scale": 1.0}, ctx(30))
      [SetPrecision(precision='float32')]
    """

    low: object = "bfloat16"
    high: object = "float32"
    warmup: int = dataclasses.field(default=200, kw_only=True)
    stable_steps: int = dataclasses.field(default=100, kw_only=True)
    window: int = dataclasses.field(default=500, kw_only=True)
    spike: float = dataclasses.field(default=1.5, kw_only=True)
    decay: float = dataclasses.field(default=0.9, kw_only=True)
    metric: str | None = dataclasses.field(default=None, kw_only=True)
    below: float | None = dataclasses.field(default=None, kw_only=True)
    above: float | None = dataclasses.field(default=None, kw_only=True)
    loss_scale_floor: float = dataclasses.field(default=1.0, kw_only=True)

    def __post_init__(self) -> None:
        owner = "PrecisionPolicy"
        for name in ("low", "high"):  # validated (and its message given) like the action
            SetPrecision(getattr(self, name))
        if precision_name(self.low) == precision_name(self.high):
            raise ValueError(
                f"{owner}: low and high are the same precision ({precision_name(self.low)!r}); "
                "give two different ones"
            )
        ints = {
            "warmup": check_int(self.warmup, owner=owner, name="warmup", minimum=0),
            "stable_steps": check_int(
                self.stable_steps, owner=owner, name="stable_steps", minimum=1
            ),
            "window": check_int(self.window, owner=owner, name="window", minimum=1),
        }
        floats = {
            "spike": check_float(self.spike, owner=owner, name="spike", low=1.0, low_open=True),
            "decay": check_float(
                self.decay,
                owner=owner,
                name="decay",
                low=0.0,
                high=1.0,
                low_open=True,
                high_open=True,
            ),
            "loss_scale_floor": check_float(
                self.loss_scale_floor, owner=owner, name="loss_scale_floor", low=0.0,
                low_open=True,
            ),
        }
        for name, value in {**ints, **floats}.items():
            object.__setattr__(self, name, value)
        self._check_rule(owner)
        super().__post_init__()

    def _check_rule(self, owner: str) -> None:
        if self.metric is None:
            if self.below is not None or self.above is not None:
                raise ValueError(f"{owner}: below= and above= need metric= (e.g. 'grad_snr')")
            return
        check_metric_gate(self, owner)

    def _initial_state(self) -> dict:
        return {
            "current": HIGH,
            "calm_since": None,  # the step from which no incident was seen
            "hold_until": 0,  # no move to low before this step
            "loss_average": None,
            "nonfinite_count": None,
            "incidents": 0,
        }

    def required_metrics(self) -> frozenset[str]:
        """``{"loss"}`` and the threshold rule's metric."""
        return frozenset({"loss"} | ({self.metric} if self.metric else set()))

    def _running(self, ctx: Context) -> str:
        """``"low"``/``"high"``: the context's precision when it has one, else the state's."""
        running = getattr(ctx, "precision", None)
        if running is not None:
            name = precision_name(running)
            if name == precision_name(self.low):
                return LOW
            if name == precision_name(self.high):
                return HIGH
        return self._state["current"]

    def _incident(self, metrics: Mapping[str, float]) -> str | None:
        """Why this evaluation is an incident (non-finite or spike), or ``None``; updates state."""
        state = self._state
        count = read_metric(metrics, "nonfinite_count")  # cumulative, from the controller
        grown = count is not None and count > (state["nonfinite_count"] or 0.0)
        if count is not None:
            state["nonfinite_count"] = count
        raw = metrics.get("loss") if isinstance(metrics, Mapping) else None
        bad_loss = isinstance(raw, int | float) and not math.isfinite(raw)
        skipped = grown or (read_metric(metrics, "nonfinite") or 0.0) > 0
        if bad_loss or (skipped and not self._loss_scale_skip(metrics)):
            return "a non-finite step"
        loss, average = read_metric(metrics, "loss"), state["loss_average"]
        if loss is None:
            return None
        if average is not None and loss > self.spike * average:
            return f"loss {loss:.4g} spiked above {self.spike:g} x its average {average:.4g}"
        d = self.decay
        state["loss_average"] = loss if average is None else d * average + (1 - d) * loss
        return None

    def _loss_scale_skip(self, metrics: Mapping[str, float]) -> bool:
        """Whether a skip (with a finite loss) is the loss scale's: its scale above the floor."""
        scale = read_metric(metrics, "loss_scale")
        return scale is not None and scale > self.loss_scale_floor

    def _rule_holds(self, metrics: Mapping[str, float]) -> bool:
        if self.metric is None:
            return True
        value = read_metric(metrics, self.metric)
        if value is None:
            return False
        if self.below is not None:
            return value < self.below
        assert self.above is not None  # __post_init__ asks for exactly one of them
        return value > self.above

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        """``[SetPrecision(low)]`` when stable, ``[SetPrecision(high)]`` after an incident."""
        state = self._state
        running = self._running(ctx)
        why = self._incident(metrics)
        if why is not None:
            state["incidents"] += 1
            state["calm_since"] = ctx.step
            state["hold_until"] = ctx.step + self.window
            state["current"] = HIGH
            if running == LOW:
                reason = (
                    f"PrecisionPolicy: {why} at step {ctx.step}: back to "
                    f"{precision_name(self.high)} until step {state['hold_until']} at least"
                )
                return [SetPrecision(self.high, reason=reason)]
            return []
        if state["calm_since"] is None:
            state["calm_since"] = ctx.step
        state["current"] = running
        calm = ctx.step - state["calm_since"]
        ready = ctx.step >= max(self.warmup, state["hold_until"]) and calm >= self.stable_steps
        if running == HIGH and ready and self._rule_holds(metrics):
            state["current"] = LOW
            rule = "" if self.metric is None else f" and {self.metric} passes its threshold"
            reason = (
                f"PrecisionPolicy: no non-finite step or loss spike for {calm} steps{rule}: "
                f"compute in {precision_name(self.low)}"
            )
            return [SetPrecision(self.low, reason=reason)]
        return []
