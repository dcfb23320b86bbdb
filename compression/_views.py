"""Leaves as block views for a block codec's exchange, the same however they are bucketed.

A block codec's transport moves ``(n, nb, block)`` arrays, row ``r`` being the
blocks replica ``r`` owns. Every block belongs to one leaf, and which replica
owns it, its random stream and its real elements depend only on the leaf and
the lane (every leaf of the codec's lane at ``n`` replicas, :func:`lane_layout`),
never on the bucket the leaf travels in, so bucketing changes which collective
carries a block and nothing else:

* a leaf's longest prefix of whole ``n × block`` units is viewed in place as
  ``(n, cols, block)``: block ``(r, c)`` is elements ``[(r·cols + c)·block, …)``
  and replica ``r`` owns it (no copy of the float32 gradient: XLA's CPU backend
  runs a concatenation of float32 leaves at a tenth of copy speed);
* the rest of every leaf (all of it when the lane has at most ``BUCKET_MAX``
  elements, which then compiles as one view) is cut into blocks numbered in
  lane order, block ``g`` owned by replica ``g mod n``; a bucket's such blocks
  are consecutive, so they fill one *packed* view with at most ``n − 1`` empty
  slots at each end.

Example:
  >>> from adaptjax.compression._views import lane_layout
  >>> [tuple(x) for x in lane_layout([4096, 100], 2, 512, pack_all=False)]
  [(4096, 4, 0, 0, 0), (100, 0, 100, 0, 1)]
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from adaptjax.compression._blocks import Blocks

_U32 = jnp.uint32

# A lane of at most this many elements goes packed whole: each bucket's leaves
# are encoded as one view (traced once: compiles faster than a view per leaf).
BUCKET_MAX = 1 << 20


class LeafLayout(NamedTuple):
    """Where one leaf's blocks go (static: the lane and ``n`` decide it).

    Attributes:
      size: its elements.
      cols: columns of its in-place view ``(n, cols, block)`` (0: none).
      tail: its elements after that view, which go packed.
      first: its first packed block's number in the lane.
      blocks: its packed blocks, ``ceil(tail / block)``.
    """

    size: int
    cols: int
    tail: int
    first: int
    blocks: int


def lane_layout(sizes, n: int, block: int, pack_all: bool) -> list[LeafLayout]:
    """The :class:`LeafLayout` of each leaf of a lane, in lane order."""
    out, g = [], 0
    for d in sizes:
        d = int(d)
        cols = 0 if pack_all else d // (n * block)
        tail = d - cols * n * block
        nblk = -(-tail // block)
        out.append(LeafLayout(d, cols, tail, g, nblk))
        g += nblk
    return out


class View(NamedTuple):
    """One ``(n, nb, block)`` array of a bucket and what its blocks are.

    Attributes:
      x: the blocks.
      leaf: the bucket position of the leaf of every block: an int (an in-place
        view) or int32 ``(n, nb, 1)`` (the packed view).
      base: None (in place: block ``(r, c)`` starts at ``(r·nb + c)·block``) or
        uint32 ``(n, nb, 1)``: each block's first element in its leaf.
      count: None (every block full) or float32 ``(n, nb, 1)``: real elements (0: empty slot).
    """

    x: Any
    leaf: Any
    base: Any
    count: Any

    def blocks(self, seeds, block: int, row=0, rows: int | None = None) -> Blocks:
        """:class:`Blocks` of rows ``[row, row + rows)`` (``row`` may be traced).

        ``seeds`` holds one uint32 seed per leaf of the bucket.
        """
        n, nb = self.x.shape[:2]
        count_rows: int = n if rows is None else rows
        if self.base is None:
            shape = (count_rows, nb, 1)
            r = jax.lax.broadcasted_iota(_U32, shape, 0) + jnp.asarray(row, _U32)
            base = (r * _U32(nb) + jax.lax.broadcasted_iota(_U32, shape, 1)) * _U32(block)
            return Blocks(seeds[self.leaf], base, jnp.float32(block), block)
        take = (lambda a: a) if count_rows == n else (
            lambda a: jax.lax.dynamic_slice_in_dim(jnp.asarray(a), row, count_rows, 0))
        seed = jnp.stack(seeds)[take(self.leaf)]
        count = take(np.maximum(self.count, 1.0).astype(np.float32))
        return Blocks(seed, take(self.base), count, block)

    def real(self, block: int, row=0, rows: int = 1):
        """bool ``(rows, nb, block)``: the real elements of rows ``[row, row + rows)``, or None."""
        if self.count is None:
            return None
        count = jax.lax.dynamic_slice_in_dim(jnp.asarray(self.count), row, rows, 0)
        return jax.lax.iota(jnp.float32, block) < count


class Packing(NamedTuple):
    """The packed view of a bucket: its first column and empty slots in front.

    Attributes:
      col0: the lane column of its first column (block ``g`` sits in lane column ``g // n``).
      front: empty slots before the bucket's first block.
      ncol: its columns.
    """

    col0: int
    front: int
    ncol: int


def bucket_views(xs, lays: list[LeafLayout], n: int, block: int):
    """The views of a bucket's leaves ``xs`` (float32, lane order) laid out by ``lays``.

    Returns:
      ``(views, packing)``: the in-place views, then the packed one if any
      (:class:`View`), and its :class:`Packing` (or None).
    """
    views = []
    for j, (x, lay) in enumerate(zip(xs, lays, strict=True)):
        if lay.cols:
            flat = jnp.ravel(x)
            main = n * lay.cols * block
            main = flat if main == lay.size else flat[:main]
            views.append(View(main.reshape(n, lay.cols, block), j, None, None))
    packed = [(j, lay) for j, lay in enumerate(lays) if lay.blocks]
    if not packed:
        return views, None
    g0 = packed[0][1].first
    g1 = packed[-1][1].first + packed[-1][1].blocks
    col0 = g0 // n
    ncol = -(-g1 // n) - col0
    front = g0 - col0 * n
    parts = [jnp.zeros((front * block,), jnp.float32)] if front else []
    leaf = np.zeros((ncol * n,), np.int32)
    base = np.zeros((ncol * n,), np.uint32)
    count = np.zeros((ncol * n,), np.float32)
    for j, lay in packed:
        tail = jnp.ravel(xs[j])[lay.size - lay.tail :]
        pad = lay.blocks * block - lay.tail
        parts.append(jnp.pad(tail, (0, pad)) if pad else tail)
        slots = lay.first - col0 * n + np.arange(lay.blocks)
        leaf[slots] = j
        base[slots] = lay.size - lay.tail + block * np.arange(lay.blocks)
        count[slots] = np.minimum(block, lay.tail - block * np.arange(lay.blocks))
    back = ncol * n - (g1 - col0 * n)
    if back:
        parts.append(jnp.zeros((back * block,), jnp.float32))
    flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts)

    def by_owner(a):  # slot g - col0·n sits at row g mod n, column (g - col0·n) // n
        return np.ascontiguousarray(a.reshape(ncol, n).T)[:, :, None]

    x = flat.reshape(ncol, n, block).transpose(1, 0, 2)
    views.append(View(x, by_owner(leaf), by_owner(base), by_owner(count)))
    return views, Packing(col0, front, ncol)


def assemble(outs, xs, lays: list[LeafLayout], packing: Packing | None, block: int) -> list:
    """Leaves shaped like ``xs`` from the views' results ``outs`` (as :func:`bucket_views` made)."""
    n = outs[0].shape[0]
    mains = iter(outs)
    packed_flat = None
    if packing is not None:
        packed_flat = outs[-1].transpose(1, 0, 2).reshape(-1)
    res = []
    for x, lay in zip(xs, lays, strict=True):
        pieces = []
        if lay.cols:
            pieces.append(next(mains).reshape(-1))
        if lay.tail:
            # a leaf with a tail: bucket_views packed it, so packing and packed_flat exist
            assert packing is not None and packed_flat is not None
            start = (lay.first - packing.col0 * n) * block
            pieces.append(jax.lax.slice(packed_flat, (start,), (start + lay.tail,)))
        flat = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
        res.append(flat.reshape(jnp.shape(x)))
    return res
