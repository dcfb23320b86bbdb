"""Quantizer buckets: the cost model's bucketing, one exchange per bucket, the same identities."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from adaptjax.compression._quantizers import bucket_plan
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import adaptjax
from adaptjax import compression as ajc
from adaptjax.costs import buckets

SHAPES = {"b": (5,), "v": (3001,), "w": (40, 30)}  # b: under min_size, the float32 psum
BIG = ("v", "w")
BUCKET = 4 * 1000  # w (1200) split in 2, v (3001) in 4: 6 buckets


def _fn(codec, n, state):
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    specs = adaptjax.state_partition_specs(state, "data")

    def f(g, s, step):
        g = jax.tree.map(lambda x: x[0], g)
        out, s = codec.sync(g, adaptjax.to_local(s), axis_name="data", step=step)
        return out, adaptjax.to_global(s)

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), specs, P()),
                                 out_specs=(P(), specs), check_vma=False))


def _state(codec, n):
    return adaptjax.stack_replicas(codec.init({k: jnp.zeros(s) for k, s in SHAPES.items()}), n)


def _grads(n, rng):
    return {k: rng.normal(size=(n, *s)).astype(np.float32) for k, s in SHAPES.items()}


def test_bucket_plan_is_the_cost_models_bucketing():
    rng = np.random.default_rng(0)
    for _ in range(50):
        sizes = [int(s) for s in rng.integers(1, 5000, rng.integers(1, 8))]
        unit = int(rng.integers(1, 6000))
        plan = bucket_plan(sizes, unit)
        assert [4.0 * sum(z - a for _, a, z in b) for b in plan] == buckets(
            [4 * s for s in sizes], 4 * unit)
        # every element once, in order
        assert [(i, a, z) for b in plan for i, a, z in b][0][1] == 0
        covered = {}
        for b in plan:
            for i, a, z in b:
                assert covered.get(i, 0) == a < z
                covered[i] = z
        assert covered == dict(enumerate(sizes))


@pytest.mark.parametrize("n", [2, 4])
def test_each_bucket_is_one_exchange(n):
    codec = ajc.qsgd(min_size=100, bucket_bytes=BUCKET)
    state = _state(codec, n)
    g = _grads(n, np.random.default_rng(0))
    report = adaptjax.wire_bytes(_fn(codec, n, state), g, state, jnp.int32(0))
    lane = [4 * int(np.prod(SHAPES[k])) for k in sorted(SHAPES) if k in BIG]  # tree order
    count = len(buckets(lane, BUCKET))
    assert count == 6
    # owner-compute: an all-to-all and an all-gather per bucket; 2 replicas: one all-gather
    assert report.count("all-to-all") == (count if n > 2 else 0)
    assert report.count("all-gather") == count
    assert report.count("all-reduce") == 1  # the small leaf's float32 psum
    default = adaptjax.wire_bytes(_fn(ajc.qsgd(min_size=100), n, state), g, state, jnp.int32(0))
    assert report.count("all-gather") - default.count("all-gather") == count - 1


def test_one_bucket_holding_the_lane_is_the_default_exactly():
    n = 4
    g = _grads(n, np.random.default_rng(1))
    outs = []
    for bucket in (None, 4 * 10**6):
        codec = ajc.qsgd(min_size=100, bucket_bytes=bucket)
        state = _state(codec, n)
        outs.append(_fn(codec, n, state)(g, state, jnp.int32(3))[0])
    for k in SHAPES:
        np.testing.assert_array_equal(outs[0][k], outs[1][k])


def test_bf16_buckets_round_like_one_exchange():
    """bf16 is deterministic and element-wise: cutting the lane changes no bit."""
    n = 8
    g = _grads(n, np.random.default_rng(2))
    outs = []
    for bucket in (None, BUCKET):
        codec = ajc.bf16(min_size=100, bucket_bytes=bucket)
        state = _state(codec, n)
        outs.append(_fn(codec, n, state)(g, state, jnp.int32(0))[0])
    for k in SHAPES:
        np.testing.assert_array_equal(outs[0][k], outs[1][k])
        np.testing.assert_allclose(outs[1][k], g[k].mean(axis=0), atol=2e-2)


def test_ef14_telescoping_identity_holds_with_buckets():
    """Σ_t out_t + mean_i(e_i,T) = Σ_t mean_i(g_i,t) (owner errors folded into residuals)."""
    n, steps = 4, 3
    codec = ajc.onebit(min_size=100, bucket_bytes=BUCKET)
    state = _state(codec, n)
    fn = _fn(codec, n, state)
    rng = np.random.default_rng(3)
    out = {k: np.zeros(s) for k, s in SHAPES.items()}
    mean = {k: np.zeros(s) for k, s in SHAPES.items()}
    for t in range(steps):
        g = _grads(n, rng)
        o, state = fn(g, state, jnp.int32(t))
        for k in SHAPES:
            out[k] += np.asarray(o[k], np.float64)
            mean[k] += g[k].astype(np.float64).mean(axis=0)
    for k in BIG:
        debt = np.asarray(state.worker.value["ef"][k], np.float64).mean(axis=0)
        tol = 5 * steps * np.finfo(np.float32).eps * max(np.abs(debt).max(),
                                                         np.abs(out[k]).max())
        np.testing.assert_allclose(out[k] + debt, mean[k], atol=tol, rtol=0)
        assert np.abs(out[k] - mean[k]).max() > 1e-3  # something was lost and is owed


def test_bucketed_qsgd_stays_unbiased():
    """The mean over steps (fresh seeds each step) of one gradient's sync is its mean."""
    n, steps = 4, 100
    codec = ajc.qsgd(1, min_size=100, block=64, bucket_bytes=BUCKET)
    state = _state(codec, n)
    g = _grads(n, np.random.default_rng(4))
    fn = _fn(codec, n, state)
    ys = {k: [] for k in BIG}
    for t in range(steps):
        o, _ = fn(g, state, jnp.int32(t))
        for k in BIG:
            ys[k].append(np.asarray(o[k], np.float64).ravel())
    for k in BIG:
        y = np.stack(ys[k])
        err = y.mean(axis=0) - g[k].astype(np.float64).mean(axis=0).ravel()
        # the summed error over elements, at 4 sigma (its standard error from the draws)
        total_se = np.sqrt(np.sum(y.var(axis=0, ddof=1)) / steps)
        assert abs(err.sum()) <= 4 * total_se
        assert np.mean(y.std(axis=0) > 0) > 0.5  # really random


@pytest.mark.parametrize("bad", [0, 6, -4, 2.5, True, "4096"])
def test_bad_bucket_bytes_is_one_line(bad):
    with pytest.raises(ValueError, match=r"^bucket_bytes must be None or a positive multiple "
                                         r"of 4 \(bytes of float32 gradient per exchange\), "
                                         r"got .*; e\.g\. 4 << 20$"):
        ajc.onebit(bucket_bytes=bad)


def test_bucket_bytes_shows_in_the_key_only_when_set():
    assert "bucket_bytes" not in adaptjax.codec_key(ajc.qsgd())
    assert "bucket_bytes=4096" in adaptjax.codec_key(ajc.qsgd(bucket_bytes=4096))
    assert ajc.qsgd(bucket_bytes=4096) != ajc.qsgd()
