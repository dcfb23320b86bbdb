"""The frozen configuration that decides which compiled step runs."""

from __future__ import annotations

import dataclasses
import re

from adaptjax._data import check_count
from adaptjax._precision import Precision


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The configuration that decides which compiled step runs.

    Every field is checked at construction (integers only: ``64.5`` or
    ``"64"`` are refused, never coerced), and the batch must split evenly over
    replicas x micro-batches.

    Attributes:
      devices: replicas on the 1-D ``"data"`` mesh.
      batch_size: global batch (samples per step).
      microbatches: gradient accumulation steps per replica.
      codec: the codec's key (see :func:`codec_key`), or ``None`` for a dense sync.
      sync: the synchronisation strategy's key (see :func:`adaptjax.sync_key`),
        or ``None`` for S-SGD.
      precision: the compute precision's key (:attr:`adaptjax.Precision.key`,
        e.g. ``"bfloat16"``; a :class:`adaptjax.Precision` or an alias such as
        ``"bf16"`` is turned into it), or ``None`` for float32: a float32
        precision is stored as ``None``, so a configuration written before
        precision existed compares equal to one that names float32.

    Example:
      >>> from adaptjax import RunConfig
      >>> RunConfig(devices=8, batch_size=64)
      RunConfig(devices=8, batch_size=64, microbatches=1, codec=None, sync=None, precision=None)
      >>> RunConfig(8, 64, precision="bf16").precision, RunConfig(8, 64, precision="float32")
      ('bfloat16', RunConfig(devices=8, batch_size=64, microbatches=1, codec=None, sync=None, precision=None))
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

    def __post_init__(self) -> None:
        for name in ("devices", "batch_size", "microbatches"):
            object.__setattr__(self, name, check_count(getattr(self, name), name, positive=True))
        if self.codec is not None and not isinstance(self.codec, str):
            raise ValueError(f"codec must be a codec key (str) or None, got {self.codec!r}")
        if self.sync is not None and not isinstance(self.sync, str):
            raise ValueError(
                f"sync must be a strategy key (adaptjax.sync_key(strategy)) or None, "
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

    @property
    def precision_name(self) -> str:
        """:attr:`precision` with float32 named: ``"float32"`` for ``None``."""
        return "float32" if self.precision is None else self.precision

    def replace(self, **changes) -> RunConfig:
        """A copy with ``changes`` (checked like the original)."""
        return dataclasses.replace(self, **changes)


def precision_key(precision) -> str | None:
    """A :attr:`RunConfig.precision`: the precision's key, or ``None`` for float32.

    ``precision`` is a :class:`adaptjax.Precision`, a key or an alias
    (``"bf16"``), or ``None``; anything else is a one-line ``ValueError``.

    Example:
      >>> import adaptjax
      >>> from adaptjax.controller._run_config import precision_key
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
    """:func:`precision_key` of a precision the :class:`adaptjax.Controller` can run.

    float16 needs dynamic loss scaling inside the controller's step (the loss
    scaled before differentiating, the gradients unscaled and the
    :class:`adaptjax.LossScaleState` adjusted after the skip-or-apply branch),
    which :func:`adaptjax.data_parallel_step` does not do yet: it is refused
    in one line, before anything compiles.

    Example:
      >>> from adaptjax.controller._run_config import controller_precision
      >>> controller_precision("bfloat16")
      'bfloat16'
      >>> controller_precision("float16")
      Traceback (most recent call last):
      ...
      ValueError: precision 'float16': float16 under the Controller needs the step's dynamic loss scaling, which is pending; use 'bfloat16' (float32's range, no loss scaling)
    """  # noqa: E501
    key = precision_key(precision)
    if key is not None and Precision.of(key).needs_loss_scale:
        raise ValueError(
            f"precision {key!r}: float16 under the Controller needs the step's dynamic loss "
            "scaling, which is pending; use 'bfloat16' (float32's range, no loss scaling)"
        )
    return key


def round_batch(batch_size: int, devices: int, microbatches: int) -> int:
    """The multiple of ``devices * microbatches`` nearest ``batch_size`` (at least one unit).

    Example:
      >>> from adaptjax.controller._run_config import round_batch
      >>> round_batch(101, 8, 1), round_batch(3, 8, 1), round_batch(96, 3, 2)
      (104, 8, 96)
    """
    unit = devices * microbatches
    return max(unit, int(round(batch_size / unit)) * unit)


def codec_key(codec) -> str | None:
    """A stable name for a codec object: its ``repr`` without memory addresses.

    Example:
      >>> from adaptjax import codec_key
      >>> codec_key(None) is None
      True
    """
    if codec is None:
        return None
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(codec))
