"""Configurations a policy announces are compiled in the background, once each."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _controller_args import make_controller  # noqa: E402

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
    # After each step, every background compile submitted so far is finished: on
    # loaded cores the lowest-priority thread may otherwise still be compiling
    # when a step needs its program, which the step then compiles itself (tested
    # below); here each change must find its program compiled.
    drained = adaptjax.Hook(lambda ctrl: ctrl._compiler.wait_all())
    ctrl = make_controller(
        hooks=[drained],
        model={"w": jnp.zeros(4)},
        loss_fn=lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
        optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.05), data=data,
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


def test_a_step_compiles_its_own_program_when_the_background_has_not_started_it(
        tmp_path, step_compiles, monkeypatch):
    """The compiling thread is held on a hint's compile; the step due next is queued behind it.

    Announced at the first step, in the policies' order: the Schedule's batch 64
    (due at step 50) and the ElasticScale's 4 -> 2 devices (due at step 20). The
    thread takes (4, 64) first and is held there, so (2, 32) waits in the queue.
    Step 21 must not wait for the held compile: it takes (2, 32) out of the queue
    and compiles it on the training thread.
    """
    from adaptjax.controller._step_cache import StepCache

    release = threading.Event()
    compile_ = StepCache.compile

    def held(self, config, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread() and config.batch_size == 64:
            assert release.wait(60), "the test never released the held compile"
        return compile_(self, config, *args, **kwargs)

    monkeypatch.setattr(StepCache, "compile", held)
    x = np.random.default_rng(0).normal(size=(512, 4)).astype(np.float32)
    ctrl = make_controller(
        model={"w": jnp.zeros(4)},
        loss_fn=lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
        optimizer=optax.sgd(0.05), data=adaptjax.ArrayDataset({"x": x, "y": x.sum(1)}, seed=0),
        devices=4, batch_size=32,
        policies=[ajp.Schedule({50: ajp.SetBatchSize(64)}), ajp.ElasticScale({20: 2})],
        compilation_cache_dir=None, precompile_upcoming=True,
        run_dir=tmp_path / "run", progress=False, tensorboard=False,
    )
    try:
        ctrl.run(30)  # would hang at the rescale (until the 60 s assert) if it waited
        assert ctrl.config.devices == 2 and ctrl.step == 30
        events = list(ctrl.log.events)
    finally:
        release.set()
        ctrl._compiler.wait_all()  # no compile of this test's left running into the next
        ctrl.close()
    compiles = [(e["config"]["devices"], e["config"]["batch_size"], e.get("compiled_ahead"))
                for e in events if e["kind"] == "compile"]
    assert compiles == [(4, 32, None), (2, 32, None)]  # compiled by the step, not ahead
    background = [e for e in events if e["kind"] == "background_compile"]
    assert not [e for e in background if e["config"]["batch_size"] == 32]


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
    ctrl = make_controller(
        model={"w": jnp.zeros(4)},
        loss_fn=lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
        optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.05),
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


class _Announces(ajp.Policy):
    """Announces batch 64; moves to it at step 30; notes what it saw."""

    def __init__(self):
        self.seen = {}

    def decide(self, metrics, ctx):
        self.seen[ctx.step] = (ctx.batch_size, ctx.compiled_batch_sizes)
        return [ajp.SetBatchSize(64)] if ctx.step == 30 else []

    def upcoming(self, ctx):
        return [ajp.SetBatchSize(64)]


def test_a_batch_change_compiled_in_the_background_waits_for_no_compile(tmp_path,
                                                                        step_compiles):
    policy = _Announces()
    x = np.random.default_rng(0).normal(size=(2048, 4)).astype(np.float32)
    ctrl = make_controller(
        model={"w": jnp.zeros(4)},
        loss_fn=lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
        optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.05),
        data=adaptjax.ArrayDataset({"x": x, "y": x.sum(1)}, seed=0), devices=4, batch_size=32,
        policies=[policy], compilation_cache_dir=None,
        run_dir=tmp_path / "run", progress=False, tensorboard=False,
    )
    ctrl.run(50)
    events = list(ctrl.log.events)
    ctrl.close()
    # the batch change, announced: 64 compiles in the background
    background = [e["config"]["batch_size"] for e in events if e["kind"] == "background_compile"]
    assert background == [64]
    # the move to 64 found its step compiled: its first step waited for no compile
    compiles = [e for e in events if e["kind"] == "compile"]
    assert [(e["config"]["batch_size"], e.get("compiled_ahead", False)) for e in compiles] == [
        (32, False), (64, True)]
    assert len(step_compiles) == 2  # 32 in the foreground, 64 in the background
    # policies see the sizes compiled in the configuration: 32 ran (64 when its compile
    # is done, which depends on the machine's load); after the change 64 too
    assert 32 in policy.seen[30][1] <= {32, 64}
    assert policy.seen[40][0] == 64 and {32, 64} <= policy.seen[40][1]


def test_compiled_batch_sizes_are_those_of_the_configuration_but_its_batch():
    from adaptjax.controller._background import BackgroundCompiler
    from adaptjax.controller._step_cache import StepCache

    steps = StepCache(model={"w": jnp.zeros(2)}, optimizer=optax.sgd(0.1),
                      loss_fn=lambda p, b: jnp.sum(b["x"] @ p["w"]))
    data = adaptjax.ArrayDataset({"x": np.ones((64, 2), np.float32)})
    compiler = BackgroundCompiler(steps)
    config = adaptjax.RunConfig(2, 8)
    assert compiler.compiled_batch_sizes(config) == frozenset()
    compiler.wait_for(config)  # the loop dispatches a step of it: it ran
    compiler.submit([config.replace(batch_size=16), adaptjax.RunConfig(1, 4)], data)
    compiler.wait_all()
    assert compiler.compiled_batch_sizes(config) == {8, 16}  # not the other device count's 4
    assert compiler.compiled_batch_sizes(adaptjax.RunConfig(1, 2)) == {4}
    compiler.shutdown()


def test_an_announced_probe_names_its_branches_configurations():
    from adaptjax._transition import plan_transition
    from adaptjax.controller._background import announced_configs

    config = adaptjax.RunConfig(4, 32)
    hints = [ajp.Probe((8, 30, 64), steps=2), ajp.SetBatchSize(64), ajp.Stop()]
    plan = lambda actions: plan_transition(actions, config, max_devices=8).config  # noqa: E731
    got = announced_configs(hints, steps=None, plan=plan)
    # each size as its SetBatchSize would land (30 rounds to 32 on 4 replicas), each once
    assert [c.batch_size for c in got] == [8, 32, 64]
