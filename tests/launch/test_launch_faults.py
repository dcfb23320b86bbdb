"""``adaptjax launch`` against a second job and a stopped process (issue 48 items 2 and 5).

* A second launch on a run directory a launched job holds ends with
  ``EXIT_LOCKED`` (73) in one line of the launcher's, never restarted, with no
  gloo traceback, and leaves the first job to finish its run alone. The first
  job holds at a step (``tests/_handshake.py``) while the second runs, so the
  lock is held throughout: nothing races.
* A process stopped by SIGSTOP is reported once ``--hang-timeout`` passes
  without a sign of life from it, while a process whose main thread is busy in
  a call that releases Python's lock (as XLA's compiles do) for three times as
  long is not: its heartbeat thread beats on.
"""

import io
import json
import os
import sys
import textwrap
import threading
import time

import pytest

from adaptjax.launch._launcher import (
    EXIT_LOCKED,
    HANG_TIMEOUT_S,
    HEARTBEAT_S,
    _ended,
    launch,
    main,
)

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
from _handshake import Gate  # noqa: E402

PY = sys.executable
JOB = os.path.join(TESTS, "distributed_job.py")


def _launch(command, n, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    rc = launch(command, processes=n, devices_per_process=2, out=out, err=err, backoff=0.1,
                **kwargs)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.slow
def test_a_second_launch_on_a_held_run_directory_exits_locked_without_a_restart(tmp_path):
    run_dir = tmp_path / "run"
    gate = Gate(tmp_path / "gate")
    first: dict = {}

    def first_job():  # holds at step 3, the run directory locked, until the test lets it go
        first["result"] = _launch(
            [PY, JOB, str(run_dir), "6", "--hold", "3", "--gate", gate.directory], 2
        )

    thread = threading.Thread(target=first_job, daemon=True)
    thread.start()
    for rank in ("0", "1"):
        gate.wait_at(rank, alive=thread.is_alive)
    t0 = time.monotonic()
    try:
        rc, out, err = _launch([PY, JOB, str(run_dir), "6"], 2, max_restarts=3)
        print(f"second launch refused after {time.monotonic() - t0:.1f} s")  # not asserted
    finally:
        gate.go("0")
        gate.go("1")
        thread.join(timeout=300)
    assert rc == EXIT_LOCKED, out + err
    lines = err.splitlines()
    assert len(lines) == 2, err  # started, then the one line
    assert lines[1] == (
        "adaptjax launch: the run directory is in use by another job (a process exited with 73, "
        "RunDirectoryLocked); not restarting: wait for that job to end or choose another run "
        "directory"
    )
    assert f"[0] adaptjax.RunDirectoryLocked: run_dir {run_dir} is in use" in out
    assert "Traceback" not in out and "DEADLINE_EXCEEDED" not in out, out
    first_rc, first_out, first_err = first["result"]
    assert first_rc == 0, first_out[-3000:] + first_err
    with open(run_dir / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, 7))


def test_a_locked_exit_is_the_attempts_code_whatever_the_others_ended_with():
    assert _ended([EXIT_LOCKED]) == EXIT_LOCKED
    assert _ended([1, EXIT_LOCKED]) == EXIT_LOCKED
    assert _ended([-9, EXIT_LOCKED, 0]) == EXIT_LOCKED


def test_a_locked_exit_of_a_worker_is_not_restarted():
    code = f"""
        import os, sys
        if os.environ["ADAPTJAX_PROCESS_ID"] == "1":
            sys.exit({EXIT_LOCKED})
        import threading
        threading.Event().wait()
    """
    out, err = io.StringIO(), io.StringIO()
    rc = launch([PY, "-c", textwrap.dedent(code)], processes=2, max_restarts=3, backoff=0.01,
                out=out, err=err)
    assert rc == EXIT_LOCKED
    assert err.getvalue().count("started 2 process(es)") == 1, err.getvalue()
    assert "ended (exit code 73)" not in err.getvalue() and "restart 1/3" not in err.getvalue()


# --- a stopped process -------------------------------------------------------------------


def test_the_default_hang_timeout_reports_a_stopped_process_within_two_minutes():
    """Reported at most ``--hang-timeout`` after its last beat, which came at most a
    heartbeat period before it stopped: within 120 s with a period to spare."""
    assert HANG_TIMEOUT_S <= 120 - HEARTBEAT_S
    import inspect

    assert inspect.signature(launch).parameters["hang_timeout"].default == HANG_TIMEOUT_S


def test_the_command_line_has_the_same_default(monkeypatch):
    seen = {}
    monkeypatch.setattr("adaptjax.launch._launcher.launch", lambda cmd, **kw: seen.update(kw))
    main(["-n", "1", "--", PY, "-c", "pass"])
    assert seen["hang_timeout"] == HANG_TIMEOUT_S


_INIT = "import os, signal, time\nimport adaptjax\nadaptjax.initialize_distributed()\n"


@pytest.mark.slow
def test_a_stopped_process_is_reported_after_the_hang_timeout():
    code = _INIT + "os.kill(os.getpid(), signal.SIGSTOP)\n"
    rc, out, err = _launch([PY, "-c", code], 1, hang_timeout=2.0,
                           max_restarts=0)
    assert rc == 1, out + err
    assert ("process 0 gave no sign of life for 2 s (stopped, e.g. by SIGSTOP, or frozen); "
            "stopping all") in err


@pytest.mark.slow
def test_a_main_thread_busy_outside_python_for_longer_is_not_reported():
    """``time.sleep`` releases Python's lock as XLA's compile does: the heartbeat thread runs."""
    code = _INIT + "time.sleep(9.0)\nprint('done')\n"
    rc, out, err = _launch([PY, "-c", code], 1, hang_timeout=3.0,
                           max_restarts=0)
    assert rc == 0, out + err
    assert "[0] done" in out and "sign of life" not in err
