"""Per-replica learning rates as hyperparameters, and per-replica metrics for policies.

Under a strategy that keeps per-replica knobs (:class:`adaptjax.sync.LocalSGD`,
:class:`adaptjax.sync.DiLoCo`) the controller exposes each replica's
learning-rate factor (:func:`adaptjax.sync.replica_lr`) as the hyperparameter
``replica_lr/i``: ``Context.hyperparams`` shows it, ``SetHyperparams`` sets it
through :func:`adaptjax.sync.set_replica_lr` (the names left out keep their
value; nothing recompiles), and a rescale carries it by the knobs' merge rule
(a surviving replica keeps its factor, a new one starts from 1.0). The
replicas' measurements (:func:`adaptjax.sync.replica_metrics`) join the metrics
a policy decides on. Under any other strategy these are empty and a
``replica_lr/...`` name is a one-line ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from adaptjax.policies._fedtune import REPLICA_LR
from adaptjax.sync._replicas import replica_count, replica_lr, replica_metrics, set_replica_lr

PREFIX = REPLICA_LR.format("")  # the name FedTune sets, without its replica


def replica_hyperparams(opt_state: Any) -> dict[str, float]:
    """``{"replica_lr/i": factor}`` of the global-view ``opt_state`` (``{}``: no replicas).

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax, adaptjax.sync
      >>> from adaptjax.controller._replica_lr import replica_hyperparams
      >>> tx = adaptjax.sync.sync_chain(optax.sgd(0.1), adaptjax.sync.LocalSGD(H=4))
      >>> state = adaptjax.init_state({"w": jnp.zeros(2)}, tx, adaptjax.make_mesh(2))
      >>> replica_hyperparams(adaptjax.sync.set_replica_lr(state.opt_state, [0.5, 2.0]))
      {'replica_lr/0': 0.5, 'replica_lr/1': 2.0}
    """
    if not replica_count(opt_state):
        return {}
    return {f"{PREFIX}{i}": float(v) for i, v in enumerate(replica_lr(opt_state))}


def replica_metrics_of(opt_state: Any) -> dict[str, float]:
    """:func:`adaptjax.sync.replica_metrics` of ``opt_state``; ``{}`` when it keeps no replicas."""
    return replica_metrics(opt_state) if replica_count(opt_state) else {}


def check_replica_values(values: Mapping[str, float], replicas: int, names: Iterable[str]) -> None:
    """One-line ``ValueError`` for a ``replica_lr/...`` name or value the run cannot take.

    Args:
      values: the hyperparameters asked for (other names are checked elsewhere).
      replicas: the replicas the run's strategy keeps knobs for (0: none).
      names: the hyperparameters the run has, named when there are no replicas.
    """
    for key, value in values.items():
        if not key.startswith(PREFIX):
            continue
        if not replicas:
            raise ValueError(
                f"{key!r}: this run's strategy keeps no per-replica learning rates (only "
                f"adaptjax.sync.LocalSGD and DiLoCo do); its hyperparameters are {sorted(names)}"
            )
        if key not in {f"{PREFIX}{i}" for i in range(replicas)}:
            raise ValueError(
                f"{key!r} names no replica: the run has {replicas} "
                f"({PREFIX}0 ... {PREFIX}{replicas - 1})"
            )
        if not value >= 0:
            raise ValueError(
                f"{key} must be >= 0 (a factor on that replica's learning rate; 0 freezes its "
                f"model), got {value}"
            )


def split_replica_values(values: Mapping[str, float]) -> tuple[dict, dict]:
    """``values`` as ``(replica_lr/... entries, the others)``."""
    replica = {k: v for k, v in values.items() if k.startswith(PREFIX)}
    return replica, {k: v for k, v in values.items() if k not in replica}


def write_replica_lr(opt_state: Any, values: Mapping[str, float]) -> Any:
    """``opt_state`` with the factors ``values`` names set (the others kept); checked first."""
    n = replica_count(opt_state)
    check_replica_values(values, n, ())
    factors = replica_lr(opt_state).astype(float)
    for key, value in values.items():
        factors[int(key[len(PREFIX):])] = value
    return set_replica_lr(opt_state, factors)
