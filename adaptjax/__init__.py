"""adaptjax: adaptive data-parallel training for JAX.

Optax transformations that synchronise gradients across a mesh axis and
measure them while they do (noise scale, SNR, variance), a data-parallel step
builder, per-replica state, and collective accounting from the compiled HLO.
"""

from adaptjax._checkpoint import CheckpointManager, CorruptCheckpointError
from adaptjax._codec import GradientCodec
from adaptjax._controller import EXIT_PREEMPTED, Controller, NonFiniteTraining
from adaptjax._data import ArrayDataset, IterableDataset
from adaptjax._distributed import EXIT_RESCALE, DecisionMismatch, initialize_distributed
from adaptjax._metrics import UpdateNormState, collect_metrics, read_metrics, update_norm
from adaptjax._monitors import (
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
from adaptjax._run_config import RunConfig, codec_key
from adaptjax._run_lock import RunDirectoryLocked
from adaptjax._run_log import RunLog
from adaptjax._state import (
    TrainState,
    abstract_state,
    init_state,
    train_state_shardings,
    train_state_specs,
)
from adaptjax._step import DataParallelStep, data_parallel_step, make_mesh
from adaptjax._sync import SyncState, noise_scale, sync_gradients
from adaptjax._tree import tree_sq_norm, tree_sq_norm_sampled, tree_vdot
from adaptjax._wire import Collective, WireReport, wire_bytes

__all__ = [
    "abstract_state",
    "Controller",
    "CorruptCheckpointError",
    "EXIT_PREEMPTED",
    "EXIT_RESCALE",
    "DecisionMismatch",
    "initialize_distributed",
    "NonFiniteTraining",
    "RunDirectoryLocked",
    "RunConfig",
    "RunLog",
    "codec_key",
    "ArrayDataset",
    "CheckpointManager",
    "Collective",
    "DataParallelStep",
    "GradStats",
    "GradientCodec",
    "GradientNoiseScale",
    "GradientNorm",
    "GradientSNR",
    "IterableDataset",
    "NoiseScaleState",
    "PerReplica",
    "SNRState",
    "SyncState",
    "TrainState",
    "UpdateNormState",
    "WireReport",
    "collect_metrics",
    "data_parallel_step",
    "has_per_replica",
    "init_state",
    "make_mesh",
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
]
