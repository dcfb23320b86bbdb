"""Bit packing and counter-based random numbers for the codecs.

Codes of ``b`` bits (``1 <= b <= 8``) are packed into uint32 words: ``32/b``
codes per word when ``b`` divides 32, else bit planes (every 32 codes become
``b`` words, word ``j`` holding bit ``j`` of each). That is exactly ``b/8``
bytes per code for any ``b`` (no rounding up to 2 or 4 bits). Packing is one
fixed-shape, branch-free reduction that XLA fuses with the encoder; it works
on uint32 because XLA's CPU code for uint8 arithmetic is several times slower.

Random numbers come from a counter-based hash (``lowbias32``, C. Wellons) of
the element index and a 32-bit seed, so a codec draws its uniforms inside the
same fused pass instead of materialising a threefry stream (which costs more
than the codec itself on CPU). Seeds are mixed from (codec seed, step, replica,
stage) with the same hash.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from adaptjax._hash import hash32

__all__ = [
    "hash32",
    "mix_seed",
    "pack_bits",
    "pack_words",
    "uniform",
    "unpack_bits",
    "unpack_words",
]

_U32 = jnp.uint32


def mix_seed(*parts) -> jax.Array:
    """A uint32 scalar seed from integers (Python or traced), order-sensitive."""
    s = jnp.asarray(0x243F6A88, _U32)
    for p in parts:
        s = hash32(s ^ hash32(jnp.asarray(p).astype(_U32) + _U32(0x9E3779B9)))
    return s


def random_bits(seed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 random bits of ``shape`` for a uint32 scalar ``seed``."""
    size = int(np.prod(shape, dtype=np.int64))
    idx = jax.lax.iota(_U32, size).reshape(shape)
    return hash32(idx ^ hash32(seed))


def uniform(seed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 uniforms in ``[0, 1)`` with 24 random bits each."""
    bits = random_bits(seed, shape) >> 8
    return bits.astype(jnp.float32) * jnp.float32(2.0**-24)


def pack_words(codes: jax.Array, bits: int, extra=()):
    """Packs uint32 codes below ``2**bits`` into uint32 words along the last axis.

    The last axis (a multiple of 32) becomes ``L * bits // 32`` words. When
    ``bits`` divides 32, each word holds ``32 // bits`` consecutive codes, code
    ``e`` in bits ``[e*bits, (e+1)*bits)``; otherwise every 32 codes become
    ``bits`` words, word ``j`` holding bit ``j`` of the 32 codes (bit planes).
    ``extra`` holds ``(operand, init, op)`` reductions computed in the same pass
    over groups of the same shape (see ``compression._formats``).

    Returns:
      ``(words, extras)``.
    """
    bits = _check_bits(bits)
    *lead, n = codes.shape
    if n % 32:
        raise ValueError(f"packing needs a last axis divisible by 32, got {n}; pad the codes")
    codes = codes.astype(_U32)
    if 32 % bits == 0:
        per = 32 // bits
        c = codes.reshape(*lead, n // per, per)
        shifts = jnp.arange(per, dtype=_U32) * bits
        ops = [c << shifts]
        group = (*lead, n // per, per)
    else:
        c = codes.reshape(*lead, n // 32, 1, 32)
        shifts = jnp.arange(32, dtype=_U32)
        planes = jnp.arange(bits, dtype=_U32).reshape(bits, 1)
        ops = [((c >> planes) & 1) << shifts]
        group = (*lead, n // 32, bits, 32)
    extra = tuple(extra)
    ex_ops = [e[0].reshape(group) if e[0].size == np.prod(group) else e[0] for e in extra]
    inits = [_U32(0)] + [e[1] for e in extra]
    fns = [jnp.bitwise_or] + [e[2] for e in extra]

    def comp(a, b):
        return tuple(f(x, y) for f, x, y in zip(fns, a, b, strict=True))

    out = jax.lax.reduce(tuple(ops + ex_ops), tuple(inits), comp, (len(group) - 1,))
    return out[0].reshape(*lead, n * bits // 32), out[1:]


def unpack_words(words: jax.Array, bits: int) -> jax.Array:
    """Inverse of :func:`pack_words`: uint32 codes, last axis ``W * 32 // bits``."""
    bits = _check_bits(bits)
    *lead, m = words.shape
    if 32 % bits == 0:
        per = 32 // bits
        shifts = jnp.arange(per, dtype=_U32) * bits
        codes = (words[..., None] >> shifts) & _U32(2**bits - 1)
        return codes.reshape(*lead, m * per)
    if m % bits:
        raise ValueError(f"unpacking needs a last axis divisible by bits={bits}, got {m}")
    w = words.reshape(*lead, m // bits, bits, 1)
    shifts = jnp.arange(32, dtype=_U32)
    planes = jnp.arange(bits, dtype=_U32).reshape(bits, 1)
    codes = jnp.sum(((w >> shifts) & 1) << planes, axis=-2, dtype=_U32)
    return codes.reshape(*lead, m // bits * 32)


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
    """Packs unsigned codes below ``2**bits`` into ``codes.size * bits / 8`` bytes.

    Codes are packed into little-endian uint32 words (see the layout below), then
    viewed as bytes: exactly ``bits/8`` bytes per code for every ``bits``.

    Layout: when ``bits`` divides 32 (1, 2, 4, 8), a word holds ``32 // bits``
    consecutive codes, the first in the lowest bits; for 3, 5, 6 and 7 bits,
    every 32 codes become ``bits`` words, word ``j`` holding bit ``j`` of each
    code (code ``e`` in bit ``e``).

    Args:
      codes: integer array whose last axis length is a multiple of 32; every value
        must be below ``2**bits`` (higher bits are dropped).
      bits: bits per code, 1 to 8.

    Returns:
      uint8 array: the last axis ``L`` becomes ``L * bits // 8`` (other axes kept).

    Example:
      >>> import jax.numpy as jnp
      >>> from adaptjax.compression import pack_bits, unpack_bits
      >>> codes = jnp.array([1, 0, 1, 1] + [0] * 28, jnp.uint8)
      >>> pack_bits(codes, 1).tolist()          # code e in bit e
      [13, 0, 0, 0]
      >>> unpack_bits(pack_bits(codes, 1), 1).tolist() == codes.tolist()
      True
    """
    words, _ = pack_words(codes, bits)
    *lead, w = words.shape
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(*lead, w * 4)


def unpack_bits(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of :func:`pack_bits`: uint8 codes, last axis ``L * 8 // bits``.

    Example:
      >>> import jax.numpy as jnp
      >>> from adaptjax.compression import pack_bits, unpack_bits
      >>> codes = jnp.arange(32, dtype=jnp.uint8) % 3
      >>> bool((unpack_bits(pack_bits(codes, 2), 2) == codes).all())
      True
    """
    *lead, m = packed.shape
    if m % 4:
        raise ValueError(f"unpack_bits needs a last axis divisible by 4 bytes, got {m}")
    words = jax.lax.bitcast_convert_type(packed.reshape(*lead, m // 4, 4), _U32)
    return unpack_words(words, bits).astype(jnp.uint8)


def _check_bits(bits) -> int:
    if int(bits) != bits or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in [1, 8], got {bits}")
    return int(bits)
