"""The controller's parts, each alone: configuration, transitions, metrics reader, run dir, lock."""

import json
import os

import numpy as np
import pytest

import adaptjax
from adaptjax import policies as ajp
from adaptjax._transition import plan_transition
from adaptjax.controller._metrics_reader import MetricsReader
from adaptjax.controller._run_dir import RunDirectory
from adaptjax.controller._run_lock import RunLock
from adaptjax.controller._run_log import truncate_run_logs


def _one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(devices=8, batch_size=64.0), "batch_size must be a positive integer, got 64.0"),
        (dict(devices=True, batch_size=64), "devices must be a positive integer, got True"),
        (dict(devices=8, batch_size=4), "smaller than the replica count 8"),
        (dict(devices=4, batch_size=64, microbatches=3), "use a multiple of 12"),
        (dict(devices=4, batch_size=64, codec=3), "codec must be a codec key"),
    ],
)
def test_run_config_refuses_what_it_would_otherwise_coerce(kwargs, message):
    with pytest.raises(ValueError) as e:
        adaptjax.RunConfig(**kwargs)
    assert message in _one_line(e)


def test_run_config_is_frozen_and_hashable():
    a, b = adaptjax.RunConfig(8, 64), adaptjax.RunConfig(8, 64)
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    with pytest.raises(AttributeError):
        a.devices = 4


def test_transition_folds_actions_later_wins_and_rounds_for_the_new_mesh():
    config = adaptjax.RunConfig(devices=8, batch_size=64)
    t = plan_transition(
        [
            ajp.SetBatchSize(100),
            ajp.SetHyperparams({"learning_rate": 0.1}),
            ajp.Rescale(devices=6),
            ajp.SetHyperparams({"b1": 0.8}),
            ajp.SetBatchSize(50, microbatches=2),
            ajp.Checkpoint(),
            ajp.Stop("done"),
        ],
        config,
        max_devices=8,
    )
    # 50 rounded to the nearest multiple of 6 devices x 2 micro-batches = 48
    assert t.config == adaptjax.RunConfig(devices=6, batch_size=48, microbatches=2)
    assert t.requested_batch == 50
    assert t.hyperparams == {"learning_rate": 0.1, "b1": 0.8}
    assert t.checkpoint and t.stop == "done" and t.rollback is None and not t.codec_changed


def test_transition_codec_change_is_by_key_and_none_means_dense():
    config = adaptjax.RunConfig(devices=2, batch_size=4, codec="C")
    assert not plan_transition([], config, max_devices=2).codec_changed
    off = plan_transition([ajp.SetCodec(None)], config, max_devices=2)
    assert off.codec_changed and off.config.codec is None


@pytest.mark.parametrize(
    "actions, message",
    [
        ([ajp.Rescale(devices=9)], "max_devices is 8"),
        ([ajp.SetHyperparams({"momentum": 0.9})], "does not expose the hyperparameter 'momentum'"),
        ([ajp.SetHyperparams({"learning_rate": -1.0})], "learning_rate must be > 0"),
    ],
)
def test_transition_refuses_before_anything_runs(actions, message):
    config = adaptjax.RunConfig(devices=8, batch_size=64)
    with pytest.raises(ValueError) as e:
        plan_transition(actions, config, max_devices=8, hyperparam_names=["learning_rate"])
    assert message in _one_line(e)


def test_transition_splits_the_batch_where_one_device_leaves_one_gradient_sample():
    # The default noise scale needs two gradient samples per step (min_samples=2).
    two = dict(max_devices=8, min_samples=2)
    on_two = adaptjax.RunConfig(devices=2, batch_size=30)
    down = plan_transition([ajp.Rescale(devices=1)], on_two, **two)
    assert down.config == adaptjax.RunConfig(devices=1, batch_size=30, microbatches=2)
    back = plan_transition([ajp.Rescale(devices=4)], down.config, **two)
    assert back.config == adaptjax.RunConfig(devices=4, batch_size=32, microbatches=1)
    assert back.requested_batch == 30
    # an odd batch on one device is rounded to the split
    odd = plan_transition([ajp.SetBatchSize(33)], down.config, **two)
    assert odd.config.batch_size == 32 and odd.requested_batch == 33
    # micro-batches an action set stay, on the way down and back up
    mine = adaptjax.RunConfig(devices=1, batch_size=32, microbatches=4)
    assert plan_transition([ajp.Rescale(devices=2)], mine, **two).config.microbatches == 4
    kept = plan_transition([ajp.Rescale(devices=2), ajp.SetBatchSize(32, microbatches=2)],
                           down.config, **two)
    assert kept.config.microbatches == 2
    # monitors that measure from one sample (differencing) change nothing
    assert plan_transition([ajp.Rescale(devices=1)], on_two, max_devices=8).config == (
        adaptjax.RunConfig(devices=1, batch_size=30))


@pytest.mark.parametrize(
    "actions, needs, message",
    [
        ([ajp.SetBatchSize(32, microbatches=1)], dict(min_samples=2),
         "microbatches=1 on 1 device(s) gives the noise scale 1 gradient sample(s) per step; "
         "use microbatches >= 2 or GradientNoiseScale(differencing=True)"),
        ([], dict(min_samples=2, min_replicas=2),
         "cannot rescale to 1 device(s): the noise scale's preconditioned norms need 2 "
         "replicas; use GradientNoiseScale(differencing=True) to measure on one device"),
    ],
)
def test_transition_refuses_a_configuration_the_monitors_cannot_measure(actions, needs, message):
    config = adaptjax.RunConfig(devices=1, batch_size=32, microbatches=2)
    with pytest.raises(ValueError) as e:
        plan_transition(actions, config, max_devices=8, **needs)
    assert _one_line(e) == message


def test_metrics_reader_reads_one_behind_and_counts_nonfinite_streaks():
    reader = MetricsReader(comm_time=lambda config: 0.5)
    config = adaptjax.RunConfig(2, 4)
    for t, bad in enumerate([0, 1, 1, 0, 1], start=1):
        reader.push(t, config, {"loss": np.float32(t), "nonfinite": np.float32(bad)})
        got = reader.read(lag=1)
        assert [s.step for s in got] == ([t - 1] if t > 1 else [])
    (last,) = reader.read(lag=0)
    assert last.step == 5 and last.metrics["loss"] == 5.0
    assert reader.nonfinite_count == 3 and reader.nonfinite_streak == 1
    assert last.metrics["nonfinite_count"] == 3.0
    # step time: the first step of a configuration is not timed; then comm_share appears
    assert 0.0 < last.metrics["comm_share"] < 1.0 and last.metrics["comm_time"] == 0.5
    assert last.metrics["throughput"] == pytest.approx(4 / last.metrics["step_time"])


def test_metrics_reader_reads_a_packed_vector_and_aux_leaves_as_floats():
    # per-example aux (logits, 4 rows) is no metric: left out, not an error
    import jax.numpy as jnp

    reader = MetricsReader()
    packed = adaptjax.Metrics.pack({"loss": jnp.float32(0.25), "nonfinite": 0},
                                   {"aux": {"acc": jnp.float32(0.5), "top": [jnp.int32(3)],
                                            "logits": jnp.zeros((4, 10))}})
    reader.push(1, adaptjax.RunConfig(2, 4), packed)
    (snap,) = reader.read(lag=0)
    values = {k: v for k, v in snap.metrics.items() if k in ("loss", "nonfinite") or "aux" in k}
    assert values == {"loss": 0.25, "nonfinite": 0.0, "aux['acc']": 0.5, "aux['top'][0]": 3.0}
    assert all(type(v) is float for v in snap.metrics.values())


def test_truncation_keeps_rows_up_to_the_step_and_drops_a_torn_line(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for s in range(1, 8):
            f.write(json.dumps({"step": s, "loss": 1.0 / s}) + "\n")
        f.write('{"step": 8, "lo')  # killed mid-write
    with open(tmp_path / "events.jsonl", "w") as f:
        f.write(json.dumps({"kind": "checkpoint", "step": 5}) + "\n")
        f.write(json.dumps({"kind": "decision", "step": 6}) + "\n")
    truncate_run_logs(tmp_path, 5)
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [json.loads(x)["kind"] for x in open(tmp_path / "events.jsonl")] == ["checkpoint"]


def test_run_lock_names_the_holder_and_is_released(tmp_path):
    lock = RunLock(tmp_path)
    assert open(tmp_path / ".adaptjax.lock").read().strip() == str(os.getpid())
    with pytest.raises(adaptjax.RunDirectoryLocked) as e:
        RunLock(tmp_path)
    assert f"pid {os.getpid()}" in _one_line(e) and "close() the other Controller" in str(e.value)
    lock.release()
    lock.release()  # idempotent
    RunLock(tmp_path).release()


def test_run_lock_check_free_asks_without_touching_the_disk(tmp_path):
    RunLock.check_free(tmp_path)  # no lock file: free, and none is created
    assert os.listdir(tmp_path) == []
    lock = RunLock(tmp_path)
    with pytest.raises(adaptjax.RunDirectoryLocked) as e:
        RunLock.check_free(tmp_path)
    assert f"pid {os.getpid()}" in _one_line(e)
    lock.release()
    RunLock.check_free(tmp_path)
    RunLock(tmp_path).release()  # checking did not leave the lock taken


def test_run_directory_logs_a_checkpoint_only_once_it_is_complete(tmp_path):
    import jax.numpy as jnp
    import optax

    state = adaptjax.init_state({"w": jnp.ones(4)}, optax.sgd(0.1), adaptjax.make_mesh(2))
    rd = RunDirectory(tmp_path / "run", max_to_keep=2)
    rd.open_log(tensorboard=None)
    rd.log.metrics(1, {"loss": 1.0})
    rd.save(1, state, {"x": 1}, [{"latency_s": 0.0}])
    rd.confirm(block=True)
    events = [json.loads(x) for x in open(tmp_path / "run" / "events.jsonl")]
    assert [(e["kind"], e["step"]) for e in events] == [("checkpoint", 1)]
    # the events that follow a checkpoint travel inside it, for a resume to recover
    assert rd.checkpoints.read_meta(1)["on_complete"] == [{"kind": "checkpoint", "latency_s": 0.0}]
    rd.close()
    rd.close()  # idempotent


def test_a_new_checkpoint_starts_only_after_the_previous_ones_events_are_logged(tmp_path):
    # A kill during save 2 must not lose checkpoint 1's event: a resume from 1 or 2 carries
    # only its own completion events.
    import jax.numpy as jnp
    import optax

    state = adaptjax.init_state({"w": jnp.ones(4)}, optax.sgd(0.1), adaptjax.make_mesh(2))
    rd = RunDirectory(tmp_path / "run", max_to_keep=3)
    rd.open_log(tensorboard=None)
    rd.save(1, state, {}, [{}])
    rd.save(2, state, {}, [{}])  # no confirm in between, as when a rescale follows a checkpoint
    events = [json.loads(x) for x in open(tmp_path / "run" / "events.jsonl")]
    assert [(e["kind"], e["step"]) for e in events] == [("checkpoint", 1)]
    rd.close()
    events = [json.loads(x) for x in open(tmp_path / "run" / "events.jsonl")]
    assert [(e["kind"], e["step"]) for e in events] == [("checkpoint", 1), ("checkpoint", 2)]
