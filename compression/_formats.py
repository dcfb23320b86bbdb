"""Element formats: how blocks of float32 values become words on the wire, and back.

A format encodes an array ``X`` of shape ``(R, nb, B)`` -- ``R`` rows (one per
destination of an all-to-all), ``nb`` blocks of ``B`` elements per row (``B`` a
multiple of 32) -- into ``R`` rows of uint32 words, and decodes them back. A row
holds the packed codes of its blocks, then one float32 scale per block (formats
without scales skip them), so its size is fixed at trace time::

    row_bytes = nb * B * bits / 8 + nb * 4 * has_scale

Encoders compute their codes in uint32 arithmetic and pack them with one
reduction (:func:`adaptjax.compression._bits.pack_words`), which also yields
partial block statistics when the codes do not depend on them (sign); formats
whose codes depend on a block statistic (max, norm) take one extra read pass.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from adaptjax.compression._bits import pack_words, random_bits, unpack_words

_U32 = jnp.uint32


def _bitcast(x, dtype):
    return jax.lax.bitcast_convert_type(x, dtype)


def _random24(seed, shape):
    """Random integers in ``[0, 2^24)`` as float32 (exact).

    Converted through int32: x86 has vector int32 <-> float32 conversions but
    none for uint32, which XLA then emulates element by element.
    """
    return (random_bits(seed, shape) >> 8).astype(jnp.int32).astype(jnp.float32)


def _abs(x):
    # |x| through the bit pattern: the same value as jnp.abs, but a different
    # expression, so XLA does not share one materialised |x| between the block
    # statistic (a reduction) and the element-wise encoder (a full extra pass).
    return _bitcast(_bitcast(x, _U32) & _U32(0x7FFFFFFF), jnp.float32)


def _block_stat(x, reduce_fn):
    """A per-block statistic of (R, nb, B) in two cheap stages (32, then B/32)."""
    r, nb, b = x.shape
    return reduce_fn(reduce_fn(x.reshape(r, nb, b // 32, 32), axis=-1), axis=-1)


@dataclasses.dataclass(frozen=True)
class Format:
    """Base: ``bits`` per code, ``block`` elements per scale, ``has_scale``."""

    bits: int
    block: int
    has_scale: bool = True

    @property
    def bits_per_element(self) -> float:
        return self.bits + (32.0 / self.block if self.has_scale else 0.0)

    # -- to implement on (R, nb, B) float32: (words (R, nb, B*bits/32) uint32, scales (R, nb))
    def encode_words(self, x, seed, valid=None):
        """``valid``: real (unpadded) elements per block, broadcastable to (R, nb)."""
        raise NotImplementedError

    def decode_words(self, words, scales):
        raise NotImplementedError

    def encode(self, x: jax.Array, seed, valid=None) -> jax.Array:
        """(R, nb, B) float32 -> (R, row_words) uint32.

        ``valid`` (optional, broadcastable to ``(R, nb)``): real elements per block;
        the rest of a block is zero padding that a mean-based scale must not count.
        """
        r, nb, _ = x.shape
        words, scales = self.encode_words(x, seed, valid)
        rows = words.reshape(r, -1)
        if self.has_scale:
            rows = jnp.concatenate([rows, _bitcast(scales.astype(jnp.float32), _U32)], axis=1)
        return rows

    def reconstruct(self, x: jax.Array, rows: jax.Array) -> jax.Array:
        """``decode(rows)`` for ``rows = encode(x, ...)``, given ``x`` (R, nb, B) too.

        The sender's own view of what it sent, for its error-feedback residual.
        Formats whose decoded value follows from ``x`` and the block scale alone
        override this to skip unpacking the codes (a full pass that XLA's CPU
        backend runs several times slower than a copy).
        """
        return self.decode(rows, x.shape[1])

    def _scales(self, rows: jax.Array, nb: int) -> jax.Array:
        ncode = nb * self.block * self.bits // 32
        return _bitcast(rows[:, ncode:], jnp.float32)

    def decode(self, rows: jax.Array, nb: int) -> jax.Array:
        """(R, row_words) uint32 -> (R, nb, B) float32."""
        r = rows.shape[0]
        ncode = nb * self.block * self.bits // 32
        words = rows[:, :ncode].reshape(r, nb, -1)
        scales = _bitcast(rows[:, ncode:], jnp.float32) if self.has_scale else None
        return self.decode_words(words, scales)


@dataclasses.dataclass(frozen=True)
class Cast(Format):
    """bfloat16 / float16 cast, sent as 16-bit patterns two per word (no scales)."""

    dtype: str = "bfloat16"

    def encode_words(self, x, seed, valid=None):
        del seed, valid
        y = x
        if self.dtype == "float16":
            fmax = float(jnp.finfo(jnp.float16).max)
            y = jnp.clip(x, -fmax, fmax)  # saturate instead of overflowing to inf
        h = _bitcast(y.astype(jnp.dtype(self.dtype)), jnp.uint16)
        r, nb, b = x.shape
        return _bitcast(h.reshape(r, nb, b // 2, 2), _U32), None

    def reconstruct(self, x, rows):
        del rows
        y = x
        if self.dtype == "float16":
            fmax = float(jnp.finfo(jnp.float16).max)
            y = jnp.clip(x, -fmax, fmax)
        return y.astype(jnp.dtype(self.dtype)).astype(jnp.float32)

    def decode_words(self, words, scales):
        del scales
        r, nb, w = words.shape
        h = _bitcast(words, jnp.uint16).reshape(r, nb, 2 * w)
        return _bitcast(h, jnp.dtype(self.dtype)).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Sign(Format):
    """1 bit per element (the sign) and one scale per block: ``mean |x|``.

    The scale minimises ``‖x − s·c‖²`` over ``s`` for codes ``c = ±1`` (EF-signSGD's
    ``‖x‖₁/d``, per block), the mean taken over the block's real elements only
    (``valid``; zero padding of a last partial block does not dilute it). A 1-bit
    code has no zero: an exact 0 decodes to ``+s`` at even and ``−s`` at odd
    positions, so a run of zeros decodes to a sum of at most ``s`` instead of
    growing with its length (a block of zeros has ``s = 0`` and decodes to 0).
    Codes and the block ``|x|`` sums come from one pass.
    """

    def encode_words(self, x, seed, valid=None):
        del seed
        pos = jax.lax.broadcasted_iota(_U32, x.shape, 2)
        # sign bit of x; for ±0 the parity of the position (alternating +s, −s)
        code = 1 - self._negative(x)
        a = jnp.abs(x)
        if valid is None:
            count = jnp.float32(self.block)
        else:  # padding (which may hold decoded ±s from an earlier stage) is not counted
            valid = jnp.broadcast_to(valid, x.shape[:2])
            a = jnp.where(pos < valid.astype(_U32)[:, :, None], a, 0.0)
            count = jnp.maximum(valid, 1.0)
        words, (part,) = pack_words(code, 1, extra=((a, jnp.float32(0), jnp.add),))
        return words, jnp.sum(part, axis=-1) / count

    @staticmethod
    def _negative(x):
        """The sign bit sent for each element (uint32 0/1): zeros alternate by position."""
        xb = _bitcast(x, _U32)
        pos = jax.lax.broadcasted_iota(_U32, x.shape, 2)
        return jnp.where((xb << 1) == 0, pos & 1, xb >> 31)

    def reconstruct(self, x, rows):
        s = _bitcast(self._scales(rows, x.shape[1]), _U32)[:, :, None]
        return _bitcast(s | (self._negative(x) << 31), jnp.float32)

    def decode_words(self, words, scales):
        # the code's complement is the float's sign bit (s >= 0): bit operations only
        code = unpack_words(words, 1)
        s = _bitcast(scales, _U32)[:, :, None]
        return _bitcast(s | ((code ^ 1) << 31), jnp.float32)


@dataclasses.dataclass(frozen=True)
class Ternary(Format):
    """TernGrad: ``s·sign(x)·Bernoulli(|x|/s)``, ``s = max |x|`` per block; 2 bits."""

    def encode_words(self, x, seed, valid=None):
        del valid  # a max or a norm does not see zero padding
        s = _block_stat(jnp.abs(x), jnp.max)
        # keep with probability |x|/s: r < |x| 2^24/s for r uniform in [0, 2^24)
        inv = jnp.where(s > 0, jnp.float32(2.0**24) / jnp.where(s > 0, s, 1.0), 0.0)
        keep = _random24(seed, x.shape) < _abs(x) * inv[:, :, None]
        code = keep.astype(_U32) * (1 + (_bitcast(x, _U32) >> 31))
        words, _ = pack_words(code, 2)
        return words, s

    def decode_words(self, words, scales):
        code = unpack_words(words, 2)
        s = scales[:, :, None]
        return jnp.where(code == 1, s, jnp.where(code == 2, -s, 0.0))


@dataclasses.dataclass(frozen=True)
class Levels(Format):
    """QSGD with ``levels`` levels: ``‖x‖·sign(x)·ξ/s``, ``ξ`` stochastic rounding.

    ``ξ = floor(s|x|/‖x‖ + u)`` with ``u`` uniform in ``[0, 1)`` rounds
    ``s|x|/‖x‖`` (``‖x‖`` the block's 2-norm) up with probability equal to its
    fractional part, so the code is unbiased. A code is the sign bit above the
    magnitude ``ξ`` in ``[0, s]``: ``1 + ceil(log2(s + 1))`` bits, which equals
    ``ceil(log2(2s + 1))``, the fewest that hold the ``2s + 1`` values.
    """

    levels: int = 7

    def encode_words(self, x, seed, valid=None):
        del valid  # a max or a norm does not see zero padding
        norm = jnp.sqrt(_block_stat(x * x, jnp.sum))
        inv = jnp.where(norm > 0, self.levels / jnp.where(norm > 0, norm, 1.0), 0.0)
        u = _random24(seed, x.shape) * jnp.float32(2.0**-24)
        xi = jnp.minimum((_abs(x) * inv[:, :, None] + u).astype(jnp.int32), self.levels)
        code = ((_bitcast(x, _U32) >> 31) << (self.bits - 1)) | xi.astype(_U32)
        words, _ = pack_words(code, self.bits)
        return words, norm

    def decode_words(self, words, scales):
        code = unpack_words(words, self.bits)
        mag = (code & _U32(2 ** (self.bits - 1) - 1)).astype(jnp.int32).astype(jnp.float32)
        val = mag * (scales / self.levels)[:, :, None]
        # the sign bit of the code becomes the float's sign bit
        return _bitcast(_bitcast(val, _U32) | ((code >> (self.bits - 1)) << 31), jnp.float32)


@dataclasses.dataclass(frozen=True)
class Natural(Format):
    """Natural compression: stochastic rounding to a signed power of two; 8 bits.

    ``|x| = 2^e (1 + f)`` is sent as ``2^e`` with probability ``1 − f`` and
    ``2^(e+1)`` with probability ``f`` (unbiased). The f32 exponent's
    fractional part ``f`` is the mantissa, so the rounding is exact integer
    work on the bit pattern. The code is the sign bit and a 7-bit exponent
    relative to the block's largest one (the scale slot holds that reference):
    values more than 2^126 below the block maximum, and subnormals, are
    flushed to zero.
    """

    def encode_words(self, x, seed, valid=None):
        del valid  # a max or a norm does not see zero padding
        xb = _bitcast(x, _U32)
        e = ((xb >> 23) & 0xFF).astype(jnp.int32)
        # the exponent is monotone in |x|: the block's largest is that of max |x|
        big = _bitcast(_block_stat(jnp.abs(x), jnp.max), _U32)
        ref = ((big >> 23) & 0xFF).astype(jnp.int32) + 1  # the largest a rounding can reach
        mant = xb & _U32(0x7FFFFF)
        up = (random_bits(seed, x.shape) >> 9) < mant
        c = e + up.astype(jnp.int32) - ref[:, :, None] + 127
        c = jnp.where((e > 0) & (c > 0), c, 0).astype(_U32)
        code = ((xb >> 31) << 7) | c
        words, _ = pack_words(code, 8)
        return words, ref.astype(jnp.float32)

    def decode_words(self, words, scales):
        code = unpack_words(words, 8)
        c = (code & 127).astype(jnp.int32)
        e = c + (scales.astype(jnp.int32) - 127)[:, :, None]
        bits = ((code >> 7) << 31) | (e.astype(_U32) << 23)
        return jnp.where((c > 0) & (e > 0), _bitcast(bits, jnp.float32), 0.0)


def qsgd_bits(levels: int) -> int:
    """Fewest bits for the ``2 levels + 1`` QSGD codes."""
    return max(1, math.ceil(math.log2(2 * levels + 1)))
