"""Top-k / DGC through owners (issue 10 item 6): routed pairs, owner re-selection, bytes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from adaptjax import compression as ajc

N = 8
MESH = Mesh(np.array(jax.devices()[:N]), ("data",))


def _sync(codec, grads):
    state = codec.init({"w": jnp.zeros(grads.shape[1:])})

    def f(g):
        out, new = codec.sync({"w": g[0]}, state, axis_name="data", step=jnp.int32(0))
        return out["w"][None], new.worker.value["ef"]["w"][None]

    fn = jax.shard_map(f, mesh=MESH, in_specs=P("data"), out_specs=(P("data"), P("data")),
                       check_vma=False)
    return [np.asarray(a) for a in jax.jit(fn)(grads)]


def test_owners_return_the_exact_mean_when_nothing_overflows():
    # the same 82-entry support on every replica, spread evenly: each owner receives at most
    # 11 distinct indices (it keeps ceil(82/8) = 11, capacity ceil(164/8) = 21): exact mean
    d, k = 8192, 82
    support = np.arange(k) * 100
    rng = np.random.default_rng(0)
    g = np.zeros((N, d), np.float32)
    g[:, support] = rng.uniform(1.0, 2.0, (N, k)) * rng.choice([-1, 1], (N, k))
    g += rng.normal(0, 1e-4, (N, d)).astype(np.float32)  # below every selected entry
    out, ef = _sync(ajc.topk(0.01, min_size=64), jnp.asarray(g))
    want = np.zeros(d, np.float32)
    want[support] = g[:, support].mean(axis=0)
    np.testing.assert_allclose(out[0], want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out, np.broadcast_to(out[0], out.shape))
    # error feedback keeps everything not sent: identity per replica and in the mean
    np.testing.assert_allclose(out[0] + ef.mean(axis=0), g.mean(axis=0), atol=1e-6)


@pytest.mark.parametrize("variant", ["threshold", "exact"])
def test_sums_that_cancel_leave_owners_slots_and_the_mean_stays_exact(variant):
    # 75 entries on every replica, and one more at the end of owners 1-7's ranges that only
    # replicas 1 and 2 send, +v and -v: those sums cancel, so owners 1-7 have fewer nonzero
    # sums than the 11 they keep, and the selections fill (lax.top_k) or leave (the native
    # kernel, which never picks a zero) the free slots; either way no index may be sent twice
    d = 8192
    shared = np.arange(75) * 109
    late = np.arange(1, 8) * 1024 + 1000
    rng = np.random.default_rng(2)
    g = np.zeros((N, d), np.float32)
    g[:, shared] = rng.uniform(1.0, 2.0, (N, 75))
    v = rng.uniform(5.0, 6.0, 7).astype(np.float32)
    g[1, late], g[2, late] = v, -v
    out, ef = _sync(ajc.topk(0.01, min_size=64, variant=variant), jnp.asarray(g))
    want = g.mean(axis=0)
    np.testing.assert_allclose(out[0], want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out[0] + ef.mean(axis=0), want, atol=1e-6)


def test_owner_drops_go_to_the_owner_residual():
    # disjoint supports: every owner receives N times more distinct indices than it keeps
    d, k = 8192, 82
    rng = np.random.default_rng(1)
    g = rng.normal(0, 1e-4, (N, d)).astype(np.float32)
    for i in range(N):
        g[i, (np.arange(k) * 100 + i) % d] = rng.uniform(1.0, 2.0, k)
    out, ef = _sync(ajc.topk(0.01, min_size=64), jnp.asarray(g))
    assert np.count_nonzero(out[0]) <= N * math.ceil(k / N)
    np.testing.assert_allclose(out[0] + ef.mean(axis=0), g.mean(axis=0), atol=1e-5)


def test_topk_sends_20x_fewer_bytes_than_fp32_at_16_and_32():
    # the plan's formula (checked against compiled HLO in test_compression_wire.py)
    model = {"w1": jnp.zeros((784, 2048)), "w2": jnp.zeros((2048, 2048)),
             "w3": jnp.zeros((2048, 1024)), "b": jnp.zeros((2048,))}
    for n in (16, 32):
        plan = ajc.plan(model, ajc.topk(0.01), n, show=False)
        assert plan.fp32_bytes / plan.bytes >= 20, (n, plan.fp32_bytes / plan.bytes)


@pytest.mark.parametrize("n", [2, 8])  # one all-gather under 4 replicas, owners from 4 on
def test_every_leaf_gets_its_own_pairs_and_feedback_keeps_the_rest(n):
    # leaves of several sizes, some inside one owner's range and some across several:
    # each leaf decodes only its own pairs, so out + mean(residual) == mean(g) leaf by leaf
    shapes = {"a": (50, 100), "b": (3000,), "c": (70,), "d": (12000,), "e": (7, 9, 11)}
    rng = np.random.default_rng(n)
    grads = {k: jnp.asarray(rng.standard_normal((n, *s)).astype(np.float32))
             for k, s in shapes.items()}
    codec = ajc.topk(0.02, min_size=64)
    state = codec.init({k: jnp.zeros(s) for k, s in shapes.items()})
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))

    def f(g):
        out, new = codec.sync({k: v[0] for k, v in g.items()}, state, axis_name="data",
                              step=jnp.int32(0))
        res = new.worker.value["ef"]
        return {k: v[None] for k, v in out.items()}, {k: v[None] for k, v in res.items()}

    out, res = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"),
                                     out_specs=(P("data"), P("data"))))(grads)
    for k in shapes:
        o, r, g = np.asarray(out[k]), np.asarray(res[k]), np.asarray(grads[k])
        np.testing.assert_array_equal(o, np.broadcast_to(o[0], o.shape))
        np.testing.assert_allclose(o[0] + r.mean(axis=0), g.mean(axis=0), atol=2e-6)
        assert np.count_nonzero(o[0]) > 0
