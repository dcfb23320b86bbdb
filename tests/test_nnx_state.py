"""Flax NNX models with state: BatchNorm statistics and Dropout RNG streams.

Math stated per test:

* BatchNorm (momentum m, training mode) after one step from mean 0, var 1:
  mean = (1 - m) * (mean of the pre-norm activations over the *global* batch)
  exactly (each replica's batch mean, averaged over equal-sized replicas, is the
  global mean); var = m + (1 - m) * (mean over replicas of each replica's own
  batch variance) - on one replica that is the global batch variance.
* Dropout(0.5) on a vector of ones, one row per replica, loss = Σ drop(1)·w:
  each replica's gradient is 2·mask_r, so SGD(lr=1) from w = 0 gives
  w = -mean_r(2·mask_r). Identical masks on all 8 replicas would put every
  entry in {0, -2}; independent masks do so with probability 2·2⁻⁸ per entry.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import adaptjax

MOMENTUM = 0.9
WIDTH = 256


class NormNet(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, momentum=MOMENTUM, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.linear(x))


class DropNet(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jnp.zeros(WIDTH))
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return jnp.mean(jnp.sum(self.drop(jnp.ones((x.shape[0], WIDTH))) * self.w, axis=1))


def _norm_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _drop_loss(model, batch):
    return model(batch["x"])


def _sgd(lr):
    return optax.chain(adaptjax.sync_gradients("data"), optax.sgd(lr))


def _batch(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, 3)) * np.array([1.0, 2.0, 0.5]) + np.arange(n)[:, None] / n)
    return {"x": x.astype(np.float32), "y": rng.normal(size=(n, 4)).astype(np.float32)}


@pytest.mark.parametrize("devices", [8, 1])
def test_batch_statistics_are_the_global_batch_mean_and_replica_mean_variance(devices):
    model = NormNet(nnx.Rngs(0))
    model.train()
    mesh = adaptjax.make_mesh(devices)
    tx = _sgd(0.1)
    step = adaptjax.data_parallel_step(_norm_loss, tx, mesh)
    state = adaptjax.init_state(model, tx, mesh)
    batch = _batch()
    kernel = np.asarray(model.linear.kernel[...])
    bias = np.asarray(model.linear.bias[...])
    h = (batch["x"] @ kernel + bias).astype(np.float64)  # pre-norm activations, params before
    state, _ = step(state, batch)
    stats = state.model_state["norm"]
    per_replica = h.reshape(devices, -1, 4)
    want_mean = (1 - MOMENTUM) * h.mean(0)
    want_var = MOMENTUM + (1 - MOMENTUM) * per_replica.var(axis=1).mean(0)
    np.testing.assert_allclose(np.asarray(stats["mean"][...]), want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(stats["var"][...]), want_var, rtol=1e-5, atol=1e-6)
    assert stats["mean"][...].sharding.spec == jax.P()  # replicated like the params
    # the module comes back with the statistics; eval mode normalises with them
    trained = state.model
    trained.eval()
    x = np.ones((2, 3), np.float32)
    lin = x @ np.asarray(trained.linear.kernel[...]) + np.asarray(trained.linear.bias[...])
    scale, offset = np.asarray(trained.norm.scale[...]), np.asarray(trained.norm.bias[...])
    want = (lin - want_mean) / np.sqrt(want_var + trained.norm.epsilon) * scale + offset
    np.testing.assert_allclose(np.asarray(trained(x)), want, rtol=1e-4, atol=1e-5)


def test_microbatches_update_the_statistics_once_per_forward_pass():
    # one replica, 2 micro-batches: two EMA updates, var = m² + (1 - m) (m v₁ + v₂)
    model = NormNet(nnx.Rngs(0))
    model.train()
    mesh = adaptjax.make_mesh(1)
    tx = _sgd(0.1)
    step = adaptjax.data_parallel_step(_norm_loss, tx, mesh, microbatches=2)
    state = adaptjax.init_state(model, tx, mesh)
    batch = _batch(16)
    h = batch["x"] @ np.asarray(model.linear.kernel[...]) + np.asarray(model.linear.bias[...])
    h1, h2 = h[:8].astype(np.float64), h[8:].astype(np.float64)
    state, _ = step(state, batch)
    want_mean = (1 - MOMENTUM) * (MOMENTUM * h1.mean(0) + h2.mean(0))
    want_var = MOMENTUM**2 + (1 - MOMENTUM) * (MOMENTUM * h1.var(0) + h2.var(0))
    stats = state.model_state["norm"]
    np.testing.assert_allclose(np.asarray(stats["mean"][...]), want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(stats["var"][...]), want_var, rtol=1e-5, atol=1e-6)


def _drop_run(state, step, steps):
    ws = []
    for _ in range(steps):
        state, _ = step(state, {"x": np.zeros((8, 1), np.float32)})
        ws.append(np.asarray(state.params["w"][...]))
    return state, ws


def test_dropout_masks_differ_per_replica_and_per_step_and_replay_from_a_checkpoint(tmp_path):
    model = DropNet(nnx.Rngs(dropout=3))
    model.train()
    mesh = adaptjax.make_mesh(8)
    tx = _sgd(1.0)
    step = adaptjax.data_parallel_step(_drop_loss, tx, mesh, donate=False)
    state = adaptjax.init_state(model, tx, mesh)
    state1, (w1,) = _drop_run(state, step, 1)
    extreme = np.isin(w1, [0.0, -2.0]).mean()
    assert extreme < 0.05  # identical masks on all replicas: 1.0; independent: ~0.008
    assert np.allclose(w1 * 4, np.round(w1 * 4))  # w = -(2/8)·(number of replicas keeping)
    _, (w2, w3) = _drop_run(state1, step, 2)
    assert not np.array_equal(w2 - w1, w1)  # step 2 drew new masks
    assert not np.array_equal(w3 - w2, w2 - w1)
    # the stream's count is part of the state: a checkpoint replays the same masks
    with adaptjax.RunCheckpoints(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, state1, {})
        target = adaptjax.init_state(DropNet(nnx.Rngs(dropout=99)), tx, mesh)
        restored, _ = ckpt.restore(target_state=target, mesh=mesh)
    _, (again2, again3) = _drop_run(restored, step, 2)
    np.testing.assert_array_equal(again2, w2)
    np.testing.assert_array_equal(again3, w3)


def test_dropout_on_one_replica_draws_new_masks_per_micro_batch():
    model = DropNet(nnx.Rngs(dropout=0))
    model.train()
    mesh = adaptjax.make_mesh(1)
    tx = _sgd(1.0)
    step = adaptjax.data_parallel_step(_drop_loss, tx, mesh, microbatches=2)
    state = adaptjax.init_state(model, tx, mesh)
    state, _ = step(state, {"x": np.zeros((2, 1), np.float32)})
    w = np.asarray(state.params["w"][...])
    # mean of two masks x2: 0, -1 or -2; one mask reused would give only 0 and -2
    assert set(np.unique(w)) <= {0.0, -1.0, -2.0} and (w == -1.0).any()
    assert int(state.model.drop.rngs.count[...]) == 2


def test_batch_statistics_survive_a_rescale_through_a_checkpoint(tmp_path):
    model = NormNet(nnx.Rngs(0))
    model.train()
    tx = _sgd(0.1)
    mesh8, mesh4 = adaptjax.make_mesh(8), adaptjax.make_mesh(4)
    state8 = adaptjax.init_state(model, tx, mesh8)
    state8, _ = adaptjax.data_parallel_step(_norm_loss, tx, mesh8)(state8, _batch())
    with adaptjax.RunCheckpoints(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, state8, {})
        target = adaptjax.abstract_state(NormNet(nnx.Rngs(1)), tx, mesh4)
        state4, _ = ckpt.restore(target_state=target, mesh=mesh4)
    for name in ("mean", "var"):
        np.testing.assert_array_equal(
            np.asarray(state4.model_state["norm"][name][...]),
            np.asarray(state8.model_state["norm"][name][...]),
        )
        assert state4.model_state["norm"][name][...].sharding.mesh.shape["data"] == 4
    state4, metrics = adaptjax.data_parallel_step(_norm_loss, tx, mesh4)(state4, _batch(seed=1))
    assert np.isfinite(float(metrics["loss"])) and int(state4.step) == 2


def test_replica_keys_are_distinct_and_the_stored_key_is_unchanged():
    from jax.sharding import PartitionSpec as P

    from adaptjax._state import fold_replica_into_keys, keys_to_data

    mesh = adaptjax.make_mesh(8)
    stored = keys_to_data({"k": jax.random.key(7)})

    def per_replica(ms):
        return fold_replica_into_keys(ms, "data")["k"].data[None]

    out = jax.shard_map(per_replica, mesh=mesh, in_specs=P(), out_specs=P("data"))(stored)
    rows = {tuple(r) for r in np.asarray(out).tolist()}
    assert len(rows) == 8 and tuple(np.asarray(stored["k"].data)) not in rows


class _CallTimeRngs(nnx.Module):
    """The flax MNIST tutorial's pattern: Dropout without a stream, rngs at call time."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)

    def __call__(self, x, rngs=None):
        return self.dropout(self.linear(x), rngs=rngs)


def test_rngs_passed_at_call_time_is_one_line_naming_the_fix():
    rngs = nnx.Rngs(0)  # made outside the step, as the tutorial's train loop does
    model = _CallTimeRngs(nnx.Rngs(1))
    model.train()
    mesh = adaptjax.make_mesh(8)
    tx = optax.chain(adaptjax.sync_gradients("data"), optax.adam(1e-3))
    step = adaptjax.data_parallel_step(lambda m, b: jnp.mean(m(b, rngs) ** 2), tx, mesh)
    with pytest.raises(ValueError) as e:
        step(adaptjax.init_state(model, tx, mesh), np.ones((16, 4), np.float32))
    assert str(e.value) == (
        "loss_fn changes an NNX object made outside the step (Cannot mutate RngCount from a "
        "different trace level): the step carries only the model's own state; give each "
        "nnx.Dropout its stream (nnx.Dropout(rate, rngs=rngs)) and call the model without rngs")
