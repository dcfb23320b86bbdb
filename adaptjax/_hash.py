"""A counter-based integer hash: random numbers inside a fused pass, without threefry."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def hash32(x: jax.Array) -> jax.Array:
    """The ``lowbias32`` integer hash (C. Wellons), element-wise on uint32 (a bijection).

    ``hash32(iota ^ hash32(seed))`` gives well-mixed random bits in a few
    integer operations that XLA fuses into their consumer; a threefry stream
    instead compiles to loops of its own and, on CPU, costs more to compile and
    to run than the small computations that draw from it.

    Example:
      >>> import jax.numpy as jnp
      >>> from adaptjax._hash import hash32
      >>> [hex(int(v)) for v in hash32(jnp.arange(3, dtype=jnp.uint32))]
      ['0x0', '0x688990c0', '0xd1132181']
    """
    x = x.astype(jnp.uint32)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)
