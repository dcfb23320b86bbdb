"""RunSpec(micro_batch_size=...): the controller's batch in accumulated micro-steps.

Each step runs one compiled micro-step ``k = batch_size / micro_batch_size``
times on consecutive micro-batches, and the optimizer steps on the mean of
their gradients. Every replica's micro-batches are equal in size, so that mean
is the mean gradient of the step's ``batch_size`` samples, the gradient one
compiled step of the whole batch takes: the parameters agree up to float32
rounding (a sum in another order). The number of micro-steps lives in the
state, so a batch change to another multiple of the micro-batch compiles
nothing.
"""

import importlib.util
import os

import _fed
import grain
import jax
import numpy as np
import pytest
from _controller_args import make_controller, resume_controller

import adaptjax
from adaptjax import policies as ajp

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "controller_job", os.path.join(TESTS, "controller_job.py"))
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)


def params_of(ctrl):
    return {k: np.asarray(v) for k, v in jax.device_get(ctrl.state.params).items()}


def ordered():
    return adaptjax.ArrayDataset(job.make_data(), shuffle=False)


def controller(run_dir, **overrides):
    return make_controller(run_dir=run_dir, **job.job_kwargs(**{
        "policies": [], "checkpoint_every": None, "data": ordered(), **overrides}))


def compiles(ctrl):
    return [e for e in ctrl.log.events if e["kind"] == "compile"]


def test_two_micro_steps_of_32_train_as_one_step_of_64(tmp_path):
    runs = {}
    for name, micro in (("whole", None), ("micro", 32)):
        ctrl = controller(tmp_path / name, batch_size=64, micro_batch_size=micro)
        ctrl.run(6)
        ctrl.close()
        runs[name] = ctrl
    whole, micro = runs["whole"], runs["micro"]
    assert micro.samples_seen == micro.data.cursor == whole.data.cursor == 6 * 64
    assert int(micro.state.opt_state.micro_steps) == 2
    assert int(micro.state.opt_state.micro_step) == 0  # every step ends on its update
    assert len(compiles(micro)) == 1 and compiles(micro)[0]["config"]["batch_size"] == 64
    a, b = params_of(whole), params_of(micro)
    assert not np.array_equal(a["w1"], np.asarray(job.init_params()["w1"]))  # it trained
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_growing_the_batch_to_another_multiple_compiles_nothing(tmp_path):
    sched = ajp.Schedule({5: ajp.SetBatchSize(128)})
    ctrl = controller(tmp_path, batch_size=32, micro_batch_size=32, policies=[sched])
    ctrl.run(10)
    ctrl.close()
    assert len(compiles(ctrl)) == 1 == ctrl.compilations
    assert ctrl.steps.step(ctrl.config).jitted._cache_size() == 1
    sizes = [int(s["batch_size"]) for s in _metric_rows(tmp_path)]
    assert set(sizes) == {32, 128} and sizes == sorted(sizes)  # 32 until the change, then 128
    assert ctrl.config.batch_size == 128 and int(ctrl.state.opt_state.micro_steps) == 4
    assert ctrl.samples_seen == ctrl.data.cursor == sum(sizes)
    # policies see that any multiple of 32 runs without a compile
    assert ctrl.context().micro_batch_sizes == {32}


def _metric_rows(run_dir):
    import json

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_a_resume_after_a_batch_change_continues_bit_exactly(tmp_path):
    def kwargs():
        return dict(batch_size=32, micro_batch_size=32, checkpoint_every=4,
                    policies=[ajp.Schedule({5: ajp.SetBatchSize(96)})],
                    data=adaptjax.ArrayDataset(job.make_data(), seed=3))

    whole = make_controller(run_dir=tmp_path / "whole", **job.job_kwargs(**kwargs()))
    whole.run(12)
    whole.close()
    first = make_controller(run_dir=tmp_path / "cut", **job.job_kwargs(**kwargs()))
    first.run(8)  # past the change (applied at step 6): a checkpoint at 3 micro-steps a step
    first.close()
    assert first.config.batch_size == 96
    resumed = resume_controller(tmp_path / "cut", **job.job_kwargs(**kwargs()))
    assert resumed.step == 8 and int(resumed.state.opt_state.micro_steps) == 3
    resumed.run(12)
    resumed.close()
    assert resumed.samples_seen == whole.samples_seen == resumed.data.cursor
    a, b = params_of(whole), params_of(resumed)
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)


def test_a_rescale_between_micro_steps_trains_as_a_run_that_never_rescaled(tmp_path):
    plain = controller(tmp_path / "plain", batch_size=64, micro_batch_size=32)
    plain.run(10)
    plain.close()
    sched = ajp.Schedule({5: ajp.Rescale(devices=4)})
    scaled = controller(tmp_path / "scaled", batch_size=64, micro_batch_size=32,
                        policies=[sched])
    scaled.run(10)
    scaled.close()
    moves = [(e["devices_from"], e["devices_to"]) for e in scaled.log.events
             if e["kind"] == "rescale"]
    assert moves == [(8, 4)] and scaled.config.devices == 4
    assert int(scaled.state.opt_state.micro_steps) == 2
    assert scaled.data.cursor == plain.data.cursor == 10 * 64
    a, b = params_of(plain), params_of(scaled)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_a_fixed_batch_iter_dataset_takes_batch_changes_in_micro_steps(tmp_path):
    # every third record dropped, nothing shuffled: the stream is known element by element
    rows = grain.MapDataset.source(job.records(job.make_data()))
    kept = rows.repeat().to_iter_dataset().filter(lambda r: r["idx"] % 3 != 0)
    data = _fed.record(adaptjax.GrainDataset.from_iter_dataset(kept, batch_size=32), tmp_path)
    sched = ajp.Schedule({5: ajp.SetBatchSize(96)})
    ctrl = controller(tmp_path, batch_size=64, micro_batch_size=32, policies=[sched], data=data)
    ctrl.run(9)
    ctrl.close()
    assert ctrl.config.batch_size == 96 and len(compiles(ctrl)) == 1
    fed, agreed = _fed.stream(tmp_path)
    assert agreed and len(fed) == ctrl.samples_seen == data.cursor == 6 * 64 + 3 * 96
    stream = [i for _ in range(2) for i in range(640) if i % 3]
    assert fed == stream[: len(fed)]  # in order: nothing skipped, nothing repeated


@pytest.mark.parametrize("bad", [5, 40])  # in the first micro-batch of step 1, or its last
def test_a_non_finite_micro_step_skips_its_whole_step(tmp_path, bad):
    # a plain step of 64 with the NaN sample is skipped whole: so is the accumulated one, and
    # both runs then go on from the same parameters over the same batches
    runs = {}
    for micro in (None, 32):
        arrays = job.make_data()
        arrays["x"][bad, 0] = np.nan
        data = adaptjax.ArrayDataset(arrays, shuffle=False)
        ctrl = controller(tmp_path / str(micro), batch_size=64, micro_batch_size=micro, data=data)
        with pytest.warns(RuntimeWarning, match="step 1 had a non-finite"):
            ctrl.run(1)
            ctrl.drain()
        initial = {k: np.asarray(v) for k, v in job.init_params().items()}
        for k, v in params_of(ctrl).items():
            np.testing.assert_array_equal(v, initial[k], err_msg=k)
        ctrl.run(5)
        ctrl.close()
        assert ctrl.latest_metrics["nonfinite_count"] == 1
        runs[micro] = params_of(ctrl)
    assert int(ctrl.state.opt_state.micro_step) == 0 and int(ctrl.state.opt_state.skipped) == 0
    for k, v in runs[None].items():
        np.testing.assert_allclose(runs[32][k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def one_line(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_bad_micro_batches_are_one_line_errors(tmp_path):
    one_line(lambda: adaptjax.RunSpec(run_dir=tmp_path, batch_size=80, micro_batch_size=32),
             "RunSpec.batch_size 80 is not a multiple of micro_batch_size 32: a step "
             "accumulates whole micro-batches; use a multiple of 32")
    one_line(lambda: adaptjax.RunSpec(run_dir=tmp_path, batch_size=64, micro_batch_size=0),
             "RunSpec.micro_batch_size must be a positive integer, got 0")
    one_line(lambda: controller(tmp_path / "a", batch_size=72, micro_batch_size=36),
             "RunSpec.micro_batch_size 36 does not split over replicas x microbatches = 8 x 1; "
             "use a micro_batch_size that is a multiple of 8")
    assert not os.path.exists(tmp_path / "a" / "spec.json")  # refused before the disk
    ctrl = controller(tmp_path / "b", batch_size=64, micro_batch_size=32)
    try:
        one_line(lambda: ctrl.apply([ajp.SetBatchSize(80)]),
                 "batch_size 80 is not a multiple of RunSpec.micro_batch_size 32: a step "
                 "accumulates whole micro-batches; use a multiple of 32 (a batch-size policy: "
                 "multiple_of=32)")
        one_line(lambda: ctrl.apply([ajp.Rescale(devices=3)]),
                 "RunSpec.micro_batch_size 32 does not split over replicas x microbatches = "
                 "3 x 1")
        assert ctrl.config.batch_size == 64 and ctrl.config.devices == 8  # nothing changed
    finally:
        ctrl.close()


def _carries(ctrl):
    return [e for e in ctrl.log.events if e["kind"] == "carry_batch"]


def _auto_limit(tmp_path):
    """A device_memory under which the model's step fits at 64 samples but not at 128, by
    the controller's own estimate from the compiled step of 32 (its fixed bytes plus its
    temporaries in proportion: total + temp at 64, total + 3 temp at 128)."""
    probe = controller(tmp_path / "probe", batch_size=32, micro_batch_size="auto")
    try:
        total, temp = probe.steps.memory(probe.config, probe.data)
    finally:
        probe.close()
    assert temp > 0
    return total + 2 * temp


def test_auto_accumulates_a_batch_that_would_not_fit_exactly_as_a_fixed_micro_batch(tmp_path):
    limit = _auto_limit(tmp_path)
    sched = {3: ajp.SetBatchSize(128), 7: ajp.SetBatchSize(32)}
    runs = {}
    for micro in ("auto", 32):
        # nothing compiled in the background, whose timing would decide what is compiled
        ctrl = controller(tmp_path / str(micro), batch_size=32, micro_batch_size=micro,
                          device_memory=limit, policies=[ajp.Schedule(dict(sched))],
                          policy_every=1, precompile_upcoming=False)
        ctrl.run(6)
        assert ctrl.config.micro_batch == 32 and int(ctrl.state.opt_state.micro_steps) == 4
        ctrl.run(10)
        ctrl.close()
        runs[micro] = ctrl
    auto, fixed = runs["auto"], runs[32]
    carried = [(e["batch_size"], e["micro_batch"], e["micro_steps"], e["compiles"])
               for e in _carries(auto)]
    assert carried == [(128, 32, 4, False), (32, 32, 1, False)]  # back to 32: compiled whole
    assert "would need" in _carries(auto)[0]["reason"]
    assert auto.compilations == fixed.compilations == 1
    assert auto.config.micro_batch is None and auto.config.batch_size == 32
    assert auto.samples_seen == auto.data.cursor == fixed.data.cursor
    a, b = params_of(fixed), params_of(auto)
    for k in a:  # one program, the same micro-steps: the same arithmetic
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)


def test_auto_resumes_in_the_micro_steps_it_chose(tmp_path):
    limit = _auto_limit(tmp_path)

    def kwargs():
        return dict(batch_size=32, micro_batch_size="auto", device_memory=limit,
                    checkpoint_every=4, policies=[ajp.Schedule({3: ajp.SetBatchSize(128)})],
                    policy_every=1, precompile_upcoming=False,
                    data=adaptjax.ArrayDataset(job.make_data(), seed=3))

    whole = make_controller(run_dir=tmp_path / "whole", **job.job_kwargs(**kwargs()))
    whole.run(10)
    whole.close()
    first = make_controller(run_dir=tmp_path / "cut", **job.job_kwargs(**kwargs()))
    first.run(8)
    first.close()
    resumed = resume_controller(tmp_path / "cut", **job.job_kwargs(**kwargs()))
    assert resumed.config.micro_batch == 32 and int(resumed.state.opt_state.micro_steps) == 4
    resumed.run(10)
    resumed.close()
    assert resumed.compilations == 1 and resumed.samples_seen == whole.samples_seen
    a, b = params_of(whole), params_of(resumed)
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)


def test_auto_times_a_program_per_call_across_the_batches_it_carried(tmp_path):
    from adaptjax.controller._micro_batch import Carrier

    ctrl = controller(tmp_path, batch_size=32, micro_batch_size="auto")
    try:
        ctrl.run(2)  # the step of 32 ran: its program is compiled
        at = ctrl.config

        class Times:  # 0.1 s a step of 32 whole, 0.4 s a step of 4 micro-steps of it
            def step_times(self):
                return {at: 0.1, at.replace(batch_size=128, micro_batch=32): 0.4}

        class Clock:  # the run's compiles waited 10 s
            def metrics(self):
                return {"compile_seconds": 10.0}

        carrier = Carrier(ctrl.steps, ctrl.data, ctrl._compiler, Times(), Clock(),
                          device_memory=None)
        to64 = at.replace(batch_size=64)
        # one program timed, at 0.1 s a call: 2 micro-steps lose at most 0.1 s a step, and
        # the compile has as many steps as the run has taken to pay for itself
        config, event = carrier.choose(to64, step=50)  # 5 s < 10 s
        assert config.micro_batch == 32 and event["micro_steps"] == 2
        assert not event["compiles"] and "would save at most ~5 s in 50 steps" in event["reason"]
        # with background compiles off, a batch left in micro-steps is chosen for again after
        # each decision: 2 micro-steps of 32 lose up to 0.1 s a step, 5 s by step 50 (it
        # stays) and 20 s by step 200, more than the compile (it goes whole, compiling)
        ctrl._compiler.enabled = False
        micro = at.replace(batch_size=64, micro_batch=32)
        assert carrier.whole(ctrl.state, micro, step=50).config == micro
        went = carrier.whole(ctrl.state, micro, step=200)
        assert went.config.micro_batch is None and went.events[0]["compiles"]
        assert int(went.state.opt_state.micro_steps) == 1
        # with them on, a compile that may pay goes to the background thread, and the step
        # runs in micro-steps until it is done, then whole
        ctrl._compiler.enabled = True
        config, event = carrier.choose(to64, step=200)
        assert config.micro_batch == 32 and not event["compiles"]
        assert event["reason"].endswith("may pay: it saves up to ~20 s over 2 micro-steps of "
                                        "32 in 200 steps; compiling it in the background, 2 "
                                        "micro-steps of 32 meanwhile")
        ctrl._compiler.wait_all()
        config, event = carrier.choose(to64, step=200)
        assert config.micro_batch is None and event["reason"] == "a step of 64 is compiled"
    finally:
        ctrl.close()


def test_auto_takes_the_whole_step_once_it_is_compiled_ahead_and_fits(tmp_path):
    # By the estimate from the step of 32 alone, 128 does not fit: 4 micro-steps of 32.
    # Compiled ahead, the step of 128 is measured, and this model's temporaries do not
    # grow with the batch, so it fits: the next decision runs it whole.
    limit = _auto_limit(tmp_path)
    ctrl = controller(tmp_path / "run", batch_size=32, micro_batch_size="auto",
                      device_memory=limit, policy_every=1, precompile_upcoming=False,
                      policies=[ajp.Schedule({3: ajp.SetBatchSize(128)})])
    try:
        ctrl.run(6)
        assert ctrl.config.micro_batch == 32 and ctrl.compilations == 1
        ctrl.precompile(batch_size=128)
        whole_bytes, _ = ctrl.steps.memory(ctrl.config.replace(micro_batch=None), ctrl.data)
        assert whole_bytes <= limit
        ctrl.run(9)
        assert ctrl.config.micro_batch is None and int(ctrl.state.opt_state.micro_steps) == 1
        whole = [e for e in _carries(ctrl) if e["micro_steps"] == 1]
        assert len(whole) == 1 and whole[0]["reason"] == "a step of 128 is compiled"
        # the decision on step 3's metrics lands after step 4 (metrics are read one behind)
        assert ctrl.samples_seen == ctrl.data.cursor == 4 * 32 + 5 * 128
    finally:
        ctrl.close()


def test_auto_reads_the_bytes_of_a_new_configuration_before_its_first_step(tmp_path):
    # After a rescale nothing is compiled for the new mesh: the whole batch's step is
    # compiled ahead, and its measured bytes decide, before it runs
    limit = _auto_limit(tmp_path)
    ctrl = controller(tmp_path / "run", batch_size=32, micro_batch_size="auto",
                      device_memory=limit, policy_every=1, precompile_upcoming=False,
                      policies=[ajp.Schedule({3: ajp.SetBatchSize(128),
                                              6: ajp.Rescale(devices=4)})])
    try:
        ctrl.run(10)
        assert ctrl.config.devices == 4
        event = _carries(ctrl)[-1]
        new = ctrl.config.replace(micro_batch=None)
        measured, _ = ctrl.steps.memory(new, ctrl.data)
        assert (event["micro_steps"] == 1) == (measured <= limit)
        first = [e for e in compiles(ctrl) if e["config"]["devices"] == 4]
        assert first and first[0].get("compiled_ahead")  # compiled for its bytes, then run
    finally:
        ctrl.close()

