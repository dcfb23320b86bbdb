"""float16 under the controller: dynamic loss scaling in the train state, its transitions.

A float16 configuration's chain wraps the ``"optimizer"`` link in
``dynamic_loss_scale``, so its state is a ``LossScaleState`` around the
optimizer's own. These tests check the scale against the state machine's rules
(grow after ``period`` finite steps, halve and skip on an overflow), that a
switch into and out of float16 wraps and unwraps exactly that link and leaves
every other array as it was, that checkpoints keep the scale and resume in
float16 or are converted after a resume in another precision, and that readers
of the optimizer's state look through the scale. Tiny MLP (``controller_job``),
a few steps.
"""

import dataclasses
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
from adaptjax.controller._background import announced_configs
from adaptjax.controller._carry_out import (
    carry_out,
    hyperparams_of,
    swap_precision,
    write_hyperparams,
)
from adaptjax.controller._step_cache import OPTIMIZER, StepCache

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import controller_job as job  # noqa: E402

from adaptjax._loss_scale import LossScaleState

INITIAL, PERIOD = 2.0**8, 3


def _steps(**kw) -> StepCache:
    return StepCache(model=job.init_params(), loss_fn=job.loss_fn,
                     optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
                     **kw)


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _same(a, b) -> bool:
    a, b = _host(a), _host(b)
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb, strict=True))


def _but_optimizer(state):
    """Everything of ``state`` but its ``"optimizer"`` link's state."""
    opt_state = {k: v for k, v in state.opt_state.items() if k != OPTIMIZER}
    return (state.params, opt_state, state.step, state.nonfinite_count, state.model_state)


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


def _rows(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def _expected_scales(finite, initial=INITIAL, period=PERIOD, factor=2.0, floor=1.0):
    """The scale after each step, by the rules: grow after ``period`` finite steps, halve
    (not below ``floor``) on a non-finite one, the count of finite steps reset by either."""
    scale, good, out = initial, 0, []
    for ok in finite:
        if ok and good + 1 >= period:
            scale, good = scale * factor, 0
        elif ok:
            good += 1
        else:
            scale, good = max(scale / factor, floor), 0
        out.append(scale)
    return out


# --- the configuration and its state --------------------------------------------------------


def test_float16_wraps_the_optimizer_link_and_readers_look_through_it():
    steps = _steps(loss_scale={"initial_scale": INITIAL})
    f32 = adaptjax.RunConfig(2, 16)
    f16 = f32.replace(precision="float16")
    plain, scaled = steps.init_state(f32), steps.init_state(f16)
    opt = scaled.opt_state[OPTIMIZER]
    assert isinstance(opt, LossScaleState) and list(scaled.opt_state) == list(
        plain.opt_state)
    assert float(opt.scale) == INITIAL and int(opt.good_steps) == 0
    # the optimizer's own state inside is the float32 run's, as the other links are
    assert _same(opt.inner_state, plain.opt_state[OPTIMIZER])
    assert _same(_but_optimizer(scaled), _but_optimizer(plain))
    assert steps.loss_scaled(f16) is steps.loss_scaled(f16) and steps.loss_scaled(f32) is None
    assert steps.loss_scaled(f32.replace(precision="bfloat16")) is None
    # hyperparameters are read and written inside the scale, which stays as it was
    assert hyperparams_of(scaled) == hyperparams_of(plain)
    written = write_hyperparams(scaled, {"learning_rate": 0.5}, steps.mesh(f16))
    assert hyperparams_of(written)["learning_rate"] == 0.5
    assert float(written.opt_state[OPTIMIZER].scale) == INITIAL
    # (the scale, then the rate factor, then inject_hyperparams: adam's moments are as they were)
    assert _same(written.opt_state[OPTIMIZER].inner_state.inner_state.inner_state,
                 opt.inner_state.inner_state.inner_state)


def test_a_switch_into_float16_has_the_state_the_float16_step_is_compiled_for():
    steps, data = _steps(), adaptjax.ArrayDataset(job.make_data(), seed=0)
    f32 = adaptjax.RunConfig(4, 32)
    f16 = f32.replace(precision="float16")
    converted = swap_precision(steps.init_state(f32), f32, "float16", steps)
    target = steps.abstract_state(f16)  # what a background compile and a restore use
    assert jax.tree.structure(converted) == jax.tree.structure(target)
    for x, t in zip(jax.tree.leaves(converted), jax.tree.leaves(target), strict=True):
        assert (x.shape, x.dtype) == (t.shape, t.dtype)
        assert x.sharding.is_equivalent_to(t.sharding, x.ndim)
    # a policy's announced SetPrecision names that configuration, for the background compiler
    hints = [ajp.SetPrecision("float16"), ajp.SetPrecision("bfloat16")]
    planned = announced_configs(
        hints, steps, lambda a: plan_transition(a, f32, max_devices=8).config)
    assert planned == [f16, f32.replace(precision="bfloat16")]
    assert steps.abstract_args(f16, data)[0].opt_state[OPTIMIZER].scale.shape == ()


def test_a_sync_strategy_switch_under_float16_keeps_the_scale():
    steps = _steps(loss_scale={"initial_scale": INITIAL})
    config = adaptjax.RunConfig(4, 32, precision="float16")
    state = steps.init_state(config)
    opt = state.opt_state[OPTIMIZER]
    opt = opt._replace(scale=jax.device_put(opt.scale * 4, opt.scale.sharding))
    state = dataclasses.replace(state, opt_state={**state.opt_state, OPTIMIZER: opt})
    local = carry_out(state, config, plan_transition(
        [ajp.SetSync(adaptjax.sync.LocalSGD(H=2))], config, max_devices=8), steps)
    scaled = local.state.opt_state[OPTIMIZER]
    assert isinstance(scaled, LossScaleState) and float(scaled.scale) == 4 * INITIAL
    moved = hyperparams_of(local.state)  # plus each new replica's rate factor, from 1.0
    assert {k: v for k, v in moved.items() if not k.startswith("replica_lr/")} == (
        hyperparams_of(state))
    assert [moved.pop(f"replica_lr/{i}") for i in range(4)] == [1.0] * 4
    back = carry_out(local.state, local.config, plan_transition(
        [ajp.SetSync(None)], local.config, max_devices=8), steps)
    assert float(back.state.opt_state[OPTIMIZER].scale) == 4 * INITIAL
    # the moments went per replica and were averaged back: identical replicas, the same moments
    assert _same(back.state.opt_state[OPTIMIZER].inner_state, opt.inner_state)
    assert _same(back.state.params, state.params)


@pytest.mark.parametrize(
    "loss_scale, message",
    [
        ({"growth": 2}, "loss_scale: unknown option 'growth'; use initial_scale, period"),
        ({"period": 0}, "dynamic_loss_scale: period must be"),
        (2.0, "loss_scale must be a dict of dynamic_loss_scale's options"),
    ],
)
def test_bad_loss_scale_options_are_refused_before_touching_disk(tmp_path, loss_scale, message):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError) as e:
        make_controller(run_dir=run_dir, **job.job_kwargs(
            policies=[], precision="float16", loss_scale=loss_scale))
    assert _one_line(e).startswith(message)
    assert not run_dir.exists()


# --- under the controller -------------------------------------------------------------------


def test_the_loss_scale_grows_every_period_and_halves_and_skips_on_an_overflow(tmp_path):
    raw = job.make_data()
    bad = 4  # the 5th batch (rows 4*16 ... 5*16 in index order) overflows float16
    raw["x"][bad * 16:(bad + 1) * 16] = 1e6  # beyond float16's 65504: inf once cast
    seen = {}

    def keep(ctrl):  # each step's state on the host, before the next step donates it
        seen[ctrl.step] = _host((ctrl.state.params, ctrl.state.opt_state[OPTIMIZER]))

    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(
        policies=[], checkpoint_every=None, devices=8, batch_size=16, on_step=keep,
        data=adaptjax.ArrayDataset(raw, shuffle=False), precision="float16",
        loss_scale={"initial_scale": INITIAL, "period": PERIOD}))
    keep(ctrl)
    ctrl.run(9)
    ctrl.close()
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 10))
    finite = [r["nonfinite"] == 0.0 for r in rows]
    assert finite == [step != bad + 1 for step in range(1, 10)]
    assert [r["loss_scale"] for r in rows] == _expected_scales(finite)
    assert ctrl.nonfinite_count == 1 and int(ctrl.state.nonfinite_count) == 1
    # the skipped step moved nothing: params and moments as they were, only the scale halved
    (p4, o4), (p5, o5) = seen[bad], seen[bad + 1]
    assert _same(p5, p4) and _same(o5.inner_state, o4.inner_state)
    assert o5.scale == o4.scale / 2 and o5.good_steps == 0
    assert not _same(seen[bad + 2][0], p5)  # and the next step trains again


def test_float32_float16_float32_switches_keep_every_array_bit_identical(tmp_path):
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(
        policies=[], checkpoint_every=None, devices=4, batch_size=32,
        loss_scale={"initial_scale": INITIAL, "period": PERIOD}))
    ctrl.run(3)
    ctrl.drain()
    before, position = _host(ctrl.state), ctrl.data.state_dict()
    ctrl.apply([ajp.SetPrecision("float16")])
    scaled = ctrl.state.opt_state[OPTIMIZER]
    assert ctrl.config.precision == "float16" and isinstance(scaled, LossScaleState)
    assert float(scaled.scale) == INITIAL and int(scaled.good_steps) == 0
    assert _same(scaled.inner_state, before.opt_state[OPTIMIZER])
    assert _same(_but_optimizer(ctrl.state), _but_optimizer(before))
    assert ctrl.data.state_dict() == position and ctrl.step == 3
    ctrl.run(7)  # 4 finite float16 steps: the scale grew once (period 3)
    ctrl.drain()
    during, position = _host(ctrl.state), ctrl.data.state_dict()
    assert float(during.opt_state[OPTIMIZER].scale) == _expected_scales([True] * 4)[-1]
    ctrl.apply([ajp.SetPrecision("float32")])
    assert ctrl.config.precision is None
    assert _same(ctrl.state.opt_state[OPTIMIZER], during.opt_state[OPTIMIZER].inner_state)
    assert _same(_but_optimizer(ctrl.state), _but_optimizer(during))
    assert ctrl.data.state_dict() == position and int(ctrl.state.step) == 7
    ctrl.run(9)
    assert ctrl.compilations == 2  # float32's step again from the cache
    assert np.isfinite(ctrl.latest_metrics["loss"]) and ctrl.nonfinite_count == 0
    moves = [(e["step"], e["precision_from"], e["precision"])
             for e in ctrl.log.events if e["kind"] == "set_precision"]
    assert moves == [(3, "float32", "float16"), (7, "float16", "float32")]
    ctrl.close()


def test_a_float16_checkpoint_resumes_with_its_scale_and_converts_to_bfloat16(tmp_path):
    kwargs = dict(policies=[], checkpoint_every=None, devices=4, batch_size=32,
                  precision="float16", loss_scale={"initial_scale": INITIAL, "period": PERIOD})
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(**kwargs))
    ctrl.run(4)  # the end is checkpointed: the scale grew once, one finite step since
    ctrl.close()
    final = _host(ctrl.state)
    assert float(final.opt_state[OPTIMIZER].scale) == 2 * INITIAL
    assert ctrl.checkpoints.read_meta(4)["config"]["precision"] == "float16"

    resumed = resume_controller(tmp_path, **job.job_kwargs(**kwargs))
    assert resumed.config == ctrl.config and _same(resumed.state, final)
    resumed.close()

    with pytest.warns(UserWarning, match=r"the spec passed differs from .* in precision; "):
        as_bf16 = resume_controller(tmp_path, **job.job_kwargs(
            **{**kwargs, "precision": "bfloat16"}))
    assert _same(as_bf16.state, final)  # restored onto the checkpoint's own structure
    for _ in range(2):
        as_bf16.apply([ajp.SetPrecision("bfloat16")])
        assert as_bf16.config.precision == "bfloat16"
        assert _same(as_bf16.state.opt_state[OPTIMIZER], final.opt_state[OPTIMIZER].inner_state)
        assert _same(_but_optimizer(as_bf16.state), _but_optimizer(final))
        # a rollback restores the float16 checkpoint onto its own structure, scale and all
        as_bf16.apply([ajp.Rollback("back")])
        assert as_bf16.config.precision == "float16" and _same(as_bf16.state, final)
    as_bf16.apply([ajp.SetPrecision("bfloat16")])
    as_bf16.run(6)
    assert np.isfinite(as_bf16.latest_metrics["loss"]) and as_bf16.data.cursor == 6 * 32
    assert as_bf16.checkpoints.read_meta(6)["config"]["precision"] == "bfloat16"
    as_bf16.close()
