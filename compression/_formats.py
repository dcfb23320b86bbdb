"""The built-in block codecs' math, written to the block-codec protocol (:mod:`._blocks`).

Each class is a mixin of :class:`~adaptjax.compression._blocks.BlockFormat`
that reads its parameters from the codec it is mixed into (``block``, and
``dtype`` or ``levels``): ``payload``, ``encode_blocks``, ``decode_blocks``
and, where ``x`` makes it cheaper, ``reconstruct_blocks``. The codecs of
:mod:`adaptjax.compression._quantizers` are these mixins on
:class:`~adaptjax.compression.BlockCodec`, exactly as a user's codec is.

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
from adaptjax.compression._bits import pack_words, unpack_words
from adaptjax.compression._blocks import BlockFormat, Blocks

_U32 = jnp.uint32


def _bitcast(x, dtype):
    return jax.lax.bitcast_convert_type(x, dtype)


def _random24(blocks: Blocks):
    """Random integers in ``[0, 2^24)`` as float32 (exact), one per element.

    Converted through int32: x86 has vector int32 <-> float32 conversions but
    none for uint32, which XLA then emulates element by element.
    """
    return (blocks.bits() >> 8).astype(jnp.int32).astype(jnp.float32)


def _abs(x):
    # |x| through the bit pattern: the same value as jnp.abs, but a different
    # expression, so XLA does not share one materialised |x| between the block
    # statistic (a reduction) and the element-wise encoder (a full extra pass).
    return _bitcast(_bitcast(x, _U32) & _U32(0x7FFFFFFF), jnp.float32)


def _block_stat(x, reduce_fn):
    """A per-block statistic of (R, nb, B) in two cheap stages (32, then B/32): (R, nb, 1)."""
    r, nb, b = x.shape
    return reduce_fn(reduce_fn(x.reshape(r, nb, b // 32, 32), axis=-1), axis=-1)[..., None]


class CastBlocks(BlockFormat):
    """bfloat16 / float16 cast (``dtype``), sent as 16-bit patterns (no scales)."""

    dtype: str

    def payload(self):
        return {"codes": (jnp.uint16, self.block)}

    def _cast(self, x):
        if self.dtype == "float16":
            fmax = float(jnp.finfo(jnp.float16).max)
            x = jnp.clip(x, -fmax, fmax)  # saturate instead of overflowing to inf
        return x.astype(jnp.dtype(self.dtype))

    def encode_blocks(self, x, blocks):
        del blocks
        return {"codes": _bitcast(self._cast(x), jnp.uint16)}

    def reconstruct_blocks(self, x, payload):
        del payload
        return self._cast(x).astype(jnp.float32)

    def decode_blocks(self, payload):
        return _bitcast(payload["codes"], jnp.dtype(self.dtype)).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class CastFormat(CastBlocks):
    """A cast on its own (the bf16 lane of every codec): ``CastFormat(block, dtype)``."""

    block: int = 32
    dtype: str = "bfloat16"


#: The bf16 lane's format: blocks of 32 elements cast to bfloat16.
BF16 = CastFormat(32, "bfloat16")


class SignBlocks(BlockFormat):
    """1 bit per element (the sign) and one scale per block: ``mean |x|``.

    The scale minimises ``‖x − s·c‖²`` over ``s`` for codes ``c = ±1`` (EF-signSGD's
    ``‖x‖₁/d``, per block), the mean taken over the block's real elements only
    (``blocks.count``). A 1-bit code has no zero: an exact 0 decodes to ``+s``
    at even and ``−s`` at odd positions, so a run of zeros decodes to a sum of
    at most ``s`` instead of growing with its length (a block of zeros has
    ``s = 0`` and decodes to 0). Codes and the block ``|x|`` sums come from one pass.
    """

    def payload(self):
        return {"codes": (_U32, self.block // 32), "scales": (jnp.float32, 1)}

    def encode_blocks(self, x, blocks):
        code = 1 - self._negative(x)
        words, (part,) = pack_words(code, 1, extra=((jnp.abs(x), jnp.float32(0), jnp.add),))
        return {"codes": words, "scales": jnp.sum(part, axis=-1, keepdims=True) / blocks.count}

    @staticmethod
    def _negative(x):
        """The sign bit sent for each element (uint32 0/1): zeros alternate by position."""
        xb = _bitcast(x, _U32)
        pos = jax.lax.broadcasted_iota(_U32, x.shape, 2)
        return jnp.where((xb << 1) == 0, pos & 1, xb >> 31)

    def reconstruct_blocks(self, x, payload):
        s = _bitcast(payload["scales"], _U32)
        return _bitcast(s | (self._negative(x) << 31), jnp.float32)

    def decode_blocks(self, payload):
        # the code's complement is the float's sign bit (s >= 0): bit operations only
        code = unpack_words(payload["codes"], 1)
        s = _bitcast(payload["scales"], _U32)
        return _bitcast(s | ((code ^ 1) << 31), jnp.float32)


class TernaryBlocks(BlockFormat):
    """TernGrad: ``s·sign(x)·Bernoulli(|x|/s)``, ``s = max |x|`` per block; 2 bits."""

    unbiased = True

    def payload(self):
        return {"codes": (_U32, self.block // 16), "scales": (jnp.float32, 1)}

    def encode_blocks(self, x, blocks):
        s = _block_stat(jnp.abs(x), jnp.max)
        # keep with probability |x|/s: r < |x| 2^24/s for r uniform in [0, 2^24)
        inv = jnp.where(s > 0, jnp.float32(2.0**24) / jnp.where(s > 0, s, 1.0), 0.0)
        keep = _random24(blocks) < _abs(x) * inv
        code = keep.astype(_U32) * (1 + (_bitcast(x, _U32) >> 31))
        words, _ = pack_words(code, 2)
        return {"codes": words, "scales": s}

    def decode_blocks(self, payload):
        code = unpack_words(payload["codes"], 2)
        s = payload["scales"]
        return jnp.where(code == 1, s, jnp.where(code == 2, -s, 0.0))


def qsgd_bits(levels: int) -> int:
    """Fewest bits for the ``2 levels + 1`` QSGD codes."""
    return max(1, math.ceil(math.log2(2 * levels + 1)))


class LevelsBlocks(BlockFormat):
    """QSGD with ``levels`` levels: ``‖x‖·sign(x)·ξ/s``, ``ξ`` stochastic rounding.

    ``ξ = floor(s|x|/‖x‖ + u)`` with ``u`` uniform in ``[0, 1)`` rounds
    ``s|x|/‖x‖`` (``‖x‖`` the block's 2-norm) up with probability equal to its
    fractional part, so the code is unbiased. A code is the sign bit above the
    magnitude ``ξ`` in ``[0, s]``: ``1 + ceil(log2(s + 1))`` bits, which equals
    ``ceil(log2(2s + 1))``, the fewest that hold the ``2s + 1`` values.
    """

    levels: int
    unbiased = True

    @property
    def code_bits(self) -> int:
        return qsgd_bits(self.levels)

    def payload(self):
        return {"codes": (_U32, self.block * self.code_bits // 32), "scales": (jnp.float32, 1)}

    def encode_blocks(self, x, blocks):
        bits = self.code_bits
        norm = jnp.sqrt(_block_stat(x * x, jnp.sum))
        inv = jnp.where(norm > 0, self.levels / jnp.where(norm > 0, norm, 1.0), 0.0)
        u = _random24(blocks) * jnp.float32(2.0**-24)
        xi = jnp.minimum((_abs(x) * inv + u).astype(jnp.int32), self.levels)
        code = ((_bitcast(x, _U32) >> 31) << (bits - 1)) | xi.astype(_U32)
        words, _ = pack_words(code, bits)
        return {"codes": words, "scales": norm}

    def decode_blocks(self, payload):
        bits = self.code_bits
        code = unpack_words(payload["codes"], bits)
        mag = (code & _U32(2 ** (bits - 1) - 1)).astype(jnp.int32).astype(jnp.float32)
        val = mag * (payload["scales"] / self.levels)
        # the sign bit of the code becomes the float's sign bit
        return _bitcast(_bitcast(val, _U32) | ((code >> (bits - 1)) << 31), jnp.float32)


class NaturalBlocks(BlockFormat):
    """Natural compression: stochastic rounding to a signed power of two; 8 bits.

    ``|x| = 2^e (1 + f)`` is sent as ``2^e`` with probability ``1 − f`` and
    ``2^(e+1)`` with probability ``f`` (unbiased). The f32 exponent's
    fractional part ``f`` is the mantissa, so the rounding is exact integer
    work on the bit pattern. The code is the sign bit and a 7-bit exponent
    relative to the block's largest one (the scale slot holds that reference):
    values more than 2^126 below the block maximum, and subnormals, are
    flushed to zero.
    """

    unbiased = True

    def payload(self):
        return {"codes": (_U32, self.block // 4), "scales": (jnp.float32, 1)}

    def encode_blocks(self, x, blocks):
        xb = _bitcast(x, _U32)
        e = ((xb >> 23) & 0xFF).astype(jnp.int32)
        # the exponent is monotone in |x|: the block's largest is that of max |x|
        big = _bitcast(_block_stat(jnp.abs(x), jnp.max), _U32)
        ref = ((big >> 23) & 0xFF).astype(jnp.int32) + 1  # the largest a rounding can reach
        mant = xb & _U32(0x7FFFFF)
        up = (blocks.bits() >> 9) < mant
        c = e + up.astype(jnp.int32) - ref + 127
        c = jnp.where((e > 0) & (c > 0), c, 0).astype(_U32)
        code = ((xb >> 31) << 7) | c
        words, _ = pack_words(code, 8)
        return {"codes": words, "scales": ref.astype(jnp.float32)}

    def decode_blocks(self, payload):
        code = unpack_words(payload["codes"], 8)
        c = (code & 127).astype(jnp.int32)
        e = c + (payload["scales"].astype(jnp.int32) - 127)
        bits = ((code >> 7) << 31) | (e.astype(_U32) << 23)
        return jnp.where((c > 0) & (e > 0), _bitcast(bits, jnp.float32), 0.0)
