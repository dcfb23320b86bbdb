"""Precision under the controller: RunConfig.precision, SetPrecision, resumes, input codecs.

The train state is the same in float32 and bfloat16 (float32 master weights
and optimizer state), so a switch is another compiled step over the same
state (float16's loss scale: ``test_controller_float16.py``): these tests
check that the state passes through every precision transition untouched,
that the compiled step really computes in the precision its configuration
names (bf16 in its HLO), that a checkpoint keeps the precision and resumes in
another one, and that an ``ArrayDataset(features=...)`` decodes inside the
controller's step. Tiny MLP (``controller_job``), a few steps.
"""

import json
import os
import sys

import jax
import numpy as np
import optax
import pytest
from _controller_args import make_controller, resume_controller  # noqa: E402

import adaptjax
from adaptjax import policies as ajp
from adaptjax._transition import plan_transition
from adaptjax.controller._carry_out import carry_out
from adaptjax.controller._persistence import config_from
from adaptjax.controller._step_cache import StepCache

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import controller_job as job  # noqa: E402


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


def _steps() -> StepCache:
    return StepCache(model=job.init_params(), loss_fn=job.loss_fn,
                     optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-2))


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _same(a, b) -> bool:
    la, lb = jax.tree.leaves(_host(a)), jax.tree.leaves(_host(b))
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb, strict=True))


class Seen(ajp.Policy):
    """Records the precision each decision's context names; decides nothing."""

    def __init__(self):
        self.precisions = []

    def decide(self, metrics, ctx):
        self.precisions.append((ctx.step, ctx.precision))
        return []


# --- the configuration ----------------------------------------------------------------------


def test_float32_is_none_so_old_configs_and_checkpoints_compare_equal():
    old = adaptjax.RunConfig(8, 64)
    for float32 in (None, "float32", "f32", adaptjax.Precision()):
        config = adaptjax.RunConfig(8, 64, precision=float32)
        assert config == old and hash(config) == hash(old) and config.precision is None
    bf16 = adaptjax.RunConfig(8, 64, precision=adaptjax.Precision("bf16"))
    assert bf16.precision == "bfloat16" and bf16 != old
    assert adaptjax.RunConfig(8, 64, precision="bfloat16") == bf16
    # a checkpoint written before precision existed has no such key in its meta
    meta = {"config": {"devices": 8, "batch_size": 64, "microbatches": 1, "codec": None,
                       "sync": None}}
    assert config_from(meta, _steps()) == old


@pytest.mark.parametrize(
    "precision, message",
    [
        (3, "precision must be an adaptjax.Precision, its key (e.g. 'bfloat16') or None, got 3"),
        ("int8", "Precision: unknown compute dtype 'int8'; use one of 'float32', 'bfloat16'"),
    ],
)
def test_run_config_refuses_an_unknown_precision(precision, message):
    with pytest.raises(ValueError) as e:
        adaptjax.RunConfig(8, 64, precision=precision)
    assert _one_line(e).startswith(message)


@pytest.mark.parametrize(
    "precision, message",
    [
        ("int8", "Precision: unknown compute dtype 'int8'"),
        (object(), "precision must be an adaptjax.Precision"),
    ],
)
def test_controller_refuses_a_precision_it_cannot_run_before_touching_disk(
    tmp_path, precision, message
):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError) as e:
        make_controller(run_dir=run_dir, **job.job_kwargs(policies=[], precision=precision))
    assert message in _one_line(e)
    assert not run_dir.exists()


def test_float16_is_planned_like_any_precision_and_a_too_large_parameter_is_refused(tmp_path):
    config = adaptjax.RunConfig(8, 64, precision="bfloat16")
    plan = plan_transition([ajp.SetPrecision(adaptjax.Precision("fp16"))], config, max_devices=8)
    assert plan.config == config.replace(precision="float16") and plan.precision_changed
    # the loss scale cannot cure a parameter float16 cannot hold: refused before the disk
    model = dict(job.init_params(), b1=np.full(16, 1e5, np.float32))
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError) as e:
        make_controller(run_dir=run_dir, **job.job_kwargs(
            policies=[], model=model, precision="float16"))
    assert _one_line(e).startswith("parameter ['b1'] reaches |x| = 1e+05, beyond float16's")
    assert not run_dir.exists()


# --- the compiled step and the transition ---------------------------------------------------


def test_the_step_is_compiled_per_precision_and_computes_in_it():
    steps, data = _steps(), adaptjax.ArrayDataset(job.make_data(), seed=0)
    f32 = adaptjax.RunConfig(2, 8)
    bf16 = f32.replace(precision="bfloat16")
    assert steps.step(f32) is steps.step(f32) and steps.step(bf16) is not steps.step(f32)
    assert steps.loss(f32) is job.loss_fn  # float32 without a codec: the user's function

    def hlo(config):
        return steps.step(config).jitted.lower(*steps.abstract_args(config, data)).as_text()

    # the model's matmuls run in bf16; the float32 step has no bf16 value at all
    assert "bf16" not in hlo(f32)
    assert any("dot_general" in line and "bf16" in line for line in hlo(bf16).splitlines())
    # the same state runs in both: only the step differs
    assert jax.tree.structure(steps.abstract_state(f32)) == jax.tree.structure(
        steps.abstract_state(bf16))


def test_a_precision_transition_leaves_the_state_as_it_is():
    steps, config = _steps(), adaptjax.RunConfig(8, 64)
    state = steps.init_state(config)
    plan = plan_transition([ajp.SetPrecision("bfloat16")], config, max_devices=8)
    carried = carry_out(state, config, plan, steps)
    assert carried.state is state and carried.transition is None
    assert carried.config == config.replace(precision="bfloat16")
    assert carried.events == ({"kind": "set_precision", "precision": "bfloat16",
                               "precision_from": "float32"},)
    back = plan_transition([ajp.SetPrecision(adaptjax.Precision("float32"))], carried.config,
                           max_devices=8)
    assert back.config == config and back.precision_changed
    again = plan_transition([ajp.SetPrecision("bfloat16")], carried.config, max_devices=8)
    assert not again.precision_changed and carry_out(state, carried.config, again,
                                                     steps).events == ()


def test_a_rescale_under_bfloat16_keeps_the_precision_and_the_state():
    steps, config = _steps(), adaptjax.RunConfig(8, 64, precision="bfloat16")
    state = steps.init_state(config)
    plan = plan_transition([ajp.Rescale(devices=4)], config, max_devices=8)
    carried = carry_out(state, config, plan, steps)
    assert carried.config == config.replace(devices=4)
    assert _same(carried.state.params, state.params)
    assert _same(carried.state.opt_state, state.opt_state)
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(carried.state.params)} == {4}


# --- under the controller -------------------------------------------------------------------


def test_a_switch_mid_run_loses_no_state_and_policies_see_the_precision(tmp_path):
    seen = Seen()
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(
        policies=[seen], policy_every=2, checkpoint_every=None))
    ctrl.run(4)
    ctrl.drain()
    before, cursor, compiled = _host(ctrl.state), ctrl.data.cursor, ctrl.compilations
    ctrl.apply([ajp.SetPrecision("bfloat16")])
    assert ctrl.config.precision == "bfloat16"
    assert _same(ctrl.state, before) and ctrl.data.cursor == cursor and ctrl.step == 4
    assert int(ctrl.state.step) == 4
    ctrl.run(8)
    assert ctrl.compilations == compiled + 1  # one new step: the bfloat16 one
    assert np.isfinite(ctrl.latest_metrics["loss"]) and ctrl.nonfinite_count == 0
    assert ctrl.data.cursor == 8 * 64
    events = [e for e in ctrl.log.events if e["kind"] == "set_precision"]
    assert [(e["step"], e["precision"]) for e in events] == [(4, "bfloat16")]
    # the context names the precision in force when the policy decides: the decision on
    # step 2 came before the switch, the ones on steps 4 and 6 (made at steps 5 and 7) after
    assert seen.precisions == [(2, "float32"), (4, "bfloat16"), (6, "bfloat16")]
    ctrl.close()


def test_a_bfloat16_checkpoint_resumes_warns_on_another_precision_and_switches(tmp_path):
    policy = ajp.Schedule({4: ajp.Rescale(devices=4)})
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(
        policies=[policy], policy_every=2, checkpoint_every=None, precision="bf16"))
    ctrl.run(8)
    metas = {s: ctrl.checkpoints.read_meta(s) for s in ctrl.checkpoints.all_steps()}
    ctrl.close()
    assert ctrl.config == adaptjax.RunConfig(4, 64, precision="bfloat16")
    final = _host(ctrl.state)
    assert [m["config"]["precision"] for m in metas.values()] == ["bfloat16"] * len(metas)
    assert {m["config"]["devices"] for m in metas.values()} == {4}  # the rescale's and the end's

    with pytest.warns(UserWarning) as record:  # float32 passed: the checkpoint's bfloat16 wins
        resumed = resume_controller(tmp_path, **job.job_kwargs(
            policies=[ajp.Schedule({4: ajp.Rescale(devices=4)})], policy_every=2,
            checkpoint_every=None))
    assert [str(w.message).split(" in ")[-1] for w in record] == [
        "precision; the passed values are used (the configuration continues as checkpointed)"]
    assert resumed.config == ctrl.config and _same(resumed.state, final)
    resumed.apply([ajp.SetPrecision("float32")])
    assert resumed.config.precision is None and _same(resumed.state, final)
    resumed.run(10)
    assert np.isfinite(resumed.latest_metrics["loss"]) and resumed.data.cursor == 10 * 64
    assert resumed.checkpoints.read_meta(10)["config"]["precision"] is None
    resumed.close()


def test_precision_policy_moves_the_run_to_bfloat16_once_it_is_stable(tmp_path):
    policy = ajp.PrecisionPolicy(warmup=4, stable_steps=2, window=10)
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(
        policies=[policy], policy_every=2, checkpoint_every=None, devices=2, batch_size=16))
    ctrl.run(8)
    moves = [e for e in ctrl.log.events if e["kind"] == "set_precision"]
    # decisions at steps 2, 4, ...: calm since step 2, warm at 4 -> asks at the decision on 4
    assert [(e["step"], e["precision"]) for e in moves] == [(5, "bfloat16")]
    assert ctrl.config.precision == "bfloat16" and ctrl.nonfinite_count == 0
    ctrl.close()


def test_an_int8_feature_dataset_decodes_inside_the_controllers_step(tmp_path):
    raw = job.make_data()
    coded = adaptjax.ArrayDataset(raw, seed=3, features={"x": adaptjax.InputCodec("int8")})
    # the same samples as floats: what the step's decode must give, computed on the host
    decoded = dict(raw, x=np.asarray(coded.codecs["x"].decode(coded.codecs["x"].encode(raw["x"]))))
    losses, moved = {}, {}
    for name, data in (("int8", coded), ("float32", adaptjax.ArrayDataset(decoded, seed=3))):
        ctrl = make_controller(run_dir=tmp_path / name, **job.job_kwargs(
            policies=[], data=data, devices=2, batch_size=16, checkpoint_every=None))
        ctrl.run(5)
        ctrl.close()
        rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        losses[name] = [r["loss"] for r in rows]
        moved[name] = [e["input_bytes"] for e in ctrl.log.events if e["kind"] == "compile"]
    np.testing.assert_allclose(losses["int8"], losses["float32"], rtol=1e-5)
    # x's 8 features per sample: 1 byte each instead of 4; y and idx as they were
    assert moved["int8"] == [16 * coded.bytes_per_sample]
    assert moved["float32"][0] - moved["int8"][0] == 16 * 8 * 3
