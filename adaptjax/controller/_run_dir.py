"""A controller's run directory: its lock, its logs and its checkpoints, kept consistent."""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from adaptjax.controller._checkpoint import CorruptCheckpointError, RunCheckpoints
from adaptjax.controller._run_lock import RunLock
from adaptjax.controller._run_log import NullRunLog, RunLog, truncate_run_logs
from adaptjax.launch._distributed import barrier, is_primary

CHECKPOINTS = "checkpoints"
QUARANTINE = "quarantine"


def check_writable_dir(path: str) -> None:
    """One-line ``ValueError`` unless ``path`` is, or can be created as, a writable directory."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(
            f"run_dir {path} is not writable ({probe} is not a writable directory); "
            "choose a run_dir you can write to"
        )


class RunDirectory:
    """Owns ``run_dir``: an exclusive lock, ``metrics.jsonl``/``events.jsonl`` and checkpoints.

    The promises it keeps:

    * **One owner.** The lock is taken before anything is written; a second
      owner gets a one-line error naming the holder's pid.
    * **Logs as durable as checkpoints.** Both log files are flushed and
      fsynced before every checkpoint is started, so a checkpoint of step *s*
      never exists without every row up to *s*; a resume drops the rows after
      the checkpoint it continues from, so every step and event is logged
      exactly once.
    * **Only completed checkpoints are logged.** A ``checkpoint`` event (and
      any event given to :meth:`save` as ``on_complete``) is written once the
      save is complete on disk; such events also travel inside the
      checkpoint, and a resume writes any that a kill kept from the log.
    * **Across processes, one writer.** In a multi-process job process 0
      holds the lock and writes the logs; the other processes write no log
      file (their :attr:`log` keeps events in memory) and take part in every
      checkpoint save and restore, as Orbax needs.
    * **A damaged checkpoint is never trusted.** :meth:`restore_newest_intact`
      tries checkpoints newest first, moves each one that fails verification to
      ``run_dir/quarantine/`` (kept, never deleted) and says why.

    Args:
      run_dir: the directory (created if missing).
      max_to_keep: checkpoints kept on disk.

    Example:
      >>> import tempfile
      >>> from adaptjax.controller._run_dir import RunDirectory
      >>> rd = RunDirectory(tempfile.mkdtemp() + "/run", max_to_keep=2)
      >>> rd.open_log(tensorboard=False)
      >>> rd.log.metrics(1, {"loss": 0.5})
      >>> rd.latest_step() is None
      True
      >>> rd.close()
    """

    def __init__(self, run_dir: str | os.PathLike, *, max_to_keep: int | None = 3):
        self.path = os.fspath(run_dir)
        self.primary = is_primary()
        os.makedirs(self.path, exist_ok=True)
        self.lock = RunLock(self.path) if self.primary else None
        self._open = True
        self.checkpoints = RunCheckpoints(
            os.path.join(self.path, CHECKPOINTS), max_to_keep=max_to_keep
        )
        self.log: RunLog | NullRunLog | None = None
        self._unconfirmed: list[tuple[int, list[dict]]] = []

    def open_log(self, *, tensorboard: bool, resume_from: int | None = None) -> None:
        """Opens the logs; on resume first drops the rows of steps after ``resume_from``."""
        if not self.primary:
            self.log = NullRunLog()
            return
        purge = None
        if resume_from is not None:
            truncate_run_logs(self.path, resume_from)
            purge = resume_from + 1  # TensorBoard hides the points of recomputed steps
        self.log = RunLog(self.path, tensorboard=tensorboard, purge_step=purge)

    def latest_step(self) -> int | None:
        return self.checkpoints.latest_step()

    def save(self, step: int, state, meta: Mapping[str, Any], on_complete: list[dict], *,
             since: float | None = None) -> None:
        """Starts an asynchronous checkpoint of ``step``; ``on_complete`` events follow it.

        Every log row written so far is on disk before the checkpoint starts.
        The events are copied here, travel inside the checkpoint as given (an
        event without ``kind`` is a ``checkpoint`` event) and are logged once it
        is complete, each with a ``latency_s`` unless it has one: for the
        ``checkpoint`` event the seconds this call waited (the write goes on in
        the background), for the others the seconds from ``since`` (a
        ``time.perf_counter()`` reading: when their transition began) to the end
        of this call.
        """
        events = [{"kind": "checkpoint", **e} if "kind" not in e else dict(e) for e in on_complete]
        t0 = time.perf_counter()
        # An earlier save completes before this one starts: its events go first, so every
        # checkpoint on disk older than this one has its events in the log.
        self.confirm(block=True)
        self.log.sync()
        self.checkpoints.save(step, state, {**meta, "on_complete": events}, wait=False)
        done = time.perf_counter()
        logged = []
        for e in events:
            start = t0 if e["kind"] == "checkpoint" else since
            timed = start is not None and "latency_s" not in e
            logged.append({**e, "latency_s": done - start} if timed else e)
        self._unconfirmed.append((step, logged))

    def confirm(self, *, block: bool) -> None:
        """Logs the events of saves that have completed (``block``: wait for them first)."""
        if not self.primary:  # nothing to log; and no collective here (calls may differ)
            self._unconfirmed.clear()
            return
        if not self._unconfirmed or (not block and self.checkpoints.is_saving()):
            return
        self.checkpoints.wait()  # this process's part; the commit is process 0's, i.e. ours
        where = self.checkpoints.directory
        for step, events in self._unconfirmed:
            if os.path.isdir(os.path.join(where, str(step))):
                for e in events:
                    fields = {k: v for k, v in e.items() if k != "kind"}
                    self.log.event(e["kind"], step=step, **fields)
        self._unconfirmed.clear()

    def recover_events(self, step: int, meta: Mapping[str, Any]) -> None:
        """Writes the completion events of checkpoint ``step`` that a kill kept from the log."""
        for e in meta.get("on_complete", []):
            if not self.log.has_event(e["kind"], step):
                fields = {k: v for k, v in e.items() if k not in ("kind", "latency_s")}
                self.log.event(e["kind"], step=step, recovered=True, **fields)

    def restore_newest_intact(self, load: Callable[[int], Any]) -> tuple[int, Any, list[dict]]:
        """Calls ``load(step)`` on checkpoints newest first until one verifies.

        Returns ``(step, load(step), skipped)``; ``skipped`` lists ``{"step",
        "reason", "moved_to"}`` for each checkpoint that failed, each of them
        moved to ``run_dir/quarantine/``. Raises a one-line ``ValueError`` when
        no checkpoint is intact.
        """
        skipped: list[dict] = []
        for step in reversed(self.checkpoints.all_steps()):
            try:
                return step, load(step), skipped
            except CorruptCheckpointError as e:
                into = os.path.join(self.path, QUARANTINE)
                if self.primary:
                    moved = self.checkpoints.quarantine(step, into)
                barrier(f"adaptjax-quarantine-{step}")
                if not self.primary:
                    self.checkpoints.reload()
                    moved = os.path.join(into, str(step))
                skipped.append({"step": step, "reason": str(e), "moved_to": moved})
                warnings.warn(
                    f"skipped checkpoint {step}: {e} (moved to {moved})",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
        where = os.path.join(self.path, CHECKPOINTS)
        if skipped:
            raise ValueError(
                f"no intact checkpoint in {where}: {len(skipped)} failed verification and were "
                f"moved to {os.path.join(self.path, QUARANTINE)}; start a new run"
            )
        raise ValueError(f"no complete checkpoint in {where} to resume from")

    def close(self) -> None:
        """Finishes or discards the in-flight checkpoint, syncs the logs, releases the lock.

        Safe to call after an exception or Ctrl-C: a save that cannot complete is
        discarded (its temporary directory removed) and never logged.
        """
        if not self._open:
            return
        self._open = False
        try:
            try:
                self.checkpoints.wait()
            except BaseException:  # noqa: BLE001 - a failed save is discarded below
                pass
            if self.log is not None:
                self.confirm(block=True)
                self.log.close()
            if self.primary:
                self.checkpoints.discard_incomplete()
            self.checkpoints.close()
        finally:
            if self.lock is not None:
                self.lock.release()


def user_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel of the first caller outside adaptjax (for the caller)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("adaptjax"):
        frame, level = frame.f_back, level + 1
    return level


def elapsed(t0: float) -> float:
    """Seconds since ``t0`` (a ``time.perf_counter()`` reading)."""
    return time.perf_counter() - t0
