"""``ReduceLROnPlateau`` and ``EarlyStop``: act when a metric stops improving."""

import dataclasses
from collections.abc import Mapping

from adaptjax.policies._actions import Action, SetHyperparams, Stop
from adaptjax.policies._checks import (
    check_choice,
    check_float,
    check_int,
    check_str,
    read_metric,
)
from adaptjax.policies._context import Context
from adaptjax.policies._policy import StatefulPolicy

MODES = ("min", "max")


def _improved(value: float, best: float | None, mode: str, min_delta: float) -> bool:
    if best is None:
        return True
    return value < best - min_delta if mode == "min" else value > best + min_delta


@dataclasses.dataclass(frozen=True, eq=False)
class ReduceLROnPlateau(StatefulPolicy):
    """Multiplies a hyperparameter by ``factor`` when ``metric`` stops improving.

    A value improves on the best so far when it is lower by more than
    ``min_delta`` (``mode="min"``; higher for ``"max"``). When ``patience``
    steps (``ctx.step``, so independent of how often the controller evaluates)
    pass without improvement, emits ``SetHyperparams({key: max(v·factor,
    min_value)})`` and starts waiting again; nothing once ``v`` has reached
    ``min_value``. Evaluations without the metric are skipped.

    Args:
      metric: the metric to watch.
      factor: the multiplier, in (0, 1).
      patience: steps without improvement before a reduction, >= 1.
      min_delta: the least change that counts as improvement, >= 0.
      min_value: the floor for the hyperparameter, >= 0.
      key: the hyperparameter to reduce.
      mode: ``"min"`` (lower is better) or ``"max"``.

    Example:
      >>> from adaptjax.policies import Context, ReduceLROnPlateau
      >>> policy = ReduceLROnPlateau(patience=100)
      >>> def ctx(step):
      ...     return Context(step=step, batch_size=64, microbatches=1, devices=8,
      ...                    max_devices=8, hyperparams={"learning_rate": 0.1})
      >>> policy.decide({"loss": 1.0}, ctx(0)), policy.decide({"loss": 1.0}, ctx(50))
      ([], [])
      >>> policy.decide({"loss": 1.0}, ctx(100))
      [SetHyperparams(values={'learning_rate': 0.05})]
    """

    metric: str = "loss"
    factor: float = dataclasses.field(default=0.5, kw_only=True)
    patience: int = dataclasses.field(default=1000, kw_only=True)
    min_delta: float = dataclasses.field(default=0.0, kw_only=True)
    min_value: float = dataclasses.field(default=0.0, kw_only=True)
    key: str = dataclasses.field(default="learning_rate", kw_only=True)
    mode: str = dataclasses.field(default="min", kw_only=True)

    def __post_init__(self) -> None:
        owner = "ReduceLROnPlateau"
        check_str(self.metric, owner=owner, name="metric", allow_empty=False)
        check_str(self.key, owner=owner, name="key", allow_empty=False)
        check_choice(self.mode, MODES, owner=owner, name="mode")
        for name, value in (
            ("factor", check_float(self.factor, owner=owner, name="factor", low=0.0,
                                   high=1.0, low_open=True, high_open=True)),
            ("patience", check_int(self.patience, owner=owner, name="patience", minimum=1)),
            ("min_delta", check_float(self.min_delta, owner=owner, name="min_delta", low=0.0)),
            ("min_value", check_float(self.min_value, owner=owner, name="min_value", low=0.0)),
        ):
            object.__setattr__(self, name, value)
        super().__post_init__()

    def _initial_state(self) -> dict:
        return {"best": None, "best_step": None, "reductions": 0}

    def required_metrics(self) -> frozenset[str]:
        """``{metric}``: the metric this policy watches."""
        return frozenset({self.metric})

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        """Returns ``[SetHyperparams({key: reduced})]`` after a plateau, else ``[]``."""
        if self.key not in ctx.hyperparams:
            raise ValueError(
                f"ReduceLROnPlateau: ctx.hyperparams has no {self.key!r} "
                f"(has {sorted(ctx.hyperparams)}); pass key=..."
            )
        value = read_metric(metrics, self.metric)
        if value is None:
            return []
        state = self._state
        if _improved(value, state["best"], self.mode, self.min_delta):
            state["best"], state["best_step"] = value, ctx.step
            return []
        if ctx.step - state["best_step"] < self.patience:
            return []
        state["best_step"] = ctx.step  # wait `patience` steps again
        current = ctx.hyperparams[self.key]
        reduced = max(current * self.factor, self.min_value)
        if reduced >= current:
            return []
        state["reductions"] += 1
        why = (
            f"ReduceLROnPlateau: {self.metric} has not improved on {state['best']:.6g} for "
            f"{self.patience}+ steps: {self.key} {current:.3g} -> {reduced:.3g}"
        )
        return [SetHyperparams({self.key: reduced}, reason=why)]


@dataclasses.dataclass(frozen=True, eq=False)
class EarlyStop(StatefulPolicy):
    """Emits ``Stop(reason)`` when ``metric`` reaches ``target`` or stops improving.

    With ``target``: stops once the metric is >= target (``mode="max"``) or <=
    target (``"min"``). With ``patience``: stops once ``patience`` steps pass
    without an improvement larger than ``min_delta``. Give either or both.
    Evaluations without the metric are skipped.

    Args:
      metric: the metric to watch, e.g. ``"eval_accuracy"``.
      target: the value that ends training, or ``None``.
      mode: ``"max"`` (higher is better) or ``"min"``.
      patience: steps without improvement that end training (>= 1), or ``None``.
      min_delta: the least change that counts as improvement, >= 0.

    Example:
      >>> from adaptjax.policies import Context, EarlyStop
      >>> policy = EarlyStop("eval_accuracy", target=0.9)
      >>> ctx = Context(step=300, batch_size=64, microbatches=1, devices=8, max_devices=8,
      ...               hyperparams={})
      >>> policy.decide({"loss": 0.1}, ctx), policy.decide({"eval_accuracy": 0.8}, ctx)
      ([], [])
      >>> policy.decide({"eval_accuracy": 0.95}, ctx)
      [Stop(reason='eval_accuracy reached 0.95 (target 0.9) at step 300')]
    """

    metric: str
    target: float | None = dataclasses.field(default=None, kw_only=True)
    mode: str = dataclasses.field(default="max", kw_only=True)
    patience: int | None = dataclasses.field(default=None, kw_only=True)
    min_delta: float = dataclasses.field(default=0.0, kw_only=True)

    def __post_init__(self) -> None:
        owner = "EarlyStop"
        check_str(self.metric, owner=owner, name="metric", allow_empty=False)
        check_choice(self.mode, MODES, owner=owner, name="mode")
        if self.target is None and self.patience is None:
            raise ValueError(f"{owner}: give target=..., patience=..., or both")
        if self.target is not None:
            target = check_float(self.target, owner=owner, name="target")
            object.__setattr__(self, "target", target)
        if self.patience is not None:
            patience = check_int(self.patience, owner=owner, name="patience", minimum=1)
            object.__setattr__(self, "patience", patience)
        min_delta = check_float(self.min_delta, owner=owner, name="min_delta", low=0.0)
        object.__setattr__(self, "min_delta", min_delta)
        super().__post_init__()

    def _initial_state(self) -> dict:
        return {"best": None, "best_step": None}

    def required_metrics(self) -> frozenset[str]:
        """``{metric}``: the metric this policy watches."""
        return frozenset({self.metric})

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        """Returns ``[Stop(reason)]`` once the target is reached or patience runs out."""
        value = read_metric(metrics, self.metric)
        if value is None:
            return []
        if self.target is not None:
            reached = value >= self.target if self.mode == "max" else value <= self.target
            if reached:
                return [
                    Stop(
                        f"{self.metric} reached {value:.6g} (target {self.target:.6g}) "
                        f"at step {ctx.step}"
                    )
                ]
        if self.patience is None:
            return []
        state = self._state
        if _improved(value, state["best"], self.mode, self.min_delta):
            state["best"], state["best_step"] = value, ctx.step
            return []
        if ctx.step - state["best_step"] >= self.patience:
            return [
                Stop(
                    f"{self.metric} did not improve for {ctx.step - state['best_step']} steps "
                    f"(best {state['best']:.6g} at step {state['best_step']})"
                )
            ]
        return []
