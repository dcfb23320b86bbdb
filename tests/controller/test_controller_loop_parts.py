"""The loop's other parts, each alone, and the shape of the loop itself.

The run clock, preemption, the background compiler's bookkeeping, the events
a run directory is handed, a checkpoint's meta, the probe's visits; and, read
from the source, that only the loop assigns the run's state and configuration
and only the loop records and checkpoints.
"""

import ast
import json
import os
import signal
import threading
import time

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _controller_args import make_controller  # noqa: E402

import adaptjax
import adaptjax.controller
from adaptjax import policies as ajp
from adaptjax._transition import plan_transition
from adaptjax.controller._background import BackgroundCompiler, announced_configs
from adaptjax.controller._metrics_reader import Snapshot
from adaptjax.controller._persistence import checkpoint_meta, snapshots_of, warn_overrides
from adaptjax.controller._plan_probe import move_actions, probe_visits
from adaptjax.controller._preemption import Preemption
from adaptjax.controller._run_clock import RunClock
from adaptjax.controller._run_dir import RunDirectory
from adaptjax.controller._run_log import RunLog
from adaptjax.controller._step_cache import StepCache

CONTROLLER = os.path.dirname(adaptjax.controller.__file__)


def _steps():
    return StepCache(model={"w": jnp.zeros(2)}, loss_fn=lambda p, b: jnp.sum(b["x"] @ p["w"]),
                     optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))


# ------------------------------------------------------------------ the shape of the loop
def _controller_class():
    with open(os.path.join(CONTROLLER, "_controller.py")) as f:
        tree = ast.parse(f.read())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Controller")


def _methods_that(cls, test):
    return sorted({f.name for f in cls.body if isinstance(f, ast.FunctionDef)
                   for node in ast.walk(f) if test(node)})


def test_only_the_loop_assigns_the_runs_state_and_configuration():
    def assigns(node):
        targets = [t for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets]
        flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        return any(isinstance(e, ast.Attribute) and e.attr in ("state", "config")
                   and isinstance(e.value, ast.Name) and e.value.id == "self" for e in flat)

    # the start, a step, and a carried-out transition landing
    assert _methods_that(_controller_class(), assigns) == ["_dispatch", "_land", "_setup"]


def test_only_the_loop_records_and_checkpoints():
    for name in sorted(os.listdir(CONTROLLER)):
        if name.endswith(".py") and name != "_controller.py":
            with open(os.path.join(CONTROLLER, name)) as f:
                text = f.read()
            for call in ("._record(", "._checkpoint(", "._dispatch(", ".save_checkpoint("):
                assert call not in text, f"{name} calls the loop's {call}"


def test_no_method_of_the_controller_is_longer_than_a_screen():
    lengths = {f.name: f.end_lineno - f.lineno + 1 for f in _controller_class().body
               if isinstance(f, ast.FunctionDef)}
    assert max(lengths.values()) <= 60, lengths


# ------------------------------------------------------------------ the run clock
def test_the_run_clock_counts_compiles_not_done_ahead_and_the_runs_age():
    clock = RunClock()
    assert clock.metrics() == {}  # nothing compiled, no step yet
    clock.compiled(4.0)
    t0 = time.perf_counter()
    clock.started(t0)
    clock.started(t0 + 100.0)  # only the first step starts the clock
    clock.compiled(2.0)
    clock.compiled(9.0)
    m = clock.metrics()
    assert m["compile_seconds"] == 4.0  # the median of 4, 2, 9
    assert 0.0 <= m["train_seconds"] <= time.perf_counter() - t0
    # a resume continues the age and the compile history from the checkpoint
    again = RunClock.from_state(clock.state_dict())
    assert again.compile_waits == [4.0, 2.0, 9.0] and again.age_before >= m["train_seconds"]
    assert RunClock.from_state({}).state_dict() == {"train_seconds": 0.0, "compile_waits": []}


# ------------------------------------------------------------------ preemption
def test_sigterm_while_armed_is_a_request_and_the_handler_is_restored():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are the main thread's")
    before = signal.getsignal(signal.SIGTERM)
    p = Preemption()
    with p.armed():
        assert not p.agreed(step=1, every=10)
        signal.raise_signal(signal.SIGTERM)
        assert p.agreed(step=1, every=10)  # one process: at once, whatever the step
    assert signal.getsignal(signal.SIGTERM) is before


# ------------------------------------------------------------------ the background compiler
def test_announced_configurations_are_planned_once_and_refused_hints_are_left_out():
    steps, config = _steps(), adaptjax.RunConfig(4, 16)

    def plan(actions):
        return plan_transition(actions, config, max_devices=4).config

    hints = [ajp.Rescale(devices=2), ajp.SetHyperparams({"learning_rate": 0.5}),
             ajp.Rescale(devices=2), ajp.Rescale(devices=16), ajp.SetBatchSize(32)]
    assert announced_configs(hints, steps, plan) == [config.replace(devices=2),
                                                     config.replace(batch_size=32)]


def test_a_background_compile_that_fails_is_an_event_and_never_compiled_ahead():
    steps = _steps()
    compiler = BackgroundCompiler(steps)
    config = adaptjax.RunConfig(2, 4)
    # a dataset without batches of the shapes the step needs: the shapes cannot be read
    compiler.submit([config], data=object())
    compiler.wait_for(config)
    (event,) = compiler.finished()
    assert event["kind"] == "background_compile" and event["error"].startswith("AttributeError")
    assert config not in compiler.compiled_ahead and compiler.finished() == []
    compiler.submit([config], data=object())  # submitted once: not again
    assert compiler.finished() == []
    compiler.shutdown()


# ------------------------------------------------------------ what the run directory is handed
def test_events_are_complete_when_handed_to_the_run_directory(tmp_path):
    state = adaptjax.init_state({"w": jnp.ones(4)}, optax.sgd(0.1), adaptjax.make_mesh(2))
    rd = RunDirectory(tmp_path / "run", max_to_keep=2)
    rd.open_log(tensorboard=None)
    move = {"kind": "rescale", "devices_from": 4, "devices_to": 2}
    t0 = time.perf_counter()
    rd.save(3, state, {}, [{"kind": "checkpoint"}, move], since=t0)
    waited = time.perf_counter() - t0
    move["devices_to"] = 99  # the caller's dict, changed after the hand-over, changes nothing
    rd.close()
    events = {e["kind"]: e for e in map(json.loads, open(tmp_path / "run" / "events.jsonl"))}
    assert events["rescale"]["devices_to"] == 2
    # the checkpoint's wait is part of the transition's, which began earlier
    assert 0 <= events["checkpoint"]["latency_s"] <= events["rescale"]["latency_s"] <= waited
    # inside the checkpoint, for a resume to recover: as given, without timings
    meta = adaptjax.RunCheckpoints(tmp_path / "run" / "checkpoints").read_meta(3)
    assert meta["on_complete"] == [{"kind": "checkpoint"},
                                   {"kind": "rescale", "devices_from": 4, "devices_to": 2}]


def test_a_controllers_rescale_is_logged_complete_with_its_checkpoint(tmp_path):
    x = np.random.default_rng(0).normal(size=(64, 2)).astype(np.float32)
    ctrl = make_controller(
        model={"w": jnp.zeros(2)}, loss_fn=lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2),
        optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        data=adaptjax.ArrayDataset({"x": x}, seed=0), devices=4, batch_size=8,
        run_dir=tmp_path, progress=False, tensorboard=False, compilation_cache_dir=None,
    )
    ctrl.run(2)
    ctrl.apply([ajp.Rescale(devices=2)])
    ctrl.close()
    events = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    (i,) = [i for i, e in enumerate(events) if e["kind"] == "rescale"]
    move, ckpt = events[i], events[i - 1]  # logged together, once the checkpoint completed
    assert (ckpt["kind"], ckpt["step"], move["step"]) == ("checkpoint", 2, 2)
    assert (move["devices_from"], move["devices_to"]) == (4, 2)
    assert 0 <= ckpt["latency_s"] <= move["latency_s"]
    meta = adaptjax.RunCheckpoints(tmp_path / "checkpoints").read_meta(2)
    assert meta["config"]["devices"] == 2  # the configuration the run continues in


# ------------------------------------------------------------------ what a checkpoint holds
def test_a_checkpoints_meta_is_the_loops_position_in_plain_json():
    class Data:
        def state_dict(self):
            return {"cursor": 24}

    class Policy:
        def state_dict(self):
            return {"seen": (1, 2)}  # a tuple comes back as a list, as from disk

    config = adaptjax.RunConfig(2, 8)
    meta = checkpoint_meta(step=3, samples_seen=24, nonfinite_count=1, config=config,
                           data=Data(), policy=Policy(),
                           to_decide=[Snapshot(3, config, {"loss": 0.5})],
                           clock={"train_seconds": 1.5, "compile_waits": [0.5]})
    assert json.loads(json.dumps(meta)) == meta
    assert meta["policy"] == {"seen": [1, 2]} and meta["config"]["devices"] == 2
    (snap,) = snapshots_of(meta, config)
    assert (snap.step, snap.metrics, snap.config) == (3, {"loss": 0.5}, config)
    assert RunClock.from_state(meta).compile_waits == [0.5]


def test_a_resume_warns_of_each_value_the_checkpoint_overrides():
    with pytest.warns(UserWarning) as record:
        warn_overrides({"learning_rate": 0.5, "b": True}, {"learning_rate": 0.1, "b": 1.0})
    assert [str(w.message).split(" was passed")[0] for w in record] == [
        "resume: learning_rate=0.5"]


# ------------------------------------------------------------------ adaptjax plan's probe
def test_the_probe_moves_by_the_controllers_own_actions():
    steps = _steps()
    now = adaptjax.RunConfig(4, 16)
    assert move_actions(now, now, steps) == []
    actions = move_actions(now, adaptjax.RunConfig(2, 8, microbatches=2), steps)
    assert [type(a).__name__ for a in actions] == ["Rescale", "SetBatchSize"]
    assert plan_transition(actions, now, max_devices=4).config == adaptjax.RunConfig(2, 8, 2)
    visits = probe_visits(["a", "b", "c"], steps=7)
    assert sum(n for c, n in visits if c == "a") == 7  # every configuration: all its steps
    assert [c for c, _ in visits] == list("abccbaabc")


def _tensorboard_records(folder):
    """Every event of the TFRecord files in ``folder`` (length, crc, data, crc per record)."""
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        at = 0
        while at < len(data):
            n = int.from_bytes(data[at:at + 8], "little")
            events.append(Event.FromString(data[at + 12:at + 12 + n]))
            at += 12 + n + 4
    return events


def test_a_steps_metrics_are_one_tensorboard_event_with_every_scalar(tmp_path):
    log = RunLog(tmp_path, tensorboard=True)
    rows = {1: {"loss": 2.5, "noise_scale": 40.0, "batch_size": 32, "codec": "none"},
            2: {"loss": 2.25, "noise_scale": 44.0, "batch_size": 64, "codec": "none"}}
    for step, row in rows.items():
        log.metrics(step, row)
    log.event("rescale", step=2, latency_s=0.5)
    log.close()
    written = [e for e in _tensorboard_records(tmp_path / "tensorboard") if e.summary.value]
    assert [e.step for e in written] == [1, 2, 2]
    for event, (step, row) in zip(written, rows.items(), strict=False):
        values = {v.tag: v.simple_value for v in event.summary.value}
        assert values == {k: v for k, v in row.items() if k != "codec"}, step
    assert {v.tag: v.simple_value for v in written[2].summary.value} == {"latency/rescale": 0.5}


def test_events_are_kept_and_read_back_in_step_order(tmp_path):
    """A transition logged with the step it took effect at lands before later decisions."""
    from adaptjax.controller._run_log import read_events

    log = RunLog(tmp_path, tensorboard=False)
    for kind, step in [("decision", 441), ("decision", 300), ("rescale", 301),
                       ("checkpoint", 441), ("decision", 301)]:
        log.event(kind, step=step)
    order = [(e["kind"], e["step"]) for e in log.events]
    assert order == [("decision", 300), ("rescale", 301), ("decision", 301),
                     ("decision", 441), ("checkpoint", 441)]
    log.close()
    assert [(e["kind"], e["step"]) for e in read_events(tmp_path)] == order
