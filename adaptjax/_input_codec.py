"""Quantized input features (BiFeat): stored and moved small, decoded inside the step.

An :class:`InputCodec` is the choice (``"int8"`` or ``"bfloat16"``); fitting it
to a float array on the host gives a ``FeatureCodec``, which encodes the
array once (the dataset keeps only the codes) and decodes a batch of codes
inside the compiled step.

* ``int8``: per column (every position of a sample, ``x.shape[1:]``), with
  ``offset = min`` and ``scale = (max - min) / 255`` over the samples,
  ``code = round((x - offset) / scale) - 128`` and
  ``decode(code) = (code + 128) * scale + offset``. The rounding moves each
  element by at most half a step: ``|decode(encode(x)) - x| <= scale / 2``
  (exactly, on the host's float64 arithmetic; the float32 decode adds its own
  rounding, a few ulps of ``x``). A constant column has ``scale = 0`` and
  decodes exactly. One byte per element instead of four.
* ``bfloat16``: round to nearest bfloat16; the relative error is at most
  ``2**-8``. Two bytes per element.

The decode's ``scale`` and ``offset`` are small constants of the compiled
step (one value per column, fitted on the whole training set: the same in
every process of a multi-process job), not per-step inputs: a batch is only
its codes, so every leaf keeps its leading batch axis (split over replicas
like any other), and the bytes moved host -> device per step are the codes'
bytes alone (:func:`batch_bytes`). References: Ma et al., "BiFeat:
Supercharge GNN Training via Graph Feature Quantization", 2022.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

#: The codes an input codec may store.
CODEC_DTYPES = ("int8", "bfloat16")
_LEVELS = 255  # int8 codes -128..127 are the levels 0..255 shifted


@dataclasses.dataclass(frozen=True)
class InputCodec:
    """How a dataset stores float features: ``"int8"`` or ``"bfloat16"``.

    Give it to :class:`adaptjax.ArrayDataset` as ``features=`` (every float
    array) or ``features={name: codec}``; the dataset stores the codes and its
    ``decode`` turns a batch back into float32 inside the step (see the module
    docstring for the rules and the error bounds).

    Args:
      dtype: ``"int8"`` (per-column scale and offset) or ``"bfloat16"``.

    Example:
      >>> import numpy as np, adaptjax
      >>> x = np.array([[0.0, 5.0], [1.0, 5.0], [0.25, 5.0]], np.float32)
      >>> codec = adaptjax.InputCodec("int8").fit(x)
      >>> codes = codec.encode(x)
      >>> codes.dtype, codes[:, 0].tolist()
      (dtype('int8'), [-128, 127, -64])
      >>> np.asarray(codec.decode(codes))[:, 1].tolist()   # a constant column is exact
      [5.0, 5.0, 5.0]
      >>> adaptjax.InputCodec("int4")
      Traceback (most recent call last):
      ...
      ValueError: InputCodec: unknown dtype 'int4'; use one of 'int8', 'bfloat16'
    """

    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in CODEC_DTYPES:
            allowed = ", ".join(repr(c) for c in CODEC_DTYPES)
            raise ValueError(f"InputCodec: unknown dtype {self.dtype!r}; use one of {allowed}")

    def fit(self, x: ArrayLike, name: str = "features") -> FeatureCodec:
        """The codec fitted to the samples of ``x`` (leading axis = samples).

        Args:
          x: a float array, every value finite.
          name: the array's name, for the error messages.

        Returns:
          A ``FeatureCodec``.
        """
        x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.floating):
            raise ValueError(
                f"{name} is {x.dtype}: an input codec quantizes float features, not integer "
                f"labels or tokens; leave {name} out of features="
            )
        if x.ndim == 0 or x.shape[0] == 0:
            raise ValueError(f"{name} needs a leading sample axis with at least one sample")
        if not np.all(np.isfinite(x)):
            raise ValueError(f"{name} holds inf or NaN; an input codec needs finite features")
        if self.dtype == "bfloat16":
            return FeatureCodec("bfloat16", x.shape[1:], None, None)
        return FeatureCodec("int8", x.shape[1:], *_fit_int8(x))


def _fit_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``(scale, offset)``: ``[offset, offset + 255 * scale]`` covers each column."""
    lo = np.min(x, axis=0).astype(np.float64)
    hi = np.max(x, axis=0).astype(np.float64)
    offset = lo.astype(np.float32)
    offset = np.where(offset > lo, np.nextafter(offset, np.float32(-np.inf)), offset)
    scale = ((hi - offset) / _LEVELS).astype(np.float32)
    # the top level must reach the column's maximum in exact arithmetic
    short = offset.astype(np.float64) + _LEVELS * scale.astype(np.float64) < hi
    scale = np.where(short, np.nextafter(scale, np.float32(np.inf)), scale)
    return scale.astype(np.float32), offset.astype(np.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class FeatureCodec:
    """An :class:`InputCodec` fitted to one array: encodes on the host, decodes in the step.

    Attributes:
      dtype: ``"int8"`` or ``"bfloat16"``: the codes' dtype.
      shape: one sample's shape (``x.shape[1:]``).
      scale: int8 only: float32 per-column step, shape ``shape``.
      offset: int8 only: float32 per-column minimum, shape ``shape``.

    Example:
      >>> import numpy as np, adaptjax
      >>> codec = adaptjax.InputCodec("int8").fit(np.array([[0.0], [255.0]]))
      >>> codec.scale.tolist(), codec.max_error().tolist()   # a step of (255 - 0) / 255
      ([1.0], [0.5])
      >>> np.asarray(codec.decode(codec.encode(np.array([[1.4], [1.6]])))).ravel().tolist()
      [1.0, 2.0]
    """

    dtype: str
    shape: tuple[int, ...]
    scale: np.ndarray | None
    offset: np.ndarray | None

    @property
    def code_dtype(self) -> np.dtype:
        """The numpy dtype of the codes."""
        return np.dtype(np.int8) if self.dtype == "int8" else np.dtype(jnp.bfloat16)

    def encode(self, x: ArrayLike) -> np.ndarray:
        """The codes of ``x`` (host, numpy); int8 values outside the fitted range are clipped."""
        x = np.asarray(x)
        if tuple(x.shape[1:]) != tuple(self.shape):
            raise ValueError(
                f"this codec was fitted to samples of shape {self.shape}, got {x.shape[1:]}"
            )
        if self.dtype == "bfloat16":
            return x.astype(jnp.bfloat16)
        scale, offset = self.scale, self.offset
        assert scale is not None and offset is not None  # int8 codecs are fitted with both
        step = np.where(scale > 0, scale, 1.0).astype(np.float64)
        levels = np.rint((x.astype(np.float64) - offset) / step)
        return (np.clip(levels, 0, _LEVELS) - 128).astype(np.int8)

    def decode(self, codes: ArrayLike, dtype: DTypeLike = jnp.float32) -> jax.Array:
        """The features of ``codes`` in ``dtype`` (jit-friendly: scale and offset are constants).

        Works on any number of rows (a replica's shard of a batch too).
        """
        codes = jnp.asarray(codes)
        if self.dtype == "bfloat16":
            return codes.astype(dtype)
        levels = codes.astype(jnp.float32) + 128.0
        return (levels * jnp.asarray(self.scale) + jnp.asarray(self.offset)).astype(dtype)

    def max_error(self) -> np.ndarray | None:
        """int8: the per-column bound ``scale / 2`` on ``|decode(encode(x)) - x|``; else None."""
        return None if self.scale is None else self.scale / 2

    def __repr__(self) -> str:
        return f"FeatureCodec({self.dtype!r}, shape={self.shape})"


def batch_bytes(batch: Any) -> int:
    """The bytes of every array in ``batch``: what moving it host -> device transfers.

    Example:
      >>> import numpy as np, adaptjax
      >>> batch_bytes({"x": np.zeros((8, 64), np.int8), "y": np.zeros(8, np.int32)})
      544
    """
    leaves = jax.tree.leaves(batch)
    return int(sum(x.nbytes if hasattr(x, "nbytes") else np.asarray(x).nbytes for x in leaves))
