"""The transports of a block codec's payload: owner-compute, all-gather, and two-level.

One call of :func:`reduce_blocks` averages one bucket of leaves (their block
views, :mod:`._views`) in one exchange:

* ``"owner"``: each replica encodes its views; one all-to-all hands replica
  ``r`` row ``r`` of every replica's views; it decodes and averages them,
  re-encodes the mean, and one all-gather returns every owner's rows. Bytes
  per device: ``2 (N−1)/N`` of one encoded copy of the bucket. With error
  feedback, ``N`` times the owner's re-encoding error joins its own residual
  on the rows it owns, so ``mean_i(x_i) = mean + mean_i(residual_i)``.
* ``"allgather"``: one all-gather of every replica's encoded rows; every
  replica decodes and averages all of them: ``(N−1)`` encoded copies per
  device, one collective, nothing re-encoded.
* two-level (``fast`` axes): bf16 reduce-scatter over the fast axes (as uint16
  through an all-to-all), owner-compute of each fast chunk over the slow
  axes, bf16 all-gather over the fast axes.

:func:`choose_transport` picks the transport of a bucket by the time
:class:`TransportModel` predicts for it. Narrow payloads always travel as
integers (XLA on CPU widens a narrow float all-reduce to f32).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from adaptjax.compression._blocks import (
    block_bytes,
    decode_rows,
    encode_rows,
    reconstruct_checked,
)
from adaptjax.compression._collectives import (
    a2a,
    axis_tuple,
    bound_size,
    gather,
    replica_index,
    sum_decoded,
)
from adaptjax.compression._views import BUCKET_MAX, assemble, bucket_views, lane_layout

TRANSPORTS = ("owner", "allgather")


@dataclasses.dataclass(frozen=True)
class TransportModel:
    """Predicted seconds of one bucket's exchange: latency, bytes and codec passes.

    ``α`` per collective, ``β`` per byte a device sends, ``γ`` per element
    encoded or decoded. Owner-compute: 2 collectives, ``2(N−1)/N·E`` bytes, and
    ``3 + 1/N`` passes (encode, decode ``N`` rows of ``1/N``, re-encode ``1/N``,
    decode); all-gather: 1 collective, ``(N−1)·E`` bytes, ``1 + N`` passes.
    The defaults are of gloo over a 1 Gbit/s link on a CPU core.

    Example:
      >>> from adaptjax.compression._exchange import TransportModel
      >>> m = TransportModel()
      >>> m.time("allgather", 2, 1e6, 8e6) < m.time("owner", 2, 1e6, 8e6)
      True
    """

    alpha: float = 1e-4
    beta: float = 8e-9
    gamma: float = 1e-9

    def time(self, transport: str, n: int, encoded: float, elements: float) -> float:
        if n <= 1:
            return 0.0
        if transport == "allgather":
            return self.alpha + (n - 1) * encoded * self.beta + (1 + n) * elements * self.gamma
        return 2 * self.alpha + 2 * (n - 1) / n * encoded * self.beta + (
            3 + 1 / n) * elements * self.gamma


def choose_transport(n: int, encoded: float = 0.0, elements: float = 0.0,
                     model: TransportModel = TransportModel()) -> str:
    """The transport with the least predicted time for one bucket (ties: owner-compute).

    Args:
      n: replicas.
      encoded: one replica's encoded bucket, bytes.
      elements: the bucket's elements.
      model: the :class:`TransportModel`.

    At 2 replicas the two send the same bytes and the all-gather needs one
    collective and fewer passes; from 4 on the all-gather sends ``N/2`` times
    the bytes and decodes every replica's copy, so it wins only for a tiny bucket.

    Example:
      >>> from adaptjax.compression._exchange import choose_transport
      >>> [choose_transport(n, 1e6, 8e6) for n in (2, 4)], choose_transport(8, 64, 512)
      (['allgather', 'owner'], 'allgather')
    """
    times = {t: model.time(t, n, encoded, elements) for t in TRANSPORTS}
    return min(TRANSPORTS, key=lambda t: (times[t], t != "owner"))


def bucket_transport(fmt, sizes, n: int, transport: str | None) -> str:
    """The transport of a bucket of leaves of ``sizes`` elements (``transport`` if given)."""
    if transport is not None:
        return transport
    nblocks = sum(-(-int(d) // fmt.block) for d in sizes)
    return choose_transport(n, nblocks * block_bytes(fmt), sum(int(d) for d in sizes))


def check_transport(transport):
    if transport is not None and transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS} or None (chosen per bucket by "
                         f"predicted time), got {transport!r}")
    return transport


def reduce_blocks(fmt, leaves, ctx, *, stages: tuple[int, int], transport: str | None = None,
                  fast_axis: str | None = None, pack_max: int = BUCKET_MAX):
    """The mean over replicas of one bucket of leaves through ``fmt``'s payload.

    Args:
      fmt: a block codec (the protocol of :mod:`._blocks`).
      leaves: the bucket's ``LeafIn`` records, in lane order (``ctx.lane``).
      ctx: the sync's ``Ctx``; ``ctx.lane`` lists every leaf of the lane.
      stages: seed stages of the replicas' encoding and the owners' re-encoding.
      transport: ``"owner"``, ``"allgather"`` or None (:func:`choose_transport`).
      fast_axis: the fast axis of the two-level mode, or None.
      pack_max: a lane of at most this many elements goes packed whole (one view
        per bucket, see :mod:`._views`); 0: every leaf's whole blocks in place.

    Returns:
      ``(means, residuals or None)``, lists shaped like the leaves.
    """
    n, block = ctx.n, fmt.block
    sizes = [leaf.size for leaf in ctx.lane]
    pack_all = sum(sizes) <= pack_max
    every = dict(zip((leaf.index for leaf in ctx.lane),
                     lane_layout(sizes, n, block, pack_all), strict=True))
    lays = [every[i.leaf.index] for i in leaves]
    xs = [i.x for i in leaves]
    views, packing = bucket_views(xs, lays, n, block)
    # the replicas' encodings draw per replica; an owner's re-encoding draws the
    # same whichever replica owns the block, so the lane layout (which decides
    # the owner of a packed block) never changes a result
    seeds = [[ctx.seed_for(s, shared=k > 0, leaf=i.leaf.index) for i in leaves]
             for k, s in enumerate(stages)]
    if fast_axis is not None:
        outs, res = _two_level(fmt, views, seeds, ctx, fast_axis)
    else:
        transport = bucket_transport(fmt, [i.leaf.size for i in leaves], n, transport)
        check_transport(transport)
        if transport == "allgather":
            outs, res = _gathered(fmt, views, seeds[0], ctx.names, n, ctx.residual)
        else:
            outs, res = _owner(fmt, views, seeds, ctx.names, n, ctx.residual)
    means = assemble(outs, xs, lays, packing, block)
    return means, (assemble(res, xs, lays, packing, block) if ctx.residual else None)


def _materialised(fn, index):
    """``fn()``, computed once into its own buffer.

    Wrapped in a conditional whose predicate (``index >= 0``) always holds but
    is not known when compiling: XLA cannot fuse across it, so the chunk-sized
    mean is decoded once instead of inside every full-size consumer (which cost
    four decodes per element of the error-feedback residual on CPU).
    """
    # the other branch never runs; fn() * 0 keeps shard_map's varying-axes type
    return jax.lax.cond(index >= 0, fn, lambda: fn() * 0.0)


def _concat(rows):
    """The views' rows side by side, along their last (word) axis."""
    return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=-1)


def _owner(fmt, views, seeds, names, n, residual, xs=None, row0=0, fold_scale=None):
    """The owner-compute transport of ``views`` (rows of the arrays ``xs``, default the views').

    ``xs[v]`` holds ``n`` rows; their blocks are rows ``[row0, row0 + n)`` of
    view ``v``'s table (the two-level mode hands over one fast chunk). Returns
    ``(outs, residuals)``: lists of ``(n, nb, block)``; a residual is what
    this replica's encoding lost plus, on the row it owns, ``n`` times the
    owner's re-encoding error (``fold_scale`` times it when given).
    """
    xs = [v.x for v in views] if xs is None else xs
    s_idx = replica_index(names, n)
    sent = [encode_rows(fmt, x, v.blocks(seeds[0], fmt.block, row0, n))
            for v, x in zip(views, xs, strict=True)]
    widths = [rows.shape[1] for rows, _ in sent]
    recv = a2a(_concat([rows for rows, _ in sent]), names, n)
    own, means, off = [], [], 0
    for v, x, w in zip(views, xs, widths, strict=True):
        nb = x.shape[1]
        part = recv[:, off : off + w]
        mean = _materialised(
            lambda part=part, nb=nb: sum_decoded(lambda r: decode_rows(fmt, r, nb), part) / n,
            s_idx)[None]
        real = v.real(fmt.block, row0 + s_idx)
        if real is not None:  # empty slots and padding: zero, as the replicas sent them
            mean = jnp.where(real, mean, 0.0)
        own.append(encode_rows(fmt, mean, v.blocks(seeds[1], fmt.block, row0 + s_idx, 1)))
        means.append(mean)
        off += w
    gathered = gather(_concat([rows[0] for rows, _ in own]), names, n)
    outs, res, off = [], [], 0
    for x, (_, payload), (own_rows, own_payload), mean in zip(xs, sent, own, means, strict=True):
        nb = x.shape[1]
        w = own_rows.shape[1]
        outs.append(decode_rows(fmt, gathered[:, off : off + w], nb))
        off += w
        if residual:
            r = x - reconstruct_checked(fmt, x, payload)
            r_srv = mean - reconstruct_checked(fmt, mean, own_payload)
            # a select, not a dynamic update of one row: XLA on CPU runs a
            # dynamic-slice/update pair over a row slower than this whole pass
            mine = jax.lax.broadcasted_iota(jnp.int32, (n, 1, 1), 0) == s_idx
            scale = n if fold_scale is None else fold_scale
            res.append(r + jnp.where(mine, scale * r_srv, 0.0))
    return outs, (res if residual else None)


def _gathered(fmt, views, seeds, names, n, residual):
    """The all-gather transport: every replica's encoded rows to every replica.

    Each replica decodes the ``n`` copies of a view and averages them (the
    adds fuse with the decodes into one pass); its residual is what its own
    encoding lost, so ``mean_i(x_i) = mean + mean_i(residual_i)`` exactly.
    """
    sent = [encode_rows(fmt, v.x, v.blocks(seeds, fmt.block)) for v in views]
    gathered = gather(_concat([rows for rows, _ in sent]), names, n)  # (replicas, rows, words)
    outs, res, off = [], [], 0
    for v, (rows, payload) in zip(views, sent, strict=True):
        nb, w = v.x.shape[1], rows.shape[1]
        part = gathered[:, :, off : off + w]
        total = sum_decoded(lambda p, nb=nb: decode_rows(fmt, p[0], nb)[None], part)
        outs.append(total / n)
        off += w
        if residual:
            res.append(v.x - reconstruct_checked(fmt, v.x, payload))
    return outs, (res if residual else None)


def _bf16_bits(x):
    y = x.astype(jnp.bfloat16)
    return jax.lax.bitcast_convert_type(y, jnp.uint16), y.astype(jnp.float32)


def _from_bf16(u16):
    return jax.lax.bitcast_convert_type(u16, jnp.bfloat16).astype(jnp.float32)


def _two_level(fmt, views, seeds, ctx, fast_axis: str):
    """bf16 over the fast axis, owner-compute over the slow ones, bf16 back.

    A view's rows are ordered ``(fast, slow)``: row ``f·S + s`` is owned by the
    replica with fast index ``f`` and slow index ``s``. With error feedback a
    replica's residual is its bf16 rounding everywhere plus, on its fast chunk,
    ``F`` times the slow stage's residual and the gather's rounding, so
    ``mean_i(x_i) = mean + mean_i(residual_i)``.
    """
    fast = (fast_axis,)
    slow = tuple(a for a in axis_tuple(ctx.names) if a != fast_axis)
    f_n = bound_size(fast)
    s_n = ctx.n // f_n
    f_idx = replica_index(fast, f_n)
    bits = [_bf16_bits(v.x.reshape(f_n, -1)) for v in views]
    recv = a2a(_concat([b for b, _ in bits]), fast, f_n)  # row f: fast peer f's chunk for me
    ys, off = [], 0
    for v in views:
        w = v.x[0].size * s_n
        part = recv[:, off : off + w]
        ys.append(sum_decoded(lambda r: _from_bf16(r), part).reshape(s_n, *v.x.shape[1:]) / f_n)
        off += w
    outs_s, res_s = _owner(fmt, views, seeds, slow, s_n, ctx.residual, xs=ys,
                           row0=f_idx * s_n, fold_scale=s_n)
    back = [_bf16_bits(o) for o in outs_s]
    gathered = gather(_concat([b.reshape(-1) for b, _ in back]), fast, f_n)
    outs, res, off = [], [], 0
    for j, v in enumerate(views):
        w = v.x[0].size * s_n
        outs.append(_from_bf16(gathered[:, off : off + w]).reshape(v.x.shape))
        off += w
        if ctx.residual:
            assert res_s is not None  # _owner returns residuals when asked for them
            own = f_n * (res_s[j] + (outs_s[j] - back[j][1]))
            r = (v.x.reshape(f_n, -1) - bits[j][1]).reshape(f_n, s_n, *v.x.shape[1:])
            mine = jax.lax.broadcasted_iota(jnp.int32, (f_n, 1, 1, 1), 0) == f_idx
            res.append((r + jnp.where(mine, own[None], 0.0)).reshape(v.x.shape))
    return outs, (res if ctx.residual else None)

