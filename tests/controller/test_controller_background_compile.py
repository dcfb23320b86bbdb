"""Configurations a policy announces are compiled in the background, once each."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax
import adaptjax.cli._main
from adaptjax import policies as ajp


@pytest.fixture
def step_compiles():
    """Counts XLA compiles of the training step (``jit(step)``) while the test runs."""
    seen = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration" and kwargs.get(
            "fun_name"
        ) == "jit(step)":
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listen)


def run(tmp_path, precompile, steps=40):
    x = np.random.default_rng(0).normal(size=(512, 4)).astype(np.float32)
    data = adaptjax.ArrayDataset({"x": x, "y": x.sum(1)}, seed=0)
    ctrl = adaptjax.Controller(
        model={"w": jnp.zeros(4)},
        loss_fn=lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
        optimizer=optax.sgd, hyperparams={"learning_rate": 0.05}, data=data,
        devices=4, batch_size=32,
        policies=[ajp.ElasticScale({20: 2}), ajp.Schedule({30: ajp.SetBatchSize(64)})],
        # the compilation cache would hide a second compile from the count
        compilation_cache_dir=None, precompile_upcoming=precompile,
        run_dir=tmp_path / "run", progress=False, tensorboard=False,
    )
    ctrl.run(steps)
    events = list(ctrl.log.events)
    params = np.asarray(ctrl.state.params["w"])
    ctrl.close()
    return events, params


def test_announced_configurations_compile_once_in_the_background(tmp_path, step_compiles):
    events, params = run(tmp_path / "bg", precompile=True)
    background = [e for e in events if e["kind"] == "background_compile"]
    compiled = [e for e in events if e["kind"] == "compile"]
    # Announced at the first step: ElasticScale's 4 -> 2 (due at 20) and the Schedule's
    # batch 64 on the current 4 devices (each hint from the configuration in force);
    # after the rescale, the Schedule's batch 64 on 2 devices (due at 30).
    assert [(e["config"]["devices"], e["config"]["batch_size"]) for e in background] == [
        (2, 32), (4, 64), (2, 64)]
    assert all(e["latency_s"] > 0 and "error" not in e for e in background)
    assert [(e["config"]["devices"], e["config"]["batch_size"]) for e in compiled] == [
        (4, 32), (2, 32), (2, 64)]
    # one XLA compile per configuration: the steps found the background's programs
    assert len(step_compiles) == 4
    # adaptjax summary says so
    text = adaptjax.cli._main.summary(str(tmp_path / "bg" / "run"))
    assert "compile seconds: " in text and " in 3 compile(s)" in text
    assert " in 3 configuration(s) (their first steps above found them compiled)" in text
    # and the run is the run without background compiles
    events_fg, params_fg = run(tmp_path / "fg", precompile=False)
    assert not [e for e in events_fg if e["kind"] == "background_compile"]
    np.testing.assert_array_equal(params, params_fg)


def test_a_hint_that_cannot_compile_is_logged_and_training_goes_on(tmp_path, step_compiles):
    class AnnouncesABrokenCodec(ajp.Policy):
        def decide(self, metrics, ctx):
            return []

        def upcoming(self, ctx):
            return [ajp.SetCodec(BrokenCodec())]

    class BrokenCodec:  # a codec whose state and sync cannot be built
        name = "broken"

        def init(self, params):
            raise RuntimeError("this codec cannot be built")

        def sync(self, grads, state, *, axis_name, step):
            raise RuntimeError("this codec cannot be built")

    x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
    ctrl = adaptjax.Controller(
        model={"w": jnp.zeros(4)},
        loss_fn=lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
        optimizer=optax.sgd, hyperparams={"learning_rate": 0.05},
        data=adaptjax.ArrayDataset({"x": x, "y": x.sum(1)}, seed=0), devices=2, batch_size=32,
        policies=[AnnouncesABrokenCodec()], compilation_cache_dir=None,
        run_dir=tmp_path / "run", progress=False, tensorboard=False,
    )
    ctrl.run(25)
    events = [e for e in ctrl.log.events if e["kind"] == "background_compile"]
    ctrl.close()
    assert ctrl.step == 25
    assert len(step_compiles) == 1  # only the configuration that ran
    assert [e["error"] for e in events] == ["RuntimeError: this codec cannot be built"]


def test_the_background_compiler_runs_at_the_lowest_cpu_priority():
    import os
    import threading

    from adaptjax.controller._background import lower_thread_priority

    if not hasattr(os, "getpriority"):
        pytest.skip("no per-thread priorities here")
    seen = {}

    def worker():
        lower_thread_priority()
        seen["worker"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["worker"] == 19
    # only that thread: the caller's (the training loop's) priority is untouched
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19
