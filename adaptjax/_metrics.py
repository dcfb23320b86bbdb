"""Reading monitor values back out of an optimizer state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adaptjax._metric_vector import Metrics
from adaptjax._tree import tree_sq_norm


def _has_metrics(node) -> bool:
    return (
        hasattr(node, "_fields")
        and "metrics" in node._fields
        and isinstance(node.metrics, dict | Metrics)
    )


def collect_metrics(opt_state: Any) -> dict:
    """Every monitor's current values as a flat dict of scalar arrays (jit-friendly).

    Example:
      >>> import jax, jax.numpy as jnp, optax, adaptjax
      >>> tx = optax.chain(optax.sgd(1.0), adaptjax.update_norm())
      >>> jax.jit(collect_metrics)(tx.init(jnp.zeros(2)))
      {'update_norm': Array(0., dtype=float32)}
    """
    out: dict = {}
    for node in jax.tree.leaves(opt_state, is_leaf=_has_metrics):
        if _has_metrics(node):
            for key, value in node.metrics.items():
                if key in out:
                    raise ValueError(
                        f"metric {key!r} is reported by two transformations; give one a name="
                    )
                out[key] = value
    return out


def read_metrics(opt_state: Any) -> dict[str, float]:
    """Every monitor's current values as a flat dict of Python floats.

    Finds each state in the tree that carries a ``metrics`` dict (the sync
    transformation's ``SyncState``, :func:`adaptjax.update_norm`)
    and merges them. Inside ``jit`` use ``collect_metrics`` instead.

    Args:
      opt_state: an optimizer state (or a whole train state).

    Returns:
      ``{name: float}``.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> tx = optax.chain(adaptjax.sync_gradients("data", monitors=(adaptjax.GradientNorm(),)),
      ...                  optax.sgd(0.1), adaptjax.update_norm())
      >>> adaptjax.read_metrics(tx.init({"w": jnp.zeros(2)}))
      {'grad_norm': 0.0, 'update_norm': 0.0}
    """
    values = jax.device_get(collect_metrics(opt_state))
    return {k: float(np.asarray(v)) for k, v in values.items()}


class UpdateNormState(NamedTuple):
    """State of :func:`update_norm`: the latest norm under ``metrics``."""

    metrics: dict


def update_norm(name: str = "update_norm") -> optax.GradientTransformation:
    """Records ``‖updates‖`` (place it after the optimizer in a chain).

    The updates are replicated after the sync, so this needs no collective.

    Args:
      name: the metric name.

    Returns:
      An identity ``optax.GradientTransformation`` that records the norm.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> tx = optax.chain(optax.sgd(1.0), adaptjax.update_norm())
      >>> _, s = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init({"w": jnp.zeros(2)}))
      >>> adaptjax.read_metrics(s)
      {'update_norm': 5.0}
    """

    def init_fn(params):
        del params
        return UpdateNormState({name: jnp.zeros((), jnp.float32)})

    def update_fn(updates, state, params=None):
        del state, params
        return updates, UpdateNormState({name: jnp.sqrt(tree_sq_norm(updates))})

    return optax.GradientTransformation(init_fn, update_fn)
