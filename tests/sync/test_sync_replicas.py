"""Per-replica learning rates and local steps, and the heterogeneity measured at each sync.

The analytic problem: replica i minimises f_i(x) = ½‖x − a_i‖² (every row of
its batch is a_i), by SGD with rate η for H steps from the round's start θ:
x_i = a_i + (1 − η)^H (θ − a_i). The deltas Δ_i = θ − x_i = c (θ − a_i) with
c = 1 − (1 − η)^H, their mean Δ̄ = c (θ − ā), so
‖Δ_i − Δ̄‖² / ‖Δ̄‖² = ‖a_i − ā‖² / ‖θ − ā‖², whatever η and H. Values are
dyadic (η = 1/2), so float32 holds every step exactly.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import adaptjax
import adaptjax.sync
from adaptjax._per_replica import state_partition_specs
from adaptjax.sync._strategy import find_model_sync

N, H, ETA = 4, 2, 0.5
A = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [1.0, 1.0]], np.float32)


def loss(p, b):
    return 0.5 * jnp.mean(jnp.sum((p["w"] - b) ** 2, axis=-1))


def run(strategy, a, steps, theta0=(0.0, 0.0), lr=None):
    mesh = adaptjax.make_mesh(N)
    tx = adaptjax.sync.sync_chain(optax.sgd(ETA), strategy)
    state = adaptjax.init_state({"w": jnp.asarray(theta0, jnp.float32)}, tx, mesh)
    if lr is not None:
        state = dataclasses.replace(
            state, opt_state=adaptjax.sync.set_replica_lr(state.opt_state, lr)
        )
    step = adaptjax.data_parallel_step(loss, tx, mesh)
    batch = np.repeat(a, 2, axis=0)  # two rows per replica, both a_i
    metrics = None
    for _ in range(steps):
        state, metrics = step(state, batch)
    return state, metrics, step


def dissimilarity(opt_state):
    m = adaptjax.sync.replica_metrics(opt_state)
    return np.array([m[f"grad_dissimilarity/{i}"] for i in range(N)])


@pytest.mark.parametrize("strategy", [adaptjax.sync.LocalSGD(H=H), adaptjax.sync.DiLoCo(H=H)])
def test_dissimilarity_is_zero_on_identical_replicas(strategy):
    state, metrics, _ = run(strategy, np.repeat(A[2:3], N, axis=0), H)
    assert np.all(dissimilarity(state.opt_state) == 0.0)
    assert float(metrics["grad_dissimilarity_max"]) == 0.0


@pytest.mark.parametrize("strategy", [adaptjax.sync.LocalSGD(H=H), adaptjax.sync.DiLoCo(H=H)])
def test_dissimilarity_matches_the_least_squares_value(strategy):
    a_bar = A.mean(0)
    expected = ((A - a_bar) ** 2).sum(1) / (a_bar**2).sum()  # θ = 0
    state, metrics, _ = run(strategy, A, H)
    np.testing.assert_allclose(dissimilarity(state.opt_state), expected, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["grad_dissimilarity"]), expected.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["grad_dissimilarity_max"]), expected.max(), rtol=1e-6)


def test_dissimilarity_of_the_second_round():
    """Local SGD's θ_1 = mean_i x_i = c ā, so ‖θ_1 − ā‖² = (1 − η)^{2H} ‖ā‖²."""
    a_bar = A.mean(0)
    state, _, _ = run(adaptjax.sync.LocalSGD(H=H), A, 2 * H)
    expected = ((A - a_bar) ** 2).sum(1) / ((1 - ETA) ** (2 * H) * (a_bar**2).sum())
    np.testing.assert_allclose(dissimilarity(state.opt_state), expected, rtol=1e-6)


def test_zero_rate_keeps_a_replica_model_between_syncs():
    lr = [0.0, 1.0, 1.0, 2.0]
    state, _, _ = run(adaptjax.sync.LocalSGD(H=4), A, 3, lr=lr)  # 3 inner steps, no sync yet
    local = np.asarray(adaptjax.sync.local_params(state.params, state.opt_state)["w"])
    assert np.array_equal(local[0], [0.0, 0.0])
    # the others: x = a + (1 - f η)^3 (θ - a) with θ = 0
    for i in (1, 2, 3):
        np.testing.assert_allclose(local[i], A[i] * (1 - (1 - lr[i] * ETA) ** 3), rtol=1e-6)
    state, _, _ = run(adaptjax.sync.LocalSGD(H=4), A, 4, lr=lr)  # the sync averages all four
    moved = [A[i] * (1 - (1 - lr[i] * ETA) ** 4) for i in (1, 2, 3)]
    np.testing.assert_allclose(np.asarray(state.params["w"]), sum(moved) / N, rtol=1e-6)


def test_local_steps_stop_a_replica_after_its_steps():
    mesh = adaptjax.make_mesh(N)
    tx = adaptjax.sync.sync_chain(optax.sgd(ETA), adaptjax.sync.LocalSGD(H=4))
    state = adaptjax.init_state({"w": jnp.zeros(2)}, tx, mesh)
    opt = adaptjax.sync.set_replica_local_steps(state.opt_state, [1, 2, 4, 9])
    state = dataclasses.replace(state, opt_state=opt)
    step = adaptjax.data_parallel_step(loss, tx, mesh)
    for _ in range(3):
        state, _ = step(state, np.repeat(A, 2, axis=0))
    local = np.asarray(adaptjax.sync.local_params(state.params, state.opt_state)["w"])
    for i, h in enumerate([1, 2, 3, 3]):  # steps taken of the 3 so far
        np.testing.assert_allclose(local[i], A[i] * (1 - (1 - ETA) ** h), rtol=1e-6)


def test_changing_the_rates_does_not_recompile():
    state, _, step = run(adaptjax.sync.LocalSGD(H=H), A, 1)
    for lr in ([0.5, 1.0, 1.5, 2.0], [0.0, 0.0, 1.0, 1.0]):
        state = dataclasses.replace(
            state, opt_state=adaptjax.sync.set_replica_lr(state.opt_state, lr)
        )
        state, _ = step(state, np.repeat(A, 2, axis=0))
        np.testing.assert_array_equal(adaptjax.sync.replica_lr(state.opt_state), lr)
    assert step.jitted._cache_size() == 1


def test_a_rescale_keeps_survivors_and_starts_new_replicas_from_the_default():
    mesh = adaptjax.make_mesh(N)
    tx = adaptjax.sync.sync_chain(optax.sgd(ETA), adaptjax.sync.DiLoCo(H=H))
    state = adaptjax.init_state({"w": jnp.zeros(2)}, tx, mesh)
    opt = adaptjax.sync.set_replica_lr(state.opt_state, [0.5, 1.5, 2.0, 3.0])
    opt = adaptjax.sync.set_replica_local_steps(opt, [1, 1, 2, 2])
    shrunk = adaptjax.sync.merge_replicas(opt, 2)
    assert adaptjax.sync.replica_lr(shrunk).tolist() == [0.5, 1.5]
    grown = adaptjax.sync.merge_replicas(shrunk, 3)
    assert adaptjax.sync.replica_lr(grown).tolist() == [0.5, 1.5, 1.0]
    assert np.asarray(find_model_sync(grown).knobs.value)[:, 1].tolist() == [1, 1, 0]  # 0: all
    measured = find_model_sync(grown).measured
    assert measured.merge == "zeros"  # a new configuration measures afresh


def _own_step(tx, mesh, specs):
    """A user's shard_map step passing the replica's loss and labels to the strategy."""

    def step(params, opt_state, x, labels):
        opt_state = adaptjax.sync.to_local(opt_state)
        at = adaptjax.sync.local_params(params, opt_state)
        value, g = jax.value_and_grad(loss)(at, x)
        u, opt_state = tx.update(
            g, opt_state, params, local_params=at, replica_loss=value, labels=labels
        )
        return optax.apply_updates(params, u), adaptjax.sync.to_global(opt_state)

    return jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), specs, P("data"), P("data")),
            out_specs=(P(), specs),
            check_vma=False,
        )
    )


def test_replica_loss_and_label_divergence_match_their_formulas():
    """Loss at step t of a round: ½ (1 − η)^{2t} ‖θ − a_i‖²; KL(p_i ‖ q) from the labels."""
    q = np.array([0.5, 0.25, 0.25])
    labels = np.array([[0, 0, 1, 2], [0, 0, 0, 0], [1, 1, 2, 2], [0, 1, 0, 2]])
    mesh = adaptjax.make_mesh(N)
    local = adaptjax.sync.LocalSGD(H=H, label_histogram=[2, 1, 1])
    tx = adaptjax.sync.sync_chain(optax.sgd(ETA), local)
    state = adaptjax.init_state({"w": jnp.zeros(2)}, tx, mesh)
    f = _own_step(tx, mesh, state_partition_specs(state.opt_state))
    params, opt_state = state.params, state.opt_state
    x = np.repeat(A, 4, axis=0)
    for _ in range(H):
        params, opt_state = f(params, opt_state, x, labels.reshape(-1))
    m = adaptjax.sync.replica_metrics(opt_state)
    for i in range(N):
        sq = (A[i] ** 2).sum()
        expected = np.mean([0.5 * (1 - ETA) ** (2 * t) * sq for t in range(H)])
        np.testing.assert_allclose(m[f"replica_loss/{i}"], expected, rtol=1e-6)
        p = np.bincount(labels[i], minlength=3) / labels.shape[1]
        kl = sum(pk * np.log(pk / qk) for pk, qk in zip(p, q, strict=True) if pk > 0)
        np.testing.assert_allclose(m[f"label_divergence/{i}"], kl, rtol=1e-5, atol=1e-7)


def test_bad_inputs_are_one_line_errors():
    mesh = adaptjax.make_mesh(N)
    tx = adaptjax.sync.sync_chain(optax.sgd(ETA), adaptjax.sync.LocalSGD(H=H))
    opt = adaptjax.init_state({"w": jnp.zeros(2)}, tx, mesh).opt_state
    with pytest.raises(ValueError, match=r"lr_factor needs one value per replica: shape \(4,\)"):
        adaptjax.sync.set_replica_lr(opt, [1.0, 1.0])
    with pytest.raises(ValueError, match="factors must be finite numbers >= 0"):
        adaptjax.sync.set_replica_lr(opt, [1.0, -1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="local steps must be integers >= 1"):
        adaptjax.sync.set_replica_local_steps(opt, [0, 1, 1, 1])
    plain = adaptjax.init_state({"w": jnp.zeros(2)}, optax.sgd(0.1), mesh).opt_state
    with pytest.raises(ValueError, match="opt_state holds no local SGD or DiLoCo state"):
        adaptjax.sync.set_replica_lr(plain, [1.0] * N)
    with pytest.raises(ValueError, match="label_histogram must be K >= 2 positive finite"):
        adaptjax.sync.LocalSGD(H=2, label_histogram=[1.0, 0.0])


def test_rates_are_checkpointed_and_carried_through_a_rescale(tmp_path):
    tx = adaptjax.sync.sync_chain(optax.sgd(ETA), adaptjax.sync.LocalSGD(H=H))
    mesh = adaptjax.make_mesh(N)
    state = adaptjax.init_state({"w": jnp.zeros(2)}, tx, mesh)
    lr = [0.5, 1.5, 2.0, 3.0]
    state = dataclasses.replace(
        state, opt_state=adaptjax.sync.set_replica_lr(state.opt_state, lr)
    )
    with adaptjax.RunCheckpoints(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, state, {})
        for n, want in ((N, lr), (2, lr[:2]), (6, [*lr, 1.0, 1.0])):
            new_mesh = adaptjax.make_mesh(n)
            target = adaptjax.init_state({"w": jnp.zeros(2)}, tx, new_mesh)
            restored, _ = ckpt.restore(1, target_state=target, mesh=new_mesh)
            assert adaptjax.sync.replica_lr(restored.opt_state).tolist() == want


def test_the_step_builder_hands_each_replica_its_own_loss():
    """replica_loss/i through data_parallel_step: replica i's loss at its rows, H = 1."""
    mesh = adaptjax.make_mesh(4)
    tx = adaptjax.sync.sync_chain(optax.sgd(0.0), adaptjax.sync.LocalSGD(H=1))
    step = adaptjax.data_parallel_step(lambda p, b: jnp.mean((b - p["w"]) ** 2), tx, mesh)
    state = adaptjax.init_state({"w": jnp.zeros(())}, tx, mesh)
    batch = np.arange(8, dtype=np.float32)  # replica i holds rows 2i, 2i + 1
    state, _ = step(state, batch)
    m = adaptjax.sync.replica_metrics(state.opt_state)
    for i in range(4):
        assert m[f"replica_loss/{i}"] == pytest.approx(np.mean(batch[2 * i:2 * i + 2] ** 2))
