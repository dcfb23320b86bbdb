"""Synchronisation strategies: one replica is plain training, exact algebra, merge rules, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax
from adaptjax import policies as ajp
from adaptjax._run_config import RunConfig
from adaptjax._transition import plan_transition
from adaptjax.controller._rebuild import rebuild_state

D = 5
RNG = np.random.default_rng(0)
X = RNG.normal(size=(8 * 8 * 8, D)).astype(np.float32)
Y = (X @ np.arange(1.0, D + 1, dtype=np.float32) + RNG.normal(size=len(X))).astype(np.float32)


def loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def grad_np(w, b, x, y):
    """The gradient of ``loss`` in numpy (float64)."""
    r = x @ w + b - y
    return 2 * x.T @ r / len(x), 2 * r.mean()


P0 = {"w": jnp.zeros(D), "b": jnp.zeros(())}


def batch(t, size):
    rows = slice(t * size, (t + 1) * size)
    return {"x": X[rows], "y": Y[rows]}


def train(strategy, n, steps, opt, size=16):
    tx = adaptjax.sync.sync_chain(opt, strategy)
    mesh = adaptjax.make_mesh(n)
    state = adaptjax.init_state(P0, tx, mesh)
    step = adaptjax.data_parallel_step(loss, tx, mesh, sync=strategy)
    for t in range(steps):
        state, _ = step(state, batch(t, size))
    return state


def local_models(state):
    return jax.device_get(adaptjax.sync._strategy.find_model_sync(state.opt_state).local.value)


ONE_REPLICA = [
    adaptjax.sync.SSGD(),
    adaptjax.sync.ModelAveraging(),
    adaptjax.sync.ModelAveraging(alpha=0.3),
    adaptjax.sync.LocalSGD(H=3),
    # DiLoCo's outer step is a plain average only with outer lr 1 and no momentum
    adaptjax.sync.DiLoCo(H=3, outer_lr=1.0, outer_momentum=0.0),
]


@pytest.mark.parametrize("strategy", ONE_REPLICA, ids=repr)
def test_one_replica_equals_plain_single_device_training(strategy):
    opt = optax.adamw(0.05, weight_decay=0.1)  # weight decay reads the (local) params
    params, opt_state = P0, opt.init(P0)
    for t in range(6):
        g = jax.grad(loss)(params, batch(t, 16))
        u, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, u)
    state = train(strategy, 1, 6, opt)
    for got in (state.params, adaptjax.sync.consensus_params(state.params, state.opt_state)):
        np.testing.assert_allclose(got["w"], params["w"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["b"], params["b"], rtol=1e-5, atol=1e-6)


def test_diloco_outer_update_is_nesterov_on_the_mean_delta_after_h_steps():
    n, H, lr, b = 8, 3, 0.05, 8
    strategy = adaptjax.sync.DiLoCo(H=H)  # outer lr 0.7, momentum 0.9, Nesterov
    state = train(strategy, n, 2 * H, optax.sgd(lr), size=n * b)
    theta = np.zeros(D + 1)
    m = np.zeros(D + 1)
    for cycle in range(2):
        deltas = []
        for i in range(n):
            x = theta.copy()
            for t in range(cycle * H, (cycle + 1) * H):
                rows = slice(t * n * b + i * b, t * n * b + (i + 1) * b)
                gw, gb = grad_np(x[:D], x[D], X[rows].astype(np.float64), Y[rows])
                x = x - lr * np.append(gw, gb)
            deltas.append(theta - x)
        delta = np.mean(deltas, axis=0)
        m = 0.9 * m + delta
        theta = theta - 0.7 * (delta + 0.9 * m)
    np.testing.assert_allclose(state.params["w"], theta[:D], rtol=2e-4, atol=1e-5)
    np.testing.assert_allclose(state.params["b"], theta[D], rtol=2e-4, atol=1e-5)
    locals_ = local_models(state)  # every replica restarts from the outer model
    np.testing.assert_allclose(locals_["w"], np.broadcast_to(theta[:D], (n, D)), atol=1e-4)


@pytest.mark.parametrize("topology", ["ring", "exponential"])
def test_gossip_preserves_the_mean_and_mixes_with_one_peer(topology):
    n, lr, b = 8, 0.05, 8
    strategy = adaptjax.sync.Gossip(topology)
    tx = adaptjax.sync.sync_chain(optax.sgd(lr), strategy)
    mesh = adaptjax.make_mesh(n)
    step = adaptjax.data_parallel_step(loss, tx, mesh, sync=strategy)
    state = adaptjax.init_state(P0, tx, mesh)
    for t in range(3):
        before = local_models(state)
        state, _ = step(state, batch(t, n * b))
        after = local_models(state)
        shift = adaptjax.sync._gossip.peer_offsets(n, topology)[t % len(
            adaptjax.sync._gossip.peer_offsets(n, topology))]
        stepped = np.empty((n, D + 1))
        for i in range(n):
            rows = slice(t * n * b + i * b, t * n * b + (i + 1) * b)
            gw, gb = grad_np(before["w"][i], before["b"][i], X[rows], Y[rows])
            stepped[i] = np.append(before["w"][i] - lr * gw, before["b"][i] - lr * gb)
        mixed = (stepped + np.roll(stepped, shift, axis=0)) / 2  # x_i <- (x_i + x_{i-s}) / 2
        got = np.concatenate([after["w"], after["b"][:, None]], axis=1)
        np.testing.assert_allclose(got, mixed, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got.mean(0), stepped.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(state.params["w"], np.zeros(D))  # no global average formed


def test_sma_with_identical_data_equals_ssgd():
    n, rows = 8, 4
    same = {"x": np.tile(X[:rows], (n, 1)), "y": np.tile(Y[:rows], n)}

    def run(strategy):
        tx = adaptjax.sync.sync_chain(optax.adam(0.05), strategy)
        mesh = adaptjax.make_mesh(n)
        state = adaptjax.init_state(P0, tx, mesh)
        step = adaptjax.data_parallel_step(loss, tx, mesh, sync=strategy)
        for _ in range(4):
            state, _ = step(state, same)
        return state

    ssgd, sma = run(adaptjax.sync.SSGD()), run(adaptjax.sync.ModelAveraging(alpha=0.5))
    np.testing.assert_allclose(sma.params["w"], ssgd.params["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sma.params["b"], ssgd.params["b"], rtol=1e-5, atol=1e-6)


def test_fold_merge_averages_on_shrink_and_copies_on_grow():
    old = {"x": adaptjax.PerReplica(np.arange(8.0)[:, None] * np.ones((8, 2)), "fold")}
    four = adaptjax.sync.merge_replicas(old, 4)["x"].value
    np.testing.assert_array_equal(four[:, 0], [2.0, 3.0, 4.0, 5.0])  # mean of i and i + 4
    eight = adaptjax.sync.merge_replicas({"x": adaptjax.PerReplica(four, "fold")}, 8)["x"].value
    np.testing.assert_array_equal(eight[:, 0], [2.0, 3.0, 4.0, 5.0, 2.0, 3.0, 4.0, 5.0])
    assert four.mean() == eight.mean() == np.arange(8.0).mean()


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(adaptjax.sync.ModelAveraging(), marks=pytest.mark.slow),
        pytest.param(adaptjax.sync.LocalSGD(H=2), marks=pytest.mark.slow),
        adaptjax.sync.DiLoCo(H=2),
        adaptjax.sync.Gossip(),
    ],
    ids=repr,
)
def test_rescale_8_4_8_keeps_the_mean_of_local_models_and_optimizer_state(strategy):
    state = jax.device_get(train(strategy, 8, 3, optax.adam(0.05), size=64))
    before = adaptjax.sync.consensus_params(state.params, state.opt_state)
    mu = jax.tree.leaves(state.opt_state[1].value)[1]  # adam's mu of "b", one per replica
    four = adaptjax.sync.merge_replicas(state, 4)
    back = adaptjax.sync.merge_replicas(four, 8)
    for s in (four, back):
        got = adaptjax.sync.consensus_params(s.params, s.opt_state)
        np.testing.assert_allclose(got["w"], before["w"], rtol=1e-6)
        np.testing.assert_allclose(jax.tree.leaves(s.opt_state[1].value)[1].mean(0), mu.mean(0),
                                   rtol=1e-6)
    assert jax.tree.leaves(back.opt_state[1].value)[1].shape == mu.shape


def test_switching_strategy_keeps_consensus_and_optimizer_state():
    mesh = adaptjax.make_mesh(8)
    state = train(adaptjax.sync.LocalSGD(H=4), 8, 3, optax.adam(0.05), size=64)  # diverged locals
    consensus = adaptjax.sync.consensus_params(state.params, state.opt_state)
    nu = np.asarray(jax.tree.leaves(state.opt_state[1].value)[2])  # adam's nu of "w", per replica
    tx = adaptjax.sync.sync_chain(optax.adam(0.05), adaptjax.sync.SSGD())
    new = rebuild_state(state, tx, mesh, carry_sync=False)
    np.testing.assert_allclose(new.params["w"], consensus["w"], rtol=1e-6)
    np.testing.assert_allclose(jax.tree.leaves(new.opt_state[1])[2], nu.mean(0), rtol=1e-6)
    assert int(jax.tree.leaves(new.opt_state[1])[0]) == 3  # adam's count carried


# ------------------------------------------------------------------ errors, before compiling
class _Codec:
    def init(self, params):
        return ()

    def sync(self, grads, state, *, axis_name, step):
        return jax.lax.pmean(grads, axis_name), state


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: adaptjax.sync.sync_chain(optax.sgd(0.1), "allreduce"), "unknown sync strategy"),
        (lambda: adaptjax.sync.LocalSGD(H=0), r"H \(inner steps between outer syncs\) must be"),
        (lambda: adaptjax.sync.DiLoCo(H=0), r"H \(inner steps between outer syncs\) must be"),
        (lambda: adaptjax.sync.DiLoCo(outer_lr=0.0), "outer_lr must be > 0"),
        (lambda: adaptjax.sync.Gossip("torus"), "unknown gossip topology"),
        (lambda: adaptjax.sync.sync_chain(optax.sgd(0.1), adaptjax.sync.Gossip(), codec=_Codec()),
         "cannot carry a codec"),
        (lambda: adaptjax.sync.sync_chain(optax.sgd(0.1), "sma", codec=_Codec()),
         "cannot carry a codec"),
        (lambda: adaptjax.data_parallel_step(loss, optax.sgd(0.1), adaptjax.make_mesh(1),
                                             sync=adaptjax.sync.Gossip()),
         "gossip needs at least 2 replicas"),
        (lambda: plan_transition([ajp.Rescale(devices=1)], RunConfig(8, 64, sync="Gossip()"),
                                 max_devices=8, strategies={"Gossip()": adaptjax.sync.Gossip()}),
         "gossip needs at least 2 replicas"),
        (lambda: plan_transition([ajp.SetSync("sma")], RunConfig(8, 64, codec="c"),
                                 max_devices=8), "cannot carry a codec"),
        (lambda: plan_transition([ajp.SetSync("ring")], RunConfig(8, 64), max_devices=8),
         "unknown sync strategy"),
    ],
)
def test_bad_inputs_give_one_line_errors(make, match):
    with pytest.raises(ValueError, match=match) as info:
        make()
    assert "\n" not in str(info.value)


def test_local_sgd_codec_compresses_the_outer_delta():
    calls = []

    class Counting(_Codec):
        def sync(self, grads, state, *, axis_name, step):
            calls.append(jax.tree.structure(grads))
            return super().sync(grads, state, axis_name=axis_name, step=step)

    tx = adaptjax.sync.sync_chain(optax.sgd(0.1), adaptjax.sync.DiLoCo(H=2), codec=Counting())
    mesh = adaptjax.make_mesh(2)
    state = adaptjax.init_state(P0, tx, mesh)
    adaptjax.data_parallel_step(loss, tx, mesh).lower(state, batch(0, 4))
    assert calls == [jax.tree.structure(P0)]  # traced once, inside the outer step
