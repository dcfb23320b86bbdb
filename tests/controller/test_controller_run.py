"""The controller: exact rescale, exact resume, sample accounting, no-recompile, faults, errors."""

import importlib.util
import json
import os

import jax
import numpy as np
import optax
import pytest
from _controller_args import make_controller, resume_controller  # noqa: E402
from _recording import Recording  # noqa: E402

import adaptjax
from adaptjax import policies as ajp

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "controller_job", os.path.join(TESTS, "controller_job.py")
)
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)
JOB = os.path.join(TESTS, "controller_job.py")


def params_of(ctrl):
    return {k: np.asarray(v) for k, v in jax.device_get(ctrl.state.params).items()}


def assert_params_close(a, b, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)


def snapshot(path):
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = fh.read()
    return out


def test_rescale_8_4_8_matches_the_same_run_without_rescale(tmp_path):
    base = dict(policies=[], checkpoint_every=None)
    plain = make_controller(run_dir=tmp_path / "a", **job.job_kwargs(**base))
    plain.run(30)
    sched = ajp.Schedule({10: ajp.Rescale(devices=4), 20: ajp.Rescale(devices=8)})
    scaled = make_controller(
        run_dir=tmp_path / "b", **job.job_kwargs(policies=[sched], checkpoint_every=None)
    )
    scaled.run(30)
    rescales = [e for e in scaled.log.events if e["kind"] == "rescale"]
    assert [(e["devices_from"], e["devices_to"]) for e in rescales] == [(8, 4), (4, 8)]
    assert scaled.config.devices == 8 and scaled.data.cursor == plain.data.cursor == 30 * 64
    assert_params_close(params_of(plain), params_of(scaled))
    plain.close()
    scaled.close()


def test_every_sample_seen_once_per_epoch_across_batch_and_mesh_changes(tmp_path):
    data = Recording(adaptjax.ArrayDataset(job.make_data(), seed=3))
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(data=data))
    ctrl.run(50)
    n = 640
    seen = np.asarray(data.seen)
    assert len(seen) == ctrl.samples_seen == data.cursor
    full_epochs = len(seen) // n
    assert full_epochs >= 2
    for e in range(full_epochs):
        assert sorted(seen[e * n : (e + 1) * n].tolist()) == list(range(n))
    rest = seen[full_epochs * n :]
    assert len(set(rest.tolist())) == len(rest)
    sizes = {e["config"]["batch_size"] for e in ctrl.log.events if e["kind"] == "compile"}
    assert {64, 32, 96} <= sizes
    ctrl.close()


def test_learning_rate_change_compiles_nothing(tmp_path):
    compiles = []
    listener = lambda name, *a, **k: compiles.append(name) if "backend_compile" in name else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(policies=[]))
        ctrl.run(3)
        before_ctrl, before_jax = ctrl.compilations, len(compiles)
        ctrl.apply([ajp.SetHyperparams({"learning_rate": 1e-4})])
        ctrl.run(6)
        assert ctrl.compilations == before_ctrl == 1
        assert len(compiles) == before_jax
        inject = ctrl.state.opt_state["optimizer"].inner_state
        assert float(inject.hyperparams["learning_rate"]) == pytest.approx(1e-4)
        ctrl.close()
    finally:
        jax.monitoring.clear_event_listeners()


def test_returning_to_a_seen_configuration_does_not_compile(tmp_path):
    sched = ajp.Schedule(
        {
            5: ajp.SetBatchSize(32),
            10: ajp.SetBatchSize(64),
            15: ajp.Rescale(devices=4),
            20: ajp.Rescale(devices=8),
        }
    )
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(policies=[sched], policy_every=5))
    ctrl.run(30)
    configs = [
        tuple(sorted(e["config"].items())) for e in ctrl.log.events if e["kind"] == "compile"
    ]
    assert len(configs) == len(set(configs)) == ctrl.compilations == 3  # 64/8, 32/8, 64/4
    ctrl.close()


def test_every_row_says_what_a_compile_costs_and_how_old_the_run_is(tmp_path):
    sched = ajp.Schedule({5: ajp.SetBatchSize(32), 10: ajp.Rescale(devices=4)})
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(policies=[sched], policy_every=5))
    ctrl.run(16)
    ctrl.close()
    compiles = [e for e in ctrl.log.events if e["kind"] == "compile"]
    assert len(compiles) == 3
    # the rescale, announced by the Schedule, found its program compiled in the background:
    # its wait says nothing of what a compile costs
    assert [e.get("compiled_ahead", False) for e in compiles] == [False, False, True]
    waits = [e["latency_s"] for e in compiles[:2]]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 17))
    # compile_seconds: the median wait of the compiles so far (each row is read one step
    # after its own, so it may count the next step's compile)
    medians = {float(np.median(waits[:i])) for i in range(1, 3)}
    assert all(r["compile_seconds"] in medians for r in rows)
    assert rows[-1]["compile_seconds"] == float(np.median(waits))
    # train_seconds: since the first step, so at least its compile, and growing
    ages = [r["train_seconds"] for r in rows]
    assert ages[0] >= waits[0] and all(b > a for a, b in zip(ages, ages[1:], strict=False))


def test_a_resumed_run_continues_its_age_and_compile_history(tmp_path):
    sched = ajp.Schedule({5: ajp.SetBatchSize(32)})
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(policies=[sched], policy_every=5))
    ctrl.run(10)
    ctrl.close()
    before = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    waits = [e["latency_s"] for e in ctrl.log.events
             if e["kind"] == "compile" and not e.get("compiled_ahead")]
    ctrl = resume_controller(
        tmp_path, **job.job_kwargs(policies=[ajp.Schedule({5: ajp.SetBatchSize(32)})],
                                   policy_every=5))
    ctrl.run(14)
    ctrl.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 15))
    # this process's compiles (none when its jit cache already holds the step)
    resumed = [e["latency_s"] for e in ctrl.log.events if e["kind"] == "compile"
               and e["step"] > 10 and not e.get("compiled_ahead")]
    # the age goes on from the checkpoint's (the end of the first run), not from zero
    meta = ctrl._dir.checkpoints.read_meta(10)
    assert meta["train_seconds"] >= before[-1]["train_seconds"]
    assert rows[10]["train_seconds"] > meta["train_seconds"]
    # and the compile history is the whole run's
    assert rows[-1]["compile_seconds"] == float(np.median(waits + resumed))


def test_injected_nan_gradient_leaves_params_unchanged_and_is_counted(tmp_path):
    data = job.make_data()
    data["x"][5, 0] = np.nan
    ds = adaptjax.ArrayDataset(data, shuffle=False)  # sample 5 is in the first batch
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(data=ds, policies=[]))
    before = params_of(ctrl)
    with pytest.warns(RuntimeWarning, match="step 1 had a non-finite"):
        ctrl.run(1)
        ctrl.drain()
    for k, v in params_of(ctrl).items():
        np.testing.assert_array_equal(v, before[k])
    assert ctrl.latest_metrics["nonfinite_count"] == 1.0 and ctrl.nonfinite_count == 1
    ctrl.run(2)  # the next batch is clean: training moves on
    assert not np.array_equal(params_of(ctrl)["w1"], before["w1"])
    ctrl.close()


def test_the_first_skipped_step_warns_once_with_the_count_so_far(tmp_path):
    data = job.make_data()
    for step in (2, 4, 9):  # one bad sample in each of these steps' batches (64, in order)
        data["x"][64 * (step - 1) + 7, 0] = np.nan
    kwargs = job.job_kwargs(data=adaptjax.ArrayDataset(data, shuffle=False), policies=[],
                            checkpoint_every=6)
    ctrl = make_controller(run_dir=tmp_path, **kwargs)
    with pytest.warns(RuntimeWarning) as said:
        ctrl.run(6)
        ctrl.drain()
    lines = [str(w.message) for w in said if "non-finite" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith("step 2 had a non-finite gradient or loss and was skipped (1 ")
    assert ctrl.nonfinite_count == 2
    ctrl.close()
    # a resumed process warns once too, counting the skips before its checkpoint
    kwargs["data"] = adaptjax.ArrayDataset(data, shuffle=False)
    ctrl = resume_controller(tmp_path, **kwargs)
    with pytest.warns(RuntimeWarning) as said:
        ctrl.run(10)
        ctrl.drain()
    lines = [str(w.message) for w in said if "non-finite" in str(w.message)]
    assert len(lines) == 1 and lines[0].startswith("step 9 had a non-finite")
    assert "(3 skipped in this run so far" in lines[0]
    ctrl.close()


def test_policy_sees_nonfinite_count_and_rolls_back(tmp_path):
    data = job.make_data()
    data["x"][64 * 7 + 3, 0] = np.inf  # a bad sample in step 8's batch
    ds = adaptjax.ArrayDataset(data, shuffle=False)
    policy = ajp.when(
        lambda m, ctx: m.get("nonfinite", 0) > 0,
        [ajp.Rollback("non-finite gradient"), ajp.SetHyperparams({"learning_rate": 1e-3})],
    )
    ctrl = make_controller(
        run_dir=tmp_path,
        **job.job_kwargs(data=ds, policies=[policy], policy_every=1, checkpoint_every=5),
    )
    with pytest.warns(RuntimeWarning, match="non-finite gradient or loss and was skipped"):
        ctrl.run(12)
    (rollback,) = [e for e in ctrl.log.events if e["kind"] == "rollback"]
    assert rollback["to_checkpoint"] == 5 and rollback["step"] in (8, 9)
    assert ctrl.step == 12 and ctrl.nonfinite_count == 1 and ctrl.samples_seen == 12 * 64
    lr = ctrl.state.opt_state["optimizer"].inner_state.hyperparams["learning_rate"]
    assert float(lr) == pytest.approx(1e-3)
    assert np.isfinite(ctrl.latest_metrics["loss"])
    ctrl.close()
    rows = [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")]
    assert rows == list(range(1, 13))  # the undone steps are logged once, like every step


# --- bad inputs: one-line errors, nothing on disk overwritten --------------------------


def _one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


def test_rescale_to_more_devices_than_exist(tmp_path):
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(policies=[]))
    ctrl.run(10)
    ctrl.drain()
    ctrl.checkpoints.latest_step()
    before = snapshot(tmp_path / "checkpoints")
    with pytest.raises(ValueError) as e:
        ctrl.apply([ajp.Rescale(devices=16)])
    assert "max_devices is 8" in _one_line(e)
    ctrl2 = make_controller(
        run_dir=tmp_path / "other", **job.job_kwargs(policies=[], max_devices=None)
    )
    with pytest.raises(ValueError) as e:
        ctrl2.apply([ajp.Rescale(devices=9)])
    assert "devices" in _one_line(e)
    assert snapshot(tmp_path / "checkpoints") == before
    assert ctrl.config.devices == 8
    ctrl.close()
    ctrl2.close()


def test_rescale_to_a_count_that_does_not_divide_the_batch_rounds_and_logs(tmp_path):
    ctrl = make_controller(
        run_dir=tmp_path, **job.job_kwargs(policies=[], batch_size=48, devices=8)
    )
    ctrl.run(2)
    ctrl.apply([ajp.Rescale(devices=5)])  # 48 is not a multiple of 5: documented rounding to 50
    assert ctrl.config.batch_size == 50 and ctrl.config.devices == 5
    (ev,) = [e for e in ctrl.log.events if e["kind"] == "batch_rounded"]
    assert ev["requested"] == 48 and ev["batch_size"] == 50
    ctrl.run(4)
    assert ctrl.samples_seen == 2 * 48 + 2 * 50
    ctrl.close()


def test_rescale_to_one_device_and_back_keeps_measuring_the_noise_scale(tmp_path):
    # The default noise scale needs two gradient samples per step: on one device the
    # batch is split in two micro-batches, and the split goes when the run leaves it.
    schedule = ajp.Schedule({4: ajp.Rescale(devices=1), 12: ajp.Rescale(devices=2)})
    ctrl = make_controller(
        run_dir=tmp_path, **job.job_kwargs(policies=[schedule], policy_every=1, devices=2,
                                           batch_size=32, checkpoint_every=None)
    )
    ctrl.run(20)
    ctrl.close()
    configs = [(e["config"]["devices"], e["config"]["microbatches"])
               for e in ctrl.log.events if e["kind"] == "compile"]
    assert configs == [(2, 1), (1, 2)]  # back on 2 devices: the first program again
    assert (ctrl.config.devices, ctrl.config.microbatches) == (2, 1)
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, 21))
    one_device = [r for r in rows if r["devices"] == 1]
    assert len(one_device) == 8 and all(r["noise_scale_valid"] == 1.0 for r in one_device)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(devices=1, microbatches=1, monitors=[adaptjax.GradientNoiseScale()]),
         "the noise scale needs 2 gradient samples per step and devices=1 x microbatches=1 "
         "gives 1; use microbatches=2 or GradientNoiseScale(differencing=True)"),
        (dict(devices=1, monitors=[adaptjax.GradientNoiseScale(preconditioned=True)]),
         "GradientNoiseScale(preconditioned=True) needs 2 replicas per step and devices=1; "
         "use GradientNoiseScale(differencing=True) on one device"),
    ],
)
def test_monitors_that_cannot_measure_on_the_devices_given(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as e:
        make_controller(run_dir=tmp_path / "r", **job.job_kwargs(**kwargs))
    assert _one_line(e) == message
    assert not (tmp_path / "r").exists()


def test_batch_smaller_than_replica_count(tmp_path):
    with pytest.raises(ValueError) as e:
        make_controller(run_dir=tmp_path / "r", **job.job_kwargs(batch_size=4))
    assert "smaller than the replica count 8" in _one_line(e)
    assert not (tmp_path / "r").exists()


def test_batch_not_divisible(tmp_path):
    with pytest.raises(ValueError) as e:
        make_controller(run_dir=tmp_path / "r", **job.job_kwargs(batch_size=60))
    assert "multiple of 8" in _one_line(e)


def test_restore_of_another_models_checkpoint(tmp_path):
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(policies=[]))
    ctrl.run(10)
    ctrl.close()
    before = snapshot(tmp_path)
    other = job.init_params()
    other["w1"] = np.zeros((job.D, 32), np.float32)
    with pytest.raises(ValueError) as e:
        resume_controller(tmp_path, **job.job_kwargs(model=other))
    assert "different model" in _one_line(e)
    assert snapshot(tmp_path) == before


def test_new_run_refuses_a_run_dir_with_checkpoints(tmp_path):
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(policies=[]))
    ctrl.run(10)
    ctrl.close()
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as e:
        make_controller(run_dir=tmp_path, **job.job_kwargs())
    assert "Controller.resume" in _one_line(e)
    assert snapshot(tmp_path) == before


def test_a_live_owner_is_reported_before_the_checkpoints_it_wrote(tmp_path):
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(policies=[]))
    ctrl.run(10)  # checkpoints on disk, and the controller still owns the directory
    before = snapshot(tmp_path)
    with pytest.raises(adaptjax.RunDirectoryLocked) as e:
        make_controller(run_dir=tmp_path, **job.job_kwargs())
    assert f"in use by another controller (pid {os.getpid()})" in _one_line(e)
    assert snapshot(tmp_path) == before
    ctrl.close()


def test_policy_returning_an_unknown_action(tmp_path):
    class Bad(ajp.Policy):
        def decide(self, metrics, ctx):
            return ["double the batch"]

    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(policies=[Bad()], policy_every=1))
    with pytest.raises(ValueError) as e:
        ctrl.run(5)
    assert "str" in _one_line(e)


def test_checkpoint_directory_not_writable(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("keep me")
    with pytest.raises(adaptjax.RunDirectoryError) as e:
        make_controller(run_dir=blocker / "run", **job.job_kwargs())
    assert "not writable" in _one_line(e)
    assert blocker.read_text() == "keep me"


def test_optimizer_without_the_hyperparameter(tmp_path):
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(policies=[]))
    with pytest.raises(ValueError) as e:
        ctrl.apply([ajp.SetHyperparams({"momentum": 0.9})])
    assert "does not expose the hyperparameter 'momentum'; it exposes ['b1'" in _one_line(e)
    ctrl.close()


def test_run_dir_outputs(tmp_path):
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(tensorboard=True))
    ctrl.run(12)
    ctrl.close()
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in lines] == list(range(1, 13))
    assert {"loss", "noise_scale", "grad_snr", "step_time", "throughput"} <= set(lines[-1])
    kinds = {json.loads(x)["kind"] for x in open(tmp_path / "events.jsonl")}
    assert {"compile", "decision", "checkpoint"} <= kinds
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tensorboard"))
    assert adaptjax.RunCheckpoints(tmp_path / "checkpoints").latest_step() == 12


def test_bad_optimizer_name_is_not_silently_accepted():
    with pytest.raises(ValueError):
        adaptjax.policies.Context(
            step=0, batch_size=8, microbatches=1, devices=8, max_devices=4, hyperparams={}
        )
    assert optax  # the policies module's own errors are exercised in test_policies_*
