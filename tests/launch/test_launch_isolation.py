"""What ``adaptjax launch`` leaves open and behind: a coordinator on loopback, no orphans.

* The coordinator listens on the launcher's address (127.0.0.1) only, never on
  every interface: checked from the listening sockets of process 0 itself
  (``/proc/self/fd`` against ``/proc/net/tcp`` and ``tcp6``) in a real
  two-process launch.
* ``kill -9`` of the launcher from outside ends its workers (they would
  otherwise hang in a collective, holding the run directory): the workers hold
  at a step (``tests/_handshake.py``) when the launcher is killed, so they
  cannot have ended by themselves; the seconds from the kill to the last
  worker's exit are printed, not asserted. A new launch then resumes the run.
"""

import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from adaptjax.launch import _distributed
from adaptjax.launch._launcher import ENV_COORDINATOR_BIND, launch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
from _handshake import Gate  # noqa: E402

PY = sys.executable
JOB = os.path.join(TESTS, "distributed_job.py")
LINUX = pytest.mark.skipif(
    not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux) for sockets and processes"
)


# --------------------------------------------------------------- the coordinator's address


def _env(monkeypatch, address="127.0.0.1:1234", bind=None):
    monkeypatch.setenv(_distributed.ENV_COORDINATOR, address)
    monkeypatch.setenv(_distributed.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(_distributed.ENV_PROCESS_ID, "0")
    if bind is None:
        monkeypatch.delenv(ENV_COORDINATOR_BIND, raising=False)
    else:
        monkeypatch.setenv(ENV_COORDINATOR_BIND, bind)


def test_the_coordinator_binds_the_address_the_processes_connect_to(monkeypatch):
    _env(monkeypatch)
    arguments = _distributed._launched_arguments()
    assert arguments["coordinator_bind_address"] == arguments["coordinator_address"]
    assert arguments["coordinator_address"] == "127.0.0.1:1234"
    _env(monkeypatch, "node0.cluster:1234", bind="10.1.2.3:1234")  # a cluster's interface
    assert _distributed._launched_arguments()["coordinator_bind_address"] == "10.1.2.3:1234"


@pytest.mark.parametrize(
    ("address", "bind", "match"),
    [
        ("127.0.0.1", None, r"ADAPTJAX_COORDINATOR_ADDRESS='127.0.0.1' is not HOST:PORT; set it"),
        ("127.0.0.1:1", "0.0.0.0", r"ADAPTJAX_COORDINATOR_BIND_ADDRESS='0.0.0.0' is not HOST:PORT"),
    ],
)
def test_an_address_without_a_port_is_one_line(monkeypatch, address, bind, match):
    _env(monkeypatch, address, bind)
    with pytest.raises(ValueError, match=match) as e:
        _distributed.initialize_distributed()
    assert "\n" not in str(e.value)


def _listening(table_line: str) -> tuple[str, int]:
    """``(address, port)`` of a ``/proc/net/tcp{,6}`` local-address field (hex, host order)."""
    hex_address, hex_port = table_line.split(":")
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # 32-bit words
    if len(words) == 4:
        return ".".join(map(str, words)), int(hex_port, 16)
    import ipaddress

    address = ipaddress.IPv6Address(words)
    return str(address.ipv4_mapped or address), int(hex_port, 16)  # ::ffff:a.b.c.d as a.b.c.d


PROCESS_0_LISTENS = """
    import os, adaptjax
    rank, _ = adaptjax.initialize_distributed()
    if rank == 0:  # the sockets this process listens on, from the kernel's tables
        mine = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                mine.add(target[8:-1])
        for table in ("tcp", "tcp6"):
            with open(f"/proc/net/{table}") as f:
                for line in f.readlines()[1:]:
                    field = line.split()
                    if field[3] == "0A" and field[9] in mine:  # 0A: LISTEN
                        print("LISTEN", table, field[1], flush=True)
    print("COORDINATOR", os.environ["ADAPTJAX_COORDINATOR_ADDRESS"], flush=True)
"""


@LINUX
@pytest.mark.slow
def test_the_coordinator_listens_on_loopback_only(monkeypatch):
    monkeypatch.setenv(ENV_COORDINATOR_BIND, "0.0.0.0:1")  # inherited: the launcher overrides it
    out, err = io.StringIO(), io.StringIO()
    command = [PY, "-c", textwrap.dedent(PROCESS_0_LISTENS)]
    assert launch(command, processes=2, devices_per_process=1, out=out, err=err) == 0, (
        out.getvalue() + err.getvalue()
    )
    lines = [line.split()[1:] for line in out.getvalue().splitlines()]
    (port,) = {int(w[1].rsplit(":", 1)[1]) for w in lines if w[0] == "COORDINATOR"}
    on_port = [(w[1], *_listening(w[2])) for w in lines if w[0] == "LISTEN"]
    on_port = [(table, address) for table, address, p in on_port if p == port]
    print(f"process 0 listens on port {port} at {on_port}")
    assert on_port, out.getvalue()  # the check sees the coordinator's socket...
    # ... and it is on loopback only (gRPC listens on an IPv6 socket, v4-mapped)
    assert {address for _, address in on_port} == {"127.0.0.1"}, on_port


# ------------------------------------------------------------------ kill -9 of the launcher


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie nobody reaped yet counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def _kill9_launcher(args, gate, ranks, ready=lambda: True):
    """Starts ``adaptjax launch ARGS``, waits until every rank holds and ``ready()``, kills the
    launcher with SIGKILL; returns the seconds until the last worker exited (bounded: a
    failure at 120 s)."""
    launcher = subprocess.Popen(
        [PY, "-m", "adaptjax.cli._main", "launch", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        alive = lambda: launcher.poll() is None  # noqa: E731
        workers = [gate.wait_at(str(rank), alive=alive)[1] for rank in ranks]
        deadline = time.monotonic() + 300
        while not ready():
            assert time.monotonic() < deadline and alive(), "never ready to be killed"
            time.sleep(0.01)
        assert not any(map(_gone, workers))
        t0 = time.monotonic()
        launcher.kill()
        while not all(map(_gone, workers)):
            assert time.monotonic() - t0 < 120, f"workers {workers} outlived the launcher"
            time.sleep(0.005)
        return time.monotonic() - t0
    finally:
        launcher.kill()
        launcher.wait()


@LINUX
def test_kill9_of_the_launcher_ends_its_workers(tmp_path):
    gate = Gate(tmp_path)
    code = f"""
        import os, sys
        sys.path.insert(0, {TESTS!r})
        from _handshake import hold
        hold({gate.directory!r}, "started", name=os.environ["ADAPTJAX_PROCESS_ID"])
    """
    seconds = _kill9_launcher(["-n", "2", "--", PY, "-c", textwrap.dedent(code)], gate, [0, 1])
    print(f"kill -9 of the launcher -> last worker gone: {seconds:.3f} s")
    assert gate.released("0") is None and gate.released("1") is None  # killed while holding


@LINUX
@pytest.mark.slow
def test_kill9_of_the_launcher_mid_run_then_a_relaunch_resumes(tmp_path):
    run_dir, gate = tmp_path / "run", Gate(tmp_path / "gate")
    job = [PY, JOB, str(run_dir), "12", "--checkpoint-every", "5"]
    args = ["-n", "2", "--devices-per-process", "2", "--", *job]
    committed = lambda: os.path.isdir(run_dir / "checkpoints" / "5")  # noqa: E731 (Orbax renames)
    seconds = _kill9_launcher(
        [*args, "--hold", "7", "--gate", gate.directory], gate, [0, 1], ready=committed
    )
    print(f"kill -9 of the launcher mid-run -> last worker gone: {seconds:.3f} s")
    # The workers held the run directory's lock; a new launch gets it and resumes from 5.
    out, err = io.StringIO(), io.StringIO()
    rc = launch(job, processes=2, devices_per_process=2, out=out, err=err, max_restarts=0)
    assert rc == 0, out.getvalue()[-3000:] + err.getvalue()
    resumed = [line for line in out.getvalue().splitlines() if "RESUMED" in line]
    assert resumed == ["[0] RESUMED 5"], out.getvalue()[-3000:]
    assert "DONE" in out.getvalue()


def test_the_reaper_kills_its_group_at_end_of_file_and_ignores_sigterm(tmp_path):
    reaper = os.path.join(os.path.dirname(_distributed.__file__), "_reaper.py")
    proc = subprocess.Popen(
        [PY, "-I", "-S", reaper], stdin=subprocess.PIPE, stdout=subprocess.PIPE, process_group=0
    )
    assert proc.stdout.read(1) == b"R"  # ready: it ignores SIGTERM now
    member = subprocess.Popen(
        [PY, "-c", "import threading; threading.Event().wait()"], process_group=proc.pid
    )
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher forwards SIGTERM to the group
        assert member.wait() == -signal.SIGTERM
        proc.stdin.close()  # the launcher is gone
        assert proc.wait() == -signal.SIGKILL
    finally:
        member.kill()
        proc.kill()
