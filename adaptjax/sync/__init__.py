"""Synchronisation strategies (the strategies' public names are ``adaptjax.*``).

The strategy protocol (:class:`adaptjax.SyncStrategy`), the five strategies
(S-SGD, model averaging, local SGD, DiLoCo, gossip) and the registry that
resolves them by name and chains them around an optimizer.

Public here: the per-replica hyperparameters and heterogeneity measurements
of local SGD and DiLoCo (:func:`set_replica_lr`, :func:`set_replica_local_steps`,
:func:`replica_lr`, :func:`replica_metrics`) and the heterogeneous data split
(:func:`dirichlet_split`, :class:`SplitArrayDataset`).
"""

from adaptjax.sync._replicas import (
    replica_lr,
    replica_metrics,
    set_replica_local_steps,
    set_replica_lr,
)
from adaptjax.sync._split import SplitArrayDataset, dirichlet_split

__all__ = [
    "SplitArrayDataset",
    "dirichlet_split",
    "replica_lr",
    "replica_metrics",
    "set_replica_local_steps",
    "set_replica_lr",
]
