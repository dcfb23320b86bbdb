"""Adaptation policies: pure decisions over a dict of metrics (imported as ``adaptjax.policies``).

A policy reads the latest metrics (``loss``, ``noise_scale``, ``step_time``,
``comm_share``, ...) and a :class:`Context` describing the run, and returns a
list of actions for the controller to carry out. Everything here is plain
Python (the standard library and numpy at most — never jax or the rest of
adaptjax), so every policy can be tested with plain numbers.

Example:
  >>> from adaptjax import policies as ajp
  >>> policy = ajp.any_of(
  ...     ajp.cooldown(ajp.AdaptiveBatchSize(max_batch_size=1024), steps=200),
  ...     ajp.ElasticScale({500: 4}),
  ...     ajp.EarlyStop("eval_accuracy", target=0.98),
  ... )
  >>> ctx = ajp.Context(step=500, batch_size=64, microbatches=1, devices=8, max_devices=8,
  ...                   hyperparams={"learning_rate": 1e-3})
  >>> policy.decide({"loss": 0.7}, ctx)
  [Rescale(devices=4, mesh_shape=None)]
"""

if __name__ != "adaptjax.policies":  # pragma: no cover - guards against shadowing
    raise ImportError("import this package as `adaptjax.policies`, not as a top-level `policies`")

from typing import TYPE_CHECKING

from adaptjax._lazy import attach

# Public name -> the private module that defines it (a test checks this table,
# __all__ and the TYPE_CHECKING imports agree).
_NAMES = {
    "Policy": "adaptjax.policies._policy",
    "Context": "adaptjax.policies._context",
    "Action": "adaptjax.policies._actions",
    "Checkpoint": "adaptjax.policies._actions",
    "Probe": "adaptjax.policies._actions",
    "Rescale": "adaptjax.policies._actions",
    "Rollback": "adaptjax.policies._actions",
    "SetBatchSize": "adaptjax.policies._actions",
    "SetCodec": "adaptjax.policies._actions",
    "SetHyperparams": "adaptjax.policies._actions",
    "SetPrecision": "adaptjax.policies._actions",
    "SetSync": "adaptjax.policies._actions",
    "Stop": "adaptjax.policies._actions",
    "AdaptiveBatchSize": "adaptjax.policies._batch_size",
    "BatchSizeWarmup": "adaptjax.policies._warmup",
    "CriticalBatchProbe": "adaptjax.policies._critical_batch",
    "ElasticScale": "adaptjax.policies._elastic",
    "EarlyStop": "adaptjax.policies._plateau",
    "ReduceLROnPlateau": "adaptjax.policies._plateau",
    "PrecisionPolicy": "adaptjax.policies._precision",
    "Schedule": "adaptjax.policies._schedule",
    "Seesaw": "adaptjax.policies._seesaw",
    "SwitchCompression": "adaptjax.policies._switch_compression",
    "SwitchSync": "adaptjax.policies._switch_sync",
    "any_of": "adaptjax.policies._combinators",
    "cooldown": "adaptjax.policies._combinators",
    "hysteresis": "adaptjax.policies._combinators",
    "when": "adaptjax.policies._combinators",
    "goodput": "adaptjax.policies._goodput",
    "Candidate": "adaptjax.policies._planner",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time names load lazily
    from adaptjax.policies._actions import (
        Action,
        Checkpoint,
        Probe,
        Rescale,
        Rollback,
        SetBatchSize,
        SetCodec,
        SetHyperparams,
        SetPrecision,
        SetSync,
        Stop,
    )
    from adaptjax.policies._batch_size import AdaptiveBatchSize
    from adaptjax.policies._combinators import any_of, cooldown, hysteresis, when
    from adaptjax.policies._context import Context
    from adaptjax.policies._critical_batch import CriticalBatchProbe
    from adaptjax.policies._elastic import ElasticScale
    from adaptjax.policies._goodput import goodput
    from adaptjax.policies._planner import Candidate
    from adaptjax.policies._plateau import EarlyStop, ReduceLROnPlateau
    from adaptjax.policies._policy import Policy
    from adaptjax.policies._precision import PrecisionPolicy
    from adaptjax.policies._schedule import Schedule
    from adaptjax.policies._seesaw import Seesaw
    from adaptjax.policies._switch_compression import SwitchCompression
    from adaptjax.policies._switch_sync import SwitchSync
    from adaptjax.policies._warmup import BatchSizeWarmup

__all__ = [
    "Policy",
    "Context",
    "Action",
    "Checkpoint",
    "Probe",
    "Rescale",
    "Rollback",
    "SetBatchSize",
    "SetCodec",
    "SetHyperparams",
    "SetPrecision",
    "SetSync",
    "Stop",
    "AdaptiveBatchSize",
    "BatchSizeWarmup",
    "CriticalBatchProbe",
    "ElasticScale",
    "EarlyStop",
    "ReduceLROnPlateau",
    "PrecisionPolicy",
    "Schedule",
    "Seesaw",
    "SwitchCompression",
    "SwitchSync",
    "any_of",
    "cooldown",
    "hysteresis",
    "when",
    "goodput",
    "Candidate",
]

__getattr__, __dir__ = attach(__name__, _NAMES)
