"""The ``Policy`` protocol and the check the controller applies to every decision."""

import abc
import copy
import json
from collections.abc import Iterable, Mapping
from typing import Any, cast

from adaptjax.policies._actions import ACTION_TYPES, Action
from adaptjax.policies._checks import short_repr
from adaptjax.policies._context import Context


class Policy(abc.ABC):
    """Observes metrics and the run's context; answers with a list of actions.

    A policy is pure Python over plain numbers: ``decide`` receives the latest
    metrics (any key may be missing, most of all early in training; a policy
    then returns ``[]``) and a :class:`Context`, and returns the actions to take
    now. The controller calls ``decide`` at every evaluation, saves
    ``state_dict()`` with every checkpoint and calls ``load_state_dict`` on
    resume, so a policy whose decisions depend on the past must keep that past
    in its state (JSON-serialisable: dicts with str keys, lists, numbers, str,
    bool, None) — then a resumed run makes exactly the decisions the
    uninterrupted one would have made.

    Any object with these three methods can stand in for a ``Policy``; deriving
    from it only supplies the stateless defaults.

    Example:
      >>> from adaptjax.policies import Context, Policy, SetBatchSize
      >>> class DoubleBatchOnNoise(Policy):
      ...     def decide(self, metrics, ctx):
      ...         if metrics.get("noise_scale", 0.0) > 2 * ctx.batch_size:
      ...             return [SetBatchSize(2 * ctx.batch_size)]
      ...         return []
      >>> ctx = Context(step=10, batch_size=64, microbatches=1, devices=8, max_devices=8,
      ...               hyperparams={})
      >>> DoubleBatchOnNoise().decide({"noise_scale": 500.0}, ctx)
      [SetBatchSize(batch_size=128, microbatches=None)]
    """

    @abc.abstractmethod
    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        """Returns the actions to take now (``[]`` for none).

        Args:
          metrics: the latest metrics, e.g. ``{"loss": 0.3, "noise_scale": 420.0}``.
          ctx: the current configuration.

        Returns:
          A list of actions, each an instance of one of ``ACTION_TYPES``.
        """

    def required_metrics(self) -> frozenset[str]:
        """Metrics without which this policy never acts (``frozenset()`` when none).

        The controller warns in one line at construction when a policy needs a
        metric it will never produce (e.g. ``comm_share`` without a link model).
        """
        return frozenset()

    def upcoming(self, ctx: Context) -> list[Action]:
        """Actions this policy already knows it will take later; hints, never carried out.

        The controller compiles the configuration each would lead to in the
        background, so that the change does not wait for XLA when it comes
        (e.g. ``ElasticScale``'s next scheduled entry). ``[]`` (the default)
        when nothing is known ahead.
        """
        del ctx
        return []

    def state_dict(self) -> dict:
        """The policy's state, JSON-serialisable (``{}`` for a stateless policy)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restores the state returned by :meth:`state_dict` (no-op when stateless)."""
        del state


def required_metrics(policy: Any) -> frozenset[str]:
    """The metrics ``policy`` needs in order to act (policies without the method need none).

    Example:
      >>> from adaptjax.policies import SwitchCompression, any_of, cooldown
      >>> from adaptjax.policies._policy import required_metrics
      >>> sorted(required_metrics(any_of(cooldown(SwitchCompression("c"), steps=5))))
      ['comm_share']
    """
    method = getattr(policy, "required_metrics", None)
    if not callable(method):
        return frozenset()
    return frozenset(cast(Iterable[str], method()))  # a duck-typed policy's promise


def upcoming(policy: Any, ctx: Context) -> list[Action]:
    """``policy.upcoming(ctx)``, checked; ``[]`` for a policy without the method.

    Example:
      >>> from adaptjax.policies import Context, ElasticScale, any_of
      >>> from adaptjax.policies._policy import upcoming
      >>> ctx = Context(step=10, batch_size=64, microbatches=1, devices=8, max_devices=8,
      ...               hyperparams={})
      >>> upcoming(any_of(ElasticScale({150: 4, 300: 8})), ctx)
      [Rescale(devices=4, mesh_shape=None)]
    """
    method = getattr(policy, "upcoming", None)
    if not callable(method):
        return []
    return validate_actions(method(ctx), source=policy)


def _type_names(types: Iterable[type]) -> str:
    return ", ".join(t.__name__ for t in types)


def validate_actions(actions: Any, *, source: Any = None) -> list[Action]:
    """Checks that a decision is a list (or tuple) of actions; returns it as a list.

    Args:
      actions: what a policy's ``decide`` returned.
      source: the policy that returned it, named in the message (optional).

    Returns:
      ``list(actions)``.

    Raises:
      ValueError: a one-line message naming the offending type and the allowed
        ones, when ``actions`` is not a list/tuple or holds anything else.

    Example:
      >>> from adaptjax.policies import Checkpoint
      >>> from adaptjax.policies._policy import validate_actions
      >>> validate_actions((Checkpoint(),))
      [Checkpoint()]
      >>> validate_actions(["stop"])
      Traceback (most recent call last):
      ...
      ValueError: a policy returned an action of type str ('stop'); allowed: SetHyperparams, SetBatchSize, Rescale, SetCodec, Checkpoint, Stop, Rollback, SetSync, SetPrecision, Probe
    """  # noqa: E501
    who = "a policy" if source is None else type(source).__name__
    if not isinstance(actions, list | tuple):
        hint = ""
        if isinstance(actions, ACTION_TYPES):
            hint = f"; wrap it in a list: [{type(actions).__name__}(...)]"
        elif actions is None:
            hint = "; return [] for no action"
        raise ValueError(
            f"{who} returned {type(actions).__name__} ({short_repr(actions)}) instead of a list "
            f"of actions{hint}"
        )
    for action in actions:
        if not isinstance(action, ACTION_TYPES):
            raise ValueError(
                f"{who} returned an action of type {type(action).__name__} "
                f"({short_repr(action)}); allowed: {_type_names(ACTION_TYPES)}"
            )
    return list(actions)


def check_policy(policy: Any, *, owner: str) -> Any:
    """Returns ``policy`` if it has a callable ``decide``; else a one-line ValueError."""
    if not callable(getattr(policy, "decide", None)):
        raise ValueError(
            f"{owner}: expected a Policy (an object with decide(metrics, ctx)), "
            f"got {short_repr(policy)}"
        )
    return policy


def policy_state(policy: Any) -> dict:
    """``policy.state_dict()``, or ``{}`` for a duck-typed policy without one."""
    method = getattr(policy, "state_dict", None)
    return {} if method is None else method()


def load_policy_state(policy: Any, state: dict) -> None:
    """``policy.load_state_dict(state)`` when the policy has that method."""
    method = getattr(policy, "load_state_dict", None)
    if method is not None:
        method(state)


class StatefulPolicy(Policy):
    """Base of the built-in policies that remember the past (private helper).

    Subclasses are frozen dataclasses: their configuration cannot change, while
    the running state lives in one private dict, ``self._state``, created by
    ``_initial_state()`` and the only thing :meth:`state_dict` returns.
    """

    _state: dict[str, Any]  # set in __post_init__ (through object.__setattr__: frozen)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_state", self._initial_state())

    def _initial_state(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        """A deep copy of the policy's state (JSON-serialisable)."""
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict) -> None:
        """Restores a state from :meth:`state_dict` (also after a JSON round trip).

        Raises:
          ValueError: when ``state`` does not have this policy's keys, i.e. it was
            saved by a different policy.
        """
        owner = f"{type(self).__name__}.load_state_dict"
        expected = sorted(self._initial_state())
        if not isinstance(state, Mapping) or sorted(state) != expected:
            got = sorted(state) if isinstance(state, Mapping) else short_repr(state)
            raise ValueError(
                f"{owner}: state has keys {got}, expected {expected}; "
                "was it saved by a different policy (or policies in a different order)?"
            )
        # A JSON round trip gives the same structure back; copy so callers can't alias it.
        loaded = json.loads(json.dumps(dict(state)))
        self._state.clear()
        self._state.update(loaded)
