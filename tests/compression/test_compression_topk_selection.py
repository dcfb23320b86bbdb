"""The threshold top-k selection against exact top-k (values, not timings).

Its speed is measured by ``benchmarks/topk_selection.py``; here: recall against
``lax.top_k`` on a stated distribution (standard Gaussian), the degenerate
inputs it must survive, and error feedback keeping what it does not send. Each
runs on both lanes: the default (on CPU the native kernel where it was built,
see test_compression_topk_native.py) and the XLA operations of other platforms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from adaptjax.compression import _sparse

from adaptjax import compression as ajc

_LANES = {
    "default": lambda a, k: _sparse.select_topk(a, k, "threshold", 0),
    "xla": _sparse._select_xla,
}


def _recall(idx, exact, size, k):
    idx = np.asarray(idx)
    return np.intersect1d(idx[idx < size], np.asarray(exact)).size / k


# 131,071 = 2^17 - 1: above the 32,768 where lax.top_k takes over, and not a multiple of 32
@pytest.mark.parametrize("ratio", [0.01, 0.001])
def test_threshold_recall_on_gaussian_is_at_least_095(ratio):
    size = 131071
    x = jnp.asarray(np.random.default_rng(11).standard_normal(size).astype(np.float32))
    codec = ajc.topk(ratio, variant="threshold")
    k = codec.k(size)
    p = jax.jit(lambda v: codec.encode(v))(x)
    exact = jax.lax.top_k(jnp.abs(x), k)[1]
    assert p["indices"].shape == (k,)
    assert _recall(p["indices"], exact, size, k) >= 0.95
    xla_idx = jax.jit(lambda v: _sparse._select_xla(v, k)[0])(x)
    assert _recall(xla_idx, exact, size, k) >= 0.95
    idx = np.asarray(p["indices"])
    assert np.unique(idx[idx < size]).size == (idx < size).sum()  # no index sent twice
    ok = idx < size
    np.testing.assert_array_equal(np.asarray(p["values"])[ok], np.asarray(x)[idx[ok]])


@pytest.mark.parametrize("cap", [5, 300, 4000])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.05, 0.5])
def test_compaction_lists_the_first_cap_set_positions(cap, density):
    # units of 4 words (128 elements) with from none to all bits set, and a padded last
    # unit (10,000 is not a multiple of 128), against numpy's flatnonzero
    mask = np.random.default_rng(int(1000 * density) + cap).random(10_000) < density
    mask[-1] = density > 0.2  # a set bit in the last, padded word
    pos, count = jax.jit(lambda m: _sparse._compact(_sparse._mask_words(m), cap))(jnp.asarray(mask))
    want = np.flatnonzero(mask)[:cap]
    assert int(count) == int(mask.sum())
    np.testing.assert_array_equal(np.asarray(pos)[: len(want)], want)
    assert (np.asarray(pos)[len(want):] == -1).all()



def test_nth_set_bit_against_the_bits_listed_one_by_one():
    # every rank of a full word, every single-bit word, and random words at every rank they have
    rng = np.random.default_rng(5)
    words = [0xFFFFFFFF] * 32 + [1 << i for i in range(32)]
    ranks = list(range(32)) + [0] * 32
    for w in rng.integers(1, 2**32, 200, dtype=np.uint64).tolist():
        on = bin(w).count("1")
        words += [w] * on
        ranks += list(range(on))
    got = _sparse._nth_set_bit(jnp.asarray(words, jnp.uint32), jnp.asarray(ranks, jnp.int32))
    want = [[i for i in range(32) if w >> i & 1][r] for w, r in zip(words, ranks, strict=True)]
    np.testing.assert_array_equal(np.asarray(got), want)

def test_threshold_plan_brackets_k_by_the_stated_margin():
    # Sample entries at or above the k-th largest: about Poisson(e), e = k·s/size. The
    # threshold (the r-th of the sample) is at most the k-th largest unless that count
    # exceeds r: r >= e + 4.5·sqrt(e). Entries above the threshold: r·size/s, relative
    # spread 1/sqrt(r): cap >= that · (1 + 4.5/sqrt(r)).
    for size, k in [(1 << 22, 41944), (1 << 22, 4195), (131071, 132)]:
        s, r, cap = _sparse.threshold_plan(size, k)
        e = k * s / size
        assert r >= e + 4.5 * np.sqrt(e)
        assert cap >= r * size / s * (1 + 4.5 / np.sqrt(r)) or cap == size
        assert cap < 3 * k  # the candidates stay few


@pytest.mark.parametrize("lane", _LANES)
def test_threshold_survives_ties(lane):
    size = 40000
    x = jnp.full((size,), 0.5, jnp.float32)
    idx = np.asarray(jax.jit(lambda a: _LANES[lane](a, 400)[0])(x))
    valid = idx[idx < size]
    assert valid.size == 400 and np.unique(valid).size == 400


@pytest.mark.parametrize("lane", _LANES)
@pytest.mark.parametrize("nonzero", [0, 300, 2000])  # k = 2621
def test_threshold_sends_every_nonzero_of_a_sparse_gradient(nonzero, lane):
    # fewer nonzeros than k (an embedding's gradient): all of them, and no zero, are
    # sent; the sampled threshold at 0 once kept the first positions instead (63 of 5242)
    size = 1 << 18
    rng = np.random.default_rng(nonzero)
    x = np.zeros(size, np.float32)
    nz = rng.choice(size, nonzero, replace=False)
    x[nz] = np.abs(rng.standard_normal(nonzero)) + 0.1
    k = size // 100
    idx = np.asarray(jax.jit(lambda a: _LANES[lane](a, k)[0])(x))
    assert idx.shape == (k,)
    assert sorted(idx[idx < size].tolist()) == sorted(nz.tolist())


def test_threshold_with_error_feedback_keeps_what_is_not_sent():
    # EF14 on one replica: sent + residual == gradient + old residual, element-wise
    size = 65536
    g = jnp.asarray(np.random.default_rng(12).standard_normal(size).astype(np.float32))
    codec = ajc.topk(0.01, variant="threshold", min_size=1)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    state = codec.init({"w": g})
    P = jax.sharding.PartitionSpec

    def f(x, s):
        out, s2 = codec.sync({"w": x}, s)
        return out["w"], s2

    out, s2 = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()),
                                    check_vma=False))(g, state)
    res = s2.worker.value["ef"]["w"]
    np.testing.assert_array_equal(np.asarray(out) + np.asarray(res), np.asarray(g))
    assert int((np.asarray(out) != 0).sum()) == codec.k(size)


@pytest.mark.parametrize("lane", _LANES)
def test_threshold_inside_shard_map_with_the_replication_check(lane):
    # check_vma=True, shard_map's default: the bisections' carries start from constants
    # and must vary over the mesh axis as the leaf does (they failed to trace before)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
    P = jax.sharding.PartitionSpec
    x = np.random.default_rng(13).standard_normal((4, 65536)).astype(np.float32)

    def per_replica(a):
        idx, vals = _LANES[lane](a[0], 600)
        return idx[None], vals[None]

    idx, vals = jax.jit(
        jax.shard_map(per_replica, mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P("d")))
    )(x)
    for r in range(4):
        want_idx, want_vals = jax.jit(lambda a: _LANES[lane](a, 600))(x[r])
        np.testing.assert_array_equal(np.asarray(idx[r]), np.asarray(want_idx))
        np.testing.assert_array_equal(np.asarray(vals[r]), np.asarray(want_vals))


@pytest.mark.parametrize("lane", _LANES)
@pytest.mark.parametrize("size", [5000, 131071])  # lax.top_k below 32768 in the XLA lane
def test_threshold_indices_ascend_on_every_lane(lane, size):
    x = jnp.asarray(np.random.default_rng(size).standard_normal(size).astype(np.float32))
    idx = np.asarray(jax.jit(lambda a: _LANES[lane](a, size // 100)[0])(x))
    assert np.all(np.diff(idx) > 0)
