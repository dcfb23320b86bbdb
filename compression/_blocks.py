"""The block-codec protocol: a codec of fixed-size blocks, and its payload on the wire.

A block codec (:class:`BlockFormat`; as a codec :class:`adaptjax.compression.BlockCodec`)
maps blocks of ``block`` float32 elements to a payload of fixed size and back.
It states four things, and the library does the rest (packing the payload into
32-bit words, the owner-compute or all-gather transport, buckets, error
feedback, :func:`adaptjax.compression.plan`, :func:`adaptjax.wire_bytes`,
checkpoints and rescale merges):

* ``payload()``: what one block becomes, ``{name: (dtype, count)}``, e.g.
  ``{"codes": (jnp.uint32, block // 8), "scales": (jnp.float32, 1)}`` for 4-bit
  codes and one scale. Each entry is a 1-, 2- or 4-byte number type and a
  multiple of 4 bytes per block (the collectives carry 32-bit words).
* ``encode_blocks(x, blocks)``: ``x`` of shape ``(R, nb, block)`` (``R`` rows of
  ``nb`` blocks; elements past a block's real ones are zero) to the payload,
  each entry of shape ``(R, nb, count)``. ``blocks`` (:class:`Blocks`) gives
  random numbers that depend only on the element's place in its leaf, and the
  real elements of each block.
* ``decode_blocks(payload)``: the payload back to ``(R, nb, block)`` float32.
* ``unbiased``: whether ``E[decode(encode(x))] = x`` (stochastic rounding).

Optionally ``reconstruct_blocks(x, payload)``: what this replica's own
``payload`` decodes to, knowing ``x`` too (its error-feedback residual is
``x`` minus that); by default ``decode_blocks(payload)``.

:func:`encode_rows` and :func:`decode_rows` turn payloads into rows of uint32
words and back, checking them against ``payload()`` at trace time.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from adaptjax._hash import hash32

_U32 = jnp.uint32


class Blocks(NamedTuple):
    """What ``encode_blocks`` of a block codec knows of its blocks besides their values.

    Random numbers are a hash of the element's index in its leaf and a seed of
    the leaf, the step, the replica and the stage, so they do not depend on
    how leaves are grouped into buckets or views.

    Attributes:
      seed: uint32 seed of each block's stream, broadcastable to ``(R, nb, 1)``.
      base: uint32 ``(R, nb, 1)``, the index in its leaf of each block's first element.
      count: float32, broadcastable to ``(R, nb, 1)``: each block's real elements
        (the rest are zero padding; a mean over the block divides by it).
      block: elements per block.

    Example:
      >>> import jax.numpy as jnp
      >>> from adaptjax.compression import Blocks
      >>> b = Blocks.of(jnp.uint32(7), 2, 32)        # 2 blocks of 32 of one leaf
      >>> b.uniform().shape, float(b.count)
      ((1, 2, 32), 32.0)
    """

    seed: Any
    base: Any
    count: Any
    block: int

    @classmethod
    def of(cls, seed: jax.Array, nb: int, block: int, rows: int = 1) -> Blocks:
        """``rows × nb`` full blocks of one leaf, laid out in order (row-major)."""
        shape = (rows, nb, 1)
        idx = jax.lax.broadcasted_iota(_U32, shape, 0) * _U32(nb)
        idx = idx + jax.lax.broadcasted_iota(_U32, shape, 1)
        return cls(jnp.asarray(seed, _U32), idx * _U32(block), jnp.float32(block), block)

    def bits(self) -> jax.Array:
        """uint32 random bits, one per element: ``(R, nb, block)``."""
        idx = self.base + jax.lax.iota(_U32, self.block)
        return hash32(idx ^ hash32(self.seed))

    def uniform(self) -> jax.Array:
        """float32 uniforms in ``[0, 1)`` with 24 random bits each, one per element."""
        # through int32: x86 converts int32 (not uint32) to float32 in vector registers
        return (self.bits() >> 8).astype(jnp.int32).astype(jnp.float32) * jnp.float32(2.0**-24)


class BlockFormat:
    """The protocol of a block codec (see the module docstring); a mixin.

    The class it is mixed into has a ``block`` attribute (elements per block).
    """

    block: int
    unbiased: ClassVar[bool] = False

    def payload(self) -> Mapping[str, tuple[Any, int]]:
        """What one block becomes: ``{name: (dtype, count per block)}``."""
        raise NotImplementedError

    def encode_blocks(self, x: jax.Array, blocks: Blocks) -> Mapping[str, jax.Array]:
        """``(R, nb, block)`` float32 to the payload, each entry ``(R, nb, count)``."""
        raise NotImplementedError

    def decode_blocks(self, payload: Mapping[str, jax.Array]) -> jax.Array:
        """The payload back to ``(R, nb, block)`` float32."""
        raise NotImplementedError

    def reconstruct_blocks(self, x: jax.Array, payload: Mapping[str, jax.Array]) -> jax.Array:
        """What ``encode_blocks(x, ...)`` decodes to (override where ``x`` makes it cheaper)."""
        del x
        return self.decode_blocks(payload)


class Entry(NamedTuple):
    """One entry of a payload: its name, dtype, values and uint32 words per block."""

    name: str
    dtype: np.dtype
    count: int
    words: int


def _fmt_name(fmt) -> str:
    return type(fmt).__name__


@functools.lru_cache(maxsize=256)
def payload_spec(fmt) -> tuple[Entry, ...]:
    """``fmt.payload()`` checked: one-line ValueErrors name what a collective cannot carry."""
    name = _fmt_name(fmt)
    spec = fmt.payload()
    if not isinstance(spec, Mapping) or not spec:
        raise ValueError(f"{name}.payload() must return a non-empty dict "
                         f"{{name: (dtype, count per block)}}, got {spec!r}")
    out = []
    for key, value in spec.items():
        try:
            dtype, count = value
            dtype = np.dtype(dtype)
        except (TypeError, ValueError):
            raise ValueError(f"{name}.payload()[{key!r}] must be (dtype, count per block), "
                             f"got {value!r}") from None
        if not (jnp.issubdtype(dtype, jnp.number) and dtype.itemsize in (1, 2, 4)):
            raise ValueError(
                f"{name}.payload()[{key!r}] has dtype {dtype}, which a collective cannot carry "
                "as bits: use a 1-, 2- or 4-byte number type (uint32 words, float32 scales; "
                "pack booleans with pack_bits)")
        if isinstance(count, bool) or int(count) != count or count < 1:
            raise ValueError(f"{name}.payload()[{key!r}] count must be an integer >= 1 per "
                             f"block, got {count!r}")
        nbytes = int(count) * dtype.itemsize
        if nbytes % 4:
            raise ValueError(
                f"{name}.payload()[{key!r}] is {nbytes} bytes per block; the collectives carry "
                "32-bit words, so make it a multiple of 4 bytes (e.g. 4 uint8 or one uint32)")
        out.append(Entry(str(key), dtype, int(count), nbytes // 4))
    return tuple(out)


def block_bytes(fmt) -> int:
    """Bytes one block's payload takes on the wire."""
    return 4 * sum(e.words for e in payload_spec(fmt))


def bits_per_element(fmt) -> float:
    """Bits on the wire per element: ``8 · block_bytes / block``."""
    return 8.0 * block_bytes(fmt) / fmt.block


def _to_words(a, e: Entry):
    r, nb = a.shape[:2]
    if e.dtype.itemsize < 4:
        a = a.reshape(r, nb, e.words, 4 // e.dtype.itemsize)
    return jax.lax.bitcast_convert_type(a, _U32).reshape(r, nb * e.words)


def _from_words(w, e: Entry, nb: int):
    r = w.shape[0]
    a = jax.lax.bitcast_convert_type(w.reshape(r, nb, e.words), e.dtype)
    return a.reshape(r, nb, e.count)


def encode_checked(fmt, x, blocks: Blocks) -> dict[str, jax.Array]:
    """``fmt.encode_blocks(x, blocks)``, checked against ``fmt.payload()`` (one-line errors)."""
    spec = payload_spec(fmt)
    payload = fmt.encode_blocks(x, blocks)
    r, nb = x.shape[:2]
    if not isinstance(payload, Mapping) or set(payload) != {e.name for e in spec}:
        got = sorted(payload) if isinstance(payload, Mapping) else type(payload).__name__
        raise ValueError(f"{_fmt_name(fmt)}.encode_blocks returned {got}; return a dict with "
                         f"the entries of its payload(): {[e.name for e in spec]}")
    for e in spec:
        a = payload[e.name]
        if tuple(jnp.shape(a)) != (r, nb, e.count) or jnp.result_type(a) != e.dtype:
            raise ValueError(
                f"{_fmt_name(fmt)}.encode_blocks returned {e.name!r} as "
                f"{jnp.result_type(a)}{list(jnp.shape(a))}; its payload() declares {e.count} "
                f"{e.dtype} per block, so {e.dtype}{[r, nb, e.count]} for {r}x{nb} blocks")
    return dict(payload)


def decode_checked(fmt, payload, shape) -> jax.Array:
    """``fmt.decode_blocks(payload)``, checked to be float32 blocks of ``shape``."""
    y = fmt.decode_blocks(payload)
    if tuple(jnp.shape(y)) != tuple(shape) or not jnp.issubdtype(jnp.result_type(y), jnp.floating):
        raise ValueError(
            f"{_fmt_name(fmt)}.decode_blocks returned {jnp.result_type(y)}{list(jnp.shape(y))}; "
            f"return float32 values of the blocks, shape {list(shape)}")
    return y.astype(jnp.float32)


def reconstruct_checked(fmt, x, payload) -> jax.Array:
    """``fmt.reconstruct_blocks(x, payload)``, checked like :func:`decode_checked`."""
    y = fmt.reconstruct_blocks(x, payload)
    if tuple(jnp.shape(y)) != tuple(x.shape):
        raise ValueError(
            f"{_fmt_name(fmt)}.reconstruct_blocks returned shape {list(jnp.shape(y))}; "
            f"return the decoded blocks, shape {list(x.shape)}")
    return y.astype(jnp.float32)


def encode_rows(fmt, x, blocks: Blocks):
    """``(rows, payload)``: ``x`` (R, nb, block) encoded, as R rows of uint32 words.

    A row holds each payload entry's words for its ``nb`` blocks, entry after
    entry in the order of ``payload()``: ``nb · block_bytes / 4`` words.
    """
    payload = encode_checked(fmt, x, blocks)
    words = [_to_words(payload[e.name], e) for e in payload_spec(fmt)]
    rows = words[0] if len(words) == 1 else jnp.concatenate(words, axis=1)
    return rows, payload


def rows_payload(fmt, rows, nb: int) -> dict[str, jax.Array]:
    """The payload of rows of :func:`encode_rows` (entries of shape ``(R, nb, count)``)."""
    out, off = {}, 0
    for e in payload_spec(fmt):
        out[e.name] = _from_words(rows[:, off : off + nb * e.words], e, nb)
        off += nb * e.words
    return out


def decode_rows(fmt, rows, nb: int) -> jax.Array:
    """Rows of :func:`encode_rows` back to ``(R, nb, block)`` float32."""
    return decode_checked(fmt, rows_payload(fmt, rows, nb), (rows.shape[0], nb, fmt.block))
