"""The controller's options, in small frozen dataclasses validated when built.

As orbax's ``CheckpointManagerOptions``: each group of related settings is one
frozen dataclass whose fields are checked in ``__post_init__``, so a bad value
is refused in one line where it is written, before a controller exists;
:class:`adaptjax.RunSpec` holds them.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from adaptjax._data import check_count


def every_or_none(value, name: str) -> int | None:
    """``value`` as a positive int, or ``None``; else a one-line error naming ``name``."""
    return None if value is None else check_count(value, name, positive=True)


def check_max_to_keep(value, name: str = "max_to_keep") -> int | None:
    """An integer >= 1, or ``None`` (keep every checkpoint); else a one-line error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an integer >= 1 or None, got {value}")
    return int(value)


def check_cache_dir(value, name: str):
    """``"auto"``, a path or ``None``; else a one-line error naming ``name``."""
    if value is not None and not isinstance(value, str | os.PathLike):
        raise ValueError(f"{name} must be 'auto', a directory path or None, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """When a :class:`adaptjax.Controller` checkpoints, and how many checkpoints it keeps.

    Whatever these say, a checkpoint is also written at every rescale, for a
    ``Checkpoint`` action and at the end of :meth:`adaptjax.Controller.run`.

    Attributes:
      every: a periodic checkpoint every this many steps (``None``: none).
      max_to_keep: checkpoints kept on disk (``None``: all of them).

    Example:
      >>> import adaptjax
      >>> adaptjax.CheckpointOptions(every=100)
      CheckpointOptions(every=100, max_to_keep=3)
      >>> adaptjax.CheckpointOptions(every=0)
      Traceback (most recent call last):
      ...
      ValueError: CheckpointOptions.every must be a positive integer, got 0
    """

    every: int | None = None
    max_to_keep: int | None = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "every", every_or_none(self.every, "CheckpointOptions.every"))
        object.__setattr__(
            self, "max_to_keep",
            check_max_to_keep(self.max_to_keep, "CheckpointOptions.max_to_keep"),
        )


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """How a :class:`adaptjax.Controller` keeps compiling off the training's path.

    Attributes:
      cache_dir: JAX's persistent compilation cache, so a resume or relaunch
        compiles nothing it compiled before: ``"auto"`` uses
        ``$XDG_CACHE_HOME/adaptjax/jax-compilation-cache`` unless JAX already
        has a cache directory; a path uses that; ``None`` leaves JAX as it is.
      precompile_upcoming: compile, in a background thread, the configurations
        that policies announce through ``Policy.upcoming`` (``background_compile``
        events), so that a change does not wait for XLA when it comes.
      device_memory: the bytes one device's step may use, read under
        ``RunSpec(micro_batch_size="auto")``: a batch whose step would need
        more (by the compiled steps' memory analysis) is accumulated in
        micro-steps that fit. ``None``: the device's own ``bytes_limit``
        where it reports one (GPUs, TPUs); none on CPU.

    Example:
      >>> import adaptjax
      >>> adaptjax.CompileOptions(cache_dir=None, precompile_upcoming=False)
      CompileOptions(cache_dir=None, precompile_upcoming=False, device_memory=None)
    """

    cache_dir: str | os.PathLike | None = "auto"
    precompile_upcoming: bool = True
    device_memory: int | None = None

    def __post_init__(self) -> None:
        check_cache_dir(self.cache_dir, "CompileOptions.cache_dir")
        object.__setattr__(self, "device_memory", every_or_none(
            self.device_memory, "CompileOptions.device_memory"))
        object.__setattr__(self, "precompile_upcoming", bool(self.precompile_upcoming))
