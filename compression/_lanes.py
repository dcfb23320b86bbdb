"""The lanes a leaf travels by, its bucket, and the records that carry one leaf through a sync.

A codec's ``sync`` describes every leaf of the gradient by a :class:`Leaf`
(what is known at trace time: its place, shape, lane, whether it keeps state),
groups each lane's leaves into buckets (:func:`lane_buckets`), hands each
bucket to its lane of :data:`LANES` in one call (one exchange per bucket) and
gets back one :class:`LeafOut` per leaf: the mean, the residual (what this
replica still owes) and new buffers.

Buckets (CaSync; PyTorch DDP's buckets): a lane's leaves are taken in
*reverse* order of the gradient's leaves -- the usual proxy for the order in
which the backward pass produces them, as in DDP (for a model whose
parameters are listed from input to output) -- and fused into buckets of at
most ``codec.bucket_bytes`` bytes of float32 gradient; a leaf larger than that
is a bucket of its own (leaves are never split). Each bucket's encode,
collective and decode read only that bucket's gradients, so XLA can schedule
the first bucket's collective while the backward pass still computes the
rest. ``bucket_bytes=None`` makes each lane one bucket. What a leaf's
replicas receive does not depend on its bucket (seeds and block owners are a
leaf's own), only which collective carries it.

A lane is a :class:`Lane`: ``reduce(codec, leaves, ctx)``, the mean over
replicas of one bucket; ``bytes(codec, shape, n, transport)``, what one leaf
costs per device per step under the transport of its bucket (what
:func:`adaptjax.compression.plan` prints); and ``transport(codec, sizes, n)``,
that transport (None where there is no choice). A codec picks each leaf's lane
with ``codec.method(shape, n)``:

=========  ===================================================  ====================
lane       leaves                                               bytes per device
=========  ===================================================  ====================
``f32``    under ``min_size``: one float32 psum, nothing owed   ``8d(N−1)/N``
``bf16``   the codec cannot take them, or would send more than  ``≈4d(N−1)/N``
           a bf16 psum: bf16 blocks, owner-compute or all-gather
``codec``  the rest: the codec's own ``reduce``                 ``codec.leaf_bytes``
=========  ===================================================  ====================
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
from adaptjax.compression._bits import mix_seed
from adaptjax.compression._blocks import block_bytes
from adaptjax.compression._collectives import psum_mean_leaves
from adaptjax.compression._exchange import bucket_transport, reduce_blocks
from adaptjax.compression._formats import BF16
from adaptjax.compression._layout import fp32_bytes, prod

_NONE: Mapping[str, Any] = types.MappingProxyType({})


@dataclasses.dataclass
class Ctx:
    """What one ``sync`` call knows at trace time (and a few traced scalars).

    Attributes:
      names: the bound axes the mean is taken over.
      n: their size (the replica count).
      step: the int32 step counter (traced).
      replica: this replica's index along ``names`` (traced).
      residual: whether the lanes must return residuals (the feedback rule needs them).
      seed: the codec's seed.
      lane: every leaf of the lane a bucket belongs to, in lane order (set by
        :func:`run_lanes`): what a leaf's layout may depend on, never its bucket.
    """

    names: tuple[str, ...]
    n: int
    step: jax.Array
    replica: jax.Array
    residual: bool
    seed: int
    lane: tuple = ()

    def seed_for(self, stage: int, shared: bool = False, leaf: int | None = None):
        """A uint32 seed of ``stage`` at this step: per replica, or one for all (``shared``).

        With ``leaf`` (a :attr:`Leaf.index`) the seed is that leaf's own, so
        its random numbers do not depend on the leaves it travels with.
        """
        who = 0x5EED if shared else self.replica
        if leaf is None:
            return mix_seed(self.seed, self.step, who, stage)
        return mix_seed(self.seed, self.step, who, stage, leaf)


class Leaf(NamedTuple):
    """One leaf of the gradient as a codec sees it at trace time (see :func:`leaf_plan`).

    Attributes:
      index: its place among the flattened leaves.
      path: its key path (``"['w']"``, or ``"the root"``).
      shape: its shape.
      lane: the key of its lane in :data:`LANES`.
      stateful: whether the codec keeps buffers for it (at least ``min_size`` elements).
    """

    index: int
    path: str
    shape: tuple[int, ...]
    lane: str
    stateful: bool

    @property
    def size(self) -> int:
        return prod(self.shape)


class LeafIn(NamedTuple):
    """What a lane gets for one leaf.

    Attributes:
      leaf: the leaf's :class:`Leaf`.
      x: what this replica sends of it (float32; the feedback rule's input).
      server: its server-side residual (a codec with ``has_server_buffer``), else None.
      shared: its replicated buffers (PowerSGD's ``"p"`` and ``"q"``, EF21's ``"ghat"``).
      offset: its first element in the concatenation of the leaves of its
        bucket (set by :func:`run_lanes`).
    """

    leaf: Leaf
    x: jax.Array
    server: jax.Array | None = None
    shared: Mapping[str, Any] = _NONE
    offset: int = 0


class LeafOut(NamedTuple):
    """What a lane returns for one leaf.

    Attributes:
      out: the mean over replicas (float32, the same on every replica).
      residual: ``x − C(x)``, what this replica still owes, when ``ctx.residual``
        (the mean over replicas of the residuals is what the mean lost); else None.
      server: the new server-side residual, or None (keep the old one).
      shared: new replicated buffers, merged over the old ones.
    """

    out: jax.Array
    residual: jax.Array | None = None
    server: jax.Array | None = None
    shared: Mapping[str, Any] = _NONE


def leaf_outs(outs, residuals=None, servers=None, shared=None) -> list[LeafOut]:
    """One :class:`LeafOut` per leaf from a lane's lists (``shared``: a dict of lists)."""
    none = [None] * len(outs)
    shared = shared or {}
    return [
        LeafOut(o, r, s, {k: v[i] for k, v in shared.items()})
        for i, (o, r, s) in enumerate(
            zip(outs, none if residuals is None else residuals,
                none if servers is None else servers, strict=True)
        )
    ]


class Lane(NamedTuple):
    """A way leaves travel (see the module docstring)."""

    reduce: Callable[[Any, Sequence[LeafIn], Ctx], list[LeafOut]]
    bytes: Callable[[Any, tuple[int, ...], int, str | None], float]
    transport: Callable[[Any, Sequence[int], int], str | None] = lambda codec, sizes, n: None


def block_leaf_bytes(fmt, size: int, n: int, transport: str = "owner") -> float:
    """Bytes per device for one leaf of ``size`` elements of a block codec ``fmt``.

    One replica's encoded leaf is ``E = ceil(size / block) · block_bytes``;
    owner-compute sends ``2(N−1)/N · E``, the all-gather ``(N−1) · E``.
    """
    if n <= 1:
        return 0.0
    e = -(-int(size) // fmt.block) * block_bytes(fmt)
    return (n - 1) * e if transport == "allgather" else 2.0 * (n - 1) / n * e


def _f32(codec, leaves: Sequence[LeafIn], ctx: Ctx) -> list[LeafOut]:
    """Leaves under ``min_size``: one float32 psum, nothing owed."""
    del codec
    return leaf_outs(psum_mean_leaves([i.x for i in leaves], ctx.names, ctx.n))


def _bf16(codec, leaves: Sequence[LeafIn], ctx: Ctx) -> list[LeafOut]:
    """Leaves the codec does not take: bf16 blocks (owner-compute or all-gather)."""
    del codec
    return leaf_outs(*reduce_blocks(BF16, leaves, ctx, stages=(7, 8)))


def _codec(codec, leaves: Sequence[LeafIn], ctx: Ctx) -> list[LeafOut]:
    """The codec's own leaves: its ``reduce``."""
    return codec.reduce(leaves, ctx)


def _codec_bytes(codec, shape, n, transport):
    if transport is None:
        return codec.leaf_bytes(shape, n)
    return codec.leaf_bytes(shape, n, transport=transport)


def _codec_transport(codec, sizes, n):
    choose = getattr(codec, "bucket_transport", None)
    return None if choose is None else choose(sizes, n)


LANES: Mapping[str, Lane] = types.MappingProxyType({
    "f32": Lane(_f32, lambda codec, shape, n, transport: fp32_bytes(prod(shape), n)),
    "bf16": Lane(_bf16, lambda codec, shape, n, transport: block_leaf_bytes(
        BF16, prod(shape), n, transport), lambda codec, sizes, n: bucket_transport(
            BF16, sizes, n, None)),
    "codec": Lane(_codec, _codec_bytes, _codec_transport),
})


def bucket_leaves(sizes: Sequence[int], bucket_bytes: int | None) -> list[list[int]]:
    """Positions of leaves of ``sizes`` elements (in order) fused into buckets.

    A bucket holds at most ``bucket_bytes`` bytes of float32 gradient
    (``4·size`` per leaf); a larger leaf is a bucket of its own; ``None``: one bucket.

    Example:
      >>> from adaptjax.compression._lanes import bucket_leaves
      >>> bucket_leaves([100, 100, 900, 50], 800)
      [[0, 1], [2], [3]]
    """
    if bucket_bytes is None:
        return [list(range(len(sizes)))] if len(sizes) else []
    out: list[list[int]] = []
    cur: list[int] = []
    fill = 0
    for j, d in enumerate(sizes):
        b = 4 * int(d)
        if cur and fill + b > bucket_bytes:
            out.append(cur)
            cur, fill = [], 0
        cur.append(j)
        fill += b
    if cur:
        out.append(cur)
    return out


class Bucket(NamedTuple):
    """One exchange of a sync: its lane, its leaves (lane order) and its transport."""

    lane: str
    leaves: tuple[Leaf, ...]
    transport: str | None


def lane_buckets(codec, records: Sequence[Leaf], n: int) -> list[Bucket]:
    """The buckets of a sync at ``n`` replicas, lane by lane (the order of :data:`LANES`).

    Each lane's leaves are taken in reverse leaf order (see the module
    docstring) and fused by :func:`bucket_leaves` with ``codec.bucket_bytes``.
    """
    out = []
    for name, lane in LANES.items():
        group = tuple(r for r in reversed(records) if r.lane == name)
        for pos in bucket_leaves([r.size for r in group], getattr(codec, "bucket_bytes", None)):
            leaves = tuple(group[j] for j in pos)
            out.append(Bucket(name, leaves, lane.transport(codec, [r.size for r in leaves], n)))
    return out


def run_lanes(codec, ins: Sequence[LeafIn], ctx: Ctx) -> list[LeafOut]:
    """Each bucket of :func:`lane_buckets` through its lane of :data:`LANES`.

    Args:
      codec: the codec (the ``codec`` lane calls its ``reduce``).
      ins: one :class:`LeafIn` per leaf, in leaf order.
      ctx: the sync's :class:`Ctx`.

    Returns:
      One :class:`LeafOut` per leaf of ``ins``, in the same order.
    """
    by_index = {i.leaf.index: i for i in ins}
    buckets = lane_buckets(codec, [i.leaf for i in ins], ctx.n)
    lanes: dict[str, list[Leaf]] = {}
    for b in buckets:
        lanes.setdefault(b.lane, []).extend(b.leaves)
    got: dict[int, LeafOut] = {}
    for b in buckets:
        group, offset = [], 0
        for leaf in b.leaves:
            group.append(by_index[leaf.index]._replace(offset=offset))
            offset += leaf.size
        lane_ctx = dataclasses.replace(ctx, lane=tuple(lanes[b.lane]))
        outs = LANES[b.lane].reduce(codec, group, lane_ctx)
        if len(outs) != len(group):
            raise ValueError(
                f"the {b.lane!r} lane of {codec!r} returned {len(outs)} results for "
                f"{len(group)} leaves; return one LeafOut per leaf"
            )
        got.update((i.leaf.index, o) for i, o in zip(group, outs, strict=True))
    return [got[i.leaf.index] for i in ins]
