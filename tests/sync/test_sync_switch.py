"""Switching strategies mid-run under the controller, with rescales 8 -> 4 -> 8 under them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _controller_args import make_controller, resume_controller  # noqa: E402

import adaptjax
from adaptjax import policies as ajp

N_ROWS, BATCH = 2048, 32


def make(run_dir, schedule, steps, **kwargs):
    x = np.random.default_rng(0).normal(size=(N_ROWS, 4)).astype(np.float32)
    data = adaptjax.ArrayDataset({"x": x, "y": x.sum(1), "i": np.arange(N_ROWS)}, seed=0)
    seen = []

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)

    ctrl = make_controller(
        model={"w": jnp.zeros(4)}, loss_fn=loss,
        optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
        data=data, devices=8, batch_size=BATCH,
        policies=[ajp.Schedule(schedule)], policy_every=1, run_dir=run_dir, progress=False,
        tensorboard=False, on_step=lambda c: seen.append(c.step), **kwargs,
    )
    ctrl.run(steps=steps)
    return ctrl, data


def test_switch_strategies_and_rescale_under_them_lose_nothing(tmp_path):
    diloco = adaptjax.sync.DiLoCo(H=4)
    schedule = {
        2: ajp.SetHyperparams({"learning_rate": 0.05}),
        4: ajp.SetSync(diloco),
        6: ajp.Rescale(devices=4),        # under DiLoCo
        8: ajp.Rescale(devices=8),
        10: ajp.SetSync("gossip"),
        12: ajp.Rescale(devices=4),       # under gossip
        14: ajp.Rescale(devices=8),
        16: ajp.SetSync(adaptjax.sync.ModelAveraging()),
        18: ajp.SetSync(None),            # back to S-SGD
        20: ajp.SetSync(diloco),          # a strategy seen before: compiled step reused
    }
    ctrl, data = make(str(tmp_path), schedule, steps=24)
    try:
        assert ctrl.step == 24 and ctrl.config.sync == repr(diloco)
        assert ctrl.samples_seen == data.cursor == 24 * BATCH  # every sample once, none twice
        assert ctrl.hyperparams["learning_rate"] == pytest.approx(0.05)
        inject = ctrl.state.opt_state["optimizer"].inner_state
        counts = np.asarray(jax.device_get(inject.inner_state.value[0].count))
        assert counts.tolist() == [24] * 8  # adam took every step, through every switch
        events = [e["sync"] for e in ctrl.log.events if e["kind"] == "set_sync"]
        assert len(events) == 5
        assert np.isfinite(ctrl.latest_metrics["loss"]) and ctrl.latest_metrics["loss"] < 5.0
        assert "noise_scale" not in ctrl.latest_metrics  # monitors are off under DiLoCo
        steps_compiled = ctrl.steps._steps
        assert sum(c.sync == repr(diloco) for c in steps_compiled) == 2  # 8 and 4 devices
    finally:
        ctrl.close()


def test_switch_sync_policy_switches_once_through_the_controller(tmp_path):
    diloco = adaptjax.sync.DiLoCo(H=2)
    policy = ajp.SwitchSync(diloco, when=lambda metrics, ctx: ctx.step >= 3)
    x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
    ctrl = make_controller(
        model={"w": jnp.zeros(4)}, loss_fn=lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
        optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.05),
        data=adaptjax.ArrayDataset({"x": x, "y": x.sum(1)}, seed=0), devices=4, batch_size=16,
        policies=[policy], policy_every=1, run_dir=str(tmp_path), progress=False,
        tensorboard=False,
    )
    try:
        ctrl.run(steps=10)
        switches = [e for e in ctrl.log.events if e["kind"] == "set_sync"]
        assert [e["sync"] for e in switches] == [repr(diloco)]  # never re-emitted
        assert ctrl.context().sync == diloco
    finally:
        ctrl.close()


def test_controller_rejects_bad_sync_before_touching_the_disk(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="gossip needs at least 2 replicas"):
        make_controller(
            model={"w": jnp.zeros(4)}, loss_fn=lambda p, b: 0.0,
            optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
            data=adaptjax.ArrayDataset({"x": np.ones(8)}),
            devices=1, batch_size=8, run_dir=str(run_dir), sync="gossip", progress=False,
        )
    with pytest.raises(ValueError, match="unknown sync strategy 'ring'"):
        make_controller(
            model={"w": jnp.zeros(4)}, loss_fn=lambda p, b: 0.0,
            optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
            data=adaptjax.ArrayDataset({"x": np.ones(8)}),
            devices=2, batch_size=8, run_dir=str(run_dir), sync="ring", progress=False,
        )
    assert not run_dir.exists()


@pytest.mark.slow
def test_resume_mid_diloco_continues_the_uninterrupted_run(tmp_path):
    schedule = {3: ajp.SetSync(adaptjax.sync.DiLoCo(H=4)), 9: ajp.Rescale(devices=4)}
    full, _ = make(str(tmp_path / "a"), schedule, steps=14)
    want = adaptjax.sync.consensus_params(full.state.params, full.state.opt_state)
    full.close()
    part, _ = make(str(tmp_path / "b"), schedule, steps=6, checkpoint_every=6)
    part.close()
    x = np.random.default_rng(0).normal(size=(N_ROWS, 4)).astype(np.float32)
    resumed = resume_controller(
        str(tmp_path / "b"), model={"w": jnp.zeros(4)},
        loss_fn=lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
        optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
        data=adaptjax.ArrayDataset({"x": x, "y": x.sum(1), "i": np.arange(N_ROWS)}, seed=0),
        devices=8, batch_size=BATCH, policies=[ajp.Schedule(schedule)], policy_every=1,
        checkpoint_every=6, progress=False, tensorboard=False,
        sync=adaptjax.sync.DiLoCo(H=4),  # what the run is in
    )
    try:
        resumed.run(steps=14)
        got = adaptjax.sync.consensus_params(resumed.state.params, resumed.state.opt_state)
        np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5, atol=1e-6)
        assert resumed.config.devices == 4
    finally:
        resumed.close()
