"""Combinators: ``cooldown``, ``hysteresis``, ``when`` and ``any_of``.

Each returns a policy, so they nest: ``cooldown(hysteresis(AdaptiveBatchSize(1024),
times=3), steps=200)``. A combinator's ``state_dict`` holds its own state and
its inner policies' states (under ``"policy"`` / ``"policies"``).
"""

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from adaptjax.policies._actions import (
    ACTION_TYPES,
    Action,
    SetHyperparams,
    action_signature,
    with_reason,
)
from adaptjax.policies._checks import check_callable, check_float, check_int, short_repr
from adaptjax.policies._context import Context
from adaptjax.policies._policy import (
    Policy,
    StatefulPolicy,
    check_policy,
    load_policy_state,
    policy_state,
    required_metrics,
    upcoming,
    validate_actions,
)


class _Wrapper(StatefulPolicy):
    """A stateful policy around one inner policy stored in the field ``policy``."""

    policy: Any

    def required_metrics(self) -> frozenset[str]:
        return required_metrics(self.policy)

    def upcoming(self, ctx: Context) -> list[Action]:
        return upcoming(self.policy, ctx)

    def state_dict(self) -> dict:
        return {**copy.deepcopy(self._state), "policy": policy_state(self.policy)}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, Mapping) or "policy" not in state:
            got = sorted(state) if isinstance(state, Mapping) else short_repr(state)
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: state has keys {got}, expected "
                f"{sorted([*self._initial_state(), 'policy'])}; was it saved by a different policy?"
            )
        super().load_state_dict({k: v for k, v in state.items() if k != "policy"})
        load_policy_state(self.policy, state["policy"])


@dataclasses.dataclass(frozen=True, eq=False)
class Cooldown(_Wrapper):
    """See :func:`cooldown`."""

    policy: Any
    steps: int

    def __post_init__(self) -> None:
        check_policy(self.policy, owner="cooldown")
        object.__setattr__(
            self, "steps", check_int(self.steps, owner="cooldown", name="steps", minimum=0)
        )
        super().__post_init__()

    def _initial_state(self) -> dict:
        return {"last_action_step": None}

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        last = self._state["last_action_step"]
        if last is not None and ctx.step < last + self.steps:
            return []
        actions = validate_actions(self.policy.decide(metrics, ctx), source=self.policy)
        if actions:
            self._state["last_action_step"] = ctx.step
        return actions


def cooldown(policy: Policy, steps: int) -> Policy:
    """After ``policy`` acts at step s, suppresses it until step s + ``steps``.

    During the cooldown the inner policy is not consulted at all (so a
    schedule entry that falls inside it fires right after, instead of being
    lost; a policy that learns from metrics sees fewer of them).

    Args:
      policy: the policy to slow down.
      steps: steps to stay quiet after an action, >= 0 (0 passes everything through).

    Returns:
      The wrapped policy.

    Example:
      >>> from adaptjax.policies import Context, SetBatchSize, cooldown, when
      >>> grow = when(lambda m, c: m["noise_scale"] > c.batch_size, SetBatchSize(128))
      >>> policy = cooldown(grow, steps=200)
      >>> def ctx(step):
      ...     return Context(step=step, batch_size=64, microbatches=1, devices=8,
      ...                    max_devices=8, hyperparams={})
      >>> [len(policy.decide({"noise_scale": 500.0}, ctx(s))) for s in (100, 200, 299, 300)]
      [1, 0, 0, 1]
    """
    return Cooldown(policy, steps)


def _same(a: Any, b: Any, rtol: float) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y, rtol) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, int | float) and isinstance(b, int | float):
            return math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)
        return False
    return a == b


@dataclasses.dataclass(frozen=True, eq=False)
class Hysteresis(_Wrapper):
    """See :func:`hysteresis`."""

    policy: Any
    times: int
    rtol: float = dataclasses.field(default=0.05, kw_only=True)

    def __post_init__(self) -> None:
        check_policy(self.policy, owner="hysteresis")
        object.__setattr__(
            self, "times", check_int(self.times, owner="hysteresis", name="times", minimum=1)
        )
        object.__setattr__(
            self, "rtol", check_float(self.rtol, owner="hysteresis", name="rtol", low=0.0)
        )
        super().__post_init__()

    def _initial_state(self) -> dict:
        return {"signature": None, "count": 0}

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        state = self._state
        actions = validate_actions(self.policy.decide(metrics, ctx), source=self.policy)
        if not actions:
            state["signature"], state["count"] = None, 0
            return []
        signature = [action_signature(a) for a in actions]
        if state["signature"] is not None and _same(signature, state["signature"], self.rtol):
            state["count"] += 1
        else:
            state["signature"], state["count"] = signature, 1
        if state["count"] < self.times:
            return []
        state["signature"], state["count"] = None, 0
        return actions


def hysteresis(policy: Policy, times: int, *, rtol: float = 0.05) -> Policy:
    """Passes a decision of ``policy`` only once it was proposed ``times`` evaluations in a row.

    Decisions are the same when they hold the same action types in the same
    order with the same values; floats (learning rates, hyperparameters)
    count as the same within a relative tolerance ``rtol`` of the first
    proposal of the streak (AdaScale learning rates drift with the noise
    scale), ``Stop``/``Rollback`` reasons are not compared, and codecs are
    compared by type and ``repr``. An evaluation with no proposal, or a
    different one, restarts the count; after a decision passes, the count
    starts over. The inner policy is consulted at every evaluation, so this
    suits policies that keep proposing while their condition holds (not
    one-shot ones such as ``Schedule``).

    Args:
      policy: the policy to debounce.
      times: consecutive identical proposals needed, >= 1 (1 passes everything through).
      rtol: relative tolerance for float values, >= 0.

    Returns:
      The wrapped policy.

    Example:
      >>> from adaptjax.policies import Context, SetCodec, hysteresis, when
      >>> noisy = when(lambda m, c: m["comm_share"] > 0.3, SetCodec("onebit"))
      >>> policy = hysteresis(noisy, times=3)
      >>> ctx = Context(step=0, batch_size=64, microbatches=1, devices=8, max_devices=8,
      ...               hyperparams={})
      >>> [len(policy.decide({"comm_share": s}, ctx)) for s in (0.4, 0.5, 0.1, 0.4, 0.4, 0.4)]
      [0, 0, 0, 0, 0, 1]
    """
    return Hysteresis(policy, times, rtol=rtol)


@dataclasses.dataclass(frozen=True, eq=False)
class When(Policy):
    """See :func:`when`."""

    predicate: Callable[[Mapping[str, float], Context], Any]
    actions: Action | Sequence[Action]  # a tuple of actions after __post_init__

    def __post_init__(self) -> None:
        check_callable(
            self.predicate, owner="when", name="predicate", signature="(metrics, ctx) -> bool"
        )
        actions = [self.actions] if isinstance(self.actions, ACTION_TYPES) else self.actions
        try:
            actions = tuple(validate_actions(actions))
        except ValueError as error:
            raise ValueError(f"when: actions: {error}") from None
        if not actions:
            raise ValueError("when: actions must hold at least one action, got []")
        object.__setattr__(self, "actions", actions)

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        try:
            fire = self.predicate(metrics, ctx)
        except KeyError:  # a metric the predicate reads is not available yet
            return []
        if not fire:
            return []
        actions = cast(tuple[Action, ...], self.actions)  # as __post_init__ left it
        return [a if a.reason else with_reason(a, "when: its predicate held") for a in actions]


def when(
    predicate: Callable[[Mapping[str, float], Context], Any],
    actions: Action | Sequence[Action],
) -> Policy:
    """A policy that emits ``actions`` at every evaluation where ``predicate`` holds.

    A ``KeyError`` raised by the predicate (it read a metric that is not
    available yet) counts as false. Wrap in ``cooldown`` so it doesn't repeat
    at every evaluation while the condition holds. Stateless.

    Args:
      predicate: ``(metrics, ctx) -> bool``.
      actions: one action or a non-empty list of them.

    Returns:
      The policy.

    Example:
      >>> from adaptjax.policies import Context, Rollback, when
      >>> policy = when(lambda m, c: m["nonfinite_count"] > 0, Rollback("non-finite gradients"))
      >>> ctx = Context(step=7, batch_size=64, microbatches=1, devices=8, max_devices=8,
      ...               hyperparams={})
      >>> policy.decide({}, ctx), policy.decide({"nonfinite_count": 2}, ctx)
      ([], [Rollback(reason='non-finite gradients')])
    """
    return When(predicate, actions)


@dataclasses.dataclass(frozen=True, eq=False)
class AnyOf(Policy):
    """See :func:`any_of`."""

    policies: tuple[Any, ...]

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("any_of: give at least one policy")
        for policy in self.policies:
            check_policy(policy, owner="any_of")
        object.__setattr__(self, "policies", tuple(self.policies))

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        out: list[Action] = []
        for policy in self.policies:
            for action in validate_actions(policy.decide(metrics, ctx), source=policy):
                index = next((i for i, a in enumerate(out) if type(a) is type(action)), None)
                if index is None:
                    out.append(action)
                elif isinstance(action, SetHyperparams):  # merge; earlier values win
                    earlier = cast(SetHyperparams, out[index])  # found by type(action)
                    kept = earlier.values
                    extra = {k: v for k, v in action.values.items() if k not in kept}
                    if extra:
                        reasons = "; ".join(r for r in (earlier.reason, action.reason) if r)
                        out[index] = SetHyperparams({**kept, **extra}, reason=reasons)
        return out

    def required_metrics(self) -> frozenset[str]:
        return frozenset().union(*(required_metrics(p) for p in self.policies))

    def upcoming(self, ctx: Context) -> list[Action]:
        return [a for p in self.policies for a in upcoming(p, ctx)]

    def state_dict(self) -> dict:
        return {"policies": [policy_state(p) for p in self.policies]}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("policies") if isinstance(state, Mapping) else None
        if not isinstance(saved, list | tuple) or len(saved) != len(self.policies):
            count = len(saved) if isinstance(saved, list | tuple) else short_repr(state)
            raise ValueError(
                f"AnyOf.load_state_dict: state holds {count} policy states, expected "
                f"{len(self.policies)}; was it saved with different policies?"
            )
        for policy, inner in zip(self.policies, saved, strict=True):
            load_policy_state(policy, inner)


def any_of(*policies: Policy) -> Policy:
    """Runs every policy in order and concatenates their decisions, one action per type.

    The order of ``policies`` is their priority: when two emit an action of the
    same type, the first one's is kept and the later one dropped — except
    ``SetHyperparams``, which are merged key by key, the earlier policy winning
    a key both set. Every policy is consulted at every evaluation (a dropped
    proposal still updated its policy's state).

    Args:
      *policies: the policies, at least one.

    Returns:
      The combined policy.

    Example:
      >>> from adaptjax.policies import Checkpoint, Context, SetHyperparams, any_of, when
      >>> always = lambda m, c: True
      >>> policy = any_of(
      ...     when(always, [SetHyperparams({"learning_rate": 0.1}), Checkpoint()]),
      ...     when(always, [SetHyperparams({"learning_rate": 0.2, "weight_decay": 0.01})]),
      ...     when(always, Checkpoint()),
      ... )
      >>> ctx = Context(step=0, batch_size=64, microbatches=1, devices=8, max_devices=8,
      ...               hyperparams={})
      >>> policy.decide({}, ctx)
      [SetHyperparams(values={'learning_rate': 0.1, 'weight_decay': 0.01}), Checkpoint()]
    """
    return AnyOf(policies)
