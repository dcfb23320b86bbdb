"""1-bit Adam: optax.adam during the warm-up, then a frozen variance and 1-bit momentum.

Identities checked (``N`` replicas, ``F = freeze_step``, ``m_t`` the state's
momentum after step ``t``, ``e_i,t`` replica ``i``'s error-feedback residual):

* warm-up (``t <= F``): the update is ``optax.adam``'s on ``mean_i(g_i,t)``, bit for bit;
* after it, ``nu`` never changes, and each step the codec averages what the
  replicas send, ``x_i,t = b1·m_{t−1} + (1 − b1)·g_i,t + e_i,t−1``, into
  ``m_t + mean_i(e_i,t) = mean_i(x_i,t)`` (EF14 with the owner's re-encoding
  error folded into its residual), so with ``e_i,F = 0``, summed over ``t``:
  ``Σ_t m_t + mean_i(e_i,T) = Σ_t (b1·m_{t−1} + (1 − b1)·mean_i(g_i,t))``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from adaptjax.compression import _onebit_adam as ajc_onebit_adam
from jax.sharding import PartitionSpec as P

import adaptjax
from adaptjax import compression as ajc
from adaptjax._per_replica import stack_replicas, state_partition_specs

N = 8
SHAPES = {"w": (64, 40), "b": (40,)}  # w (2560) is compressed, b (40) goes in a float32 psum


def _params():
    k = jax.random.split(jax.random.key(0), 2)
    return {"w": jax.random.normal(k[0], SHAPES["w"]) * 0.1, "b": jnp.zeros(SHAPES["b"])}


def _loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def _batch(i, rows=32):
    rng = np.random.default_rng(i)
    return {"x": rng.normal(size=(rows, 64)).astype(np.float32),
            "y": rng.normal(size=(rows, 40)).astype(np.float32)}


def _injected(factory, lr=0.01, **kw):
    return optax.inject_hyperparams(factory, hyperparam_dtype=jnp.float32)(lr, **kw)


def _shard_update(tx, mesh, state):
    """``tx.update`` in a plain user ``jax.shard_map`` step (global view in and out)."""
    specs = state_partition_specs(state, "data")

    def f(g, s):
        u, s = tx.update(jax.tree.map(lambda x: x[0], g), adaptjax.sync.to_local(s))
        return u, adaptjax.sync.to_global(s)

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), specs),
                                 out_specs=(P(), specs)))


def _grads(rng, scale=1.0):
    """Per-replica gradients, multiples of 1/16 below 1: their mean is exact in float32."""
    return {k: (rng.integers(-15, 16, size=(N, *s)) / 16 * scale).astype(np.float32)
            for k, s in SHAPES.items()}


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_warm_up_is_optax_adam_bit_for_bit_through_data_parallel_step(weight_decay):
    mesh = adaptjax.make_mesh(N)
    tx = _injected(ajc.onebit_adam, weight_decay=weight_decay, freeze_step=4)
    dense = (_injected(optax.adamw, weight_decay=weight_decay) if weight_decay
             else _injected(optax.adam))
    ref = optax.chain(adaptjax.sync_gradients("data"), dense)
    s, r = adaptjax.init_state(_params(), tx, mesh), adaptjax.init_state(_params(), ref, mesh)
    step = adaptjax.data_parallel_step(_loss, tx, mesh, donate=False)
    ref_step = adaptjax.data_parallel_step(_loss, ref, mesh, donate=False)
    for i in range(4):
        s, _ = step(s, _batch(i))
        r, _ = ref_step(r, _batch(i))
        for k in SHAPES:
            np.testing.assert_array_equal(s.params[k], r.params[k])
    adam = r.opt_state[1].inner_state[0]
    ours = s.opt_state.inner_state
    for k in SHAPES:
        np.testing.assert_array_equal(ours.mu[k], adam.mu[k])
        np.testing.assert_array_equal(ours.nu[k], adam.nu[k])
    assert not np.asarray(ours.feedback.worker.value["ef"]["w"]).any()  # nothing owed yet
    s, _ = step(s, _batch(4))  # the first compressed step differs: the momentum is 1-bit
    r, _ = ref_step(r, _batch(4))
    assert not np.array_equal(s.params["w"], r.params["w"])


@pytest.mark.parametrize("lr", [0.01, optax.linear_schedule(0.01, 0.001, 3)],
                         ids=["constant", "schedule"])
def test_warm_up_is_optax_adam_bit_for_bit_in_a_user_shard_map(lr):
    """Against the user's own step: a psum mean, then ``optax.adam``, in ``shard_map`` too.

    (A reference jitted outside ``shard_map`` differs in the last bit of ``nu``
    from the second step on: XLA fuses ``b2·nu + (1 − b2)·g²`` differently there.)
    """
    mesh = adaptjax.make_mesh(N)
    tx = ajc.onebit_adam(lr, freeze_step=3)
    state = stack_replicas(tx.init(_params()), N)
    update = _shard_update(tx, mesh, state)
    adam = optax.adam(lr)
    ref_state = adam.init(_params())

    def ref_fn(g, s):
        return adam.update(jax.tree.map(lambda x: jax.lax.psum(x[0], "data") / N, g), s)

    ref_update = jax.jit(jax.shard_map(ref_fn, mesh=mesh, in_specs=(P("data"), P()),
                                       out_specs=P()))
    rng = np.random.default_rng(0)
    for _ in range(3):
        g = _grads(rng)
        u, state = update(g, state)
        ref, ref_state = ref_update(g, ref_state)
        for k in SHAPES:
            np.testing.assert_array_equal(u[k], ref[k])
            np.testing.assert_array_equal(state.nu[k], ref_state[0].nu[k])
    assert int(state.count) == 3


def _after_freeze(steps, lr=0.01, b1=0.9, b2=0.999, eps=1e-8, freeze=2):
    """Runs ``freeze + steps`` updates in a user shard_map; returns what each step saw."""
    mesh = adaptjax.make_mesh(N)
    tx = ajc.onebit_adam(lr, b1, b2, eps, freeze_step=freeze)
    state = stack_replicas(tx.init(_params()), N)
    update = _shard_update(tx, mesh, state)
    rng = np.random.default_rng(1)
    history = []
    for _ in range(freeze + steps):
        g = _grads(rng, scale=0.1)
        before = state
        u, state = update(g, state)
        history.append((g, before, u, state))
    return history[freeze:]


def test_after_the_freeze_nu_is_constant_and_the_update_uses_it():
    lr, b1, b2, eps, freeze = 0.01, 0.9, 0.999, 1e-8, 2
    history = _after_freeze(4, lr, b1, b2, eps, freeze)
    frozen = history[0][1].nu
    for t, (_, _, u, state) in enumerate(history, start=freeze + 1):
        for k in SHAPES:
            np.testing.assert_array_equal(state.nu[k], frozen[k])
            m = np.asarray(state.mu[k], np.float64)
            v = np.asarray(frozen[k], np.float64) / (1 - b2**freeze)
            bound = float(ajc_onebit_adam.adam_step_bound(b1, b2))
            want = -lr * np.clip((m / (1 - b1**t)) / (np.sqrt(v) + eps), -bound, bound)
            # float32 rounds b2**F to an ulp of 1: relative eps32 / (1 − b2**F) in ν̂
            rtol = 8 * np.finfo(np.float32).eps / (1 - b2**freeze)
            np.testing.assert_allclose(u[k], want, rtol=rtol, atol=0)


def _run(tx, grads):
    """``tx`` in a user shard_map over the per-replica ``grads``; each step's ``(u, state)``."""
    mesh = adaptjax.make_mesh(N)
    state = stack_replicas(tx.init(_params()), N)
    update = _shard_update(tx, mesh, state)
    out = []
    for g in grads:
        u, state = update(g, state)
        out.append((u, state))
    return out


@pytest.mark.filterwarnings("ignore:.*compresses nothing:UserWarning")
def test_with_an_exact_codec_it_is_adam_with_the_variance_frozen():
    """A codec that compresses nothing (a float32 psum) after the freeze.

    ``m_t = b1·m_{t−1} + (1 − b1)·mean_i(g_i,t)`` and the step is
    ``m̂_t/(√ν̂_F + eps)`` (clipped to Adam's bound), ``ν`` as the warm-up left it.
    """
    lr, b1, b2, freeze = 0.01, 0.9, 0.999, 2
    tx = ajc.onebit_adam(lr, b1, b2, freeze_step=freeze, codec=ajc.onebit(min_size=10**9))
    rng = np.random.default_rng(2)
    grads = [_grads(rng, scale=0.1) for _ in range(freeze + 4)]
    history = _run(tx, grads)
    m = {k: np.asarray(history[freeze - 1][1].mu[k], np.float64) for k in SHAPES}
    frozen = history[freeze - 1][1].nu
    bound = float(ajc_onebit_adam.adam_step_bound(b1, b2))
    for t in range(freeze + 1, freeze + 5):
        u, state = history[t - 1]
        for k in SHAPES:
            m[k] = b1 * m[k] + (1 - b1) * grads[t - 1][k].astype(np.float64).mean(axis=0)
            np.testing.assert_allclose(state.mu[k], m[k], rtol=1e-5, atol=1e-7)
            np.testing.assert_array_equal(state.nu[k], frozen[k])
            v = np.asarray(frozen[k], np.float64) / (1 - b2**freeze)
            want = -lr * np.clip(m[k] / (1 - b1**t) / (np.sqrt(v) + 1e-8), -bound, bound)
            # float32 rounds b2**F to an ulp of 1: relative eps32 / (1 − b2**F) in ν̂
            rtol = 8 * np.finfo(np.float32).eps / (1 - b2**freeze)
            np.testing.assert_allclose(u[k], want, rtol=rtol, atol=1e-9)


def test_a_frozen_variance_that_is_zero_or_tiny_never_makes_a_step_larger_than_adams():
    """Gradients of 1e-6 (0 in column 0 of w) through the warm-up, then of 1: the CNN's dead units.

    Where ``nu`` is 0 the momentum and the step are 0 (DeepSpeed's
    ``exp_avg_mask``, found automatically); elsewhere every step is at most
    ``lr·(1 − b1)/√(1 − b2)``, Adam's bound, and reaches it (unclipped it
    would be about 1e5 times that).
    """
    lr, b1, b2, freeze = 0.01, 0.9, 0.999, 3
    rng = np.random.default_rng(5)
    warm = [_grads(rng, scale=1e-6) for _ in range(freeze)]
    for g in warm:
        g["w"][:, :, 0] = 0.0
    history = _run(ajc.onebit_adam(lr, b1, b2, freeze_step=freeze),
                   warm + [_grads(rng) for _ in range(3)])
    bound = float(ajc_onebit_adam.adam_step_bound(b1, b2))
    assert bound == pytest.approx(0.1 / np.sqrt(0.001))
    for u, state in history[freeze:]:
        assert not np.asarray(state.nu["w"][:, 0]).any()
        assert not np.asarray(state.mu["w"][:, 0]).any()
        assert not np.asarray(u["w"][:, 0]).any()
        for k in SHAPES:
            assert np.abs(np.asarray(u[k])).max() <= lr * bound * (1 + 1e-6)
        assert np.abs(np.asarray(u["w"][:, 1:])).max() == pytest.approx(lr * bound, rel=1e-6)


def test_the_momentum_error_feedback_telescopes():
    """Σ_t m_t + mean_i(e_i,T) = Σ_t (b1·m_{t−1} + (1 − b1)·mean_i(g_i,t)) (module docstring)."""
    b1 = 0.9
    history = _after_freeze(5, b1=b1)
    sent = np.zeros(SHAPES["w"])
    owed = np.zeros(SHAPES["w"])
    for g, before, _, state in history:
        sent += np.asarray(state.mu["w"], np.float64)
        owed += b1 * np.asarray(before.mu["w"], np.float64) + (1 - b1) * g["w"].mean(axis=0)
        # the small leaf goes in an exact float32 psum: nothing owed there
        want_b = b1 * np.asarray(before.mu["b"], np.float64) + (1 - b1) * g["b"].mean(axis=0)
        np.testing.assert_allclose(state.mu["b"], want_b, rtol=0, atol=1e-7)
    debt = np.asarray(state.feedback.worker.value["ef"]["w"], np.float64).mean(axis=0)
    # float32 rounding: a few ulps of the largest term, per step
    tol = 5 * len(history) * np.finfo(np.float32).eps * max(np.abs(sent).max(), 1.0)
    np.testing.assert_allclose(sent + debt, owed, rtol=0, atol=tol)
    assert np.abs(sent - owed).max() > 100 * tol  # the signs lost something the debt carries


def test_after_the_freeze_only_the_one_bit_momentum_crosses_the_wire():
    """Each branch of the step's ``lax.cond`` against the ring formulas of ``wire_bytes``."""
    mesh = adaptjax.make_mesh(N)
    params = {"w": jnp.zeros((512, 512)), "b": jnp.zeros(512)}
    tx = ajc.onebit_adam(0.01, freeze_step=10)
    state = adaptjax.init_state(params, tx, mesh)
    step = adaptjax.data_parallel_step(
        lambda p, b: jnp.mean((b @ p["w"] + p["b"]) ** 2), tx, mesh, donate=False)
    report = adaptjax.wire_bytes(step, state, np.ones((16, 512), np.float32))
    compressed, warm_up = report.branch_totals()  # lax.cond: false, then true
    ring = 2 * (N - 1) / N
    guard = ring * 4 * 2  # the non-finite guard's two float32 scalars, in every step
    dense = ring * 4 * (512 * 512 + 512)
    one_bit = ajc.onebit().leaf_bytes((512, 512), N) + ring * 4 * 512  # b: a float32 psum
    assert warm_up == pytest.approx(dense + guard, rel=1e-9)
    assert compressed == pytest.approx(one_bit + guard, rel=1e-9)
    assert dense / one_bit > 25  # 32 bits against 1 + 32/512 on the large leaf


def test_on_a_sharded_mesh_each_shard_of_the_momentum_is_compressed():
    """A (2, 4) mesh with FSDP: the warm-up is still optax.adam's, bit for bit.

    The compressed phase sends the 1-bit codes of each device's shard over
    "data" and nothing over "fsdp" (no leaf is gathered whole to be compressed).
    """
    mesh = adaptjax.make_mesh({"data": 2, "fsdp": 4})
    rule = adaptjax.FSDP(min_size=64)
    codec = ajc.onebit(min_size=256)  # w's shards (640 elements) are compressed, b is not
    tx = ajc.onebit_adam(0.01, freeze_step=2, codec=codec)
    ref = optax.chain(adaptjax.sync_gradients("data"), optax.adam(0.01))
    s = adaptjax.init_state(_params(), tx, mesh, sharding=rule)
    r = adaptjax.init_state(_params(), ref, mesh, sharding=rule)
    step = adaptjax.data_parallel_step(_loss, tx, mesh, sharding=rule, donate=False)
    ref_step = adaptjax.data_parallel_step(_loss, ref, mesh, sharding=rule, donate=False)
    for i in range(2):
        s, _ = step(s, _batch(i))
        r, _ = ref_step(r, _batch(i))
        for k in SHAPES:
            np.testing.assert_array_equal(s.params[k], r.params[k])
    shard = s.params["w"].addressable_shards[0].data.shape
    assert np.prod(shard) == np.prod(SHAPES["w"]) // 4
    ef = s.opt_state.feedback.worker.value["ef"]["w"]
    assert ef.addressable_shards[0].data.shape == (1, *shard)  # per replica, per shard
    report = adaptjax.wire_bytes(step, s, _batch(2))
    in_branch = [c for c in report.collectives if c.branch]
    compressed = [c for c in in_branch if c.branch[-1][1] == 0]  # lax.cond: false first
    assert {c.axes for c in compressed} == {("data",)}
    b_psum = 2 * (2 - 1) / 2 * 4 * SHAPES["b"][0]  # b is replicated and small: a float32 psum
    assert sum(c.bytes for c in compressed) == pytest.approx(
        codec.leaf_bytes(shard, 2) + b_psum, rel=1e-9)


def test_converges_close_to_dense_adam():
    """Noisy least squares, minibatches of 64 rows over 8 replicas, 1/4 of the run dense.

    The least-squares optimum's loss (``lstsq``) is the floor; 1-bit Adam must
    end within 10% of it and of dense Adam's loss after the same steps.
    """
    mesh = adaptjax.make_mesh(N)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4096, 64)).astype(np.float32)
    y = (x @ rng.normal(size=(64, 40)) + 0.5 + rng.normal(size=(4096, 40))).astype(np.float32)
    full = {"x": x, "y": y}
    ones = np.concatenate([x, np.ones((4096, 1), np.float32)], axis=1).astype(np.float64)
    optimum = np.mean((ones @ np.linalg.lstsq(ones, y, rcond=None)[0] - y) ** 2)
    rows = np.random.default_rng(4).integers(0, 4096, size=(300, 64))
    losses = {}
    txs = {"onebit": ajc.onebit_adam(0.05, freeze_step=75),
           "dense": optax.chain(adaptjax.sync_gradients("data"), optax.adam(0.05))}
    for name, tx in txs.items():
        state = adaptjax.init_state({"w": jnp.zeros((64, 40)), "b": jnp.zeros(40)}, tx, mesh)
        step = adaptjax.data_parallel_step(_loss, tx, mesh)
        for r in rows:
            state, _ = step(state, {"x": x[r], "y": y[r]})
        losses[name] = float(_loss(state.params, full))
    assert losses["onebit"] < 1.1 * optimum
    assert losses["onebit"] < 1.1 * losses["dense"]


def test_learning_rate_is_a_hyperparameter_in_the_state():
    """inject_hyperparams: a learning rate of 0 set in the state stops the compressed steps."""
    mesh = adaptjax.make_mesh(N)
    tx = _injected(ajc.onebit_adam, freeze_step=1)
    state = adaptjax.init_state(_params(), tx, mesh)
    step = adaptjax.data_parallel_step(_loss, tx, mesh, donate=False)
    state, _ = step(state, _batch(0))
    hp = dict(state.opt_state.hyperparams, learning_rate=jnp.zeros_like(
        state.opt_state.hyperparams["learning_rate"]))
    frozen = dataclasses.replace(state, opt_state=state.opt_state._replace(hyperparams=hp))
    after, _ = step(frozen, _batch(1))
    for k in SHAPES:
        np.testing.assert_array_equal(after.params[k], frozen.params[k])
    assert int(after.opt_state.inner_state.count) == 2  # it did take a compressed step
    owed = after.opt_state.inner_state.feedback.worker.value["ef"]["w"]
    assert np.abs(np.asarray(owed)).max() > 0


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def test_checkpoint_and_rescale_8_4_8_keep_the_state(tmp_path):
    tx = ajc.onebit_adam(0.01, freeze_step=2)
    meshes = {n: adaptjax.make_mesh(n) for n in (8, 4)}
    steps = {n: adaptjax.data_parallel_step(_loss, tx, m, donate=False) for n, m in meshes.items()}
    state = adaptjax.init_state(_params(), tx, meshes[8])
    for i in range(4):
        state, _ = steps[8](state, _batch(i))
    with adaptjax.RunCheckpoints(tmp_path / "ckpt") as ckpt:
        ckpt.save(4, state, {})
        same, _ = ckpt.restore(4, target_state=adaptjax.abstract_state(_params(), tx, meshes[8]),
                               mesh=meshes[8])
        for a, b in zip(jax.tree.leaves(_host(state)), jax.tree.leaves(_host(same)), strict=True):
            np.testing.assert_array_equal(a, b)  # a resume is the same state, bit for bit
        for i, n_to in enumerate((4, 8)):  # 8 -> 4, a step, 4 -> 8
            target = adaptjax.abstract_state(_params(), tx, meshes[n_to])
            moved, _ = ckpt.restore(4 + i, target_state=target, mesh=meshes[n_to])
            old, new = _host(state.opt_state), _host(moved.opt_state)
            assert int(new.count) == int(old.count)
            for k in SHAPES:
                np.testing.assert_array_equal(new.mu[k], old.mu[k])
                np.testing.assert_array_equal(new.nu[k], old.nu[k])
            ef_old = old.feedback.worker.value["ef"]["w"]
            ef_new = new.feedback.worker.value["ef"]["w"]
            assert ef_new.shape == (n_to, *SHAPES["w"])
            # the "mean" merge rule keeps the debt mean_i(e_i) (rounded once to float32)
            tol = 4 * np.finfo(np.float32).eps * np.abs(ef_old).max()
            np.testing.assert_allclose(ef_new.mean(0), ef_old.mean(0, dtype=np.float64),
                                       rtol=0, atol=tol)
            assert np.abs(ef_old.mean(0)).max() > 1e-3
            state, _ = steps[n_to](moved, _batch(5 + i))
            ckpt.save(5 + i, state, {})
    assert int(state.opt_state.count) == 6


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^freeze_step must be an integer >= 1 .* got 0; e\.g\."):
        ajc.onebit_adam(0.01, freeze_step=0)
    with pytest.raises(ValueError, match=r"^freeze_step must be .* got 2\.5"):
        ajc.onebit_adam(0.01, freeze_step=2.5)
    with pytest.raises(ValueError, match=r"^codec must be an adaptjax.compression codec, got"):
        ajc.onebit_adam(0.01, codec="onebit")
    for tx in (ajc.onebit_adam(0.01, weight_decay=0.1), _injected(ajc.onebit_adam)):
        with pytest.raises(ValueError, match=r"^onebit_adam with weight_decay needs params: "
                                             r".*static_args=\('weight_decay',\)"):
            tx.update({"w": jnp.zeros(3)}, tx.init({"w": jnp.zeros(3)}))
    tx = optax.inject_hyperparams(ajc.onebit_adam, static_args=("weight_decay",))(0.01)
    state = stack_replicas(tx.init(_params()), N)
    _shard_update(tx, adaptjax.make_mesh(N), state)(_grads(np.random.default_rng(0)), state)
