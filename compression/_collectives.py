"""The collectives that move compressed payloads (inside ``shard_map``).

* :func:`psum_mean` -- linear payloads in float32 (random-k values, PowerSGD
  factors, small dense leaves).
* :func:`allgather_sparse` -- (value, index) pairs, bit-cast to one int32
  all-gather; every replica scatter-adds all of them.
* :func:`owner_compute` -- quantised payloads: each replica owns one chunk of
  the flat gradient. An all-to-all moves every replica's encoded chunk ``j`` to
  replica ``j``, which decodes and averages it, adds its server-side error
  buffer, re-encodes it, and an all-gather hands every replica every encoded
  chunk. Bytes per device: ``2 (N−1)/N`` of one encoded copy of the gradient,
  nearly flat in ``N``. Narrow payloads always travel as integers (XLA on CPU
  widens a narrow float all-reduce to f32).
* :func:`choose_transport` -- which of the two carries a quantised payload at
  ``N`` replicas: at ``N = 2`` one all-gather of every replica's whole encoded
  gradient sends exactly the bytes of owner-compute's all-to-all + all-gather
  (``(N−1)·E = 2(N−1)/N·E``) in one collective instead of two, with no
  re-encoding by an owner between them; above 2 it sends ``N/2`` times more, so
  owner-compute is used.
* two-level (``fast`` axis given): bf16 reduce-scatter over the fast axis (as
  uint16 through an all-to-all), the owner-compute pattern on each fast
  chunk over the slow axes, bf16 all-gather over the fast axis.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from adaptjax.compression._bits import mix_seed
from adaptjax.compression._formats import Cast, Format
from adaptjax.compression._layout import make_layout

__all__ = [
    "BF16",
    "allgather_sparse",
    "axis_arg",
    "axis_tuple",
    "bound_size",
    "choose_transport",
    "owner_compute",
    "owner_compute_leaves",
    "owner_sparse",
    "sparse_capacity",
    "psum_mean",
    "scatter_leaf",
    "sum_decoded",
]


def axis_tuple(axis_name) -> tuple[str, ...]:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def axis_arg(names: tuple[str, ...]):
    """A collective's ``axis_name`` argument for a tuple of names."""
    return names[0] if len(names) == 1 else tuple(names)


def bound_size(axis_name) -> int:
    """Size of the (product of the) bound axes; a one-line ValueError if unbound."""
    n = 1
    for name in axis_tuple(axis_name):
        try:
            n *= jax.lax.axis_size(name)
        except NameError:
            raise ValueError(
                f"axis {name!r} is not bound here: run the codec inside jax.shard_map over a "
                f"mesh with a {name!r} axis, or pass axis_name= naming one of its axes"
            ) from None
    return n


def psum_mean(x, names: tuple[str, ...], n: int):
    if n == 1:
        return x
    return jax.lax.psum(x, axis_arg(names)) / n


def psum_mean_leaves(leaves, names: tuple[str, ...], n: int) -> list:
    """Mean over replicas of a list of float32 arrays, in one all-reduce."""
    lay = make_layout([x.size for x in leaves])
    mean = psum_mean(lay.flatten(leaves), names, n)
    return lay.unflatten(mean, [x.shape for x in leaves])


def allgather_sparse(values, indices, sizes, ks, names: tuple[str, ...], n: int) -> list:
    """Mean over replicas of sparse vectors given as (values f32, indices int32).

    ``indices`` index the concatenation of leaves of ``sizes`` elements
    (``sum(sizes)``: unused), leaf by leaf: the first ``ks[0]`` pairs are the
    first leaf's, and so on. Returns each leaf's dense mean, flat.
    """
    k = values.shape[0]
    payload = jnp.concatenate([jax.lax.bitcast_convert_type(values, jnp.int32), indices])
    gathered = _gather(payload, names, n)
    vals = jax.lax.bitcast_convert_type(gathered[:, :k], jnp.float32)
    idx = gathered[:, k:]
    out, off, at = [], 0, 0
    for size, kl in zip(sizes, ks, strict=True):  # each leaf scatters its own pairs only
        seg = slice(at, at + kl)
        out.append(scatter_leaf(vals[:, seg].reshape(-1), idx[:, seg].reshape(-1), off, size, n))
        off += size
        at += kl
    return out


def scatter_leaf(values, indices, offset: int, size: int, n: int):
    """``zeros(size).at[indices - offset].add(values) / n``, the pairs in ``[offset, offset+size)``.

    One buffer per leaf rather than one of the whole gradient sliced into
    leaves: no copy per leaf, and no buffer above glibc's largest mmap threshold
    (32 MiB), which is mapped afresh, page-faulted and unmapped on every call.
    """
    local = jnp.where((indices >= offset) & (indices < offset + size), indices - offset, size)
    return jnp.zeros((size,), jnp.float32).at[local].add(values, mode="drop") / n


def _a2a(rows, names, size):
    if size == 1:
        return rows
    return jax.lax.all_to_all(rows, axis_arg(names), 0, 0)


def _gather(row, names, size):
    # "invarying": every replica ends with the same value, which shard_map's
    # replication check (check_vma=True) can then see.
    if size == 1:
        return row[None]
    return jax.lax.all_gather(row, axis_arg(names), to="invarying")


def sum_decoded(decode, rows):
    """``decode(rows).sum(axis=0)`` as element-wise adds of rows decoded one by one.

    ``decode`` maps ``rows[i:i+1]`` to an array with a leading axis of 1. Both
    halves matter on XLA:CPU. A reduction over the leading axis of a large
    array runs about 20 times slower than a copy (315 ms against 16 ms for
    2 x 4.2M float32), while unrolled adds fuse into one element-wise pass with
    the decodes and whatever reads the sum. And decoding all rows in one
    expression, then adding its slices, ran 2.5-9 times slower than decoding
    each row on its own (2 x 2M codes fused with a momentum update: 3.1-15.1 ms
    against 0.65-3.4 ms, bf16 to natural); in a training step that was most
    of the codecs' cost over a dense step.
    """
    acc = decode(rows[0:1])[0]
    for i in range(1, rows.shape[0]):
        acc = acc + decode(rows[i : i + 1])[0]
    return acc


def replica_index(names, size):
    if size == 1:
        return jnp.zeros((), jnp.int32)
    return jax.lax.axis_index(axis_arg(names)).astype(jnp.int32)


BF16 = Cast(bits=16, block=32, has_scale=False, dtype="bfloat16")


def _bf16_rows(x, rows):
    """f32 vector -> (rows, len/rows) uint16 bit patterns of its bf16 cast."""
    y = x.astype(jnp.bfloat16)
    return jax.lax.bitcast_convert_type(y, jnp.uint16).reshape(rows, -1), y.astype(jnp.float32)


def _from_bf16(u16):
    return jax.lax.bitcast_convert_type(u16, jnp.bfloat16).astype(jnp.float32)


def owner_compute(
    x,
    fmt: Format,
    *,
    slow: tuple[str, ...],
    slow_size: int,
    fast: tuple[str, ...] = (),
    fast_size: int = 1,
    seed_worker,
    seed_server,
    server=None,
    residual: bool = False,
    server_mode: str | None = None,
    valid=None,
):
    """Mean over replicas of the flat vector ``x`` through an encoded payload.

    Args:
      x: this replica's flat float32 vector; its length is a multiple of
        ``fast_size * slow_size * fmt.block``.
      fmt: the element format.
      slow, slow_size: the axes the compressed payload crosses, and their size.
      fast, fast_size: the fast axes (bf16 stage), ``()`` and 1 for none.
      seed_worker, seed_server: uint32 seeds of this replica's two encodings.
      server: ``server_mode == "buffer"``: this replica's server error buffer in
        the same flat layout (non-zero only on the chunk it owns).
      residual: whether to return this replica's worker residual.
      server_mode: ``None`` (no server-side error feedback), ``"buffer"`` (keep
        it in ``server``) or ``"fold"`` (add ``N`` times it to this replica's
        residual on the owned chunk, so the mean over replicas carries it).
      valid: optional numpy array, real (unpadded) elements of each block of ``x``
        (see :meth:`Layout.block_counts`), for formats whose scale is a mean.

    Returns:
      ``(mean, residual or None, new server buffer or None)``. ``mean`` is the
      same on every replica. With ``residual``, the mean over replicas of the
      residual plus the server buffer's change accounts exactly for the lost
      part: ``mean(x) = mean_out + mean(residual) + server_new − server_old``.
    """
    f_len = x.shape[0] // fast_size  # one fast chunk
    s_len = f_len // slow_size  # one owner chunk
    nb = s_len // fmt.block
    y, f_idx, res = _fast_scatter(x, fast, fast_size, residual)
    v_fast = v_own = None
    if valid is not None:
        counts = jnp.asarray(valid, jnp.float32)
        fb = f_len // fmt.block  # blocks in one fast chunk
        v_fast = jax.lax.dynamic_slice(counts, (f_idx * fb,), (fb,)).reshape(slow_size, nb)
    rows = fmt.encode(y.reshape(slow_size, nb, fmt.block), seed_worker, v_fast)
    recv = _a2a(rows, slow, slow_size)
    mean_chunk = sum_decoded(lambda r: fmt.decode(r, nb), recv).reshape(s_len) / slow_size
    s_idx = replica_index(slow, slow_size)
    own = f_idx * f_len + s_idx * s_len  # start of the chunk this replica owns
    z = mean_chunk
    if server_mode == "buffer":
        z = z + jax.lax.dynamic_slice(server, (own,), (s_len,))
    if valid is not None:
        v_own = jax.lax.dynamic_slice(counts, (own // fmt.block,), (nb,)).reshape(1, nb)
    row_s = fmt.encode(z.reshape(1, nb, fmt.block), seed_server, v_own)
    yhat = fmt.decode(_gather(row_s[0], slow, slow_size), nb).reshape(f_len)
    new_server = None
    r_fast = None  # residual on this replica's fast chunk, scaled by fast_size
    if residual:
        r_fast = y - fmt.decode(rows, nb).reshape(f_len)
    if server_mode is not None:
        r_srv = z - jax.lax.dynamic_slice(yhat, (s_idx * s_len,), (s_len,))
        if server_mode == "buffer":
            new_server = jax.lax.dynamic_update_slice(jnp.zeros_like(x), r_srv, (own,))
        else:  # fold: N times it on the owned chunk
            r_fast = r_fast + jax.lax.dynamic_update_slice(
                jnp.zeros((f_len,), jnp.float32), slow_size * r_srv, (s_idx * s_len,)
            )
    out, res = _fast_gather(yhat, res, r_fast, f_idx, fast, fast_size, residual)
    return out, res, new_server


def _fast_scatter(x, fast, fast_size: int, residual: bool):
    """The bf16 reduce-scatter of ``x`` over the fast axes (none: ``x`` itself).

    Returns ``(y, f_idx, res)``: the mean of this replica's fast chunk, the
    chunk's index, and with ``residual`` what the bf16 rounding lost (all of
    ``x``'s length), else None.
    """
    if fast_size == 1:
        return x, jnp.zeros((), jnp.int32), None
    rows16, xb = _bf16_rows(x, fast_size)
    y = sum_decoded(_from_bf16, _a2a(rows16, fast, fast_size)) / fast_size
    f_idx = replica_index(fast, fast_size)
    return y, f_idx, (x - xb if residual else None)


def _fast_gather(yhat, res, r_fast, f_idx, fast, fast_size: int, residual: bool):
    """The bf16 all-gather of each fast chunk's mean ``yhat`` over the fast axes.

    Returns ``(out, residual)``: the whole mean, and with ``residual`` the
    residual of the whole vector: ``res`` (the scatter's) plus, on this
    replica's fast chunk, ``fast_size`` times ``r_fast`` and the gather's bf16
    rounding. Without fast axes, ``(yhat, r_fast)``.
    """
    if fast_size == 1:
        return yhat, r_fast
    f_len = yhat.shape[0]
    rows16, yb = _bf16_rows(yhat, 1)
    out = _from_bf16(_gather(rows16[0], fast, fast_size)).reshape(f_len * fast_size)
    if residual:
        r_fast = r_fast + (yhat - yb)
        mine = jax.lax.dynamic_slice(res, (f_idx * f_len,), (f_len,))
        res = jax.lax.dynamic_update_slice(res, mine + fast_size * r_fast, (f_idx * f_len,))
    return out, res


TRANSPORTS = ("owner", "allgather")


def choose_transport(n: int) -> str:
    """The transport of a quantised payload over ``n`` replicas: ``"allgather"`` or ``"owner"``.

    Bytes per device for an encoded gradient of ``E`` bytes: owner-compute
    (all-to-all + all-gather) ``2 (n−1)/n · E``; one all-gather of the whole
    encoded gradient ``(n−1) · E``. They are equal at ``n = 2``, where the
    all-gather also saves a collective's round trip and the owner's decode,
    re-encode pass between the two (across real processes over gloo each
    collective is a network round trip, and the step waits for both). Above 2
    the all-gather sends ``n/2`` times the bytes, so owner-compute wins there.

    Example:
      >>> from adaptjax.compression._collectives import choose_transport
      >>> [choose_transport(n) for n in (2, 4)]
      ['allgather', 'owner']
    """
    return "allgather" if int(n) == 2 else "owner"


def _materialised(fn, index):
    """``fn()``, computed once into its own buffer.

    Wrapped in a conditional whose predicate (``index >= 0``) always holds but
    is not known when compiling: XLA cannot fuse across it, so the chunk-sized
    mean is decoded once instead of inside every full-size consumer (which cost
    four decodes per element of the error-feedback residual on CPU).
    """
    # the other branch never runs; fn() * 0 keeps shard_map's varying-axes type
    return jax.lax.cond(index >= 0, fn, lambda: fn() * 0.0)


def owner_compute_leaves(
    xs,
    fmt: Format,
    *,
    names: tuple[str, ...],
    n: int,
    seed_worker,
    seed_server,
    residual: bool = False,
    fold: bool = False,
    transport: str | None = None,
):
    """Owner-compute mean of a list of float32 leaves, without flattening them.

    The one-level form of :func:`owner_compute` (same bytes, same identity),
    shaped for XLA on CPU: a leaf's longest prefix of whole ``N × block`` units
    is viewed in place as ``(N, nb, block)`` (row ``j`` is the chunk replica
    ``j`` owns), and only the remainders of the leaves are concatenated and
    padded into one more such view. Each view is encoded on its own and only the
    *encoded* rows are concatenated for the one all-to-all and the one
    all-gather. Concatenating the float32 leaves instead, as a flat layout does,
    is a fusion that XLA's CPU backend runs at a tenth of copy speed.

    Args:
      xs: this replica's leaves (float32, any shapes).
      fmt: the element format.
      names, n: the bound axes the payload crosses, and their size.
      seed_worker, seed_server: uint32 seeds of this replica's two encodings.
      residual: whether to return this replica's residual per leaf.
      fold: add ``n`` times the owner's re-encoding error to its residual on
        the chunk it owns (server-side error feedback without a server buffer).
      transport: ``"owner"`` (all-to-all, owners decode, average and
        re-encode, all-gather), ``"allgather"`` (one all-gather of every
        replica's encoded rows, each replica decodes and averages all of them;
        nothing is re-encoded, so ``fold`` adds nothing) or ``None`` for
        :func:`choose_transport` of ``n``.

    Returns:
      ``(means, residuals or None)``, lists shaped like ``xs``. With ``residual``
      and ``fold``, ``mean_i(x_i) = mean + mean_i(residual_i)`` exactly (up to
      float rounding), leaf by leaf.
    """
    v = _leaf_views(xs, fmt.block, n)
    s_idx = replica_index(names, n)
    seeds_w = [mix_seed(seed_worker, k) for k in range(len(v.views))]
    seeds_s = [mix_seed(seed_server, k) for k in range(len(v.views))]
    rows = [fmt.encode(x, s, c) for x, s, c in zip(v.views, seeds_w, v.valids, strict=True)]
    transport = choose_transport(n) if transport is None else transport
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS} or None, got {transport!r}")
    if transport == "allgather":
        outs_v, res_v = _gathered_means(fmt, v.views, rows, names, n, residual)
    else:
        outs_v, res_v = _owner_means(fmt, v, rows, seeds_s, s_idx, names, n, residual, fold)
    return v.assemble(xs, outs_v), (v.assemble(xs, res_v) if residual else None)


class _LeafViews(NamedTuple):
    """Leaves as ``(n, nb, block)`` views: each leaf's longest prefix of whole
    ``n × block`` units in place, the remainders of all of them in one more view.

    Attributes:
      views: the views; the last one holds the remainders when there are any.
      valids: ``None`` for a main view; for the remainders' view, its real
        (unpadded) elements per block, ``(n, nb)``.
      owners: the leaf index of each main view, ``None`` for the remainders'.
      tails: the indices of the leaves with a remainder.
      lay: the remainders' :class:`Layout`, or None.
      sizes, mains: each leaf's elements, and those in its main view.
    """

    views: list
    valids: list
    owners: list
    tails: list
    lay: Any
    sizes: list
    mains: list

    def assemble(self, xs, parts) -> list:
        """Leaves shaped like ``xs`` from the flat parts of the views."""
        sizes, mains, tails = self.sizes, self.mains, self.tails
        rest = []
        if tails:
            rest = self.lay.unflatten(parts[-1], [(sizes[i] - mains[i],) for i in tails])
        rest_of = dict(zip(tails, rest, strict=True))
        main_of = {i: p for i, p in zip(self.owners, parts, strict=True) if i is not None}
        out = []
        for i, x in enumerate(xs):
            pieces = [p for p in (main_of.get(i), rest_of.get(i)) if p is not None]
            flat = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
            out.append(flat.reshape(jnp.shape(x)))
        return out


def _leaf_views(xs, block: int, n: int) -> _LeafViews:
    """The :class:`_LeafViews` of float32 leaves ``xs`` for ``n`` owners of ``block``-blocks."""
    unit = n * block
    flats = [jnp.ravel(x) for x in xs]
    sizes = [f.shape[0] for f in flats]
    mains = [(d // unit) * unit for d in sizes]
    views, valids, owners = [], [], []
    for i, (f, m) in enumerate(zip(flats, mains, strict=True)):
        if m:
            views.append((f if m == sizes[i] else f[:m]).reshape(n, m // unit, block))
            valids.append(None)
            owners.append(i)
    tails = [i for i, (d, m) in enumerate(zip(sizes, mains, strict=True)) if d > m]
    lay = None
    if tails:
        lay = make_layout([sizes[i] - mains[i] for i in tails], block, n)
        rest = lay.flatten([flats[i][mains[i] :] if mains[i] else flats[i] for i in tails])
        views.append(rest.reshape(n, -1, block))
        valids.append(jnp.asarray(lay.block_counts().reshape(n, -1)))
        owners.append(None)
    return _LeafViews(views, valids, owners, tails, lay, sizes, mains)


def _owner_means(fmt, v: _LeafViews, rows, seeds_s, s_idx, names, n, residual, fold):
    """The owner-compute transport of encoded ``rows`` of the views ``v``.

    One all-to-all hands owner ``j`` row ``j`` of every replica's views; it
    decodes and averages them, re-encodes the mean, and one all-gather returns
    every owner's rows. Returns the flat means and, with ``residual``, the
    residuals of the views (with ``fold``, plus ``n`` times the owner's
    re-encoding error on the row it owns).
    """
    widths = [r.shape[1] for r in rows]
    recv = _a2a(jnp.concatenate(rows, axis=1) if len(rows) > 1 else rows[0], names, n)
    own_rows, means = [], []
    off = 0
    for x, w, s, c in zip(v.views, widths, seeds_s, v.valids, strict=True):
        nb = x.shape[1]
        part = recv[:, off : off + w]
        mean = _materialised(
            lambda part=part, nb=nb: sum_decoded(lambda r: fmt.decode(r, nb), part) / n, s_idx
        )
        c_own = None if c is None else jax.lax.dynamic_index_in_dim(c, s_idx, 0, keepdims=True)
        own_rows.append(fmt.encode(mean[None], s, c_own))
        means.append(mean)
        off += w
    sent = jnp.concatenate(own_rows, axis=1) if len(own_rows) > 1 else own_rows[0]
    gathered = _gather(sent[0], names, n)
    outs_v, res_v = [], []
    off = 0
    for x, w, row, own, mean in zip(v.views, widths, rows, own_rows, means, strict=True):
        nb = x.shape[1]
        outs_v.append(fmt.decode(gathered[:, off : off + w], nb).reshape(-1))
        off += w
        if residual:
            r = x - fmt.reconstruct(x, row)
            if fold:  # n times the owner's re-encoding error, on the row it owns
                r_srv = mean - fmt.reconstruct(mean[None], own)[0]
                # a select, not a dynamic update of one row: XLA on CPU runs a
                # dynamic-slice/update pair over a row slower than this whole pass
                mine = jax.lax.broadcasted_iota(jnp.int32, (n, 1, 1), 0) == s_idx
                r = r + jnp.where(mine, n * r_srv[None], 0.0)
            res_v.append(r.reshape(-1))
    return outs_v, res_v


def _gathered_means(fmt, views, rows, names, n, residual):
    """The all-gather transport: every replica's encoded rows to every replica.

    Each replica decodes the ``n`` copies of a view and averages them (the
    adds fuse with the decodes into one pass); its residual is what its own
    encoding lost, so ``mean_i(x_i) = mean + mean_i(residual_i)`` exactly.
    """
    widths = [r.shape[1] for r in rows]
    sent = jnp.concatenate(rows, axis=1) if len(rows) > 1 else rows[0]
    gathered = _gather(sent, names, n)  # (n replicas, n rows, words)
    outs_v, res_v = [], []
    off = 0
    for v, w, row in zip(views, widths, rows, strict=True):
        nb = v.shape[1]
        part = gathered[:, :, off : off + w]  # (n replicas, rows per replica, w)
        total = sum_decoded(lambda p, nb=nb: fmt.decode(p[0], nb)[None], part)
        outs_v.append((total / n).reshape(-1))
        off += w
        if residual:
            res_v.append((v - fmt.reconstruct(v, row)).reshape(-1))
    return outs_v, res_v


def sparse_capacity(k: int, n: int, factor: float = 2.0) -> tuple[int, int]:
    """(pairs routed to each owner, pairs each owner keeps) for ``k`` pairs per replica."""
    return max(1, math.ceil(factor * k / n)), max(1, math.ceil(k / n))


def owner_sparse(values, indices, sizes, names: tuple[str, ...], n: int, select):
    """Mean over replicas of sparse vectors through their owners, in ``O(k)`` bytes.

    Replica ``j`` owns indices ``[j·c, (j+1)·c)``, ``c = ceil(total/N)``. Each
    replica routes its pairs to their owners in one fixed-capacity all-to-all
    (``cap = ceil(2k/N)`` pairs per owner, the rest stay unsent); each owner sums
    what it received, keeps the ``ceil(k/N)`` largest sums, and one all-gather
    hands every replica every owner's pairs. Bytes per device:
    ``8·(N−1)·(cap + ceil(k/N)) ≈ 24k(N−1)/N`` instead of an all-gather's ``8k(N−1)``.

    Args:
      values, indices: this replica's pairs (float32, int32) into the concatenation
        of leaves of ``sizes`` elements; index ``total = sum(sizes)`` marks an
        unused slot.
      sizes: the leaves' sizes.
      names, n: the bound axes and their size.
      select: ``select(f, k) -> (indices, values)``, the ``k`` largest of
        ``|f|``, unused slots ``f.size``: how an owner keeps its largest sums
        (the codec's own selection; on CPU the native kernel, which never
        picks a zero).

    Returns:
      ``(means, sent, dropped_idx, dropped_val)``: each leaf's dense mean, flat
      (the same on every replica, :func:`scatter_leaf`); a bool mask of this
      replica's pairs that were routed; and the owner's sums it received but
      did not keep (global indices, ``total`` for none, and values already
      divided by ``N``), so that error feedback can keep them:
      ``mean_i(x_i) = mean + mean_i(unsent_i) + dropped``.
    """
    k = values.shape[0]
    total = sum(sizes)
    cap, keep = sparse_capacity(k, n)
    c = -(-total // n)
    order = jnp.argsort(indices)
    idx_s = indices[order]
    val_s = values[order]
    dest = jnp.where(idx_s < total, idx_s // c, n)
    start = jnp.searchsorted(dest, jnp.arange(n, dtype=dest.dtype), side="left")
    pos = jnp.arange(k, dtype=jnp.int32) - start[jnp.minimum(dest, n - 1)].astype(jnp.int32)
    routed = (dest < n) & (pos < cap)
    slot = jnp.where(routed, dest * cap + pos, n * cap)
    buf_v = jnp.zeros((n * cap + 1,), jnp.float32).at[slot].set(val_s)[:-1]
    buf_i = jnp.full((n * cap + 1,), total, jnp.int32).at[slot].set(idx_s)[:-1]
    sent = jnp.zeros((k,), bool).at[order].set(routed)
    payload = jnp.concatenate(
        [jax.lax.bitcast_convert_type(buf_v, jnp.int32).reshape(n, cap), buf_i.reshape(n, cap)],
        axis=1,
    )
    recv = _a2a(payload, names, n)  # row i: replica i's pairs for my range
    r_val = jax.lax.bitcast_convert_type(recv[:, :cap], jnp.float32).reshape(-1)
    r_idx = recv[:, cap:].reshape(-1)
    own = replica_index(names, n)
    loc = jnp.where(r_idx < total, r_idx - own * c, c)
    sums = jnp.zeros((c + 1,), jnp.float32).at[loc].add(r_val)
    m = r_idx.shape[0]
    first = jnp.full((c + 1,), m, jnp.int32).at[loc].min(jnp.arange(m, dtype=jnp.int32))
    unique = (first[loc] == jnp.arange(m, dtype=jnp.int32)) & (loc < c)
    mean_at = sums[loc] / n
    # repeats and zero sums enter as 0: a selection that picks zeros (lax.top_k)
    # must still not send a repeat, whose sum its first copy already carries
    top = select(jnp.where(unique, mean_at, 0.0), min(keep, m))[0]
    used = top < m
    top = jnp.minimum(top, m - 1)
    chosen = used & unique[top]
    out_idx = jnp.where(chosen, r_idx[top], total)
    out_val = jnp.where(chosen, mean_at[top], 0.0)
    kept = jnp.zeros((m,), bool).at[top].max(chosen)
    dropped = unique & ~kept
    dropped_idx = jnp.where(dropped, r_idx, total)
    dropped_val = jnp.where(dropped, mean_at, 0.0)
    row = jnp.concatenate([jax.lax.bitcast_convert_type(out_val, jnp.int32), out_idx])
    gathered = _gather(row, names, n)
    kk = out_val.shape[0]
    g_val = jax.lax.bitcast_convert_type(gathered[:, :kk], jnp.float32)  # row j: owner j's
    g_idx = gathered[:, kk:]
    # owner j's pairs lie in [j·c, (j+1)·c): each leaf scatters the rows of the owners
    # its range meets, (L + N)·keep pairs in all instead of L·N·keep
    means, off = [], 0
    for size in sizes:
        first, last = off // c, (off + size - 1) // c
        means.append(scatter_leaf(g_val[first : last + 1].reshape(-1),
                                  g_idx[first : last + 1].reshape(-1), off, size, 1))
        off += size
    return means, sent, dropped_idx, dropped_val
