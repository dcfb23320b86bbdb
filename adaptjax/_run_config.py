"""The frozen configuration that decides which compiled step runs."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from adaptjax._data import check_count
from adaptjax._mesh import checked_shape
from adaptjax._precision import Precision


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The configuration that decides which compiled step runs.

    Every field is checked at construction (integers only: ``64.5`` or
    ``"64"`` are refused, never coerced), and the batch must split evenly over
    replicas x micro-batches.

    Attributes:
      devices: replicas: the size of the ``"data"`` axis (on the default 1-D
        mesh, the devices).
      batch_size: global batch (samples per step).
      microbatches: gradient accumulation steps per replica.
      codec: the codec's key (its ``repr``), or ``None`` for a dense sync.
      sync: the synchronisation strategy's key (its ``repr``),
        or ``None`` for S-SGD.
      precision: the compute precision's key (:attr:`adaptjax.Precision.key`,
        e.g. ``"bfloat16"``; a :class:`adaptjax.Precision` or an alias such as
        ``"bf16"`` is turned into it), or ``None`` for float32: a float32
        precision is stored as ``None``, so a configuration written before
        precision existed compares equal to one that names float32.
      mesh_shape: the mesh's named axes in order, as ``((axis, size), ...)``
        (a ``{axis: size}`` mapping is turned into it), with ``"data"`` of
        size ``devices``; ``None`` for the 1-D ``("data",)`` mesh (a mesh of
        ``"data"`` alone is stored as ``None``, so configurations written
        before sharded meshes compare equal). :meth:`replace` with a new
        ``devices`` keeps the other axes.
      micro_batch: the global samples one call of the compiled step takes
        (``None``: the whole batch). Set, a step is ``batch_size //
        micro_batch`` calls of the program compiled for a batch of
        ``micro_batch``, accumulated (:func:`adaptjax.accumulate`): it divides
        ``batch_size`` and replicas x micro-batches divide it.

    Example:
      >>> from adaptjax import RunConfig
      >>> RunConfig(devices=8, batch_size=64)
      RunConfig(devices=8, batch_size=64, microbatches=1, codec=None, sync=None, precision=None, mesh_shape=None, micro_batch=None)
      >>> RunConfig(8, 64, precision="bf16").precision, RunConfig(8, 64, precision="float32").precision
      ('bfloat16', None)
      >>> c = RunConfig(2, 64, mesh_shape={"data": 2, "fsdp": 4})
      >>> c.mesh_shape, c.device_count, c.replace(devices=1).mesh_shape
      ((('data', 2), ('fsdp', 4)), 8, (('data', 1), ('fsdp', 4)))
      >>> RunConfig(devices=8, batch_size=60)
      Traceback (most recent call last):
      ...
      ValueError: batch_size 60 is not divisible by replicas x microbatches = 8 x 1; use a multiple of 8
    """  # noqa: E501

    devices: int
    batch_size: int
    microbatches: int = 1
    codec: str | None = None
    sync: str | None = None
    precision: str | None = None
    mesh_shape: tuple[tuple[str, int], ...] | None = None
    micro_batch: int | None = None

    def __post_init__(self) -> None:
        for name in ("devices", "batch_size", "microbatches"):
            object.__setattr__(self, name, check_count(getattr(self, name), name, positive=True))
        object.__setattr__(self, "mesh_shape", mesh_key(self.mesh_shape, self.devices))
        if self.codec is not None and not isinstance(self.codec, str):
            raise ValueError(f"codec must be a codec key (str) or None, got {self.codec!r}")
        if self.sync is not None and not isinstance(self.sync, str):
            raise ValueError(
                f"sync must be a strategy key (str, the strategy's repr) or None, "
                f"got {self.sync!r}"
            )
        object.__setattr__(self, "precision", precision_key(self.precision))
        if self.batch_size < self.devices:
            raise ValueError(
                f"batch_size {self.batch_size} is smaller than the replica count {self.devices}; "
                f"use batch_size >= {self.devices}"
            )
        unit = self.devices * self.microbatches
        if self.batch_size % unit:
            raise ValueError(
                f"batch_size {self.batch_size} is not divisible by replicas x microbatches = "
                f"{self.devices} x {self.microbatches}; use a multiple of {unit}"
            )
        if self.micro_batch is not None:
            self._check_micro_batch(unit)

    def _check_micro_batch(self, unit: int) -> None:
        micro = check_count(self.micro_batch, "micro_batch", positive=True)
        object.__setattr__(self, "micro_batch", micro)
        if self.batch_size % micro or micro % unit:
            raise ValueError(
                f"micro_batch {micro} must divide batch_size {self.batch_size} and be a "
                f"multiple of replicas x microbatches = {unit}"
            )

    @property
    def precision_name(self) -> str:
        """:attr:`precision` with float32 named: ``"float32"`` for ``None``."""
        return "float32" if self.precision is None else self.precision

    @property
    def axes(self) -> dict[str, int]:
        """``{axis: size}`` of the mesh, in order (``{"data": devices}`` on a 1-D mesh)."""
        return dict(self.mesh_shape) if self.mesh_shape is not None else {"data": self.devices}

    @property
    def device_count(self) -> int:
        """The number of devices of the mesh (``devices`` times the model axes' sizes)."""
        return math.prod(self.axes.values())

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` (checked like the original).

        A new ``devices`` without a new ``mesh_shape`` resizes the ``"data"``
        axis and keeps the others.
        """
        if "devices" in changes and "mesh_shape" not in changes and self.mesh_shape is not None:
            changes["mesh_shape"] = tuple(
                (a, int(changes["devices"]) if a == "data" else n) for a, n in self.mesh_shape
            )
        return dataclasses.replace(self, **changes)


def mesh_key(shape, devices: int | None = None) -> tuple[tuple[str, int], ...] | None:
    """A :attr:`RunConfig.mesh_shape`: ``((axis, size), ...)``, or ``None`` for data alone.

    ``shape`` is ``None``, a ``{axis: size}`` mapping or ``(axis, size)``
    pairs (as JSON gives them back), checked by :func:`shape_dict`; with
    ``devices`` its ``"data"`` size must be ``devices`` (else a one-line
    ``ValueError``).

    Example:
      >>> from adaptjax._run_config import mesh_key
      >>> mesh_key({"data": 8}), mesh_key([["fsdp", 4], ["data", 2]])
      (None, (('fsdp', 4), ('data', 2)))
    """
    if shape is None:
        return None
    shape = shape_dict(shape)
    if devices is not None and shape["data"] != devices:
        raise ValueError(
            f"mesh_shape {shape} has data={shape['data']} but devices={devices}; devices is "
            f"the replica count (the 'data' axis): pass devices={shape['data']} or leave it out"
        )
    if list(shape) == ["data"]:
        return None
    return tuple(shape.items())


def shape_dict(shape) -> dict[str, int]:
    """``{axis: size}`` from a mapping or ``(axis, size)`` pairs, checked as
    :func:`adaptjax.make_mesh` checks it (known axes, sizes >= 1, a ``"data"`` axis)."""
    if not isinstance(shape, Mapping):
        try:
            shape = {name: size for name, size in shape}
        except (TypeError, ValueError):
            raise ValueError(
                f"mesh_shape must be a dict {{axis: size}} such as {{'data': 2, 'fsdp': 4}}, "
                f"got {shape!r}"
            ) from None
    return checked_shape(shape)


def precision_key(precision) -> str | None:
    """A :attr:`RunConfig.precision`: the precision's key, or ``None`` for float32.

    ``precision`` is a :class:`adaptjax.Precision`, a key or an alias
    (``"bf16"``), or ``None``; anything else is a one-line ``ValueError``.

    Example:
      >>> import adaptjax
      >>> from adaptjax._run_config import precision_key
      >>> precision_key("bf16"), precision_key(adaptjax.Precision("float32")), precision_key(None)
      ('bfloat16', None, None)
    """
    if precision is not None and not isinstance(precision, str | Precision):
        raise ValueError(
            f"precision must be an adaptjax.Precision, its key (e.g. 'bfloat16') or None, "
            f"got {precision!r}"
        )
    resolved = Precision.of(precision)
    return None if resolved.is_full else resolved.key


def controller_precision(precision) -> str | None:
    """:func:`precision_key` of a precision the :class:`adaptjax.Controller` runs.

    Every precision :class:`adaptjax.Precision` names: float32, bfloat16, and
    float16, whose steps the controller builds with dynamic loss scaling
    (:class:`adaptjax.controller._step_cache.StepCache`); what a model cannot
    run in (a parameter beyond float16's range) is refused by
    ``check_precision`` when the run starts.

    Example:
      >>> from adaptjax._run_config import controller_precision
      >>> controller_precision("bf16"), controller_precision("fp16"), controller_precision(None)
      ('bfloat16', 'float16', None)
      >>> controller_precision("int8")
      Traceback (most recent call last):
      ...
      ValueError: Precision: unknown compute dtype 'int8'; use one of 'float32', 'bfloat16', 'float16'
    """  # noqa: E501
    return precision_key(precision)


def round_batch(batch_size: int, devices: int, microbatches: int) -> int:
    """The multiple of ``devices * microbatches`` nearest ``batch_size`` (at least one unit).

    Example:
      >>> from adaptjax._run_config import round_batch
      >>> round_batch(101, 8, 1), round_batch(3, 8, 1), round_batch(96, 3, 2)
      (104, 8, 96)
    """
    unit = devices * microbatches
    return max(unit, int(round(batch_size / unit)) * unit)


def codec_key(codec: object) -> str | None:
    """A stable name for a codec object: its ``repr`` without memory addresses.

    Example:
      >>> from adaptjax._run_config import codec_key
      >>> codec_key(None) is None
      True
    """
    if codec is None:
        return None
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(codec))
