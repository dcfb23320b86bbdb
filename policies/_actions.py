"""The action vocabulary: everything a policy may ask the controller to do.

Actions are small frozen dataclasses. Their fields are validated and normalised
in ``__post_init__`` (numpy ints become Python ints, a hyperparameter dict
becomes a read-only :class:`FrozenMapping`, a mesh-shape list becomes a tuple),
so two equal decisions compare equal and hash alike, and a bad field fails at
the line that built it with a one-line ``ValueError``.

Every action takes an optional keyword ``reason``: a human-readable sentence
saying why it was proposed (built-in policies write ``"PolicyName: why"``). It
is a description, not part of the decision: it is left out of ``==``, ``hash``
and ``repr`` (``Stop`` and ``Rollback`` keep their positional ``reason``), and
the controller logs it with the decision. :func:`with_reason` adds one.

==================  ========================================================
action              what the controller does
==================  ========================================================
``SetHyperparams``  sets scalar hyperparameters (no recompile)
``SetBatchSize``    changes the global batch (and optionally micro-batches)
``Rescale``         moves to a device count or a mesh shape (via a checkpoint)
``SetCodec``        switches gradient compression on (a codec) or off (None)
``SetSync``         switches the synchronisation strategy (S-SGD, DiLoCo, ...)
``SetPrecision``    switches the compute precision (float32, bfloat16, ...)
``Probe``           measures the critical batch by branching training from the live state
``Checkpoint``      saves a checkpoint now
``Stop``            ends training
``Rollback``        restores the last checkpoint
==================  ========================================================
"""

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, TypeAlias

from adaptjax.policies._checks import (
    check_float,
    check_int,
    check_mapping,
    check_optional_int,
    check_str,
    short_repr,
)
from adaptjax.policies._mapping import FrozenMapping


@dataclasses.dataclass(frozen=True)
class SetHyperparams:
    """Set scalar hyperparameters (e.g. the learning rate) without recompiling.

    Args:
      values: hyperparameter name -> new value; at least one, every value finite.

    Example:
      >>> SetHyperparams({"learning_rate": 0.05})
      SetHyperparams(values={'learning_rate': 0.05})
    """

    values: Mapping[str, float]
    reason: str = dataclasses.field(default="", compare=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        owner = "SetHyperparams"
        check_str(self.reason, owner=owner, name="reason")
        check_mapping(self.values, owner=owner, name="values")
        if not self.values:
            raise ValueError(f"{owner}: values must name at least one hyperparameter, got {{}}")
        clean = {}
        for key, value in self.values.items():
            check_str(key, owner=owner, name="every key of values", allow_empty=False)
            clean[key] = check_float(value, owner=owner, name=f"values[{key!r}]")
        object.__setattr__(self, "values", FrozenMapping(clean))


@dataclasses.dataclass(frozen=True)
class SetBatchSize:
    """Change the global batch size (recompiles the step; compiled steps are cached).

    Args:
      batch_size: the new global batch size, >= 1.
      microbatches: the new number of gradient-accumulation micro-batches per
        step, or ``None`` to keep the current one. ``batch_size`` must be
        divisible by it.

    Example:
      >>> SetBatchSize(256)
      SetBatchSize(batch_size=256, microbatches=None)
    """

    batch_size: int
    microbatches: int | None = None
    reason: str = dataclasses.field(default="", compare=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        owner = "SetBatchSize"
        check_str(self.reason, owner=owner, name="reason")
        batch = check_int(self.batch_size, owner=owner, name="batch_size", minimum=1)
        micro = check_optional_int(self.microbatches, owner=owner, name="microbatches", minimum=1)
        if micro is not None and batch % micro:
            raise ValueError(
                f"{owner}: batch_size={batch} is not divisible by microbatches={micro}; "
                f"use a multiple of {micro}"
            )
        object.__setattr__(self, "batch_size", batch)
        object.__setattr__(self, "microbatches", micro)


@dataclasses.dataclass(frozen=True)
class Rescale:
    """Move training to another device count or mesh shape (through a checkpoint).

    ``devices`` counts replicas (the ``"data"`` axis): on a sharded mesh the
    other axes keep their sizes. ``mesh_shape`` names the whole new mesh,
    ``{"data": d, "fsdp": f}`` (``"model"`` too; a mapping of ``"data"``
    alone is the 1-D mesh), kept as a read-only mapping in the given axis
    order; a tuple of ints gives the sizes of the run's own axes, in order.

    Args:
      devices: the new number of replicas, >= 1.
      mesh_shape: the new mesh shape, ``{axis: size}`` (every size >= 1, a
        ``"data"`` axis) or a tuple of sizes. Give exactly one of
        ``devices`` and ``mesh_shape``.

    Example:
      >>> Rescale(devices=4)
      Rescale(devices=4, mesh_shape=None)
      >>> Rescale(mesh_shape=[2, 4]).mesh_shape
      (2, 4)
      >>> Rescale(mesh_shape={"data": 1, "fsdp": 4})
      Rescale(devices=None, mesh_shape={'data': 1, 'fsdp': 4})
    """

    devices: int | None = None
    mesh_shape: tuple[int, ...] | Mapping[str, int] | None = None
    reason: str = dataclasses.field(default="", compare=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        owner = "Rescale"
        check_str(self.reason, owner=owner, name="reason")
        if (self.devices is None) == (self.mesh_shape is None):
            raise ValueError(
                f"{owner}: give exactly one of devices and mesh_shape, got "
                f"devices={short_repr(self.devices)}, mesh_shape={short_repr(self.mesh_shape)}"
            )
        if self.devices is not None:
            devices = check_int(self.devices, owner=owner, name="devices", minimum=1)
            object.__setattr__(self, "devices", devices)
            return
        if isinstance(self.mesh_shape, Mapping):
            object.__setattr__(self, "mesh_shape", _named_shape(self.mesh_shape, owner))
            return
        sizes = self.mesh_shape
        assert sizes is not None  # devices is None, so mesh_shape was given (checked above)
        if isinstance(sizes, str | bytes) or not hasattr(sizes, "__iter__"):
            raise ValueError(
                f"{owner}: mesh_shape must be a tuple of ints or a dict {{axis: size}}, got "
                f"{short_repr(sizes)}"
            )
        shape = tuple(
            check_int(d, owner=owner, name="every mesh_shape dimension", minimum=1) for d in sizes
        )
        if not shape:
            raise ValueError(f"{owner}: mesh_shape must have at least one dimension, got ()")
        object.__setattr__(self, "mesh_shape", shape)


def _named_shape(shape: Mapping, owner: str) -> FrozenMapping:
    """``{axis: size}`` checked: str axes, int sizes >= 1, a ``"data"`` axis (the replicas)."""
    out = {}
    for axis, size in shape.items():
        check_str(axis, owner=owner, name="every mesh_shape axis", allow_empty=False)
        out[axis] = check_int(size, owner=owner, name=f"mesh_shape[{axis!r}]", minimum=1)
    if "data" not in out:
        raise ValueError(
            f"{owner}: mesh_shape {out} has no 'data' axis (the replicas); add one, e.g. "
            f"{{'data': 1, **{out}}}"
        )
    return FrozenMapping(out)


@dataclasses.dataclass(frozen=True)
class SetCodec:
    """Switch gradient compression on (with ``codec``) or off (``codec=None``).

    Args:
      codec: a codec the user built (e.g. from ``adaptjax.compression``), held as
        an opaque object and never inspected here; ``None`` clears compression.

    Example:
      >>> SetCodec(None)
      SetCodec(codec=None)
    """

    codec: object | None
    reason: str = dataclasses.field(default="", compare=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        check_str(self.reason, owner="SetCodec", name="reason")


@dataclasses.dataclass(frozen=True)
class SetSync:
    """Switch how replicas synchronise (recompiles once per strategy; state is kept).

    Args:
      strategy: a strategy the user built (e.g. ``adaptjax.sync.DiLoCo(H=32)``) or
        its name (``"ssgd"``, ``"sma"``, ``"local_sgd"``, ``"diloco"``,
        ``"gossip"``), held as an opaque value and never inspected here;
        ``None`` means S-SGD.

    Example:
      >>> SetSync("diloco")
      SetSync(strategy='diloco')
    """

    strategy: object | None
    reason: str = dataclasses.field(default="", compare=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        check_str(self.reason, owner="SetSync", name="reason")


#: The compute dtypes a precision may be named by (``adaptjax.Precision``'s choices).
PRECISION_NAMES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class SetPrecision:
    """Switch the precision the step computes in (float32 master weights stay).

    The controller's compiled steps are keyed by it; params and optimizer
    moments are the same float32 arrays in every precision. Moving to float16
    wraps the optimizer state in a dynamic loss scale
    (:func:`adaptjax.dynamic_loss_scale`); leaving float16 drops the scale.

    Args:
      precision: an ``adaptjax.Precision`` the user built, held as an opaque
        value and never inspected here, or a precision's key: a compute dtype
        name (``"float32"``, ``"bfloat16"``, ``"float16"``), optionally
        followed by ``",output=<dtype>"``.

    Example:
      >>> SetPrecision("bfloat16")
      SetPrecision(precision='bfloat16')
      >>> SetPrecision("int8")
      Traceback (most recent call last):
      ...
      ValueError: SetPrecision: unknown precision 'int8'; use one of 'float32', 'bfloat16', 'float16' or an adaptjax.Precision
    """  # noqa: E501

    precision: object
    reason: str = dataclasses.field(default="", compare=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        owner = "SetPrecision"
        check_str(self.reason, owner=owner, name="reason")
        if self.precision is None:
            raise ValueError(
                f"{owner}: precision is None; give 'float32' (or another name) or an "
                "adaptjax.Precision"
            )
        if isinstance(self.precision, str):
            compute = self.precision.split(",")[0]
            if compute not in PRECISION_NAMES:
                allowed = ", ".join(repr(n) for n in PRECISION_NAMES)
                raise ValueError(
                    f"{owner}: unknown precision {short_repr(self.precision)}; use one of "
                    f"{allowed} or an adaptjax.Precision"
                )


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Save a checkpoint now.

    Example:
      >>> Checkpoint()
      Checkpoint()
    """

    reason: str = dataclasses.field(default="", compare=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        check_str(self.reason, owner="Checkpoint", name="reason")


@dataclasses.dataclass(frozen=True)
class Stop:
    """End training (after a final checkpoint, at the controller's discretion).

    Args:
      reason: why, for the log.

    Example:
      >>> Stop("target reached")
      Stop(reason='target reached')
    """

    reason: str = ""

    def __post_init__(self) -> None:
        check_str(self.reason, owner="Stop", name="reason")


@dataclasses.dataclass(frozen=True)
class Rollback:
    """Restore the last checkpoint (e.g. after non-finite gradients).

    Args:
      reason: why, for the log.

    Example:
      >>> Rollback("loss became NaN")
      Rollback(reason='loss became NaN')
    """

    reason: str = ""

    def __post_init__(self) -> None:
        check_str(self.reason, owner="Rollback", name="reason")


@dataclasses.dataclass(frozen=True)
class Probe:
    """Measure the critical batch size by branching training from the live state.

    The controller copies the state in memory and, for each batch size B,
    trains ``steps`` x max(batch_sizes) / B optimizer steps at B (every branch
    on the same samples, read ahead of the data cursor without moving it), the
    learning rate scaled from the current one by ``lr_rule`` for B / current
    batch. It evaluates each branch's loss on data common to all of them, fits
    ``fit_critical_batch`` to the drops, logs the metric ``critical_batch`` and
    goes on from the copy: no step, sample or random draw of the main run changes.

    Args:
      batch_sizes: the branches' global batch sizes, 3 or more distinct, each >= 1
        (kept sorted).
      steps: optimizer steps of the largest branch, >= 1.
      lr_rule: ``"sqrt"`` (Adam), ``"linear"`` (SGD), ``"none"`` or
        ``"adascale"`` (see ``lr_scale``).
      lr_multipliers: factors on each branch's scaled learning rate, each > 0
        (kept sorted, distinct). A batch trains once per factor and its lowest
        loss counts: the loss at the best rate for its batch, which the model
        ΔL(B) = ΔL_max / (1 + B_crit / B) assumes (Merrill et al. tune each
        branch's rate alike). ``(1.0,)``: the rule's rate alone.

    Example:
      >>> Probe(batch_sizes=[128, 32, 64], steps=20)
      Probe(batch_sizes=(32, 64, 128), steps=20, lr_rule='sqrt', lr_multipliers=(1.0,))
    """

    batch_sizes: tuple[int, ...]
    steps: int = 10
    lr_rule: str = "sqrt"
    lr_multipliers: tuple[float, ...] = (1.0,)
    reason: str = dataclasses.field(default="", compare=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        owner = "Probe"
        check_str(self.reason, owner=owner, name="reason")
        if isinstance(self.batch_sizes, str | bytes) or not hasattr(self.batch_sizes, "__iter__"):
            raise ValueError(
                f"{owner}: batch_sizes must be a tuple of ints, got {short_repr(self.batch_sizes)}"
            )
        sizes = sorted(
            {check_int(b, owner=owner, name="every batch size", minimum=1)
             for b in self.batch_sizes}
        )
        if len(sizes) < 3:
            raise ValueError(
                f"{owner}: batch_sizes needs 3 or more distinct sizes to fit the critical batch, "
                f"got {sizes}; add sizes"
            )
        object.__setattr__(self, "batch_sizes", tuple(sizes))
        object.__setattr__(self, "steps", check_int(self.steps, owner=owner, name="steps",
                                                    minimum=1))
        rules = ("adascale", "sqrt", "linear", "none")  # policies._goodput.LR_RULES
        if self.lr_rule not in rules:
            allowed = ", ".join(repr(r) for r in rules)
            raise ValueError(
                f"{owner}: unknown lr_rule {short_repr(self.lr_rule)}; use one of {allowed}"
            )
        object.__setattr__(self, "lr_multipliers", _multipliers(self.lr_multipliers, owner))


def _multipliers(value: Any, owner: str) -> tuple[float, ...]:
    """``value`` as a sorted tuple of distinct finite floats > 0, at least one."""
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise ValueError(
            f"{owner}: lr_multipliers must be a tuple of numbers, got {short_repr(value)}"
        )
    factors = sorted({check_float(m, owner=owner, name="every lr multiplier", low=0.0,
                                  low_open=True) for m in value})
    if not factors:
        raise ValueError(f"{owner}: lr_multipliers needs at least one factor, got ()")
    return tuple(factors)


#: The action classes, as a tuple (for ``isinstance``).
ACTION_TYPES: tuple[type, ...] = (
    SetHyperparams,
    SetBatchSize,
    Rescale,
    SetCodec,
    Checkpoint,
    Stop,
    Rollback,
    SetSync,
    SetPrecision,
    Probe,
)

#: Any one action: the union of the action classes a policy returns.
Action: TypeAlias = (
    SetHyperparams
    | SetBatchSize
    | Rescale
    | SetCodec
    | Checkpoint
    | Stop
    | Rollback
    | SetSync
    | SetPrecision
    | Probe
)


def with_reason(action: Action, reason: str) -> Action:
    """A copy of ``action`` carrying ``reason`` (why it was proposed), for the run's log.

    Example:
      >>> a = with_reason(SetBatchSize(128), "AdaptiveBatchSize: goodput +20%")
      >>> a.reason, a == SetBatchSize(128)
      ('AdaptiveBatchSize: goodput +20%', True)
    """
    return dataclasses.replace(action, reason=reason)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def opaque_key(obj: object) -> str | None:
    """A string that names an opaque object (a codec) stably across processes.

    The qualified type name plus ``repr`` with memory addresses removed, so the
    same configured codec gives the same key after a restart.
    """
    return None if obj is None else _qualified_repr(obj)


def _qualified_repr(obj: object) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}:{_ADDRESS.sub('', repr(obj))}"


def precision_name(precision: object) -> str:
    """A precision's key: the name itself, or an ``adaptjax.Precision``'s ``key``.

    Example:
      >>> precision_name("bfloat16")
      'bfloat16'
    """
    if isinstance(precision, str):
        return precision
    key = getattr(precision, "key", None)
    return key if isinstance(key, str) else _qualified_repr(precision)


def action_signature(action: Action) -> list[Any]:
    """A JSON-serialisable description of an action's type and decision values.

    Used by ``hysteresis`` to compare decisions across evaluations and across a
    resume. ``Stop``/``Rollback`` reasons are descriptions, not decisions, and
    are left out; codecs are described by :func:`opaque_key`.

    Example:
      >>> action_signature(SetBatchSize(128))
      ['SetBatchSize', 128, None]
    """
    if isinstance(action, SetHyperparams):
        return ["SetHyperparams", [[k, action.values[k]] for k in sorted(action.values)]]
    if isinstance(action, SetBatchSize):
        return ["SetBatchSize", action.batch_size, action.microbatches]
    if isinstance(action, Rescale):
        shape = action.mesh_shape
        if isinstance(shape, Mapping):
            shape = [[axis, size] for axis, size in shape.items()]
        return ["Rescale", action.devices, None if shape is None else list(shape)]
    if isinstance(action, SetCodec):
        return ["SetCodec", opaque_key(action.codec)]
    if isinstance(action, SetSync):
        strategy = action.strategy
        return ["SetSync", strategy if isinstance(strategy, str) else opaque_key(strategy)]
    if isinstance(action, SetPrecision):
        return ["SetPrecision", precision_name(action.precision)]
    return [type(action).__name__]
