"""``adaptjax plan SCRIPT -- ARGS``: an unmodified training script probed, then ranked."""

import contextlib
import io
import os
import sys
import tempfile

import pytest

from adaptjax._run_config import RunConfig
from adaptjax.cli._main import main
from adaptjax.controller import _plan_probe
from adaptjax.controller._plan_probe import probe_configs

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the job scripts


def _plan(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *argv]) == 0
    return out.getvalue().splitlines()


@pytest.fixture
def tmp_root(tmp_path, monkeypatch):
    """Where the plan's temporary directories go, to check that none is left behind."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def _script(tmp_path, body):
    path = tmp_path / "train.py"
    path.write_text(body)
    return str(path)


def test_a_missing_script_or_zero_steps_is_refused_before_running(tmp_path, tmp_root):
    with pytest.raises(SystemExit, match="no script or run directory at .*nope.py"):
        main(["plan", str(tmp_path / "nope.py")])
    script = _script(tmp_path, "raise SystemExit('ran')\n")
    with pytest.raises(SystemExit, match="--steps must be >= 1 .*got 0"):
        main(["plan", script, "--steps", "0"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(SystemExit, match="--keep .*full must be a new or empty directory"):
        main(["plan", script, "--keep", str(tmp_path / "full")])
    with pytest.raises(SystemExit, match="are for a script"):
        main(["plan", str(tmp_path), "--steps", "3"])
    assert os.listdir(tmp_root) == []


def test_a_failing_script_shows_its_last_stderr_line(tmp_path, tmp_root):
    script = _script(tmp_path, (
        "import os, sys\n"
        "print('an earlier line', file=sys.stderr)\n"
        "sys.exit(f'args={sys.argv[1:]} cwd={os.getcwd()} plan={os.environ[\"ADAPTJAX_PLAN_DIR\"]}')\n"  # noqa: E501
    ))
    with pytest.raises(SystemExit) as e:
        main(["plan", script, "--", "--run-dir", "runs/x"])
    msg = str(e.value)
    assert msg.startswith(f"adaptjax plan: {script} exited with status 1: args=['--run-dir', "
                          "'runs/x'] cwd=")
    cwd, plan_dir = msg.split(" cwd=")[1].split(" plan=")
    # It ran in a fresh directory under the temporary root, where its relative paths land.
    assert cwd == os.path.join(plan_dir, "cwd") and plan_dir.startswith(str(tmp_root))
    assert os.listdir(tmp_root) == []  # removed after the failure
    keep = tmp_path / "keep"
    with pytest.raises(SystemExit, match="exited with status 1"):
        main(["plan", script, "--keep", str(keep)])
    assert os.listdir(keep) == ["cwd"]  # --keep keeps it


def test_a_script_without_a_controller_writes_no_costs(tmp_path, tmp_root):
    script = _script(tmp_path, "print('trained nothing')\n")
    with pytest.raises(SystemExit, match="finished without running an adaptjax.Controller "
                       r"\(no costs.json written\)"):
        main(["plan", script])
    assert os.listdir(tmp_root) == []


def test_probe_configurations_cover_what_the_fit_needs():
    # Two per-replica batches (half when it splits, else double) and two replica counts.
    assert probe_configs(RunConfig(4, 32, codec="c"), [None, "c", "d"], 8) == [
        RunConfig(4, 32), RunConfig(4, 16), RunConfig(4, 32, codec="c"),
        RunConfig(4, 32, codec="d"), RunConfig(2, 16)]
    assert probe_configs(RunConfig(4, 4), [], 8) == [RunConfig(4, 4), RunConfig(4, 8),
                                                     RunConfig(2, 2)]
    assert probe_configs(RunConfig(2, 6, 3), [], 8) == [  # 3 does not split over 2 x 3
        RunConfig(2, 6, 3), RunConfig(2, 12, 3), RunConfig(1, 3, 3)]
    assert probe_configs(RunConfig(1, 8), [], 8)[2:] == [RunConfig(2, 16)]  # from one: two
    assert probe_configs(RunConfig(1, 8), [], 1) == [RunConfig(1, 8), RunConfig(1, 4)]


@pytest.mark.slow
def test_plan_probes_a_training_script_and_ranks_configurations(tmp_path, tmp_root,
                                                                 monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    user = tmp_path / "user_run"  # the script's own run directory: an existing run
    user.mkdir()
    (user / "metrics.jsonl").write_text('{"step": 1}\n')
    lines = _plan(os.path.join(HERE, "plan_job.py"), "--steps", "3", "--",
                  "--run-dir", str(user))
    assert os.listdir(user) == ["metrics.jsonl"]
    assert (user / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert os.listdir(tmp_root) == []  # the plan directory is gone
    assert "4 measured" in lines[0]
    assert lines[1].split() == ["#", "dev", "batch", "mb", "step", "ms", "meas", "ms",
                                "bytes/dev", "samples/s", "goodput", "codec"]
    rows = [line.split(None, 9) for line in lines[2:]]
    assert {r[9] for r in rows} == {"none", "onebit"}  # the codec's name, not its repr
    key = {(int(r[1]), int(r[2]), r[9] == "none"): r for r in rows}
    # Every predictable configuration: replicas 1..4 dividing a probed batch, with and
    # without the policy's codec; measured exactly at the probed ones.
    assert set(key) == {(n, b, dense) for n in (1, 2, 4) for b in (16, 32)
                        for dense in (True, False)}
    measured = {k for k, r in key.items() if r[5] != "-"}
    assert measured == {(4, 32, True), (4, 16, True), (4, 32, False), (2, 16, True)}
    params = 8 * 16 + 16 + 16 * 2  # the MLP of controller_job.py, f32
    goodputs = [float(r[8]) for r in rows]
    assert goodputs == sorted(goodputs, reverse=True)
    for (n, b, dense), r in key.items():
        step = float(r[4]) / 1e3  # printed to 0.01 ms: samples/s = batch / step within that
        assert step > 0 and b / (step + 5e-6) * 0.999 <= float(r[7]) <= b / (step - 5e-6)
        sent = float(r[6])
        if n == 1:
            assert sent == 0
        elif dense:  # the ring all-reduce of the gradients, plus the monitors' scalars
            assert 2 * (n - 1) / n * 4 * params <= sent < 2 * (n - 1) / n * 4 * params + 64


class _NoBatchAt:
    """A dataset the controller accepts but a probe cannot read compiled steps from."""

    def __init__(self, inner):
        self.inner = inner

    def next_batch(self, n):
        return self.inner.next_batch(n)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


def test_under_plan_a_controller_never_touches_its_run_dir(tmp_path, monkeypatch):
    import adaptjax

    sys.path.insert(0, HERE)
    import controller_job as job
    from _controller_args import make_controller, resume_controller

    from adaptjax.cli._probe import Probe

    plan_dir, user = tmp_path / "plan", tmp_path / "user"
    plan_dir.mkdir()
    monkeypatch.setattr(_plan_probe, "_factory", Probe)  # as adaptjax plan's child installs it
    monkeypatch.setenv("ADAPTJAX_PLAN_DIR", str(plan_dir))
    monkeypatch.setenv("ADAPTJAX_PLAN_STEPS", "0")
    with pytest.raises(ValueError, match="ADAPTJAX_PLAN_STEPS='0': timed steps per "):
        make_controller(run_dir=user, **job.job_kwargs())
    monkeypatch.setenv("ADAPTJAX_PLAN_STEPS", "2")
    data = _NoBatchAt(adaptjax.ArrayDataset(job.make_data(), seed=0))
    ctrl = resume_controller(user,  # no checkpoint needed: fresh
                             **job.job_kwargs(data=data, devices=2, batch_size=8))
    assert ctrl.run_dir == str(plan_dir / "run")
    with pytest.raises(ValueError, match="needs a dataset with batch_at; _NoBatchAt has none"):
        ctrl.run(10)
    assert not user.exists()


def test_the_plan_variable_without_adaptjax_plan_is_one_line_and_writes_nothing(
        tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(HERE)
    import controller_job as job
    from _controller_args import make_controller

    plan_dir, user = tmp_path / "plan", tmp_path / "user"
    monkeypatch.setattr(_plan_probe, "_factory", None)  # a script started by plain python
    monkeypatch.setenv("ADAPTJAX_PLAN_DIR", str(plan_dir))
    with pytest.raises(ValueError) as e:
        make_controller(run_dir=user, **job.job_kwargs())
    assert str(e.value) == ("ADAPTJAX_PLAN_DIR is set but no plan probe is installed; run the "
                            "script under `adaptjax plan SCRIPT -- ARGS` (or unset it)")
    assert not plan_dir.exists() and not user.exists()
