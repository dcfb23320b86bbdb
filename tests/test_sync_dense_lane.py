"""The dense lane as reduce-scatter + all-gather: the psum's mean, and the ring bytes in the HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import adaptjax
from adaptjax._wire import _ring_bytes

RSAG = "reduce-scatter+all-gather"
# sizes not divisible by 2, 4 or 8 (7, 15·3, 1) and a scalar leaf
SHAPES = {"w": (15, 3), "b": (7,), "one": (1,), "s": ()}


def _grads(n, seed=0, integers=False):
    rng = np.random.default_rng(seed)
    draw = (lambda s: rng.integers(-8, 8, s).astype(np.float32)) if integers else (
        lambda s: rng.standard_normal(s).astype(np.float32))
    return {k: jnp.asarray(draw((n, *s))) for k, s in SHAPES.items()}


def _synced(n, lane, grads, monitors=(), check_vma=False):
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    tx = adaptjax.sync_gradients("data", monitors=monitors, dense_lane=lane)

    def f(g):
        g = jax.tree.map(lambda x: x[0], g)  # this replica's gradient
        mean, state = tx.update(g, tx.init(g))
        return mean, state.metrics

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P(),
                               check_vma=check_vma))
    return fn, fn(grads)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_reduce_scatter_lane_averages_like_the_psum(n):
    grads = _grads(n, seed=n)
    _, (ar, _) = _synced(n, "all-reduce", grads)
    _, (rs, _) = _synced(n, RSAG, grads)
    for k in SHAPES:
        assert rs[k].shape == SHAPES[k]
        np.testing.assert_allclose(rs[k], np.mean(np.asarray(grads[k]), axis=0), rtol=1e-6,
                                   atol=1e-6)
        np.testing.assert_allclose(rs[k], ar[k], rtol=1e-6, atol=1e-7)
    # integers sum exactly in any order: the two lanes agree bit for bit
    ints = _grads(n, seed=1, integers=True)
    _, (ar, _) = _synced(n, "all-reduce", ints)
    _, (rs, _) = _synced(n, RSAG, ints)
    for k in SHAPES:
        np.testing.assert_array_equal(rs[k], ar[k])


def test_reduce_scatter_lane_sends_the_ring_bytes_and_keeps_monitors():
    n = 8
    grads = _grads(n)
    monitors = (adaptjax.GradientNoiseScale(local_batch_size=4), adaptjax.GradientNorm())
    fn, (mean, metrics) = _synced(n, RSAG, grads, monitors=monitors, check_vma=True)
    _, (mean_ar, metrics_ar) = _synced(n, "all-reduce", grads, monitors=monitors,
                                       check_vma=True)
    report = adaptjax.wire_bytes(fn, grads)
    assert report.count("reduce-scatter") == 1 and report.count("all-gather") == 1
    padded = 4 * n * -(-sum(int(np.prod(s)) for s in SHAPES.values()) // n)  # float32 bytes
    (rs,) = [c for c in report.collectives if c.kind == "reduce-scatter"]
    (ag,) = [c for c in report.collectives if c.kind == "all-gather"]
    assert rs.bytes == _ring_bytes("reduce-scatter", n, padded)
    assert ag.bytes == _ring_bytes("all-gather", n, padded / n)
    # the monitors' scalars: their own all-reduce, far smaller than the gradients
    assert all(c.bytes < rs.bytes / 4 for c in report.collectives if c.kind == "all-reduce")
    assert set(metrics) == set(metrics_ar) and metrics
    for k in metrics:
        np.testing.assert_allclose(metrics[k], metrics_ar[k], rtol=1e-5)


def test_all_reduce_lane_is_the_default_program():
    n = 4
    grads = _grads(n)
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))

    def hlo(**kw):
        tx = adaptjax.sync_gradients("data", **kw)
        f = lambda g: tx.update(jax.tree.map(lambda x: x[0], g),
                                tx.init(jax.tree.map(lambda x: x[0], g)))[0]
        fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P(),
                                   check_vma=False))
        return fn.lower(grads).as_text()

    assert hlo(dense_lane="all-reduce") == hlo()


def test_bad_dense_lane_says_the_choices():
    with pytest.raises(ValueError, match=r"dense_lane must be one of \('all-reduce', "
                                         r"'reduce-scatter\+all-gather'\), got 'ring'"):
        adaptjax.sync_gradients("data", dense_lane="ring")
