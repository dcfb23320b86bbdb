"""adaptjax: adaptive data-parallel training for JAX.

Optax transformations that synchronise gradients across a mesh axis and
measure them while they do (noise scale, SNR, variance), a data-parallel step
builder, per-replica state, and collective accounting from the compiled HLO.

Public names load on first use (PEP 562), so ``import adaptjax.policies`` and
the ``adaptjax`` command's read-only subcommands never import jax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaptjax._lazy import attach

# Public name -> the private module that defines it. To export a new name, add
# it here, to __all__ and to the TYPE_CHECKING imports below (a test checks the
# three agree). Every public package of adaptjax has this facade (adaptjax._lazy).
_NAMES = {
    "RunCheckpoints": "adaptjax.controller._checkpoint",
    "CorruptCheckpointError": "adaptjax.controller._checkpoint",
    "GradientCodec": "adaptjax._codec",
    "Controller": "adaptjax.controller._controller",
    "EXIT_PREEMPTED": "adaptjax.controller._preemption",
    "EXIT_RESCALE": "adaptjax.launch._distributed",
    "DecisionMismatch": "adaptjax.launch._distributed",
    "initialize_distributed": "adaptjax.launch._distributed",
    "NonFiniteTraining": "adaptjax.controller._controller",
    "CheckpointOptions": "adaptjax.controller._options",
    "CompileOptions": "adaptjax.controller._options",
    "RunConfig": "adaptjax._run_config",
    "RunSpec": "adaptjax.controller._spec",
    "Hook": "adaptjax.controller._hooks",
    "Evaluate": "adaptjax.controller._hooks",
    "ProgressBar": "adaptjax.controller._hooks",
    "TensorBoard": "adaptjax.controller._hooks",
    "default_hooks": "adaptjax.controller._hooks",
    "codec_key": "adaptjax._run_config",
    "RunDirectoryError": "adaptjax.controller._run_lock",
    "RunDirectoryLocked": "adaptjax.controller._run_lock",
    "ArrayDataset": "adaptjax._data",
    "accumulate": "adaptjax._accumulation",
    "set_micro_steps": "adaptjax._accumulation",
    "FeatureCodec": "adaptjax._input_codec",
    "InputCodec": "adaptjax._input_codec",
    "batch_bytes": "adaptjax._input_codec",
    "LossScaleState": "adaptjax._loss_scale",
    "LossScaled": "adaptjax._loss_scale",
    "current_loss_scale": "adaptjax._loss_scale",
    "dynamic_loss_scale": "adaptjax._loss_scale",
    "Precision": "adaptjax._precision",
    "check_precision": "adaptjax._precision",
    "with_precision": "adaptjax._precision",
    "IterableDataset": "adaptjax._data",
    "GrainDataset": "adaptjax._grain",
    "Metrics": "adaptjax._metric_vector",
    "UpdateNormState": "adaptjax._metrics",
    "collect_metrics": "adaptjax._metrics",
    "read_metrics": "adaptjax._metrics",
    "update_norm": "adaptjax._metrics",
    "GradientMonitor": "adaptjax._monitors",
    "GradientNoiseScale": "adaptjax._monitors",
    "GradientNorm": "adaptjax._monitors",
    "GradientSNR": "adaptjax._monitors",
    "GradStats": "adaptjax._monitors",
    "NoiseScaleState": "adaptjax._monitors",
    "SNRState": "adaptjax._monitors",
    "PerReplica": "adaptjax._per_replica",
    "has_per_replica": "adaptjax._per_replica",
    "merge_replicas": "adaptjax._per_replica",
    "stack_replicas": "adaptjax._per_replica",
    "state_partition_specs": "adaptjax._per_replica",
    "state_shardings": "adaptjax._per_replica",
    "to_global": "adaptjax._per_replica",
    "to_local": "adaptjax._per_replica",
    "RunLog": "adaptjax.controller._run_log",
    "TrainState": "adaptjax._state",
    "abstract_state": "adaptjax._state",
    "init_state": "adaptjax._state",
    "train_state_shardings": "adaptjax._state",
    "train_state_specs": "adaptjax._state",
    "DataParallelStep": "adaptjax._step",
    "data_parallel_step": "adaptjax._step",
    "make_mesh": "adaptjax._mesh",
    "FSDP": "adaptjax._mesh",
    "param_specs": "adaptjax._mesh",
    "ShardLayout": "adaptjax._tree",
    "SyncState": "adaptjax._sync",
    "SyncGradients": "adaptjax._sync",
    "SyncChain": "adaptjax._chain",
    "chain": "adaptjax._chain",
    "named_chain": "adaptjax._chain",
    "noise_scale": "adaptjax._sync",
    "sync_gradients": "adaptjax._sync",
    "tree_sq_norm": "adaptjax._tree",
    "tree_sq_norm_sampled": "adaptjax._tree",
    "tree_vdot": "adaptjax._tree",
    "Collective": "adaptjax._wire",
    "WireReport": "adaptjax._wire",
    "wire_bytes": "adaptjax._wire",
    # synchronisation strategies
    "SyncStrategy": "adaptjax.sync._strategy",
    "consensus_params": "adaptjax.sync._strategy",
    "local_params": "adaptjax.sync._strategy",
    "per_replica_optimizer": "adaptjax.sync._strategy",
    "sync_chain": "adaptjax.sync._registry",
    "sync_key": "adaptjax.sync._registry",
    "SSGD": "adaptjax.sync._ssgd",
    "ModelAveraging": "adaptjax.sync._model_averaging",
    "ModelAveragingState": "adaptjax.sync._model_averaging",
    "model_averaging": "adaptjax.sync._model_averaging",
    "LocalSGD": "adaptjax.sync._local_sgd",
    "LocalSGDState": "adaptjax.sync._local_sgd",
    "local_sgd": "adaptjax.sync._local_sgd",
    "DiLoCo": "adaptjax.sync._diloco",
    "diloco": "adaptjax.sync._diloco",
    "Gossip": "adaptjax.sync._gossip",
    "GossipState": "adaptjax.sync._gossip",
    "gossip": "adaptjax.sync._gossip",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time names load lazily
    from adaptjax._accumulation import accumulate, set_micro_steps
    from adaptjax._chain import SyncChain, chain, named_chain
    from adaptjax._codec import GradientCodec
    from adaptjax._data import ArrayDataset, IterableDataset
    from adaptjax._grain import GrainDataset
    from adaptjax._input_codec import FeatureCodec, InputCodec, batch_bytes
    from adaptjax._loss_scale import (
        LossScaled,
        LossScaleState,
        current_loss_scale,
        dynamic_loss_scale,
    )
    from adaptjax._mesh import FSDP, make_mesh, param_specs
    from adaptjax._metric_vector import Metrics
    from adaptjax._metrics import UpdateNormState, collect_metrics, read_metrics, update_norm
    from adaptjax._monitors import (
        GradientMonitor,
        GradientNoiseScale,
        GradientNorm,
        GradientSNR,
        GradStats,
        NoiseScaleState,
        SNRState,
    )
    from adaptjax._per_replica import (
        PerReplica,
        has_per_replica,
        merge_replicas,
        stack_replicas,
        state_partition_specs,
        state_shardings,
        to_global,
        to_local,
    )
    from adaptjax._precision import Precision, check_precision, with_precision
    from adaptjax._run_config import RunConfig, codec_key
    from adaptjax._state import (
        TrainState,
        abstract_state,
        init_state,
        train_state_shardings,
        train_state_specs,
    )
    from adaptjax._step import DataParallelStep, data_parallel_step
    from adaptjax._sync import SyncGradients, SyncState, noise_scale, sync_gradients
    from adaptjax._tree import ShardLayout, tree_sq_norm, tree_sq_norm_sampled, tree_vdot
    from adaptjax._wire import Collective, WireReport, wire_bytes
    from adaptjax.controller._checkpoint import CorruptCheckpointError, RunCheckpoints
    from adaptjax.controller._controller import Controller, NonFiniteTraining
    from adaptjax.controller._hooks import Evaluate, Hook, ProgressBar, TensorBoard, default_hooks
    from adaptjax.controller._options import CheckpointOptions, CompileOptions
    from adaptjax.controller._preemption import EXIT_PREEMPTED
    from adaptjax.controller._run_lock import RunDirectoryError, RunDirectoryLocked
    from adaptjax.controller._run_log import RunLog
    from adaptjax.controller._spec import RunSpec
    from adaptjax.launch._distributed import EXIT_RESCALE, DecisionMismatch, initialize_distributed
    from adaptjax.sync._diloco import DiLoCo, diloco
    from adaptjax.sync._gossip import Gossip, GossipState, gossip
    from adaptjax.sync._local_sgd import LocalSGD, LocalSGDState, local_sgd
    from adaptjax.sync._model_averaging import ModelAveraging, ModelAveragingState, model_averaging
    from adaptjax.sync._registry import sync_chain, sync_key
    from adaptjax.sync._ssgd import SSGD
    from adaptjax.sync._strategy import (
        SyncStrategy,
        consensus_params,
        local_params,
        per_replica_optimizer,
    )

__all__ = [
    "abstract_state",
    "Controller",
    "CorruptCheckpointError",
    "EXIT_PREEMPTED",
    "EXIT_RESCALE",
    "DecisionMismatch",
    "initialize_distributed",
    "NonFiniteTraining",
    "CheckpointOptions",
    "CompileOptions",
    "RunConfig",
    "RunSpec",
    "Hook",
    "Evaluate",
    "ProgressBar",
    "TensorBoard",
    "default_hooks",
    "RunDirectoryError",
    "RunDirectoryLocked",
    "RunLog",
    "codec_key",
    "ArrayDataset",
    "accumulate",
    "set_micro_steps",
    "FeatureCodec",
    "InputCodec",
    "batch_bytes",
    "LossScaleState",
    "LossScaled",
    "current_loss_scale",
    "dynamic_loss_scale",
    "Precision",
    "check_precision",
    "with_precision",
    "RunCheckpoints",
    "Collective",
    "DataParallelStep",
    "GradStats",
    "GradientCodec",
    "GradientMonitor",
    "GradientNoiseScale",
    "GradientNorm",
    "GradientSNR",
    "IterableDataset",
    "GrainDataset",
    "NoiseScaleState",
    "PerReplica",
    "SNRState",
    "SyncState",
    "SyncGradients",
    "SyncChain",
    "chain",
    "named_chain",
    "TrainState",
    "Metrics",
    "UpdateNormState",
    "WireReport",
    "collect_metrics",
    "data_parallel_step",
    "has_per_replica",
    "init_state",
    "make_mesh",
    "FSDP",
    "param_specs",
    "ShardLayout",
    "merge_replicas",
    "noise_scale",
    "read_metrics",
    "stack_replicas",
    "state_partition_specs",
    "state_shardings",
    "sync_gradients",
    "to_global",
    "to_local",
    "train_state_shardings",
    "train_state_specs",
    "tree_sq_norm",
    "tree_sq_norm_sampled",
    "tree_vdot",
    "update_norm",
    "wire_bytes",
    "SyncStrategy",
    "consensus_params",
    "local_params",
    "per_replica_optimizer",
    "sync_chain",
    "sync_key",
    "SSGD",
    "ModelAveraging",
    "ModelAveragingState",
    "model_averaging",
    "LocalSGD",
    "LocalSGDState",
    "local_sgd",
    "DiLoCo",
    "diloco",
    "Gossip",
    "GossipState",
    "gossip",
]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("adaptjax")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"


_DEPRECATED = {"CheckpointManager": "RunCheckpoints"}  # old -> new, for one release
_getattr, __dir__ = attach(__name__, _NAMES, _DEPRECATED)


def __getattr__(name: str) -> object:
    if name == "__version__":
        value = globals()["__version__"] = _version()
        return value
    return _getattr(name)
