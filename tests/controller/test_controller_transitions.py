"""Carrying out a transition, alone: (state, config, transition) -> (state, config, events).

Each kind of transition is planned with plan_transition and carried out with
carry_out (or roll_back) on a state built by a StepCache, with no controller,
no run directory and no step run: what comes back is checked against what the
transition asks for, and the state passed in is checked to be left as it was.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax
from adaptjax import compression as ajc
from adaptjax import policies as ajp
from adaptjax._run_config import codec_key
from adaptjax._transition import Transition, plan_transition
from adaptjax.controller._carry_out import carry_out, hyperparams_of, roll_back
from adaptjax.controller._persistence import config_from
from adaptjax.controller._step_cache import StepCache
from adaptjax.launch._distributed import ENV_MAX_PROCESSES
from adaptjax.sync._registry import sync_key

W = np.arange(6, dtype=np.float32).reshape(3, 2)


def _steps(**kw):
    return StepCache(model={"w": jnp.asarray(W)}, loss_fn=lambda p, b: jnp.sum(p["w"]),
                     optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=0.1), **kw)


def _plan(actions, config, steps=None):
    return plan_transition(actions, config, max_devices=8, hyperparam_names=["learning_rate",
                           "b1", "b2", "eps", "eps_root", "nesterov"],
                           strategies=None if steps is None else steps.strategies)


def _with_count(state, count):
    """``state`` whose sync transformation has counted ``count`` updates."""
    opt_state = dict(state.opt_state)
    opt_state["sync"] = opt_state["sync"]._replace(count=jnp.int32(count))
    return dataclasses.replace(state, opt_state=type(state.opt_state)(opt_state))


def _devices_of(x) -> int:
    return len(x.sharding.device_set)


def test_hyperparams_are_written_into_the_state_and_nothing_else_changes():
    steps, config = _steps(), adaptjax.RunConfig(4, 16)
    state = steps.init_state(config)
    plan = _plan([ajp.SetHyperparams({"learning_rate": 0.05, "b1": 0.8})], config)
    carried = carry_out(state, config, plan, steps)
    assert hyperparams_of(carried.state)["learning_rate"] == np.float32(0.05)
    assert hyperparams_of(carried.state)["b1"] == np.float32(0.8)
    assert hyperparams_of(state)["learning_rate"] == np.float32(0.1)  # the input is untouched
    assert carried.config == config and carried.transition is None and carried.relaunch is None
    assert carried.events == ({"kind": "set_hyperparams", "learning_rate": 0.05, "b1": 0.8},)
    assert carried.state.params["w"] is state.params["w"]
    assert carried.state.opt_state["sync"] is state.opt_state["sync"]


def test_a_batch_size_change_is_a_new_config_and_a_rounded_one_says_so():
    steps, config = _steps(), adaptjax.RunConfig(4, 16)
    state = steps.init_state(config)
    exact = carry_out(state, config, _plan([ajp.SetBatchSize(32)], config), steps)
    assert exact.config == config.replace(batch_size=32) and exact.events == ()
    assert exact.state is state  # the batch is the step's input, not the state's
    # 30 is not a multiple of 4 replicas: the nearest one, 32, and an event with both
    rounded = carry_out(state, config, _plan([ajp.SetBatchSize(30)], config), steps)
    assert rounded.config.batch_size == 32
    assert rounded.events == ({"kind": "batch_rounded", "requested": 30, "batch_size": 32,
                               "replicas": 4, "microbatches": 1},)


@pytest.mark.filterwarnings("ignore:onebit.*trains worse than dense sync:UserWarning")
def test_a_codec_swap_starts_its_state_fresh_and_carries_the_rest_over():
    steps, config = _steps(), adaptjax.RunConfig(4, 16)
    state = _with_count(steps.init_state(config), 7)
    codec = ajc.onebit()
    carried = carry_out(state, config, _plan([ajp.SetCodec(codec)], config), steps)
    assert carried.config == config.replace(codec=codec_key(codec))
    assert carried.events == ({"kind": "set_codec", "codec": codec_key(codec)},)
    old, new = state.opt_state["sync"], carried.state.opt_state["sync"]
    assert int(new.count) == 7 and new.monitor_states is old.monitor_states
    # the codec's state (its error-feedback residuals) starts at zero; before, there was none
    assert jax.tree.leaves(old.codec_state) == []
    leaves = jax.tree.leaves(new.codec_state)
    assert leaves and all(not np.any(np.asarray(x)) for x in leaves)
    assert carried.state.opt_state["optimizer"] is state.opt_state["optimizer"]
    # and back to dense: the codec's state goes, the count stays
    back = carry_out(carried.state, carried.config,
                     _plan([ajp.SetCodec(None)], carried.config), steps)
    assert back.config == config and int(back.state.opt_state["sync"].count) == 7
    assert jax.tree.leaves(back.state.opt_state["sync"].codec_state) == []


def test_a_sync_swap_rebuilds_the_state_and_loses_no_parameter():
    steps, config = _steps(), adaptjax.RunConfig(4, 16)
    state = steps.init_state(config)
    strategy = adaptjax.sync.LocalSGD(H=4)
    carried = carry_out(state, config, _plan([ajp.SetSync(strategy)], config, steps), steps)
    assert carried.config == config.replace(sync=sync_key(strategy))
    assert carried.events == ({"kind": "set_sync", "sync": repr(strategy)},)
    # the consensus of the replicas' local models is the model that went in
    np.testing.assert_array_equal(
        adaptjax.sync.consensus_params(carried.state.params, carried.state.opt_state)["w"], W)
    # back to S-SGD: the same parameters again
    back = carry_out(carried.state, carried.config,
                     _plan([ajp.SetSync(None)], carried.config, steps), steps)
    assert back.config == config
    np.testing.assert_array_equal(back.state.params["w"], W)


def test_a_rescale_moves_the_state_to_the_new_mesh_and_asks_for_a_checkpoint():
    steps, config = _steps(), adaptjax.RunConfig(4, 16)
    state = steps.init_state(config)
    carried = carry_out(state, config, _plan([ajp.Rescale(devices=2)], config), steps)
    assert carried.config == config.replace(devices=2)
    assert carried.transition == {"kind": "rescale", "devices_from": 4, "devices_to": 2}
    assert carried.relaunch is None and carried.events == ()
    assert _devices_of(carried.state.params["w"]) == 2 and _devices_of(state.params["w"]) == 4
    np.testing.assert_array_equal(carried.state.params["w"], W)
    assert hyperparams_of(carried.state) == hyperparams_of(state)


def test_a_rescale_to_another_process_count_keeps_the_state_for_a_relaunch(monkeypatch):
    # 16 replicas need two processes of 8 devices; the state cannot move there in memory.
    monkeypatch.setenv(ENV_MAX_PROCESSES, "2")
    steps, config = _steps(), adaptjax.RunConfig(8, 32)
    state = steps.init_state(config)
    carried = carry_out(state, config, Transition(config=config.replace(devices=16)), steps)
    assert carried.relaunch == 2 and carried.state is state
    assert carried.config.devices == 16
    assert carried.transition == {"kind": "rescale", "devices_from": 8, "devices_to": 16,
                                  "processes_from": 1, "processes_to": 2}


def test_a_rollback_returns_the_latest_checkpoints_state_and_config(tmp_path):
    steps, config = _steps(), adaptjax.RunConfig(4, 16)
    saved = steps.init_state(config)
    checkpoints = adaptjax.RunCheckpoints(tmp_path / "checkpoints")
    with pytest.raises(ValueError) as e:
        roll_back(checkpoints, steps, "why")
    assert str(e.value) == (
        "Rollback needs a checkpoint; set RunSpec(checkpoint=CheckpointOptions(every=N)) or "
        "return Checkpoint() first")
    checkpoints.save(5, saved, {"config": dataclasses.asdict(config)})
    # since then: another mesh and other hyperparameters
    moved = carry_out(saved, config, _plan(
        [ajp.Rescale(devices=2), ajp.SetHyperparams({"learning_rate": 0.01})], config), steps)
    carried = roll_back(checkpoints, steps, "non-finite loss")
    assert carried.config == config and moved.config != config
    assert _devices_of(carried.state.params["w"]) == 4
    np.testing.assert_array_equal(carried.state.params["w"], W)
    assert hyperparams_of(carried.state)["learning_rate"] == np.float32(0.1)
    (event,) = carried.events
    assert event["kind"] == "rollback" and event["reason"] == "non-finite loss"
    assert event["to_checkpoint"] == 5 and event["latency_s"] >= 0
    checkpoints.close()


def test_checkpoint_and_stop_are_the_loops_and_change_nothing_here():
    steps, config = _steps(), adaptjax.RunConfig(4, 16)
    state = steps.init_state(config)
    plan = _plan([ajp.Checkpoint(), ajp.Stop("enough")], config)
    assert plan.checkpoint and plan.stop == "enough"
    carried = carry_out(state, config, plan, steps)
    assert carried.state is state and carried.config == config
    assert carried.events == () and carried.transition is None


def test_a_checkpoint_of_an_unknown_codec_or_strategy_names_the_fix():
    steps = _steps()
    meta = {"config": dataclasses.asdict(adaptjax.RunConfig(4, 16, codec="Mystery()"))}
    with pytest.raises(ValueError) as e:
        config_from(meta, steps)
    assert str(e.value) == ("the checkpoint was written with codec 'Mystery()'; pass that codec "
                            "as codec= or inside a policy")
    meta = {"config": dataclasses.asdict(adaptjax.RunConfig(4, 16, sync="Gossip()"))}
    with pytest.raises(ValueError, match="pass it as sync= or inside a policy"):
        config_from(meta, steps)


