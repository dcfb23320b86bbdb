"""``adaptjax launch``: bad inputs give one line or a restart within a stated timeout, never a hang.

Most workers here are tiny ``python -c`` scripts (no jax), so each test takes
about a second; the one with a collective starts jax in two processes. A worker
that must be stopped by the launcher waits forever (``FOREVER``), so the launch
returning at all shows that the launcher stopped it: no test depends on how
fast anything runs.
"""

import io
import json
import os
import signal
import socket
import sys
import textwrap
import threading
import time

import pytest

from adaptjax import EXIT_RESCALE
from adaptjax.cli._main import main as cli_main
from adaptjax.launch._launcher import LaunchError, launch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
from _handshake import Gate  # noqa: E402

PY = sys.executable
FOREVER = "threading.Event().wait()"  # a worker that never ends by itself


def run(code, n=2, **kwargs):
    """Launches ``python -c code`` as ``n`` processes; returns (rc, stdout, stderr, seconds)."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    rc = launch([PY, "-c", textwrap.dedent(code)], processes=n, out=out, err=err, **kwargs)
    return rc, out.getvalue(), err.getvalue(), time.monotonic() - t0


def test_script_missing_is_one_line():
    with pytest.raises(LaunchError, match=r"script 'no_such_train\.py' not found"):
        launch([PY, "no_such_train.py"], processes=2)


def test_command_missing_is_one_line():
    with pytest.raises(LaunchError, match="command 'no-such-program-xyz' not found"):
        launch(["no-such-program-xyz"], processes=2)
    with pytest.raises(LaunchError, match="give it after --"):
        launch([], processes=2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"processes": 0}, "-n must be an integer >= 1, got 0"),
        ({"processes": 2, "max_restarts": -1}, "--max-restarts must be an integer >= 0"),
        ({"processes": 2, "devices_per_process": 0}, "--devices-per-process must be"),
        ({"processes": 2, "hang_timeout": 0}, "--hang-timeout must be > 0"),
        ({"processes": 2, "step_timeout": -1}, "--step-timeout must be > 0"),
    ],
)
def test_bad_numbers_are_one_line(kwargs, match):
    with pytest.raises(LaunchError, match=match):
        launch([PY, "-c", "pass"], **kwargs)


def test_port_in_use_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LaunchError, match=f"port {port} on 127.0.0.1 is in use"):
            launch([PY, "-c", "pass"], processes=2, port=port)


def test_cli_prints_one_line_and_exits_2(capsys):
    assert cli_main(["launch", "-n", "0", "--", PY, "train.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "-n must be an integer >= 1" in err


def test_output_is_prefixed_with_rank():
    rc, out, _, _ = run("import os; print('rank', os.environ['ADAPTJAX_PROCESS_ID'])")
    assert rc == 0
    assert sorted(out.splitlines()) == ["[0] rank 0", "[1] rank 1"]


def test_a_dead_process_stops_the_others_within_seconds():
    code = f"""
        import os, sys, threading
        if os.environ["ADAPTJAX_PROCESS_ID"] == "1":
            sys.exit(5)
        {FOREVER}
    """
    rc, _, err, _ = run(code, max_restarts=0)  # returns: process 0 was killed, not waited for
    assert rc == 5
    assert "process 1 ended (exit code 5); stopping the others" in err


def test_failures_restart_with_backoff_then_succeed(tmp_path):
    marker = tmp_path / "failed-once"
    code = f"""
        import os, sys
        if not os.path.exists({str(marker)!r}):
            open({str(marker)!r}, "w").close()
            sys.exit(3)
    """
    rc, _, err, _ = run(code, max_restarts=1, backoff=0.01)
    assert rc == 0
    assert "restart 1/1" in err and err.count("started 2 process(es)") == 2


def test_gives_up_after_max_restarts():
    rc, _, err, _ = run("import sys; sys.exit(3)", max_restarts=2, backoff=0.01)
    assert rc == 3
    assert err.count("started 2 process(es)") == 3 and "giving up after 2 restart(s)" in err


def test_rescale_exit_code_relaunches_with_the_asked_count():
    code = f"""
        import json, os, sys
        if os.environ["ADAPTJAX_NUM_PROCESSES"] == "2":
            if os.environ["ADAPTJAX_PROCESS_ID"] == "0":
                with open(os.environ["ADAPTJAX_RESCALE_FILE"], "w") as f:
                    json.dump({{"processes": 3, "devices": 3}}, f)
            sys.exit({EXIT_RESCALE})
        print(os.environ["ADAPTJAX_NUM_PROCESSES"], os.environ["ADAPTJAX_MAX_PROCESSES"])
    """
    rc, out, err, _ = run(code, max_processes=3, max_restarts=0)
    assert rc == 0
    assert sorted(out.splitlines()) == ["[0] 3 3", "[1] 3 3", "[2] 3 3"]
    assert "relaunching with 3 process(es) (was 2)" in err


def test_rescale_above_max_processes_stops_with_its_code():
    code = f"""
        import json, os, sys
        with open(os.environ["ADAPTJAX_RESCALE_FILE"], "w") as f:
            json.dump({{"processes": 8}}, f)
        sys.exit({EXIT_RESCALE})
    """
    rc, _, err, _ = run(code, max_processes=4)
    assert rc == EXIT_RESCALE and "above --max-processes 4" in err


def test_worker_that_never_reaches_initialize_times_out():
    rc, _, err, _ = run(f"import threading; {FOREVER}", start_timeout=1.0, max_restarts=0)
    assert rc == 1
    assert "process(es) [0, 1] did not reach initialize_distributed within 1 s" in err


@pytest.mark.slow
def test_worker_hung_in_a_collective_times_out(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        textwrap.dedent(
            """
            import threading
            import adaptjax
            rank, _ = adaptjax.initialize_distributed()
            from jax.experimental import multihost_utils
            if rank == 1:
                threading.Event().wait()  # never joins the collective below
            multihost_utils.sync_global_devices("never-met")
            """
        )
    )
    out, err = io.StringIO(), io.StringIO()
    rc = launch(
        [PY, str(script)],
        processes=2,
        devices_per_process=1,
        step_timeout=3.0,
        max_restarts=0,
        out=out,
        err=err,
    )
    assert rc == 1
    assert "made no step for 3 s (hung in a collective?)" in err.getvalue()


def test_rescale_request_file_is_json(tmp_path, monkeypatch):
    from adaptjax.launch._distributed import ENV_RESCALE_FILE, write_rescale_request

    path = tmp_path / "r.json"
    monkeypatch.setenv(ENV_RESCALE_FILE, str(path))
    assert write_rescale_request(4, 8) == str(path)
    assert json.loads(path.read_text())["processes"] == 4
    assert not os.path.exists(str(path) + ".tmp")


def test_sigterm_to_the_launcher_reaches_every_process(tmp_path):
    gate = Gate(tmp_path)
    code = f"""
        import os, signal, sys
        sys.path.insert(0, {TESTS!r})
        from _handshake import hold
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))  # as the controller: checkpoint, 75
        hold({gate.directory!r}, "ready", name=os.environ["ADAPTJAX_PROCESS_ID"])
    """
    out, err = io.StringIO(), io.StringIO()
    done = threading.Event()

    def preempt():
        for rank in ("0", "1"):  # each worker's handler is in place, and it cannot end first
            gate.wait_at(rank, alive=lambda: not done.is_set())
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's handler is in place meanwhile

    threading.Thread(target=preempt, daemon=True).start()
    try:
        rc = launch([PY, "-c", textwrap.dedent(code)], processes=2, out=out, err=err)
    finally:
        done.set()
    assert rc == 75, out.getvalue() + err.getvalue()
    assert "forwarding SIGTERM to every process" in err.getvalue()
    assert gate.released("0") == gate.released("1") == "SIGTERM"
