"""The lanes a leaf travels by, and the records that carry one leaf through a sync.

A codec's ``sync`` describes every leaf of the gradient by a :class:`Leaf`
(what is known at trace time: its place, shape, lane, whether it keeps state),
hands each lane of :data:`LANES` the :class:`LeafIn` of all its leaves in one
call (one exchange per lane) and gets back one :class:`LeafOut` per leaf: the
mean, the residual (what this replica still owes) and new buffers.

A lane is a :class:`Lane` of two functions: ``reduce(codec, leaves, ctx)``, the
mean over replicas of its leaves, and ``bytes(codec, shape, n)``, what one leaf
costs per device per step (what :func:`adaptjax.compression.plan` prints). A
codec picks each leaf's lane with ``codec.method(shape, n)``:

=========  ===================================================  ====================
lane       leaves                                               bytes per device
=========  ===================================================  ====================
``f32``    under ``min_size``: one float32 psum, nothing owed   ``8d(N−1)/N``
``bf16``   the codec cannot take them, or would send more than  ``4d(N−1)/N``
           a bf16 psum: owner-compute bf16
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
from adaptjax.compression._collectives import BF16, owner_compute_leaves, psum_mean_leaves
from adaptjax.compression._layout import bf16_bytes, fp32_bytes, prod

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
    """

    names: tuple[str, ...]
    n: int
    step: jax.Array
    replica: jax.Array
    residual: bool
    seed: int

    def seed_for(self, stage: int, shared: bool = False):
        """A uint32 seed of ``stage`` at this step: per replica, or one for all (``shared``)."""
        if shared:
            return mix_seed(self.seed, self.step, 0x5EED, stage)
        return mix_seed(self.seed, self.step, self.replica, stage)


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
      offset: its first element in the concatenation of the leaves handed to the
        lane together (set by :func:`run_lanes`).
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
    """A way leaves travel: ``reduce(codec, leaves, ctx)`` and ``bytes(codec, shape, n)``."""

    reduce: Callable[[Any, Sequence[LeafIn], Ctx], list[LeafOut]]
    bytes: Callable[[Any, tuple[int, ...], int], float]


def _f32(codec, leaves: Sequence[LeafIn], ctx: Ctx) -> list[LeafOut]:
    """Leaves under ``min_size``: one float32 psum, nothing owed."""
    del codec
    return leaf_outs(psum_mean_leaves([i.x for i in leaves], ctx.names, ctx.n))


def _bf16(codec, leaves: Sequence[LeafIn], ctx: Ctx) -> list[LeafOut]:
    """Leaves the codec does not take: bf16 owner-compute (see ``owner_compute_leaves``)."""
    del codec
    outs, res = owner_compute_leaves(
        [i.x for i in leaves],
        BF16,
        names=ctx.names,
        n=ctx.n,
        seed_worker=ctx.seed_for(7),
        seed_server=ctx.seed_for(8),
        residual=ctx.residual,
        fold=ctx.residual,
    )
    return leaf_outs(outs, res if ctx.residual else None)


def _codec(codec, leaves: Sequence[LeafIn], ctx: Ctx) -> list[LeafOut]:
    """The codec's own leaves: its ``reduce``."""
    return codec.reduce(leaves, ctx)


LANES: Mapping[str, Lane] = types.MappingProxyType({
    "f32": Lane(_f32, lambda codec, shape, n: fp32_bytes(prod(shape), n)),
    "bf16": Lane(_bf16, lambda codec, shape, n: bf16_bytes(prod(shape), n)),
    "codec": Lane(_codec, lambda codec, shape, n: codec.leaf_bytes(shape, n)),
})


def run_lanes(codec, ins: Sequence[LeafIn], ctx: Ctx) -> list[LeafOut]:
    """Each lane of :data:`LANES` once, in the table's order, on all of its leaves.

    Args:
      codec: the codec (the ``codec`` lane calls its ``reduce``).
      ins: one :class:`LeafIn` per leaf, in leaf order.
      ctx: the sync's :class:`Ctx`.

    Returns:
      One :class:`LeafOut` per leaf of ``ins``, in the same order.
    """
    got: dict[int, LeafOut] = {}
    for name, lane in LANES.items():
        group, offset = [], 0
        for i in ins:
            if i.leaf.lane == name:
                group.append(i._replace(offset=offset))
                offset += i.leaf.size
        if group:
            outs = lane.reduce(codec, group, ctx)
            if len(outs) != len(group):
                raise ValueError(
                    f"the {name!r} lane of {codec!r} returned {len(outs)} results for "
                    f"{len(group)} leaves; return one LeafOut per leaf"
                )
            got.update((i.leaf.index, o) for i, o in zip(group, outs, strict=True))
    return [got[i.leaf.index] for i in ins]
