"""The controller under faults: real kills from outside, Ctrl-C, SIGTERM, two owners, corrupt files.

Every fault test checks every promise after the fault: the final parameters are
bit-identical to an uninterrupted run's, every step is in ``metrics.jsonl``
exactly once, every event in ``events.jsonl`` exactly once, and the run goes on
in the configuration the uninterrupted run had at that step.
"""

import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import optax
import pytest
from _controller_args import make_controller, resume_controller  # noqa: E402

import adaptjax
from adaptjax import policies as ajp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import controller_job as job  # noqa: E402
from _handshake import Gate  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "controller_job.py")
STEPS = 45
# Events that describe the run itself (compile/resume/skip events describe the sessions).
RUN_EVENTS = {
    "decision",
    "set_hyperparams",
    "set_codec",
    "batch_rounded",
    "checkpoint",
    "rescale",
    "rollback",
    "stop",
    "eval",
}


class Job:
    """The job as a subprocess: its stdout lines are read as they come (by a thread, so the
    job never blocks on a full pipe), and its ``--hold`` handshake goes through ``gate``."""

    count = 0

    def __init__(self, run_dir, steps=STEPS, *extra, hold=None, hold_in_save=None):
        Job.count += 1
        self.gate = Gate(os.path.join(os.path.dirname(run_dir), f"gate-{Job.count}"))
        held = ["--hold", hold, "--gate", self.gate.directory] if hold else []
        if hold_in_save is not None:
            held += ["--hold-in-save", str(hold_in_save), "--gate", self.gate.directory]
        self.proc = subprocess.Popen(
            [sys.executable, "-u", JOB, str(run_dir), str(steps), *held, *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._more = threading.Condition()
        self._eof = False
        threading.Thread(target=self._read, daemon=True).start()
        self._watchdog = threading.Timer(240, self.proc.kill)
        self._watchdog.start()

    def _read(self):
        for line in self.proc.stdout:
            with self._more:
                self.lines.append(line)
                self._more.notify_all()
        with self._more:
            self._eof = True
            self._more.notify_all()

    def wait_for(self, predicate) -> str | None:
        """Waits for a line with ``predicate(words)``; ``None`` when the process ended first."""
        seen = 0
        with self._more:
            while True:
                for line in self.lines[seen:]:
                    if predicate(line.split()):
                        return line
                seen = len(self.lines)
                if self._eof:
                    return None
                self._more.wait()

    def wait_held(self) -> str:
        """Waits until the job stops at its ``--hold``; returns where (``step S devices D``)."""
        label, pid = self.gate.wait_at(alive=lambda: self.proc.poll() is None)
        assert pid == self.proc.pid
        return label

    def finish(self) -> int:
        self.proc.wait()
        with self._more:
            while not self._eof:
                self._more.wait()
        self._watchdog.cancel()
        return self.proc.returncode

    def output(self) -> str:
        return "".join(self.lines[-60:])


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _event_key(e):
    fields = (
        "kind",
        "step",
        "metrics_step",
        "actions",
        "devices_from",
        "devices_to",
        "learning_rate",
        "requested",
        "batch_size",
        "codec",
    )
    return tuple((k, json.dumps(e.get(k))) for k in fields)


def run_events(run_dir):
    return collections.Counter(
        _event_key(e)
        for e in _rows(os.path.join(run_dir, "events.jsonl"))
        if e["kind"] in RUN_EVENTS
    )


def final_params(run_dir):
    with np.load(os.path.join(run_dir, "final_params.npz")) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    j = Job(run_dir)
    assert j.finish() == 0, j.output()
    return run_dir


def assert_same_run(run_dir, reference, steps=STEPS):
    got, want = final_params(run_dir), final_params(reference)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)  # bit-identical
    logged = [r["step"] for r in _rows(os.path.join(run_dir, "metrics.jsonl"))]
    assert logged == list(range(1, steps + 1)), "every step exactly once, in order"
    got_events, want_events = run_events(run_dir), run_events(reference)
    # A preemption (SIGTERM) adds one real checkpoint, at the step it was asked for.
    preempted = {
        e["step"] for e in _rows(os.path.join(run_dir, "events.jsonl")) if e["kind"] == "preempted"
    }
    for step in preempted:
        key = _event_key({"kind": "checkpoint", "step": step})
        if got_events[key] > want_events[key]:
            got_events[key] -= 1
    assert +got_events == +want_events, "every event exactly once"
    leftovers = [n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if "tmp" in n]
    assert leftovers == []


@pytest.mark.slow
def test_sigkill_at_random_moments_then_sigint_and_sigterm_lose_nothing(tmp_path, reference):
    """Five ``kill -9`` from outside (two during rescales, one right after one), then
    Ctrl-C and SIGTERM, each followed by a resume; the run ends as if never interrupted."""
    rng = random.Random(int(os.environ.get("ADAPTJAX_FAULT_SEED", "8")))
    run_dir = tmp_path / "run"
    # (signal, where the job holds until signalled, seconds after its RESCALE line or None).
    # With None the signal is sent once the job holds there; with seconds, at a random moment
    # of the transition, and at the latest at the hold on the first step after it: never
    # after the job could have gone on, let alone ended.
    trials = [
        ("SIGKILL", f"step={rng.randint(4, 9)}", None),  # before the first checkpoint
        ("SIGKILL", "devices=4", rng.uniform(0.0, 0.3)),  # inside the 8 -> 4 transition
        ("SIGKILL", "devices=4", None),  # just after it: the checkpoint must say 4 devices
        ("SIGINT", f"step={rng.randint(24, 28)}", None),  # an async checkpoint may be in flight
        ("SIGKILL", "devices=8", rng.uniform(0.0, 0.3)),  # inside the 4 -> 8 transition
        ("SIGTERM", "step=42", None),  # preemption: checkpoint now, exit 75
        ("SIGKILL", f"step={rng.randint(43, 44)}", None),
    ]
    landed = []
    for sig, hold, after_rescale in trials:
        j = Job(run_dir, hold=hold)
        if after_rescale is None:
            where = j.wait_held()
        else:
            hit = j.wait_for(lambda w: w[:1] == ["RESCALE"])
            assert hit is not None, f"{sig}: no rescale before {hold}:\n{j.output()}"
            time.sleep(after_rescale)  # picks the moment; the hold is what makes it safe
            where = f"{after_rescale:.2f} s after {hit.strip()}"
        j.proc.send_signal(getattr(signal, sig))
        j.gate.go()  # only now may the job go on (SIGKILL: it is gone already)
        code = j.finish()
        if after_rescale is not None:
            where += f", at the hold ({j.gate.wait_at()[0]})" if j.gate.held() else ", before it"
        landed.append((sig, where))
        if sig == "SIGKILL":
            assert code == -signal.SIGKILL, j.output()
        else:  # the handler ran while the job held (hold returns on the handled signal)
            assert j.gate.released() == sig, j.output()
        if sig == "SIGTERM":
            assert code == adaptjax.EXIT_PREEMPTED == 75, j.output()
            preempted = [e for e in _rows(run_dir / "events.jsonl") if e["kind"] == "preempted"]
            assert preempted and preempted[-1]["step"] == 42, preempted
            assert 42 in adaptjax.RunCheckpoints(run_dir / "checkpoints").all_steps()
        elif sig == "SIGINT":
            assert code != 0, j.output()  # KeyboardInterrupt propagates
        # Whatever was interrupted: only completed checkpoints are logged (older ones may be
        # gone by max_to_keep), and a clean exit finished and logged its in-flight checkpoint.
        on_disk = set(adaptjax.RunCheckpoints(run_dir / "checkpoints").all_steps())
        logged = {e["step"] for e in _rows(run_dir / "events.jsonl") if e["kind"] == "checkpoint"}
        assert {s for s in logged if not on_disk or s >= min(on_disk)} <= on_disk
        if sig != "SIGKILL":
            assert max(on_disk) in logged
            assert not [n for n in os.listdir(run_dir / "checkpoints") if "tmp" in n]
    print(f"fault trials (signal, where it landed): {landed}")
    assert sum(sig == "SIGKILL" for sig, _ in landed) >= 5
    j = Job(run_dir)
    assert j.finish() == 0, j.output()
    assert_same_run(run_dir, reference)
    resumes = [e for e in _rows(run_dir / "events.jsonl") if e["kind"] == "resume"]
    assert len(resumes) >= 5, landed


@pytest.mark.slow
def test_kill_inside_a_checkpoint_write_resumes_from_the_previous_one(tmp_path, reference):
    run_dir = tmp_path / "run"
    j = Job(run_dir, STEPS, "--kill-in-save", "20")
    assert j.finish() == 17, j.output()
    assert any(".orbax-checkpoint-tmp" in n for n in os.listdir(run_dir / "checkpoints"))
    j = Job(run_dir)
    assert j.wait_for(lambda w: w[:1] == ["RESUMED"]) == "RESUMED 10\n"
    assert j.finish() == 0, j.output()
    assert_same_run(run_dir, reference)


#: What Orbax's threads print when a save is torn apart under them.
THREAD_NOISE = ("Exception in thread", "Event loop is closed", "ERROR:absl")


@pytest.mark.slow
def test_sigint_as_a_save_begins_finishes_that_save_and_leaves_no_temporary_directory(
    tmp_path, reference
):
    """Ctrl-C lands inside Orbax's save of step 20, after its writes were launched (the job
    holds there until signalled): the save is finished, logged once, and nothing is left."""
    run_dir = tmp_path / "run"
    j = Job(run_dir, hold_in_save=20)
    assert j.wait_held() == "save 20"
    j.proc.send_signal(signal.SIGINT)
    j.gate.go()
    code = j.finish()
    out = "".join(j.lines)
    assert code != 0 and j.gate.released() == "SIGINT", j.output()
    assert "KeyboardInterrupt" in out, j.output()
    for noise in THREAD_NOISE:
        assert noise not in out, j.output()
    ckpts = run_dir / "checkpoints"
    assert adaptjax.RunCheckpoints(ckpts).all_steps() == [10, 20]  # finished, not torn
    assert [n for n in os.listdir(ckpts) if "tmp" in n] == []
    logged = [e["step"] for e in _rows(run_dir / "events.jsonl") if e["kind"] == "checkpoint"]
    assert logged == [10, 20]
    j = Job(run_dir)
    assert j.wait_for(lambda w: w[:1] == ["RESUMED"]) == "RESUMED 20\n"
    assert j.finish() == 0, j.output()
    assert_same_run(run_dir, reference)


@pytest.mark.slow
def test_a_second_process_on_the_run_dir_is_refused_and_the_first_is_unharmed(tmp_path, reference):
    run_dir = tmp_path / "run"
    first = Job(run_dir, hold="step=1")  # holds the run directory until the second is done
    assert first.wait_held() == "step 1 devices 8"
    second = Job(run_dir)
    assert second.finish() != 0
    assert f"in use by another controller (pid {first.proc.pid})" in second.output()
    first.gate.go()
    assert first.finish() == 0, first.output()
    assert first.gate.released() == "go"
    assert_same_run(run_dir, reference)


# ---------------------------------------------------------------------------- in-process


def _one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


class Recorder(ajp.Policy):
    """Records the context step of every decision; acts through ``actions(ctx)``."""

    def __init__(self, actions=lambda ctx: []):
        self.steps, self.actions = [], actions

    def decide(self, metrics, ctx):
        self.steps.append(ctx.step)
        return self.actions(ctx)


def test_one_decision_fires_once_even_when_it_rescales(tmp_path):
    policy = Recorder(lambda ctx: [ajp.Rescale(devices=4)] if ctx.step == 4 else [])
    ctrl = make_controller(
        run_dir=tmp_path, **job.job_kwargs(policies=[policy], policy_every=1)
    )
    ctrl.run(8)
    ctrl.close()
    events = _rows(tmp_path / "events.jsonl")
    assert [e["devices_to"] for e in events if e["kind"] == "rescale"] == [4]
    assert [e["metrics_step"] for e in events if e["kind"] == "decision"] == [4]
    assert policy.steps == list(range(1, 8)), "each step decided once, in order"


def test_context_step_is_the_step_the_metrics_belong_to(tmp_path):
    policy = Recorder()
    sched = ajp.Schedule({15: ajp.SetBatchSize(32)})
    ctrl = make_controller(
        run_dir=tmp_path,
        **job.job_kwargs(policies=[policy, sched], policy_every=5, checkpoint_every=10),
    )
    ctrl.run(21)
    ctrl.close()
    assert policy.steps == [5, 10, 15, 20]
    (decision,) = [e for e in _rows(tmp_path / "events.jsonl") if e["kind"] == "decision"]
    assert decision["metrics_step"] == 15 and decision["step"] == 16
    compiles = [e for e in _rows(tmp_path / "events.jsonl") if e["kind"] == "compile"]
    assert [e["step"] for e in compiles] == [1, 17]  # batch 32 from step 17: s + 2


def test_exception_finishes_the_in_flight_checkpoint_and_logs_only_completed_ones(tmp_path):
    class Boom(ajp.Policy):
        def decide(self, metrics, ctx):
            if ctx.step == 10:
                raise RuntimeError("policy bug")
            return []

    ctrl = make_controller(
        run_dir=tmp_path, **job.job_kwargs(policies=[Boom()], policy_every=1, checkpoint_every=10)
    )
    with pytest.raises(RuntimeError, match="policy bug"):
        ctrl.run(20)  # checkpoint 10 is written asynchronously, then step 11 decides on 10
    assert [n for n in os.listdir(tmp_path / "checkpoints")] == ["10"]
    logged = [e["step"] for e in _rows(tmp_path / "events.jsonl") if e["kind"] == "checkpoint"]
    assert logged == [10]
    # the run directory was released: it resumes in this same process
    resumed = resume_controller(
        tmp_path, **job.job_kwargs(policies=[Boom()], policy_every=1)
    )
    assert resumed.step == 10
    resumed.close()


def test_a_second_controller_on_the_run_dir_gets_the_holders_pid(tmp_path):
    first = make_controller(run_dir=tmp_path, **job.job_kwargs(policies=[]))
    with pytest.raises(adaptjax.RunDirectoryLocked) as e:
        make_controller(run_dir=tmp_path, **job.job_kwargs(policies=[]))
    assert f"pid {os.getpid()}" in _one_line(e)
    first.close()
    make_controller(run_dir=tmp_path, **job.job_kwargs(policies=[])).close()


# --- corrupt checkpoints -------------------------------------------------------------


@pytest.fixture
def three_checkpoints(tmp_path):
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(policies=[]))
    ctrl.run(30)
    ctrl.close()
    return tmp_path


def _array_files(step_dir):
    out = []
    for root, _, files in os.walk(step_dir / "state"):
        out += [os.path.join(root, f) for f in files if os.sep + "d" + os.sep in root + os.sep]
    return sorted(out, key=os.path.getsize)


def _truncate(run_dir):
    # every data file: which of them a restore reads depends on Orbax's layout
    for path in _array_files(run_dir / "checkpoints" / "30"):
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)


def _flip(run_dir):
    # 64 bytes in the middle of every data file, XOR-ed (the file sizes are unchanged)
    for path in _array_files(run_dir / "checkpoints" / "30"):
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            chunk = bytearray(f.read(64))
            f.seek(os.path.getsize(path) // 2)
            f.write(bytes(b ^ 0x5A for b in chunk))


def _delete_metadata(run_dir):
    os.remove(run_dir / "checkpoints" / "30" / "state" / "_METADATA")


def _garbage_meta(run_dir):
    (run_dir / "checkpoints" / "30" / "meta" / "metadata").write_text("{not json")


@pytest.mark.parametrize("damage", [_truncate, _flip, _delete_metadata, _garbage_meta])
def test_a_damaged_latest_checkpoint_is_skipped_for_the_newest_intact_one(
    three_checkpoints, damage
):
    run_dir = three_checkpoints
    damage(run_dir)
    with pytest.warns(UserWarning, match="skipped checkpoint 30"):
        ctrl = resume_controller(run_dir, **job.job_kwargs(policies=[]))
    assert ctrl.step == 20
    (skip,) = [e for e in ctrl.log.events if e["kind"] == "checkpoint_skipped"]
    assert skip["skipped_step"] == 30 and "checkpoints/30" in skip["reason"]
    assert os.path.isdir(run_dir / "quarantine" / "30")  # kept, never deleted
    assert [r["step"] for r in _rows(run_dir / "metrics.jsonl")] == list(range(1, 21))
    ctrl.run(30)  # the steps after 20 are recomputed and checkpoint 30 written again
    ctrl.close()
    assert adaptjax.RunCheckpoints(run_dir / "checkpoints").latest_step() == 30
    assert [r["step"] for r in _rows(run_dir / "metrics.jsonl")] == list(range(1, 31))


def test_changed_array_bytes_are_refused_by_checksum_with_a_one_line_error(three_checkpoints):
    # Orbax can read every byte (step 20's arrays under step 30's meta); only checksums see it.
    ckpts = three_checkpoints / "checkpoints"
    shutil.rmtree(ckpts / "30" / "state")
    shutil.copytree(ckpts / "20" / "state", ckpts / "30" / "state")
    ctrl = make_controller(run_dir=three_checkpoints / "x", **job.job_kwargs(policies=[]))
    with adaptjax.RunCheckpoints(ckpts) as ckpt:
        with pytest.raises(adaptjax.CorruptCheckpointError) as e:
            ckpt.restore(30, target_state=ctrl.state, mesh=adaptjax.make_mesh(8))
    msg = _one_line(e)
    assert "checkpoints/30 is corrupt" in msg and "does not match the checksum" in msg
    ctrl.close()


def test_a_stray_step_directory_is_quarantined_with_a_warning(three_checkpoints):
    os.makedirs(three_checkpoints / "checkpoints" / "999")
    with pytest.warns(UserWarning, match="skipped checkpoint 999: .* not a complete checkpoint"):
        ctrl = resume_controller(three_checkpoints, **job.job_kwargs(policies=[]))
    assert ctrl.step == 30
    ctrl.close()
    assert not os.path.exists(three_checkpoints / "checkpoints" / "999")
    assert os.path.isdir(three_checkpoints / "quarantine" / "999")  # kept, never deleted


def test_no_intact_checkpoint_says_so_in_one_line(three_checkpoints):
    for step in (10, 20, 30):
        os.remove(three_checkpoints / "checkpoints" / str(step) / "state" / "_METADATA")
    with pytest.warns(UserWarning), pytest.raises(ValueError) as e:
        resume_controller(three_checkpoints, **job.job_kwargs(policies=[]))
    assert "no intact checkpoint" in _one_line(e)


# --- every check before anything touches the disk ---------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(max_devices=4), "max_devices=4 is below devices=8"),
        (dict(learning_rate=float("nan")), "learning_rate must be > 0 and finite, got nan"),
        (dict(learning_rate=float("inf")), "learning_rate must be > 0 and finite, got inf"),
        (dict(learning_rate=-1e-3), "learning_rate must be > 0 and finite, got -0.001"),
        (dict(optimizer=optax.adam), "optimizer must be an optax.GradientTransformation"),
        (dict(batch_size=64.5), "batch_size must be a positive integer, got 64.5"),
        (dict(batch_size="64"), "batch_size must be a positive integer, got '64'"),
        (dict(devices=8.0), "devices must be a positive integer"),
        (dict(link_bandwidth=-1.0), "link_bandwidth must be a positive number"),
    ],
)
def test_bad_arguments_fail_before_the_run_dir_exists(tmp_path, overrides, message):
    with pytest.raises(ValueError) as e:
        make_controller(run_dir=tmp_path / "run", **job.job_kwargs(**overrides))
    assert message in _one_line(e)
    assert not (tmp_path / "run").exists()


def test_run_with_negative_or_past_steps_writes_nothing(tmp_path):
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(policies=[]))
    with pytest.raises(ValueError) as e:
        ctrl.run(steps=-5)
    assert "steps must be a non-negative integer, got -5" in _one_line(e)
    assert not (tmp_path / "checkpoints").exists() or os.listdir(tmp_path / "checkpoints") == []
    ctrl.run(3)
    with pytest.raises(ValueError) as e:
        ctrl.run(2)
    assert "already at step 3" in _one_line(e)
    ctrl.close()


def test_a_run_whose_every_step_is_nonfinite_stops_with_an_error(tmp_path):
    data = job.make_data()
    data["x"][:] = np.nan
    ctrl = make_controller(
        run_dir=tmp_path,
        **job.job_kwargs(
            policies=[], data=adaptjax.ArrayDataset(data, seed=0), max_nonfinite_steps=5
        ),
    )
    with pytest.raises(adaptjax.NonFiniteTraining) as e:
        ctrl.run(50)
    assert "non-finite" in _one_line(e)
    assert ctrl.step < 10  # it stopped within a step or two of the limit


def test_resume_warns_for_every_value_the_checkpoint_overrides(tmp_path):
    ctrl = make_controller(
        run_dir=tmp_path,
        **job.job_kwargs(policies=[Recorder()], optimizer=optax.inject_hyperparams(optax.adam)(
            learning_rate=1e-2, b1=0.9)),
    )
    ctrl.run(10)
    ctrl.close()
    seen = Recorder()
    seen.decide = lambda metrics, ctx: seen.steps.append(dict(ctx.hyperparams)) or []
    with pytest.warns(UserWarning) as record:
        resumed = resume_controller(
            tmp_path,
            **job.job_kwargs(
                policies=[seen],
                policy_every=1,
                devices=4,
                batch_size=32,
                optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-3, b1=0.8),
            ),
        )
    messages = [str(w.message) for w in record]
    spec_warnings = [m for m in messages if "the spec passed differs" in m]
    assert len(spec_warnings) == 1  # one warning naming every differing field
    assert spec_warnings[0].startswith(f"resume: the spec passed differs from {tmp_path}")
    assert " in batch_size, devices, policy_every; " in spec_warnings[0]
    for key in ("learning_rate=0.001", "b1=0.8"):
        assert any(key in m and "continues with the checkpoint's" in m for m in messages), key
    assert len(messages) == 3
    resumed.run(12)
    assert seen.steps[-1]["b1"] == pytest.approx(0.9)  # what the optimizer really holds
    assert resumed.config.devices == 8 and resumed.config.batch_size == 64
    resumed.close()


def test_resume_accepts_run_dir_among_the_same_arguments(tmp_path):
    kwargs = job.job_kwargs(policies=[], run_dir=tmp_path)
    ctrl = make_controller(**kwargs)
    ctrl.run(10)
    ctrl.close()
    resumed = resume_controller(**job.job_kwargs(policies=[], run_dir=tmp_path))
    assert resumed.step == 10
    resumed.close()


def test_a_policy_that_needs_a_metric_never_produced_warns_at_construction(tmp_path):
    switch = ajp.SwitchCompression(object(), when_comm_share_above=0.5)
    with pytest.warns(UserWarning, match="'comm_share'.*link_bandwidth") as record:
        ctrl = make_controller(
            run_dir=tmp_path / "a", **job.job_kwargs(policies=[ajp.cooldown(switch, steps=5)])
        )
    assert sum("comm_share" in str(w.message) for w in record) == 1  # one line, once
    ctrl.close()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctrl = make_controller(
            run_dir=tmp_path / "b", **job.job_kwargs(policies=[switch], link_bandwidth=1e9)
        )
    ctrl.close()


# --- the handshake the fault tests stand on (tests/_handshake.py) ------------------------


def _signal_once_held(gate, sig):
    def send():
        gate.wait_at()
        os.kill(os.getpid(), sig)

    threading.Thread(target=send, daemon=True).start()


def test_hold_returns_only_after_the_signal_handler_ran(tmp_path):
    from _handshake import hold

    ran = []

    def mine(*_):
        ran.append("handler")

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        _signal_once_held(Gate(tmp_path), signal.SIGTERM)
        assert hold(tmp_path, "step 3") == "SIGTERM"
        assert ran == ["handler"]  # the handler in place before the hold, once
        assert signal.getsignal(signal.SIGTERM) is mine  # ... and it is back in place
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert Gate(tmp_path).released() == "SIGTERM"


def test_hold_raises_what_the_handler_raises_and_goes_on_at_go(tmp_path):
    from _handshake import hold

    _signal_once_held(Gate(tmp_path / "a"), signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        hold(tmp_path / "a", "step 1")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    gate = Gate(tmp_path / "b")
    threading.Thread(target=lambda: gate.wait_at() and gate.go(), daemon=True).start()
    assert hold(gate.directory, "step 2") == "go"
    assert gate.wait_at() == ("step 2", os.getpid())
