"""A handshake through a directory: a job stops at a point until the test has signalled it.

A fault test that signals a job "at step N" must not race the job: read from
the job's output alone, "step N" may already be long past (the job may even
have finished) by the time the signal is sent. Here the job stops at the
point instead, and only the test lets it go on:

* the job calls :func:`hold` (e.g. from the Controller's ``on_step`` hook). It
  first installs handlers for the signals it may get, then writes
  ``at-NAME`` (``label`` and its pid) and waits until either one of those
  signals has been handled or the test wrote ``go-NAME``. It writes
  ``released-NAME`` (the signal's name, or ``go``) and returns.
* the test calls :meth:`Gate.wait_at` (returns the label once ``at-NAME``
  exists; raises if the job ended first), sends its signal, and calls
  :meth:`Gate.go`.

So the job cannot pass the point, let alone exit, before the signal was sent,
and the signal lands inside :func:`hold`: ``SIGKILL`` ends the job there;
``SIGINT``'s and ``SIGTERM``'s handlers (the ones in place when ``hold`` was
called: Python's ``KeyboardInterrupt``, the Controller's preemption flag) run
while the job waits, and ``hold`` returns only after they ran (or raises what
they raise), since it returns on the handled signal, not on ``go``. No sleep
synchronises anything; the polling below only waits for a file to appear.
``NAME`` tells the processes of one job apart (its rank).
"""

from __future__ import annotations

import os
import signal
import time

POLL_S = 0.01
#: A bound on any one wait, so a broken job fails the test instead of hanging it.
WAIT_S = 300.0


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # the reader sees all of it or nothing


def hold(directory, label: str, *, name: str = "0", signals=(signal.SIGINT, signal.SIGTERM)):
    """Job side: waits here until one of ``signals`` was handled or the test says go.

    Returns what released it: a signal's name (``"SIGTERM"``) or ``"go"``. A
    handler that raises (``KeyboardInterrupt`` for SIGINT) raises out of here.
    Only the main thread can install handlers, so call it from there.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    go = os.path.join(directory, f"go-{name}")
    if os.path.exists(go):  # left by an earlier hold: not an answer to this one
        os.remove(go)
    got: list[str] = []
    previous = {}

    def handler(signum, frame):
        got.append(signal.Signals(signum).name)
        before = previous[signum]
        if callable(before):
            before(signum, frame)  # may raise (KeyboardInterrupt)
        elif before == signal.SIG_DFL:  # the default action (die): restore it, resend
            signal.signal(signum, before)
            os.kill(os.getpid(), signum)

    for sig in signals:
        before = signal.signal(sig, handler)
        previous[sig] = signal.SIG_DFL if before is None else before  # None: set outside Python
    released = "go"
    try:
        _write(os.path.join(directory, f"at-{name}"), f"{label}\n{os.getpid()}\n")
        while not got and not os.path.exists(go):
            time.sleep(POLL_S)
        released = got[0] if got else "go"
    except BaseException:
        released = got[0] if got else "error"
        raise
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)
        _write(os.path.join(directory, f"released-{name}"), released + "\n")
    return released


class Gate:
    """Test side of :func:`hold` for one directory (make a fresh one for each job)."""

    def __init__(self, directory):
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)

    def _path(self, kind: str, name: str) -> str:
        return os.path.join(self.directory, f"{kind}-{name}")

    def wait_at(self, name: str = "0", *, alive=lambda: True, timeout: float = WAIT_S):
        """Waits until job ``name`` holds; returns ``(label, pid)``.

        ``alive()`` says whether the job still runs (e.g. ``lambda: proc.poll()
        is None``): an AssertionError as soon as it does not, or after ``timeout``.
        """
        path = self._path("at", name)
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if not alive():
                if os.path.exists(path):  # it held, then was ended (e.g. by another signal)
                    break
                raise AssertionError(f"the job ended before it held ({path})")
            if time.monotonic() > deadline:
                raise AssertionError(f"the job did not hold within {timeout:.0f} s ({path})")
            time.sleep(POLL_S)
        with open(path) as f:
            label, pid = f.read().splitlines()
        return label, int(pid)

    def held(self, name: str = "0") -> bool:
        """Whether job ``name`` reached its hold (it may have been released since)."""
        return os.path.exists(self._path("at", name))

    def go(self, name: str = "0") -> None:
        """Lets job ``name`` go on (call it after the signal, if the job should go on)."""
        _write(self._path("go", name), "go\n")

    def released(self, name: str = "0") -> str | None:
        """What released job ``name``'s hold (``"SIGTERM"``, ``"go"``...), or None (not yet)."""
        try:
            with open(self._path("released", name)) as f:
                return f.read().strip()
        except FileNotFoundError:
            return None
