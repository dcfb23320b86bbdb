"""``adaptjax launch`` under faults, for ``benchmarks/fault_trials.py``: a second launch on a
held run directory, and a stopped worker.

The job is ``tests/distributed_job.py`` (a Controller under the launcher, 6
steps), started through the ``adaptjax`` command with 2 simulated CPU devices
per process; its ``--hold STEP --gate DIR`` stops every process at a step
until signalled (``tests/_handshake.py``), so each fault lands where it is
aimed without racing the job.

* :func:`locked_trial`: a first launch (2 processes) holds at step 3, the run
  directory locked; a second launch of the same job on it, allowed 3
  restarts, must exit with ``EXIT_LOCKED`` (73) after one start and no
  restart; then the first is let go and must finish its 6 steps alone.
* :func:`hang_trial`: a launch of one process with ``--hang-timeout T`` and no
  restart holds at step 3; its worker gets ``SIGSTOP`` there. The time from
  that signal to the launcher's "gave no sign of life" line is measured:
  between ``T`` minus one heartbeat period (``min(5, T / 4)`` s) and ``T`` plus
  the launcher's 0.1 s poll when nothing is late.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "distributed_job.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))
from _handshake import Gate  # noqa: E402

#: The launcher's exit code for a run directory held by another job (``adaptjax launch -h``).
EXIT_LOCKED = 73
STEPS = 6
HOLD_STEP = 3
WATCHDOG_S = 300


def adaptjax_command() -> str:
    """The ``adaptjax`` command of this Python's environment."""
    here = shutil.which("adaptjax", path=os.path.dirname(sys.executable))
    found = here or shutil.which("adaptjax")
    if found is None:
        raise SystemExit("the adaptjax command is not installed (pip install -e .)")
    return found


class Launch:
    """``adaptjax launch OPTIONS -- python tests/distributed_job.py ARGS`` as a subprocess;
    its stderr (the launcher's own lines) is read by a thread, each line timed."""

    def __init__(self, options: list[str], job_args: list[str]):
        command = [adaptjax_command(), "launch", *options, "--", sys.executable, JOB, *job_args]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.err: list[tuple[float, str]] = []  # (time.monotonic(), line)
        self.out: list[str] = []
        self._readers = [
            threading.Thread(target=self._read_err, daemon=True),
            threading.Thread(target=lambda: self.out.extend(self.proc.stdout), daemon=True),
        ]
        for t in self._readers:
            t.start()
        self._watchdog = threading.Timer(WATCHDOG_S, self.proc.kill)
        self._watchdog.start()

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.err.append((time.monotonic(), line))

    def finish(self) -> int:
        code = self.proc.wait()
        for t in self._readers:
            t.join()
        self._watchdog.cancel()
        return code

    def said(self) -> str:
        return "".join(line for _, line in self.err)


def locked_trial(work: str, n: int) -> dict:
    """A second launch on a run directory a held first launch locks; see the module doc."""
    run_dir = os.path.join(work, f"locked-{n}")
    gate = Gate(os.path.join(work, f"gate-locked-{n}"))
    options = ["-n", "2", "--devices-per-process", "2", "--backoff", "0.1"]
    first = Launch(options, [run_dir, str(STEPS), "--hold", str(HOLD_STEP),
                             "--gate", gate.directory])
    try:
        for rank in ("0", "1"):
            gate.wait_at(rank, alive=lambda: first.proc.poll() is None)
        second = Launch([*options, "--max-restarts", "3"], [run_dir, str(STEPS)])
        code = second.finish()
    finally:
        gate.go("0")
        gate.go("1")
    first_code = first.finish()
    said = second.said()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f if line.strip()]
    refused = (
        code == EXIT_LOCKED
        and said.count("started 2 process(es)") == 1
        and "restart" not in said.replace("not restarting", "")
        and "the run directory is in use by another job" in said
    )
    unharmed = first_code == 0 and steps == list(range(1, STEPS + 1))
    return {"code": code, "refused": refused, "first_code": first_code, "unharmed": unharmed,
            "said": said}


def hang_trial(work: str, n: int, hang_timeout: float) -> dict:
    """A worker stopped by SIGSTOP at a held step; see the module doc."""
    run_dir = os.path.join(work, f"hang-{n}")
    gate = Gate(os.path.join(work, f"gate-hang-{n}"))
    options = ["-n", "1", "--devices-per-process", "4", "--max-restarts", "0",
               "--hang-timeout", repr(hang_timeout)]
    launch = Launch(options, [run_dir, str(STEPS), "--hold", str(HOLD_STEP),
                              "--gate", gate.directory])
    _, pid = gate.wait_at("0", alive=lambda: launch.proc.poll() is None)
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    code = launch.finish()  # the launcher kills its process group, the stopped worker too
    reports = [t for t, line in launch.err if "gave no sign of life" in line]
    reported_s = reports[0] - stopped_at if reports else None
    return {"code": code, "reported_s": reported_s, "said": launch.said()}
