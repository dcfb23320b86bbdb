"""The user's optimizer under the controller: its hyperparameters, read and set in its state.

The controller runs any ``optax.GradientTransformation`` inside
:func:`with_rate_factor`. What a policy may read and set
(``Context.hyperparams``, ``SetHyperparams``) is:

* every numeric hyperparameter of an ``optax.inject_hyperparams`` state in the
  optimizer's state (not one it schedules): set in that state;
* ``learning_rate``, whenever the rate is known: injected (numeric or
  scheduled) or given to the controller as ``learning_rate=`` (a float or an
  optax schedule of the optimizer's update count). Unless it is an injected
  number, it is set as a float32 **factor** on the optimizer's updates, so it
  composes with the user's own schedule and compiles nothing.

**The rule for a rate.** A policy sees ``learning_rate`` = the rate the
latest step used, ``base x factor`` (``base``: the schedule's value at that
step, or the constant rate), the same value the step logs. Asking for a rate
X sets ``factor = X / base``: the next step runs at about X and the schedule's
shape goes on, scaled (halving the seen rate halves every later one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from adaptjax._loss_scale import split_loss_scale
from adaptjax._per_replica import PerReplica

LR = "learning_rate"


class RateFactorState(NamedTuple):
    """State of :func:`with_rate_factor`.

    Attributes:
      count: int32, the updates applied (a skipped, non-finite step applies none).
      factor: float32, multiplies the optimizer's updates (1.0 until a policy sets the rate).
      metrics: ``{"learning_rate": base x factor}``, the rate of the latest update (at
        ``init``: of the first one), when the rate is known; else ``{}``.
      inner_state: the optimizer's own state.
    """

    count: jax.Array
    factor: jax.Array
    metrics: dict
    inner_state: Any


def _is_injected(node) -> bool:
    return isinstance(node, optax.InjectHyperparamsState | optax.InjectStatefulHyperparamsState)


def _stop(node) -> bool:
    # per-replica state (local models) holds per-replica hyperparameters: not exposed
    return _is_injected(node) or isinstance(node, PerReplica)


def injected(state) -> list:
    """The ``inject_hyperparams`` states in ``state`` (not in per-replica state), in order."""
    return [n for n in jax.tree.leaves(state, is_leaf=_stop) if _is_injected(n)]


def _numeric(node) -> list[str]:
    """``node``'s hyperparameters that are numbers (its schedules have a state of their own)."""
    scheduled = getattr(node, "hyperparams_states", {})
    return [k for k in node.hyperparams if k not in scheduled]


def _rate(inner, learning_rate, count) -> jax.Array | None:
    """The rate an update at ``count`` ran at, without the factor (``None``: unknown)."""
    for node in injected(inner):
        if LR in node.hyperparams:
            return jnp.asarray(node.hyperparams[LR], jnp.float32)
    if learning_rate is None:
        return None
    value = learning_rate(count) if callable(learning_rate) else learning_rate
    return jnp.asarray(value, jnp.float32)


def with_rate_factor(
    optimizer: optax.GradientTransformation,
    learning_rate: float | Callable[[jax.Array], jax.Array] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``optimizer`` with its updates times a float32 factor held in the state.

    Args:
      optimizer: any optax transformation.
      learning_rate: the rate (a float, or a schedule of the update count) the
        optimizer was built with, when no ``inject_hyperparams`` state holds it.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`RateFactorState`; its ``metrics`` report ``learning_rate``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from adaptjax.controller._hyperparams import with_rate_factor
      >>> tx = with_rate_factor(optax.sgd(optax.linear_schedule(1.0, 0.0, 10)),
      ...                       optax.linear_schedule(1.0, 0.0, 10))
      >>> state = tx.init(jnp.zeros(2))
      >>> updates, state = tx.update(jnp.ones(2), state._replace(factor=jnp.float32(0.5)))
      >>> updates.tolist(), float(state.metrics["learning_rate"])
      ([-0.5, -0.5], 0.5)
    """
    optimizer = optax.with_extra_args_support(optimizer)

    def metrics(inner, count, factor) -> dict:
        rate = _rate(inner, learning_rate, count)
        return {} if rate is None else {LR: rate * factor}

    def init_fn(params):
        inner = optimizer.init(params)
        count, factor = jnp.zeros([], jnp.int32), jnp.ones([], jnp.float32)
        return RateFactorState(count, factor, metrics(inner, count, factor), inner)

    def update_fn(updates, state, params=None, **extra_args):
        updates, inner = optimizer.update(updates, state.inner_state, params, **extra_args)
        updates = jax.tree.map(lambda u: (u * state.factor).astype(u.dtype), updates)
        return updates, RateFactorState(
            jnp.asarray(optax.safe_increment(state.count)), state.factor,
            metrics(inner, state.count, state.factor), inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _controlled(opt_state) -> tuple[RateFactorState, Any]:
    """The :class:`RateFactorState` of the ``"optimizer"`` link, and its loss scale or ``None``."""
    state, scaled = split_loss_scale(opt_state)
    assert isinstance(state, RateFactorState), "the controller wraps every optimizer"
    return state, scaled


def hyperparams_of(opt_state) -> dict[str, float]:
    """What a policy may read and set, by name, in the ``"optimizer"`` link's ``opt_state``."""
    state, _ = _controlled(opt_state)
    found: dict[str, Any] = {}  # the scalars alone cross to the host, not the moments
    for node in injected(state.inner_state):
        for key in _numeric(node):
            found.setdefault(key, node.hyperparams[key])
    if LR not in found and LR in state.metrics:
        found[LR] = state.metrics[LR]
    return {k: float(np.asarray(v)) for k, v in jax.device_get(found).items()}


def injected_values(optimizer: optax.GradientTransformation, params) -> dict[str, float]:
    """The numeric hyperparameters ``optimizer``'s ``inject_hyperparams`` states start with.

    Read from an ``init`` on one scalar per parameter leaf (the values do not
    depend on the shapes); ``{}`` for an optimizer that cannot start from it.
    """
    scalars = jax.tree.map(lambda x: np.zeros((), np.asarray(x).dtype), params)
    try:
        state = jax.device_get(optimizer.init(scalars))
    except Exception:  # noqa: BLE001 - a shape-bound optimizer: nothing to compare, no warning
        return {}
    return {k: float(np.asarray(n.hyperparams[k])) for n in reversed(injected(state))
            for k in _numeric(n)}


def write_hyperparams(opt_state, values: Mapping[str, float], mesh) -> Any:
    """The ``"optimizer"`` link's ``opt_state`` with ``values`` set (names from
    :func:`hyperparams_of`; an unknown one is a ``KeyError``)."""
    state, scaled = _controlled(opt_state)
    replicated = NamedSharding(mesh, P())

    def put(value, like):
        return jax.device_put(np.asarray(value, dtype=np.asarray(like).dtype), replicated)

    numeric = {k for n in injected(state.inner_state) for k in _numeric(n)}
    inject = {k: v for k, v in values.items() if k in numeric}

    def set_in(node):
        if not _is_injected(node) or not set(inject) & set(node.hyperparams):
            return node
        found = {k: put(v, node.hyperparams[k]) for k, v in inject.items()
                 if k in node.hyperparams}
        return node._replace(hyperparams={**node.hyperparams, **found})

    state = state._replace(inner_state=jax.tree.map(set_in, state.inner_state, is_leaf=_stop))
    for key in set(values) - numeric:
        if key != LR or LR not in state.metrics:
            raise KeyError(key)
        state = _set_factor(state, float(values[key]), put)
    return state if scaled is None else scaled._replace(inner_state=state)


def _set_factor(state: RateFactorState, rate: float, put) -> RateFactorState:
    """``state`` whose factor makes the rate of its latest update ``rate`` (see the module)."""
    seen, factor = (float(np.asarray(jax.device_get(x)))
                    for x in (state.metrics[LR], state.factor))
    base = seen / factor
    if not base > 0:
        raise ValueError(
            f"learning_rate cannot be set while the optimizer's own rate is {base} (its "
            "schedule's value at the latest step); set it once the schedule is above 0")
    new = np.float32(rate / base)
    return state._replace(factor=put(new, state.factor),
                          metrics={**state.metrics, LR: put(rate, state.metrics[LR])})
