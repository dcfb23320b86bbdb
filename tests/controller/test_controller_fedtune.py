"""Per-replica learning rates through the Controller, and FedTune as its policy (issue 49, 3-4).

The analytic problem of tests/sync/test_sync_replicas.py, under the
Controller: replica i's rows are all a_i (an unshuffled dataset whose batch
of 8 gives replica i rows 2i, 2i+1), its loss ½‖x − a_i‖², SGD at η = 1/2
with factor f_i, so one inner step is x ← x − f_i η (x − a_i) and k steps
give x = a_i + (1 − f_i η)^k (x_0 − a_i). Local SGD syncs every H = 4 steps;
after the first round from θ = 0, replica i's grad_dissimilarity is
‖a_i − ā‖² / ‖ā‖² = [0.5, 0.5, 1, 0] for the a_i below. Every value is
dyadic, so float32 holds each step exactly.
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax
import adaptjax.sync
from adaptjax import policies as ajp

N, H, ETA, BATCH = 4, 4, 0.5, 8
A = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [1.0, 1.0]], np.float32)
FIRST_ROUND = np.array([0.5, 0.5, 1.0, 0.0])  # ‖a_i − ā‖² / ‖ā‖², ā = (1, 1)
MAPPING = adaptjax.sync.LrMapping.fit([0.0, 1.0], [0.5, 0.125])  # lr(m) = 0.5 · 0.25^m
LOCAL = adaptjax.sync.LocalSGD(H=H)
ROWS = np.tile(np.repeat(A, BATCH // N, axis=0), (64, 1))  # replica i: a_i (on 4 replicas)


def loss(p, b):
    return 0.5 * jnp.mean(jnp.sum((p["w"] - b["x"]) ** 2, axis=-1))


def make(tmp_path, sync=LOCAL, policies=(), **spec):
    data = adaptjax.ArrayDataset({"x": ROWS}, shuffle=False)
    spec = adaptjax.RunSpec(run_dir=str(tmp_path), devices=N, batch_size=BATCH, sync=sync,
                            policies=list(policies), policy_every=1, **spec)
    return adaptjax.Controller({"w": jnp.zeros(2)}, loss,
                               optax.inject_hyperparams(optax.sgd)(learning_rate=ETA), data, spec,
                               hooks=[])


def local_models(ctrl):
    return np.asarray(adaptjax.sync.local_params(ctrl.state.params, ctrl.state.opt_state)["w"])


def events(ctrl, kind):
    return [{k: v for k, v in e.items() if k not in ("time", "kind")}
            for e in ctrl.log.events if e["kind"] == kind]


def test_hyperparams_show_each_replica_factor_and_a_zero_freezes_its_model(tmp_path):
    with make(tmp_path) as ctrl:
        expected = {"learning_rate": ETA, **{f"replica_lr/{i}": 1.0 for i in range(N)}}
        assert ctrl.hyperparams == expected == dict(ctrl.context().hyperparams)
        ctrl.run(steps=H)  # one round, synced: every local model is θ again
        ctrl.apply([ajp.SetHyperparams({"replica_lr/1": 0.0, "replica_lr/3": 2.0})])
        assert ctrl.hyperparams == {**expected, "replica_lr/1": 0.0, "replica_lr/3": 2.0}
        assert events(ctrl, "set_hyperparams") == [
            {"step": H, "replica_lr/1": 0.0, "replica_lr/3": 2.0}]
        start = local_models(ctrl)
        ctrl.run(steps=H + 3)  # three inner steps, no sync
        got = local_models(ctrl)
        assert np.array_equal(got[1], start[1])  # frozen
        for i, f in ((0, 1.0), (2, 1.0), (3, 2.0)):  # x = a + (1 − f η)^3 (x_0 − a)
            np.testing.assert_array_equal(got[i], A[i] + (1 - f * ETA) ** 3 * (start[i] - A[i]))
        assert not np.array_equal(got[0], start[0])
        # one compile, the first step's: the factors are values in the state
        assert ctrl.compilations == 1 and len(events(ctrl, "compile")) == 1
        assert ctrl.latest_metrics["replica_lr/1"] == 0.0  # the rows log the factors in force


def test_bad_replica_keys_are_one_line_errors(tmp_path):
    with make(tmp_path / "local") as ctrl:
        for values, message in (
            ({"replica_lr/4": 0.5}, "'replica_lr/4' names no replica: the run has 4 "
                                    "(replica_lr/0 ... replica_lr/3)"),
            ({"replica_lr/01": 0.5}, "'replica_lr/01' names no replica: the run has 4 "
                                     "(replica_lr/0 ... replica_lr/3)"),
            ({"replica_lr/2": -1.0}, "replica_lr/2 must be >= 0 (a factor on that replica's "
                                     "learning rate; 0 freezes its model), got -1.0"),
        ):
            with pytest.raises(ValueError) as e:
                ctrl.apply([ajp.SetHyperparams({"learning_rate": 0.1, **values})])
            assert str(e.value) == message
        assert ctrl.hyperparams["learning_rate"] == ETA  # nothing was written
        assert events(ctrl, "set_hyperparams") == []
    with make(tmp_path / "ssgd", sync=None) as ctrl:
        assert ctrl.hyperparams == {"learning_rate": ETA}
        with pytest.raises(ValueError) as e:
            ctrl.apply([ajp.SetHyperparams({"replica_lr/0": 0.5})])
        assert str(e.value) == (
            "'replica_lr/0': this run's strategy keeps no per-replica learning rates (only "
            "adaptjax.sync.LocalSGD and DiLoCo do); its hyperparameters are ['learning_rate']")


def test_a_rescale_keeps_survivors_factors_and_new_replicas_start_at_one(tmp_path):
    schedule = ajp.Schedule({2: ajp.Rescale(devices=2), 4: ajp.Rescale(devices=4)})
    with make(tmp_path, policies=[schedule], max_devices=N) as ctrl:
        ctrl.apply([ajp.SetHyperparams({f"replica_lr/{i}": f
                                        for i, f in enumerate([0.5, 1.5, 2.0, 3.0])})])
        ctrl.run(steps=3)  # the rescale to 2 decided on step 2's metrics
        assert ctrl.config.devices == 2
        assert ctrl.hyperparams == {"learning_rate": ETA, "replica_lr/0": 0.5,
                                    "replica_lr/1": 1.5}
        ctrl.run(steps=6)
        assert ctrl.config.devices == 4
        factors = [0.5, 1.5, 1.0, 1.0]  # a vanished replica hands nothing on
        np.testing.assert_array_equal(adaptjax.sync.replica_lr(ctrl.state.opt_state), factors)
        # the rows name the replicas there are, not the ones before the move
        assert [ctrl.latest_metrics.get(f"replica_lr/{i}") for i in range(N)] == factors
        assert [e["devices_to"] for e in events(ctrl, "rescale")] == [2, 4]


def test_fedtune_sets_each_factor_from_the_replica_metrics_the_state_holds(tmp_path):
    policy = adaptjax.sync.FedTune(MAPPING)
    with make(tmp_path, policies=[policy]) as ctrl:
        ctrl.run(steps=H + 2)  # the first sync at step H; no other before step 2H
        m = adaptjax.sync.replica_metrics(ctrl.state.opt_state)
        seen = np.array([m[f"grad_dissimilarity/{i}"] for i in range(N)])
        np.testing.assert_allclose(seen, FIRST_ROUND, rtol=1e-6)
        [first] = events(ctrl, "set_hyperparams")  # once: later decisions found it in force
        assert first["step"] <= H + 1
        want = {f"replica_lr/{i}": MAPPING(v) / ETA for i, v in enumerate(seen)}
        assert {k: v for k, v in first.items() if k != "step"} == pytest.approx(want, rel=1e-12)
        np.testing.assert_allclose(adaptjax.sync.replica_lr(ctrl.state.opt_state),
                                   [0.5, 0.5, 0.25, 1.0], rtol=1e-6)
        [decision] = [e for e in ctrl.log.events if e["kind"] == "decision"]
        assert decision["metrics"]["grad_dissimilarity/2"] == seen[2]  # what the policy saw
        assert decision["reasons"][0].startswith("FedTune: grad_dissimilarity/")
        ctrl.run(steps=2 * H + 2)  # the second sync moves every metric: refitted once more
        m = adaptjax.sync.replica_metrics(ctrl.state.opt_state)
        second = events(ctrl, "set_hyperparams")[-1]
        assert len(events(ctrl, "set_hyperparams")) == 2 and H + 1 < second["step"] <= 2 * H + 1
        want = {f"replica_lr/{i}": MAPPING(m[f"grad_dissimilarity/{i}"]) / ETA for i in range(N)}
        assert {k: v for k, v in second.items() if k != "step"} == pytest.approx(want, rel=1e-12)


def test_factors_are_checkpointed_with_the_state(tmp_path):
    with make(tmp_path) as ctrl:
        ctrl.apply([ajp.SetHyperparams({"replica_lr/2": 0.25})])
        ctrl.run(steps=1)  # checkpoints its end
    spec = adaptjax.RunSpec(run_dir=str(tmp_path), devices=N, batch_size=BATCH,
                            sync=LOCAL, policy_every=1)
    with adaptjax.Controller.resume(
            str(tmp_path), model={"w": jnp.zeros(2)}, loss_fn=loss,
            optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=ETA),
            data=adaptjax.ArrayDataset({"x": ROWS}, shuffle=False), spec=spec,
            hooks=[]) as resumed:
        assert resumed.step == 1
        assert resumed.hyperparams == {"learning_rate": ETA, "replica_lr/0": 1.0,
                                       "replica_lr/1": 1.0, "replica_lr/2": 0.25,
                                       "replica_lr/3": 1.0}
