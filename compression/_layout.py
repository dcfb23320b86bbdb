"""Flat layouts: a list of leaves as one padded float32 vector, and back."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class Layout:
    """Leaves of ``sizes`` elements, each padded to a multiple of ``align``,
    concatenated and padded to a multiple of ``align * groups``.

    Attributes:
      sizes: elements of each leaf.
      offsets: start of each leaf in the flat vector.
      total: length of the flat vector.
      align: per-leaf alignment (a block).
      groups: the total is split into this many equal chunks of whole blocks.
    """

    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int
    align: int
    groups: int

    def flatten(self, leaves) -> jax.Array:
        parts = []
        for x, size, nxt in zip(leaves, self.sizes, self._ends(), strict=True):
            flat = jnp.ravel(x).astype(jnp.float32)
            pad = nxt - size
            parts.append(jnp.pad(flat, (0, pad)) if pad else flat)
        used = self.offsets[-1] + round_up(self.sizes[-1], self.align) if self.sizes else 0
        if self.total > used:
            parts.append(jnp.zeros((self.total - used,), jnp.float32))
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    def unflatten(self, flat, shapes) -> list:
        return [
            jax.lax.slice(flat, (o,), (o + s,)).reshape(shape)
            for o, s, shape in zip(self.offsets, self.sizes, shapes, strict=True)
        ]

    def block_counts(self) -> np.ndarray:
        """Real (unpadded) elements in each ``align``-block of the flat vector (float32)."""
        counts = np.zeros(self.total // self.align if self.align else 0, np.float32)
        for o, s in zip(self.offsets, self.sizes, strict=True):
            first, full = o // self.align, s // self.align
            counts[first : first + full] = self.align
            if s % self.align:
                counts[first + full] = s % self.align
        return counts

    def _ends(self):
        return [round_up(s, self.align) for s in self.sizes]


def make_layout(sizes, align: int = 1, groups: int = 1) -> Layout:
    """A :class:`Layout` for leaves of ``sizes`` elements."""
    sizes = tuple(int(s) for s in sizes)
    offsets, o = [], 0
    for s in sizes:
        offsets.append(o)
        o += round_up(s, align)
    total = max(round_up(o, align * groups), align * groups) if sizes else 0
    return Layout(sizes, tuple(offsets), total, align, groups)


def prod(shape) -> int:
    return math.prod(int(d) for d in shape)


def bf16_bytes(size: int, n: int) -> float:
    """Bytes per device of a bf16 psum of ``size`` elements: ``4 d (N−1)/N``."""
    return 4.0 * size * (n - 1) / n if n > 1 else 0.0


def fp32_bytes(size: int, n: int) -> float:
    """Bytes per device of a float32 psum of ``size`` elements: ``8 d (N−1)/N``."""
    return 8.0 * size * (n - 1) / n if n > 1 else 0.0
