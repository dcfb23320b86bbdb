"""Synchronisation strategies: how replicas agree on their parameters.

The strategy protocol (:class:`SyncStrategy`), the five strategies (S-SGD,
model averaging, local SGD, DiLoCo, gossip) with their factories, and
:func:`sync_chain`, which chains a strategy around an optimizer. Per-replica
state moves between the local view inside ``shard_map`` and the global one
with :func:`to_local` and :func:`to_global`; ``merge_replicas`` maps it to
a new replica count. Local SGD and DiLoCo take per-replica hyperparameters
(:func:`set_replica_lr`, :func:`set_replica_local_steps`) and report the
replicas' heterogeneity (:func:`replica_metrics`); :func:`dirichlet_split`
and :class:`SplitArrayDataset` give each replica its own data.
:class:`FedTune` sets each replica's rate under the controller from an
:class:`LrMapping` that :func:`fedtune_search` fits on proxy data.
"""

from typing import TYPE_CHECKING

from adaptjax._lazy import attach

# Public name -> the private module that defines it (a test checks this table,
# __all__ and the TYPE_CHECKING imports agree).
_NAMES = {
    "SyncStrategy": "adaptjax.sync._strategy",
    "SSGD": "adaptjax.sync._ssgd",
    "ModelAveraging": "adaptjax.sync._model_averaging",
    "model_averaging": "adaptjax.sync._model_averaging",
    "LocalSGD": "adaptjax.sync._local_sgd",
    "local_sgd": "adaptjax.sync._local_sgd",
    "DiLoCo": "adaptjax.sync._diloco",
    "diloco": "adaptjax.sync._diloco",
    "Gossip": "adaptjax.sync._gossip",
    "gossip": "adaptjax.sync._gossip",
    "sync_chain": "adaptjax.sync._registry",
    "consensus_params": "adaptjax.sync._strategy",
    "local_params": "adaptjax.sync._strategy",
    "per_replica_optimizer": "adaptjax.sync._strategy",
    "to_local": "adaptjax._per_replica",
    "to_global": "adaptjax._per_replica",
    "merge_replicas": "adaptjax._per_replica",
    "replica_lr": "adaptjax.sync._replicas",
    "replica_metrics": "adaptjax.sync._replicas",
    "set_replica_local_steps": "adaptjax.sync._replicas",
    "set_replica_lr": "adaptjax.sync._replicas",
    "SplitArrayDataset": "adaptjax.sync._split",
    "dirichlet_split": "adaptjax.sync._split",
    "FedTune": "adaptjax.policies._fedtune",
    "LrMapping": "adaptjax.policies._fedtune",
    "fedtune_search": "adaptjax.sync._fedtune",
    "ProxyRun": "adaptjax.sync._fedtune",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time names load lazily
    from adaptjax._per_replica import merge_replicas, to_global, to_local
    from adaptjax.policies._fedtune import FedTune, LrMapping
    from adaptjax.sync._diloco import DiLoCo, diloco
    from adaptjax.sync._fedtune import ProxyRun, fedtune_search
    from adaptjax.sync._gossip import Gossip, gossip
    from adaptjax.sync._local_sgd import LocalSGD, local_sgd
    from adaptjax.sync._model_averaging import ModelAveraging, model_averaging
    from adaptjax.sync._registry import sync_chain
    from adaptjax.sync._replicas import (
        replica_lr,
        replica_metrics,
        set_replica_local_steps,
        set_replica_lr,
    )
    from adaptjax.sync._split import SplitArrayDataset, dirichlet_split
    from adaptjax.sync._ssgd import SSGD
    from adaptjax.sync._strategy import (
        SyncStrategy,
        consensus_params,
        local_params,
        per_replica_optimizer,
    )

__all__ = [
    "SyncStrategy",
    "SSGD",
    "ModelAveraging",
    "model_averaging",
    "LocalSGD",
    "local_sgd",
    "DiLoCo",
    "diloco",
    "Gossip",
    "gossip",
    "sync_chain",
    "consensus_params",
    "local_params",
    "per_replica_optimizer",
    "to_local",
    "to_global",
    "merge_replicas",
    "replica_lr",
    "replica_metrics",
    "set_replica_local_steps",
    "set_replica_lr",
    "SplitArrayDataset",
    "dirichlet_split",
    "FedTune",
    "LrMapping",
    "fedtune_search",
    "ProxyRun",
]

__getattr__, __dir__ = attach(__name__, _NAMES)
