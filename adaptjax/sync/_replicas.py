"""Per-replica hyperparameters and heterogeneity measurements of local SGD / DiLoCo.

Under :func:`adaptjax.sync.local_sgd` (and DiLoCo, built on it) every replica
trains its own model between syncs, so each can run with its own inner
learning rate and its own number of local steps, and each has its own data.
The strategy's state keeps, per replica (:class:`adaptjax.PerReplica`), two
float32 vectors (one leaf each: every leaf costs a buffer per device per step):

* ``knobs``: the learning-rate factor (default 1), which multiplies the
  replica's inner update (for SGD and Adam-style optimizers: its learning
  rate), and the local steps (default 0 = all ``H``): the replica applies its
  updates on its first ``local_steps`` inner steps of each round and keeps its
  model for the rest (its optimizer still reads every gradient).
* ``measured``: what the latest sync measured on the replica (see
  :func:`replica_metrics`) and the current round's sums.

Both knobs are values in the state: :func:`set_replica_lr` and
:func:`set_replica_local_steps` replace them between steps without
recompiling, Orbax checkpoints them with the rest of the state, and a
rescale maps them by :func:`keep_or_default`: replica ``j`` keeps its value
when it survives, a replica that disappears hands nothing on, and a new one
starts from the default (its policy then sets it from its mapping).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from adaptjax._metric_vector import Metrics
from adaptjax._per_replica import PerReplica

#: The per-replica values :func:`replica_metrics` reports, as measured at the latest sync.
MEASURED = ("grad_dissimilarity", "replica_loss", "label_divergence")
# the measurements' vector: MEASURED, then the round's loss sum and steps, then label counts
_LOSS_SUM, _STEPS, _COUNTS = len(MEASURED), len(MEASURED) + 1, len(MEASURED) + 2
#: The knobs' vector: the learning-rate factor, then the local steps (0: every step).
_LR, _LOCAL_STEPS = 0, 1
_DEFAULT_KNOBS = (1.0, 0.0)
_MAX_STEPS = 2**24  # float32 holds every integer up to here


def keep_or_default(old: np.ndarray, m: int) -> np.ndarray:
    """The knobs' merge rule: replica ``j < min(n, m)`` keeps its row; new ones the defaults.

    Example:
      >>> import numpy as np
      >>> from adaptjax.sync._replicas import keep_or_default
      >>> keep_or_default(np.array([[0.5, 2.0], [3.0, 0.0]]), 3).tolist()
      [[0.5, 2.0], [3.0, 0.0], [1.0, 0.0]]
    """
    new = np.broadcast_to(np.asarray(_DEFAULT_KNOBS, old.dtype), (m, *old.shape[1:])).copy()
    k = min(m, old.shape[0])
    new[:k] = old[:k]
    return new


def init_knobs(label_classes: int) -> tuple[PerReplica, PerReplica]:
    """``(knobs, measured)`` of one replica (local view): two float32 vectors.

    One leaf each (every leaf of the state costs a buffer per device per step).
    """
    knobs = PerReplica(jnp.asarray(_DEFAULT_KNOBS, jnp.float32), keep_or_default)
    measured = PerReplica(jnp.zeros((_COUNTS + label_classes,), jnp.float32), "zeros")
    return knobs, measured


def step_factor(knobs: Any, count: Any, H: int) -> Any:
    """This step's factor on the replica's update: its rate factor, or 0 past its local steps."""
    steps = knobs[_LOCAL_STEPS]
    active = (steps == 0) | ((count % H).astype(jnp.float32) < steps)
    return jnp.where(active, knobs[_LR], 0.0)


def _model_sync_node(opt_state: Any):
    from adaptjax.sync._strategy import find_model_sync

    node = find_model_sync(opt_state)
    if node is None or not hasattr(node, "knobs"):
        raise ValueError(
            "opt_state holds no local SGD or DiLoCo state; per-replica hyperparameters need "
            "adaptjax.sync.sync_chain(optimizer, LocalSGD(...) or DiLoCo(...))"
        )
    return node


def replica_count(opt_state: Any) -> int:
    """Host side: the replicas whose knobs ``opt_state`` keeps (0 without local SGD or DiLoCo).

    Reads shapes only: nothing crosses to the host.
    """
    from adaptjax.sync._strategy import find_model_sync

    node = find_model_sync(opt_state)
    knobs = getattr(node, "knobs", None)
    return 0 if knobs is None else int(np.shape(knobs.value)[0])


def _replace_node(opt_state: Any, node, new_node):
    def is_node(x):
        return x is node

    return jax.tree.map(lambda x: new_node if x is node else x, opt_state, is_leaf=is_node)


def _set_knob(opt_state: Any, column: int, name: str, values: np.ndarray) -> Any:
    node = _model_sync_node(opt_state)
    old = node.knobs
    n = int(np.shape(old.value)[0])
    if values.shape != (n,):
        raise ValueError(
            f"{name} needs one value per replica: shape ({n},), got {values.shape}; pass a "
            f"sequence of {n} values"
        )
    table = np.array(jax.device_get(old.value))
    table[:, column] = values
    new = jnp.asarray(table, old.value.dtype)
    sharding = getattr(old.value, "sharding", None)
    if sharding is not None:
        new = jax.device_put(new, sharding)
    return _replace_node(opt_state, node, node._replace(knobs=PerReplica(new, old.merge)))


def set_replica_lr(opt_state: Any, factors: Any) -> Any:
    """Host side: each replica's inner learning-rate factor (no recompile).

    Takes and returns the *global view* of the optimizer state (what the step
    returns); the new factors keep the old array's shape, dtype and sharding,
    so the compiled step is reused.

    Args:
      opt_state: the optimizer state of a chain with local SGD or DiLoCo.
      factors: ``n_replicas`` finite numbers ``>= 0`` (0 freezes a replica's model).

    Returns:
      The optimizer state with the new factors.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax.sync
      >>> tx = adaptjax.sync.sync_chain(optax.sgd(0.1), adaptjax.sync.LocalSGD(H=4))
      >>> state = adaptjax.init_state({"w": jnp.zeros(2)}, tx, adaptjax.make_mesh(2))
      >>> opt = adaptjax.sync.set_replica_lr(state.opt_state, [0.5, 2.0])
      >>> adaptjax.sync.replica_lr(opt).tolist()
      [0.5, 2.0]
    """
    values = np.asarray(factors, np.float64)
    if values.ndim != 1 or not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError(
            f"learning-rate factors must be finite numbers >= 0, one per replica, got {factors!r}"
        )
    return _set_knob(opt_state, _LR, "lr_factor", values)


def set_replica_local_steps(opt_state: Any, steps: Any) -> Any:
    """Host side: each replica's local steps per round (no recompile).

    A replica with ``h < H`` applies its updates on the first ``h`` inner steps
    of each round and keeps its model for the other ``H - h``; ``h >= H`` is
    every step.

    Args:
      opt_state: the global-view optimizer state of a chain with local SGD or DiLoCo.
      steps: ``n_replicas`` integers ``>= 1``.

    Returns:
      The optimizer state with the new local steps.
    """
    values = np.asarray(steps)
    if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer) or np.any(values < 1):
        raise ValueError(f"local steps must be integers >= 1, one per replica, got {steps!r}")
    return _set_knob(opt_state, _LOCAL_STEPS, "local_steps", np.minimum(values, _MAX_STEPS))


def replica_lr(opt_state: Any) -> np.ndarray:
    """Host side: each replica's learning-rate factor, shape ``(n_replicas,)``."""
    return np.asarray(jax.device_get(_model_sync_node(opt_state).knobs.value))[:, _LR]


def replica_metrics(opt_state: Any) -> dict[str, float]:
    """Host side: each replica's measurements at the latest sync, by ``name/replica``.

    ``grad_dissimilarity/i`` is ``‖Δ_i − Δ̄‖² / ‖Δ̄‖²`` of replica ``i``'s delta
    ``Δ_i = θ − x_i`` against the mean delta (the outer sync's
    pseudo-gradients); ``replica_loss/i`` the replica's mean loss over the
    round; ``label_divergence/i`` ``KL(p_i ‖ q)`` of the replica's label
    histogram over the round against the global one. The step's metrics
    vector carries their mean and max over replicas (its names are fixed
    when the state is built, before the replica count is known); these are
    read from the state, one small transfer per name.

    Args:
      opt_state: the global-view optimizer state of a chain with local SGD or DiLoCo.

    Returns:
      ``{"grad_dissimilarity/0": ..., ..., "label_divergence/{n-1}": ...}``.
    """
    measured = np.asarray(jax.device_get(_model_sync_node(opt_state).measured.value))
    return {
        f"{name}/{i}": float(measured[i, j])
        for j, name in enumerate(MEASURED)
        for i in range(measured.shape[0])
    }


def check_label_histogram(histogram: Any) -> np.ndarray | None:
    """``histogram`` normalised to sum 1 (float64), or ``None``; one-line errors."""
    if histogram is None:
        return None
    q = np.asarray(histogram, np.float64)
    if q.ndim != 1 or q.size < 2 or not np.all(np.isfinite(q)) or np.any(q <= 0):
        raise ValueError(
            f"label_histogram must be K >= 2 positive finite numbers (the global label counts "
            f"or frequencies), got {histogram!r}"
        )
    return q / q.sum()


def accumulate(measured: Any, replica_loss: Any, labels: Any) -> Any:
    """``measured`` with this step's loss and label counts added to the round's sums."""
    measured = measured.at[_STEPS].add(1.0)
    if replica_loss is not None:
        measured = measured.at[_LOSS_SUM].add(jnp.asarray(replica_loss, jnp.float32))
    if labels is not None and measured.shape[0] > _COUNTS:
        measured = measured.at[_COUNTS + jnp.ravel(labels)].add(1.0, mode="drop")
    return measured


def at_sync(measured: Any, spread_sq: Any, mean_sq: Any, q: np.ndarray | None) -> Any:
    """The round's measurements of one replica, and its sums restarted.

    ``spread_sq = ‖Δ_i − Δ̄‖²``, ``mean_sq = ‖Δ̄‖²`` (0 / 0 reads 0: nobody moved).
    """
    ratio = jnp.where(mean_sq > 0, spread_sq / jnp.where(mean_sq > 0, mean_sq, 1.0), 0.0)
    loss = measured[_LOSS_SUM] / jnp.maximum(measured[_STEPS], 1.0)
    divergence = jnp.zeros((), jnp.float32)
    if q is not None:
        counts = measured[_COUNTS:]
        p = counts / jnp.maximum(counts.sum(), 1.0)
        logq = jnp.asarray(np.log(q), jnp.float32)
        terms = jnp.where(p > 0, p * (jnp.log(jnp.where(p > 0, p, 1.0)) - logq), 0.0)
        divergence = terms.sum()
    head = jnp.stack([ratio, loss, divergence]).astype(jnp.float32)
    return jnp.zeros_like(measured).at[: len(MEASURED)].set(head)


def summary_metrics(values: Any) -> Metrics:
    """Mean and max over replicas of ``values[n, len(MEASURED)]``, packed (one leaf)."""
    out = {}
    for j, name in enumerate(MEASURED):
        out[name] = jnp.mean(values[:, j])
        out[f"{name}_max"] = jnp.max(values[:, j])
    return Metrics.pack(out)


def measured_head(measured: Any) -> Any:
    """This replica's :data:`MEASURED` values, shape ``(1, len(MEASURED))`` (for the all-gather)."""
    return measured[None, : len(MEASURED)]
