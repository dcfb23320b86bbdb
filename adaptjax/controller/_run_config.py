"""The frozen configuration that decides which compiled step runs."""

from __future__ import annotations

import dataclasses
import re

from adaptjax._data import check_count


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

    Example:
      >>> from adaptjax import RunConfig
      >>> RunConfig(devices=8, batch_size=64)
      RunConfig(devices=8, batch_size=64, microbatches=1, codec=None, sync=None)
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

    def replace(self, **changes) -> RunConfig:
        """A copy with ``changes`` (checked like the original)."""
        return dataclasses.replace(self, **changes)


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
