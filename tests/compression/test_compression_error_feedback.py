"""Error feedback: the EF14 telescoping identity, the EF21 invariant, rescale merges."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from adaptjax.compression._base import SumToAll
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import adaptjax
from adaptjax import compression as ajc
from adaptjax._per_replica import stack_replicas, state_partition_specs, state_shardings

SHAPES = {"w": (40, 30), "v": (3001,), "b": (5,)}
BIG = ("w", "v")  # leaves of >= min_size elements carry error-feedback state


def _mesh(n, names=("data",), shape=None):
    devs = np.array(jax.devices()[:n])
    return Mesh(devs.reshape(shape or (n,)), names)


def _sync_fn(codec, mesh, axis, state):
    specs = state_partition_specs(state, axis)

    def f(g, s, step):
        g = jax.tree.map(lambda x: x[0], g)
        out, s = codec.sync(g, adaptjax.sync.to_local(s), axis_name=axis, step=step)
        return out, adaptjax.sync.to_global(s)

    return jax.jit(
        jax.shard_map(
            f, mesh=mesh, in_specs=(P(axis), specs, P()), out_specs=(P(), specs), check_vma=False
        )
    )


def _run(codec, mesh, axis, state, steps, rng, first_step=0):
    """Runs ``steps`` syncs; returns (sum of outputs, sum of true means, state), float64."""
    n = mesh.size
    fn = _sync_fn(codec, mesh, axis, state)
    sum_out = {k: np.zeros(s) for k, s in SHAPES.items()}
    sum_mean = {k: np.zeros(s) for k, s in SHAPES.items()}
    for t in range(steps):
        g = {k: rng.normal(size=(n, *s)).astype(np.float32) for k, s in SHAPES.items()}
        out, state = fn(g, state, jnp.int32(first_step + t))
        for k in SHAPES:
            sum_out[k] += np.asarray(out[k], np.float64)
            sum_mean[k] += g[k].astype(np.float64).mean(axis=0)
    return sum_out, sum_mean, state


def _debt(state):
    """mean_i(e_i) + e_server: what the replicas still owe the averaged gradient."""
    d = {k: np.asarray(state.worker.value["ef"][k], np.float64).mean(axis=0) for k in BIG}
    if state.server:
        for k in BIG:
            d[k] = d[k] + np.asarray(state.server.value["ef"][k], np.float64).sum(axis=0)
    return d


def _init(codec, n):
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    return stack_replicas(codec.init(params), n)


CODECS = {
    "onebit": (ajc.onebit(min_size=100), 1),
    "terngrad+ef": (ajc.terngrad(min_size=100, error_feedback="ef14"), 1),
    "bf16+ef": (ajc.bf16(min_size=100, error_feedback="ef14"), 1),
    "topk": (ajc.topk(0.02, min_size=100), 1),
    "topk->bf16": (ajc.topk(0.3, min_size=100), 1),  # 8k(N-1) > bf16: the bf16 path
    "randomk+ef": (ajc.randomk(0.1, min_size=100, error_feedback="ef14"), 1),
    "powersgd": (ajc.powersgd(3, min_size=100), 1),
    "powersgd-alternate": (ajc.powersgd(3, min_size=100, alternate=True), 1),
    "onebit-2level": (ajc.onebit(min_size=100, fast_axis="fast"), 2),
    "terngrad-2level+ef": (ajc.terngrad(min_size=100, fast_axis="fast", error_feedback=True), 2),
}


@pytest.mark.parametrize("name", sorted(CODECS))
def test_ef14_telescoping_identity(name):
    """Σ_t out_t + mean_i(e_i,T) + e_server,T = Σ_t mean_i(g_i,t), exactly (float rounding)."""
    codec, dims = CODECS[name]
    if dims == 1:
        mesh, axis = _mesh(8), "data"
    else:
        mesh, axis = _mesh(8, ("slow", "fast"), (2, 4)), ("slow", "fast")
    state = _init(codec, 8)
    out, mean, state = _run(codec, mesh, axis, state, 3, np.random.default_rng(0))
    debt = _debt(state)
    for k in BIG:
        # float32 rounding: a few ulps of the largest term per step
        tol = 5 * 3 * np.finfo(np.float32).eps * max(np.abs(debt[k]).max(), np.abs(out[k]).max())
        np.testing.assert_allclose(out[k] + debt[k], mean[k], atol=tol, rtol=0)
        # and the codec really lost something that the debt carries
        assert np.abs(out[k] - mean[k]).max() > 1e-3
    np.testing.assert_allclose(out["b"], mean["b"], atol=1e-5)  # small leaf: exact psum


@pytest.mark.parametrize(
    "codec",
    [ajc.topk(0.02, min_size=100, error_feedback="ef21"),
     ajc.onebit(min_size=100, error_feedback="ef21"),
     ajc.powersgd(3, min_size=100, error_feedback="ef21"),
     ajc.topk(0.3, min_size=100, error_feedback="ef21")],
    ids=["topk", "onebit", "powersgd", "topk->bf16"],
)
def test_ef21_invariant(codec):
    """ĝ + e_server = mean_i(g_i) after every step (e_server = 0 without owner-compute)."""
    state = _init(codec, 8)
    mesh = _mesh(8)
    fn = _sync_fn(codec, mesh, "data", state)
    rng = np.random.default_rng(1)
    for t in range(4):
        g = {k: rng.normal(size=(8, *s)).astype(np.float32) for k, s in SHAPES.items()}
        out, state = fn(g, state, jnp.int32(t))
        for k in BIG:
            gi = np.asarray(state.worker.value["g"][k], np.float64).mean(axis=0)
            ghat = np.asarray(state.shared["ghat"][k], np.float64)
            srv = np.asarray(state.server.value["ef"][k]).sum(axis=0) if state.server else 0.0
            np.testing.assert_allclose(ghat + srv, gi, atol=1e-5)
            np.testing.assert_allclose(np.asarray(out[k]), ghat, atol=1e-6)


@pytest.mark.parametrize(
    "codec",
    [ajc.onebit(min_size=100), ajc.topk(0.02, min_size=100)],
    ids=["onebit", "topk"],
)
def test_merge_replicas_keeps_the_error_feedback_debt(codec):
    """8 -> 4 replicas mid-run: the telescoping identity holds across the rescale."""
    rng = np.random.default_rng(2)
    state = _init(codec, 8)
    out1, mean1, state = _run(codec, _mesh(8), "data", state, 3, rng)
    before = _debt(state)
    merged = adaptjax.sync.merge_replicas(state, 4)
    for k in BIG:
        # "mean" keeps mean_i(e_i); SumToAll hands every new replica the whole server
        # debt (each reads the chunk it owns under the new layout on its next step).
        after = np.asarray(merged.worker.value["ef"][k], np.float64).mean(axis=0)
        if merged.server:
            srv = np.asarray(merged.server.value["ef"][k], np.float64)
            np.testing.assert_array_equal(srv, np.broadcast_to(srv[0], srv.shape))
            after = after + srv[0]
        np.testing.assert_allclose(after, before[k], atol=1e-6)
        assert merged.worker.value["ef"][k].shape[0] == 4
    mesh4 = _mesh(4)
    merged = jax.device_put(merged, state_shardings(merged, mesh4))
    out2, mean2, state = _run(codec, mesh4, "data", merged, 3, rng, first_step=3)
    debt = _debt(state)
    for k in BIG:
        np.testing.assert_allclose(out1[k] + out2[k] + debt[k], mean1[k] + mean2[k], atol=2e-5)


def test_server_buffer_merge_rule_is_sum_to_all():
    state = ajc.onebit(min_size=100).init({"w": jnp.zeros((40, 30))})
    assert state.worker.merge == "mean"
    assert state.server == ()  # the owner's error is folded into its worker residual
    old = np.zeros((4, 6), np.float32)
    old[np.arange(4), np.arange(4)] = [1.0, 2.0, 3.0, 4.0]  # each owns a different chunk
    new = SumToAll()(old, 3)
    np.testing.assert_array_equal(new, np.broadcast_to([1, 2, 3, 4, 0, 0], (3, 6)))


def test_codec_state_survives_a_checkpoint_round_trip(tmp_path):
    """EF buffers are ordinary optax state: saved and restored, never reset."""
    import orbax.checkpoint as ocp

    codec = ajc.onebit(min_size=100)
    state = _init(codec, 8)
    _, _, state = _run(codec, _mesh(8), "data", state, 2, np.random.default_rng(3))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "c", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "c", jax.eval_shape(lambda: state))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.abs(np.asarray(restored.worker.value["ef"]["w"])).max() > 0
