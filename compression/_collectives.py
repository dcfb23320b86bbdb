"""The collectives that move compressed payloads (inside ``shard_map``).

* :func:`psum_mean` -- linear payloads in float32 (random-k values, PowerSGD
  factors, small dense leaves).
* :func:`allgather_sparse` -- (value, index) pairs, bit-cast to one int32
  all-gather; every replica scatter-adds all of them.
* :func:`owner_sparse` -- (value, index) pairs routed to the owners of their
  index ranges, leaf by leaf, in one all-to-all and one all-gather.
* :func:`a2a`, :func:`gather` and :func:`sum_decoded` -- the pieces the block
  codecs' transports (:mod:`adaptjax.compression._exchange`) are built of.
  Narrow payloads always travel as integers (XLA on CPU widens a narrow
  float all-reduce to f32).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from adaptjax.compression._layout import make_layout

from adaptjax._tree import psum_replicas

__all__ = [
    "a2a",
    "allgather_sparse",
    "axis_arg",
    "axis_tuple",
    "bound_size",
    "gather",
    "owner_sparse",
    "sparse_capacity",
    "psum_mean",
    "replicated",
    "scatter_leaf",
    "sum_decoded",
    "varying_axes",
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


def varying_axes(x) -> tuple[str, ...]:
    """The shard_map axes ``x`` varies over (``()`` outside shard_map or unchecked)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10
    varying = manual.varying if manual is not None else getattr(aval, "vma", ())
    return tuple(sorted(varying))


def replicated(tree, names: tuple[str, ...]):
    """``tree`` marked as the same on every replica of ``names``, at one replica.

    At one replica the collectives are left out (:func:`psum_mean`, :func:`gather`),
    so what they would have made replicated still varies over ``names`` for
    ``shard_map``'s replication check (``check_vma=True``), which then rejects
    an ``out_specs`` of ``P()``. A psum over one replica is the identity and
    marks it; leaves that vary over none of ``names`` (any leaf under
    ``check_vma=False``) are left as they are.
    """
    def mark(x):
        return psum_replicas(x, axis_arg(names)) if set(names) & set(varying_axes(x)) else x

    return jax.tree.map(mark, tree)


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
    gathered = gather(payload, names, n)
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


def a2a(rows, names, size):
    """All-to-all of ``rows`` over ``names`` (row ``j`` to replica ``j``); itself at 1."""
    if size == 1:
        return rows
    return jax.lax.all_to_all(rows, axis_arg(names), 0, 0)


def gather(row, names, size):
    """All-gather of ``row`` over ``names``: ``(size, *row.shape)``, the same on every replica."""
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


def sparse_capacity(k: int, n: int, factor: float = 2.0) -> tuple[int, int]:
    """(pairs routed to each owner, pairs each owner keeps) for ``k`` pairs per replica."""
    return max(1, math.ceil(factor * k / n)), max(1, math.ceil(k / n))


def owner_sparse(pairs, sizes, names: tuple[str, ...], n: int, selects):
    """Mean over replicas of sparse leaves through their owners, in ``O(k)`` bytes.

    Leaf by leaf, replica ``j`` owns indices ``[j·c, (j+1)·c)``,
    ``c = ceil(d/N)`` of a leaf of ``d`` elements. Each replica routes a
    leaf's ``k`` pairs to their owners (``cap = ceil(2k/N)`` pairs per owner,
    the rest stay unsent), each owner sums what it received and keeps the
    ``ceil(k/N)`` largest sums, and every replica gets every owner's pairs;
    all leaves travel in one all-to-all and one all-gather. Bytes per device
    per leaf: ``8·(N−1)·(cap + ceil(k/N)) ≈ 24k(N−1)/N`` instead of an
    all-gather's ``8k(N−1)``. Each leaf is routed on its own, so a leaf's result
    does not depend on the leaves it travels with.

    Args:
      pairs: per leaf, this replica's ``(values, indices)`` (float32, int32;
        index ``d`` marks an unused slot).
      sizes: the leaves' sizes.
      names, n: the bound axes and their size.
      selects: per leaf, ``select(f, k) -> (indices, values)``, the ``k``
        largest of ``|f|``, unused slots ``f.size``: how an owner keeps its
        largest sums (the codec's own selection; on CPU the native kernel,
        which never picks a zero).

    Returns:
      Per leaf ``(mean, sent, dropped_idx, dropped_val)``: its dense mean, flat
      (the same on every replica); a bool mask of this replica's pairs that were
      routed; and the owner's sums it received but did not keep (indices, ``d``
      for none, and values already divided by ``N``), so that error feedback
      can keep them: ``mean_i(x_i) = mean + mean_i(unsent_i) + dropped``.
    """
    routes = [_route(v, i, d, n) for (v, i), d in zip(pairs, sizes, strict=True)]
    recv = a2a(jnp.concatenate([r.payload for r in routes], axis=1), names, n)
    own = replica_index(names, n)
    kept, off = [], 0
    for r, d, select in zip(routes, sizes, selects, strict=True):
        kept.append(_keep(recv[:, off : off + 2 * r.cap], r.cap, r.keep, d, own, n, select))
        off += 2 * r.cap
    rows = jnp.concatenate([jnp.concatenate([jax.lax.bitcast_convert_type(v, jnp.int32), i])
                            for v, i, _, _ in kept])
    gathered = gather(rows, names, n)  # row j: owner j's pairs of every leaf
    out, off = [], 0
    for r, (v, _, d_idx, d_val), d in zip(routes, kept, sizes, strict=True):
        kk = v.shape[0]
        g_val = jax.lax.bitcast_convert_type(gathered[:, off : off + kk], jnp.float32)
        g_idx = gathered[:, off + kk : off + 2 * kk]
        off += 2 * kk
        mean = scatter_leaf(g_val.reshape(-1), g_idx.reshape(-1), 0, d, 1)
        out.append((mean, r.sent, d_idx, d_val))
    return out


class _Route(NamedTuple):
    """One leaf's pairs bound for their owners: ``(n, 2·cap)`` int32 rows and what went."""

    payload: Any
    sent: Any
    cap: int
    keep: int


def _route(values, indices, d: int, n: int) -> _Route:
    """Row ``j``: the (at most ``cap``) pairs of owner ``j``'s range, values then indices."""
    k = values.shape[0]
    cap, keep = sparse_capacity(k, n)
    c = -(-d // n)
    order = jnp.argsort(indices)
    idx_s = indices[order]
    val_s = values[order]
    dest = jnp.where(idx_s < d, idx_s // c, n)
    start = jnp.searchsorted(dest, jnp.arange(n, dtype=dest.dtype), side="left")
    pos = jnp.arange(k, dtype=jnp.int32) - start[jnp.minimum(dest, n - 1)].astype(jnp.int32)
    routed = (dest < n) & (pos < cap)
    slot = jnp.where(routed, dest * cap + pos, n * cap)
    buf_v = jnp.zeros((n * cap + 1,), jnp.float32).at[slot].set(val_s)[:-1]
    buf_i = jnp.full((n * cap + 1,), d, jnp.int32).at[slot].set(idx_s)[:-1]
    payload = jnp.concatenate(
        [jax.lax.bitcast_convert_type(buf_v, jnp.int32).reshape(n, cap), buf_i.reshape(n, cap)],
        axis=1,
    )
    return _Route(payload, jnp.zeros((k,), bool).at[order].set(routed), cap, keep)


def _keep(recv, cap: int, keep: int, d: int, own, n: int, select):
    """An owner's pairs of one leaf: ``(values, indices, dropped_idx, dropped_val)``.

    ``recv`` row ``i`` holds replica ``i``'s pairs in this owner's range; the
    owner sums them per index and keeps the ``ceil(k/N)`` largest means.
    """
    c = -(-d // n)
    r_val = jax.lax.bitcast_convert_type(recv[:, :cap], jnp.float32).reshape(-1)
    r_idx = recv[:, cap:].reshape(-1)
    loc = jnp.where(r_idx < d, r_idx - own * c, c)
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
    out_idx = jnp.where(chosen, r_idx[top], d)
    out_val = jnp.where(chosen, mean_at[top], 0.0)
    kept = jnp.zeros((m,), bool).at[top].max(chosen)
    dropped = unique & ~kept
    return out_val, out_idx, jnp.where(dropped, r_idx, d), jnp.where(dropped, mean_at, 0.0)
