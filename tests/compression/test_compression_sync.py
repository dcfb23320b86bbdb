"""Codecs inside training: the optax form, sync_gradients(codec=), the step builder,
odd shapes, bf16 parameters, and the noise-scale monitor with a codec on."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import adaptjax
from adaptjax import compression as ajc
from adaptjax._chain import chain as guarded_chain  # sync_chain's (and the controller's) chain
from adaptjax._per_replica import stack_replicas, state_partition_specs

MESH = Mesh(np.array(jax.devices()), ("data",))
N = 8

ALL = {
    "bf16": ajc.bf16(min_size=64),
    "fp16": ajc.fp16(min_size=64),
    "onebit": ajc.onebit(min_size=64, block=64),
    "terngrad": ajc.terngrad(min_size=64, block=64),
    "qsgd": ajc.qsgd(3, min_size=64, block=64),
    "natural": ajc.natural(min_size=64, block=64),
    "topk": ajc.topk(0.05, min_size=64),
    "topk-sampled": ajc.topk(0.05, min_size=64, variant="sampled"),
    "randomk": ajc.randomk(0.1, min_size=64),
    "dgc": ajc.dgc(0.05, min_size=64, warmup_steps=4, warmup_densities=(0.1,)),
    "powersgd": ajc.powersgd(2, min_size=64),
}

# odd shapes: a scalar, lengths not divisible by N or a block, a 3-D leaf, a 1-D big leaf
ODD = {"s": (), "v": (1001,), "t": (5, 7, 9), "m": (33, 17), "b": (3,)}


def _per_replica_out(codec, grads, params):
    """Runs codec.update in a user's shard_map (check_vma on); returns every replica's output."""
    state = stack_replicas(codec.init(params), N)
    specs = state_partition_specs(state)

    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=MESH, in_specs=(P("data"), specs), out_specs=(P("data"), specs)
    )
    def f(g, s):
        g = jax.tree.map(lambda x: x[0], g)
        out, s = codec.update(g, adaptjax.sync.to_local(s))
        return jax.tree.map(lambda x: x[None], out), adaptjax.sync.to_global(s)

    return f(grads, state)


@pytest.mark.parametrize("name", sorted(ALL))
def test_odd_shapes_identical_on_every_replica(name):
    codec = ALL[name]
    rng = np.random.default_rng(0)
    # integers in [-4, 4]: the bf16 stages and the small-leaf psum are exact on them
    grads = {
        k: jnp.asarray(rng.integers(-4, 5, (N, *s)).astype(np.float32)) for k, s in ODD.items()
    }
    params = {k: jnp.zeros(s) for k, s in ODD.items()}
    out, state = _per_replica_out(codec, grads, params)
    for k, s in ODD.items():
        o = np.asarray(out[k])
        assert o.shape == (N, *s) and o.dtype == np.float32
        assert np.isfinite(o).all()
        np.testing.assert_array_equal(o, np.broadcast_to(o[0], o.shape))  # same everywhere
    mean = {k: np.asarray(g).mean(axis=0) for k, g in grads.items()}
    for k in ("s", "b"):  # under min_size: one exact float32 psum
        np.testing.assert_allclose(np.asarray(out[k][0]), mean[k], rtol=1e-6)
    if name in ("bf16", "fp16"):
        for k in ODD:
            np.testing.assert_allclose(np.asarray(out[k][0]), mean[k], rtol=1e-6)
    if name == "powersgd":  # the 1-D leaf goes bf16 (owner-compute), exact on these values
        np.testing.assert_allclose(np.asarray(out["v"][0]), mean["v"], rtol=1e-6)
    assert int(state.count) == 1


@pytest.mark.parametrize("name", ["onebit", "topk", "powersgd", "bf16"])
def test_bf16_parameters(name):
    codec = ALL[name]
    rng = np.random.default_rng(1)
    shapes = {"w": (40, 30), "b": (5,)}
    grads = {k: jnp.asarray(rng.normal(size=(N, *s)), jnp.bfloat16) for k, s in shapes.items()}
    params = {k: jnp.zeros(s, jnp.bfloat16) for k, s in shapes.items()}
    out, state = _per_replica_out(codec, grads, params)
    assert all(o.dtype == jnp.bfloat16 for o in jax.tree.leaves(out))
    ef = jax.tree.leaves(state.worker.value) if state.worker else []
    assert all(e.dtype == jnp.float32 for e in ef)  # residuals stay in float32
    w = np.asarray(out["w"][0], np.float32)
    mean = np.asarray(grads["w"], np.float32).mean(axis=0)
    rel = np.linalg.norm(w - mean) / np.linalg.norm(mean)
    assert rel < (0.01 if name == "bf16" else 3.0)


def test_optax_chain_form():
    codec = ajc.topk(0.02, axis_name="data", min_size=64)
    tx = optax.chain(codec, optax.sgd(1.0))
    params = {"w": jnp.zeros((20, 10))}
    state = stack_replicas(tx.init(params), N)
    specs = state_partition_specs(state)
    g = jnp.asarray(np.random.default_rng(2).normal(size=(N, 20, 10)).astype(np.float32))

    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=MESH, in_specs=(P("data"), specs), out_specs=(P(), specs)
    )
    def f(g, s):
        upd, s = tx.update({"w": g[0]}, adaptjax.sync.to_local(s), params)
        return upd, adaptjax.sync.to_global(s)

    upd, state = f(g, state)
    # first step (no residual yet): the mean over replicas of each one's top-4, of which
    # each of the 8 owners keeps its ceil(4/8) = 1 largest (the rest stays in the residuals)
    want = -np.mean([np.asarray(codec.decode(codec.encode(x), x.shape)) for x in g], axis=0)
    got = np.asarray(upd["w"])
    kept = got != 0
    assert 0 < kept.sum() <= N
    np.testing.assert_allclose(got[kept], want[kept], rtol=1e-6)
    ef = np.asarray(state[0].worker.value["ef"]["w"]).mean(axis=0)
    np.testing.assert_allclose(-got + ef, np.asarray(g).mean(axis=0), atol=1e-6)
    init, update = ajc.topk(0.1)  # unpacks like an optax transformation
    assert callable(init) and callable(update)


def _mlp_loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


@pytest.mark.parametrize("codec", [ajc.onebit(min_size=256), ajc.topk(0.05, min_size=256)],
                         ids=["onebit", "topk"])
def test_data_parallel_step_with_codec_state(codec):
    """init_state shards the EF buffers over 'data'; several steps run and lower the loss."""
    rng = np.random.default_rng(3)
    params = {
        "w1": jnp.asarray(rng.normal(size=(16, 32)).astype(np.float32) / 4),
        "b1": jnp.zeros(32),
        "w2": jnp.asarray(rng.normal(size=(32, 8)).astype(np.float32) / 6),
    }
    tx = optax.chain(adaptjax.sync_gradients("data", codec=codec), optax.sgd(0.1))
    state = adaptjax.init_state(params, tx, MESH)
    ef = state.opt_state[0].codec_state.worker.value["ef"]["w1"]
    assert ef.shape == (N, 16, 32) and ef.sharding.spec == P("data")
    assert state.opt_state[0].codec_state.worker.value["ef"]["b1"] is None  # small: no state
    step = adaptjax.data_parallel_step(_mlp_loss, tx, MESH)
    x = rng.normal(size=(64, 16)).astype(np.float32)
    batch = {"x": x, "y": np.tanh(x @ rng.normal(size=(16, 8))).astype(np.float32)}
    losses = []
    for _ in range(8):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    assert int(state.opt_state[0].codec_state.count) == 8
    ef = np.asarray(state.opt_state[0].codec_state.worker.value["ef"]["w1"])
    assert not np.allclose(ef[0], ef[1])  # residuals differ per replica


@pytest.mark.parametrize("codec", [ajc.onebit(min_size=256), ajc.topk(0.05, min_size=256)],
                         ids=["onebit", "topk"])
def test_a_skipped_step_keeps_codec_residuals_with_either_chain(codec):
    """guarded_chain runs the codec before the guard decides; a non-finite step must
    still leave every error-feedback residual, count and monitor as it was, and both
    chains must train identically."""
    rng = np.random.default_rng(5)
    params = {
        "w1": jnp.asarray(rng.normal(size=(16, 32)).astype(np.float32) / 4),
        "b1": jnp.zeros(32),
        "w2": jnp.asarray(rng.normal(size=(32, 8)).astype(np.float32) / 6),
    }
    x = rng.normal(size=(64, 16)).astype(np.float32)
    good = {"x": x, "y": np.tanh(x @ rng.normal(size=(16, 8))).astype(np.float32)}
    bad = {"x": x.copy(), "y": good["y"]}
    bad["x"][9, 3] = np.nan  # one example on replica 1
    finals = []
    for chain in (optax.chain, guarded_chain):
        sync = adaptjax.sync_gradients("data", codec=codec, monitors=(adaptjax.GradientNorm(),))
        tx = chain(sync, optax.sgd(0.1))
        state = adaptjax.init_state(params, tx, MESH)
        step = adaptjax.data_parallel_step(_mlp_loss, tx, MESH)
        for _ in range(2):
            state, _ = step(state, good)
        before = jax.device_get((state.params, state.opt_state))
        state, metrics = step(state, bad)
        assert float(metrics["nonfinite"]) == 1.0
        after = jax.device_get((state.params, state.opt_state))
        for a, c in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
        state, _ = step(state, good)
        assert int(state.opt_state[0].codec_state.count) == 3  # the skipped step not counted
        finals.append(jax.device_get((state.params, state.opt_state)))
    for a, c in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(finals[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-7)


def test_noise_scale_with_a_codec_matches_the_analytic_value():
    """Per-example gradient w − x, x ~ N(μ, σ²I): B_simple = dσ²/‖w − μ‖².

    With a codec, the codec runs on every step and the monitors see the exact
    mean at shared random coordinates (``codec_sample``); the estimate must
    match the analytic value like the dense run does.
    """
    d, b, sigma, steps = 2048, 4, 1.0, 160
    g2 = d * sigma**2 / 32.0  # analytic B_simple = 32
    w = jnp.zeros(d)
    mu = jnp.full((d,), np.sqrt(g2 / d), jnp.float32)

    def loss(p, batch):
        return 0.5 * jnp.mean(jnp.sum((p["w"] - batch["x"]) ** 2, axis=-1))

    rng = np.random.default_rng(4)
    batches = [
        {"x": (np.asarray(mu) + sigma * rng.normal(size=(N * b, d))).astype(np.float32)}
        for _ in range(steps)
    ]
    results = {}
    for name, codec in (("codec", ajc.onebit()), ("dense", None)):
        mon = adaptjax.GradientNoiseScale(decay=0.95)
        sync = adaptjax.sync_gradients("data", codec=codec, monitors=(mon,))
        tx = optax.chain(sync, optax.sgd(0.0))
        state = adaptjax.init_state({"w": w}, tx, MESH)
        step = adaptjax.data_parallel_step(loss, tx, MESH)
        for batch in batches:
            state, metrics = step(state, batch)
            # keep few steps in flight: 8 simulated devices on 2 cores can starve a
            # device thread past XLA's collective rendezvous timeout otherwise
            jax.block_until_ready(metrics)
        results[name] = float(metrics["noise_scale"])
        if codec is not None:
            assert int(state.opt_state[0].codec_state.count) == steps  # codec on every step
    assert results["codec"] == pytest.approx(32.0, rel=0.10)
    assert results["dense"] == pytest.approx(32.0, rel=0.10)


def test_shared_coordinates_estimate_each_leafs_square_norm_without_bias():
    # One random draw serves every sampled leaf; each leaf must still get its own
    # uniform coordinates, weighted d / k, so that E[w * sum x[idx]^2] = |x|^2 per leaf.
    from adaptjax._sync import _sample_coordinates

    rng = np.random.default_rng(6)
    tree = {"a": rng.normal(size=(300, 100)), "b": rng.normal(size=(7,)),
            "c": 3.0 + rng.normal(size=(5000,))}
    tree = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)
    leaves = jax.tree.leaves(tree)

    @jax.jit
    def estimates(count):
        coords = _sample_coordinates(tree, count, 0.05)
        return jnp.stack([w * jnp.sum(jnp.square(x.reshape(-1)[idx]))
                          for x, (idx, w) in zip(leaves, coords, strict=True)])

    draws = np.stack([np.asarray(estimates(jnp.int32(c))) for c in range(300)])
    exact = np.array([float(jnp.sum(jnp.square(x))) for x in leaves])
    np.testing.assert_allclose(draws[:, 1], exact[1], rtol=1e-5)  # "b" is taken whole
    stderr = draws.std(axis=0) / np.sqrt(len(draws))
    assert np.all(np.abs(draws.mean(axis=0) - exact) <= 4 * stderr + 1e-5 * exact)  # + f32 sums
    assert stderr[0] > 0 and stderr[2] > 0  # the sampled leaves do vary


def test_powersgd_leaf_thinner_than_the_rank_syncs_in_the_bf16_lane():
    # issue 10 item 5: (1001, 3) under the default rank 4 goes bf16 (exact on small integers)
    rng = np.random.default_rng(5)
    grads = {"w": jnp.asarray(rng.integers(-4, 5, (N, 1001, 3)).astype(np.float32))}
    out, _ = _per_replica_out(ajc.powersgd(), grads, {"w": jnp.zeros((1001, 3))})
    np.testing.assert_array_equal(np.asarray(out["w"][0]), np.asarray(grads["w"]).mean(axis=0))


@pytest.mark.parametrize(
    "codec", [None, ajc.onebit(min_size=64, block=64)], ids=["dense", "onebit"]
)
def test_deferred_update_with_sums_completes_to_the_eager_result(codec):
    # update_with_sums(deferred=True) hands back the old state and complete(out), which the
    # step calls only in its update branch: complete must give exactly the eager call's
    # mean and new state (codec residuals, counts, monitor EMAs and metrics).
    sync = adaptjax.sync_gradients(
        "data", codec=codec, monitors=(adaptjax.GradientNoiseScale(), adaptjax.GradientNorm())
    )
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}
    rng = np.random.default_rng(2)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=(N, *p.shape)), jnp.float32), params)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=MESH, in_specs=P("data"), out_specs=P(),
                       check_vma=False)
    def f(g):
        g = jax.tree.map(lambda x: x[0], g)
        state = sync.init(params)
        kw = dict(extra_sums=jnp.ones(()), local_batch_size=4)
        out, finish, new, total = sync.update_with_sums(g, state, **kw)
        out_d, complete, old, total_d = sync.update_with_sums(g, state, deferred=True, **kw)
        mean_d, new_d = complete(out_d)
        same = [jnp.array_equal(a, b) for a, b in
                zip(jax.tree.leaves((finish(out), new, total)),
                    jax.tree.leaves((mean_d, new_d, total_d)), strict=True)]
        kept = [jnp.array_equal(a, b) for a, b in
                zip(jax.tree.leaves(old), jax.tree.leaves(state), strict=True)]
        return jnp.stack(same), jnp.stack(kept), new.count, new.metrics["grad_norm"]

    same, kept, count, norm = f(grads)
    assert np.all(np.asarray(same)) and np.all(np.asarray(kept))
    assert int(count) == 1 and float(norm) > 0.0  # the eager call did update


def _one_device_step(tx, grads, check_vma):
    """``tx.update`` in a user's ``jax.shard_map`` on a 1-device mesh: mean ``P()``, state."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    state = stack_replicas(tx.init(grads), 1)
    specs = state_partition_specs(state)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), specs),
                       out_specs=(P(), specs), check_vma=check_vma)
    def f(g, s):
        out, s = tx.update(g, adaptjax.sync.to_local(s))
        return out, adaptjax.sync.to_global(s)

    return f(grads, state)


@pytest.mark.parametrize("name", [*sorted(ALL), "sync_gradients(powersgd)"])
def test_one_device_mesh_with_check_vma(name):
    """Issue 45: at one replica no collective runs, and shard_map's replication check
    (``check_vma=True``, its default) could not infer that the mean is replicated."""
    tx = adaptjax.sync_gradients("data", codec=ALL["powersgd"]) if name.startswith("sync") \
        else ALL[name]
    rng = np.random.default_rng(4)
    # a rank-2 matrix (PowerSGD at rank 2 returns it) and a 1-D leaf
    grads = {"m": jnp.asarray(rng.normal(size=(48, 2)) @ rng.normal(size=(2, 40)), jnp.float32),
             "v": jnp.asarray(rng.normal(size=1001), jnp.float32)}
    checked, unchecked = (_one_device_step(tx, grads, vma) for vma in (True, False))
    for a, b in zip(jax.tree.leaves(checked), jax.tree.leaves(unchecked), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same step
    if "powersgd" in name:
        np.testing.assert_allclose(checked[0]["m"], grads["m"], atol=1e-4)
