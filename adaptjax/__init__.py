"""adaptjax: adaptive data-parallel training for JAX.

Optax transformations that synchronise gradients across a mesh axis and
measure them while they do (noise scale, SNR, variance), a data-parallel step
builder, per-replica state, collective accounting from the compiled HLO, and
the :class:`Controller` that adapts a run while it trains. The sync
strategies are in :mod:`adaptjax.sync`, codecs in :mod:`adaptjax.compression`,
policies in :mod:`adaptjax.policies`, the cost model in :mod:`adaptjax.costs`.

Public names load on first use (PEP 562), so ``import adaptjax.policies`` and
the ``adaptjax`` command's read-only subcommands never import jax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaptjax._lazy import attach

# Public name -> the private module that defines it. To export a new name, add
# it here, to __all__ and to the TYPE_CHECKING imports below (a test checks the
# three agree; tests/test_public_structure.py keeps the four faces <= 120 names).
_NAMES = {
    "Controller": "adaptjax.controller._controller",
    "NonFiniteTraining": "adaptjax.controller._controller",
    "RunSpec": "adaptjax.controller._spec",
    "CheckpointOptions": "adaptjax.controller._options",
    "CompileOptions": "adaptjax.controller._options",
    "RunConfig": "adaptjax._run_config",
    "Hook": "adaptjax.controller._hooks",
    "Evaluate": "adaptjax.controller._hooks",
    "ProgressBar": "adaptjax.controller._hooks",
    "TensorBoard": "adaptjax.controller._hooks",
    "default_hooks": "adaptjax.controller._hooks",
    "RunCheckpoints": "adaptjax.controller._checkpoint",
    "CorruptCheckpointError": "adaptjax.controller._checkpoint",
    "RunDirectoryError": "adaptjax.controller._run_lock",
    "RunDirectoryLocked": "adaptjax.controller._run_lock",
    "EXIT_PREEMPTED": "adaptjax.controller._preemption",
    "EXIT_RESCALE": "adaptjax.launch._distributed",
    "DecisionMismatch": "adaptjax.launch._distributed",
    "initialize_distributed": "adaptjax.launch._distributed",
    "ArrayDataset": "adaptjax._data",
    "IterableDataset": "adaptjax._data",
    "GrainDataset": "adaptjax._grain",
    "InputCodec": "adaptjax._input_codec",
    "make_mesh": "adaptjax._mesh",
    "FSDP": "adaptjax._mesh",
    "param_specs": "adaptjax._mesh",
    "TrainState": "adaptjax._state",
    "init_state": "adaptjax._state",
    "abstract_state": "adaptjax._state",
    "train_state_shardings": "adaptjax._state",
    "train_state_specs": "adaptjax._state",
    "data_parallel_step": "adaptjax._step",
    "PerReplica": "adaptjax._per_replica",
    "accumulate": "adaptjax._accumulation",
    "set_micro_steps": "adaptjax._accumulation",
    "Precision": "adaptjax._precision",
    "with_precision": "adaptjax._precision",
    "dynamic_loss_scale": "adaptjax._loss_scale",
    "current_loss_scale": "adaptjax._loss_scale",
    "sync_gradients": "adaptjax._sync",
    "noise_scale": "adaptjax._sync",
    "GradientMonitor": "adaptjax._monitors",
    "GradientNoiseScale": "adaptjax._monitors",
    "GradientNorm": "adaptjax._monitors",
    "GradientSNR": "adaptjax._monitors",
    "Metrics": "adaptjax._metric_vector",
    "read_metrics": "adaptjax._metrics",
    "update_norm": "adaptjax._metrics",
    "wire_bytes": "adaptjax._wire",
    "Collective": "adaptjax._wire",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time names load lazily
    from adaptjax._accumulation import accumulate, set_micro_steps
    from adaptjax._data import ArrayDataset, IterableDataset
    from adaptjax._grain import GrainDataset
    from adaptjax._input_codec import InputCodec
    from adaptjax._loss_scale import current_loss_scale, dynamic_loss_scale
    from adaptjax._mesh import FSDP, make_mesh, param_specs
    from adaptjax._metric_vector import Metrics
    from adaptjax._metrics import read_metrics, update_norm
    from adaptjax._monitors import GradientMonitor, GradientNoiseScale, GradientNorm, GradientSNR
    from adaptjax._per_replica import PerReplica
    from adaptjax._precision import Precision, with_precision
    from adaptjax._run_config import RunConfig
    from adaptjax._state import (
        TrainState,
        abstract_state,
        init_state,
        train_state_shardings,
        train_state_specs,
    )
    from adaptjax._step import data_parallel_step
    from adaptjax._sync import noise_scale, sync_gradients
    from adaptjax._wire import Collective, wire_bytes
    from adaptjax.controller._checkpoint import CorruptCheckpointError, RunCheckpoints
    from adaptjax.controller._controller import Controller, NonFiniteTraining
    from adaptjax.controller._hooks import Evaluate, Hook, ProgressBar, TensorBoard, default_hooks
    from adaptjax.controller._options import CheckpointOptions, CompileOptions
    from adaptjax.controller._preemption import EXIT_PREEMPTED
    from adaptjax.controller._run_lock import RunDirectoryError, RunDirectoryLocked
    from adaptjax.controller._spec import RunSpec
    from adaptjax.launch._distributed import EXIT_RESCALE, DecisionMismatch, initialize_distributed

__all__ = [
    "Controller",
    "NonFiniteTraining",
    "RunSpec",
    "CheckpointOptions",
    "CompileOptions",
    "RunConfig",
    "Hook",
    "Evaluate",
    "ProgressBar",
    "TensorBoard",
    "default_hooks",
    "RunCheckpoints",
    "CorruptCheckpointError",
    "RunDirectoryError",
    "RunDirectoryLocked",
    "EXIT_PREEMPTED",
    "EXIT_RESCALE",
    "DecisionMismatch",
    "initialize_distributed",
    "ArrayDataset",
    "IterableDataset",
    "GrainDataset",
    "InputCodec",
    "make_mesh",
    "FSDP",
    "param_specs",
    "TrainState",
    "init_state",
    "abstract_state",
    "train_state_shardings",
    "train_state_specs",
    "data_parallel_step",
    "PerReplica",
    "accumulate",
    "set_micro_steps",
    "Precision",
    "with_precision",
    "dynamic_loss_scale",
    "current_loss_scale",
    "sync_gradients",
    "noise_scale",
    "GradientMonitor",
    "GradientNoiseScale",
    "GradientNorm",
    "GradientSNR",
    "Metrics",
    "read_metrics",
    "update_norm",
    "wire_bytes",
    "Collective",
]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("adaptjax")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"


_getattr, __dir__ = attach(__name__, _NAMES)


# Subpackages load on first use too: `import adaptjax` then `adaptjax.sync.LocalSGD`.
_SUBPACKAGES = ("sync", "compression", "policies", "costs")


def __getattr__(name: str) -> object:
    if name == "__version__":
        value = globals()["__version__"] = _version()
        return value
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    return _getattr(name)
