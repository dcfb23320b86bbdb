"""A controller's run directory: its lock, its logs and its checkpoints, kept consistent."""

from __future__ import annotations

import errno
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax

from adaptjax.controller._checkpoint import (
    CorruptCheckpointError,
    RunCheckpoints,
    deferred_interrupts,
    unfinished_saves,
)
from adaptjax.controller._run_lock import (
    RunDirectoryError,
    RunDirectoryLocked,
    RunLock,
    as_run_dir_error,
    free_space,
    human_bytes,
    run_dir_error,
)
from adaptjax.controller._run_log import (
    NullRunLog,
    RunLog,
    step_ranges,
    truncate_run_logs,
)
from adaptjax.launch._distributed import barrier, broadcast_json, is_primary

CHECKPOINTS = "checkpoints"
QUARANTINE = "quarantine"
#: What a run writes inside its directory: the directories, then the files.
WRITTEN_DIRS = (CHECKPOINTS, QUARANTINE, "tensorboard")
WRITTEN_FILES = ("metrics.jsonl", "events.jsonl", ".adaptjax.lock")


def check_writable_dir(path: str) -> None:
    """One-line :class:`RunDirectoryError` unless ``path`` is, or can be created as, a
    writable directory (its ``filename``: the path that is not; ``errno``: why)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise _not_writable(
            probe, write_errno(probe, is_dir=True),
            f"run_dir {path} is not writable ({probe} is not a writable directory); "
            "choose a run_dir you can write to",
        )


def check_writable_run_dir(path: str) -> None:
    """One-line :class:`RunDirectoryError` unless the run can write everything it will write
    in ``path``.

    ``path`` itself (or the parent it is created in), and those of
    :data:`WRITTEN_DIRS` and :data:`WRITTEN_FILES` that exist already. Writes nothing.
    """
    check_writable_dir(path)
    for name in WRITTEN_DIRS + WRITTEN_FILES:
        where = os.path.join(path, name)
        is_dir = name in WRITTEN_DIRS
        if not os.path.lexists(where):
            continue
        if (os.path.isdir(where) or not is_dir) and os.access(
            where, os.W_OK | (os.X_OK if is_dir else 0)
        ):
            continue
        code = write_errno(where, is_dir=is_dir)
        why = "a file, not a directory" if code == errno.ENOTDIR else os.strerror(code).lower()
        raise _not_writable(
            where, code, f"{where} is not writable ({why}); make it writable or choose another "
            "run_dir",
        )


def write_errno(path: str, *, is_dir: bool) -> int:
    """Why ``path`` (that exists) cannot be written: ``ENOTDIR`` (a directory was needed),
    ``EROFS`` (a read-only file system) or ``EACCES``."""
    if is_dir and not os.path.isdir(path):
        return errno.ENOTDIR
    return errno.EROFS if read_only_fs(path) else errno.EACCES


def _not_writable(path: str, code: int, message: str) -> RunDirectoryError:
    error = RunDirectoryError(message)
    error.errno, error.filename = code, path
    return error


def check_resumable(run_dir: str) -> None:
    """One-line ``ValueError`` unless ``run_dir/checkpoints`` holds a step to resume from.

    A resume it refuses leaves nothing behind: process 0 first removes the
    temporary directories of saves that never completed (a run killed before
    its first checkpoint was committed), unless a live owner holds ``run_dir``
    (they may be its save in flight).
    """
    where = os.path.join(run_dir, CHECKPOINTS)
    if os.path.isdir(where) and any(n.isdigit() for n in os.listdir(where)):
        return
    gone = discard_unfinished_saves(run_dir) if is_primary() else []
    removed = ""
    if gone:
        names = ", ".join(os.path.basename(p) for p in gone)
        removed = f" (removed the unfinished save{'s' if len(gone) > 1 else ''} {names})"
    raise ValueError(
        f"no complete checkpoint in {where} to resume from{removed}; start a new run with "
        "Controller(...) instead"
    )


def discard_unfinished_saves(run_dir: str) -> list[str]:
    """Removes ``run_dir``'s unfinished saves (:func:`unfinished_saves`) unless a live owner
    holds it; returns the paths removed. The lock is taken meanwhile."""
    where = os.path.join(run_dir, CHECKPOINTS)
    if not unfinished_saves(where):
        return []
    try:
        lock = RunLock(run_dir)
    except RunDirectoryLocked:
        return []
    try:
        gone = unfinished_saves(where)
        for path in gone:
            shutil.rmtree(path, ignore_errors=True)
    finally:
        lock.release()
    return gone


def read_only_fs(path: str) -> bool:
    """Whether ``path`` lies on a file system mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def free_bytes(path: str) -> int:
    """Bytes free for a checkpoint under ``path`` (a module function: tests replace it)."""
    return free_space(path)


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
      >>> rd.open_log(tensorboard=None)
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
        self._told = False  # a RunDirectoryError has been raised: close() does not repeat it
        self._sizes: dict[int, int] = {}  # bytes on disk of checkpoints, by step

    def open_log(self, *, tensorboard: int | None, resume_from: int | None = None) -> None:
        """Opens the logs (``tensorboard``: write its scalars every this many steps, ``None``:
        not at all); on resume first drops the rows of steps after ``resume_from``.

        Damaged lines are dropped too; on a resume (``resume_from > 0``) one
        warning per file says how many, and one says which steps up to
        ``resume_from`` have no metrics row (a log truncated or deleted by hand).
        """
        if not self.primary:
            self.log = NullRunLog()
            return
        purge = None
        if resume_from is not None:
            repair = truncate_run_logs(self.path, resume_from)
            if resume_from > 0:
                _warn_repair(repair, resume_from)
            purge = resume_from + 1  # TensorBoard hides the points of recomputed steps
        self.log = RunLog(self.path, tensorboard=tensorboard is not None, purge_step=purge,
                          tensorboard_every=tensorboard or 1)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (after the save in flight: a failed one raises)."""
        self.confirm(block=True)
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

        A checkpoint that cannot be written (no room for it, a read-only or
        unwritable directory) raises a one-line :class:`RunDirectoryError` here,
        before it starts. Ctrl-C is held back until the save has started whole.
        """
        events = [{"kind": "checkpoint", **e} if "kind" not in e else dict(e) for e in on_complete]
        t0 = time.perf_counter()
        with deferred_interrupts():
            # An earlier save completes before this one starts: its events go first, so every
            # checkpoint on disk older than this one has its events in the log.
            self.confirm(block=True)
            self._tell_on(self._open_log().sync)
            self._check_room(step, state)
            try:
                self.checkpoints.save(step, state, {**meta, "on_complete": events}, wait=False)
            except Exception as e:
                self._raise_failed(step, e)
            done = time.perf_counter()
            logged = []
            for e in events:
                start = t0 if e["kind"] == "checkpoint" else since
                if start is not None and "latency_s" not in e:
                    logged.append({**e, "latency_s": done - start})
                else:
                    logged.append(e)
            self._unconfirmed.append((step, logged))

    def _check_room(self, step: int, state) -> None:
        """Raises a :class:`RunDirectoryError` now if checkpoint ``step`` cannot be written.

        Its directory must be writable, and the disk must hold it: a checkpoint
        takes about what the newest one took (or the state's bytes, for the
        first), and the space of those ``max_to_keep`` deletes first is counted
        as free. Across processes process 0 decides for all.
        """
        problem = None  # [path, errno, detail] of run_dir_error
        latest = self.checkpoints.latest_step()  # (collectives across processes: every one asks)
        dropped = self.checkpoints.dropped_by_next_save()
        if self.primary:
            where = os.path.join(self.checkpoints.directory, str(step))
            probe = self.checkpoints.directory
            while not os.path.exists(probe) and os.path.dirname(probe) != probe:
                probe = os.path.dirname(probe)
            if not os.access(probe, os.W_OK | os.X_OK):
                problem = [where, write_errno(probe, is_dir=True), ""]
            else:
                need = max(_nbytes(state), 0 if latest is None else self._size(latest))
                free = free_bytes(probe) + sum(self._size(s) for s in dropped)
                if free < need:
                    detail = (f"{human_bytes(free)} free, a checkpoint takes about "
                              f"{human_bytes(need)}")
                    problem = [where, errno.ENOSPC, detail]
        if jax.process_count() > 1:
            problem = broadcast_json(problem)
        if problem is not None:
            self._told = True
            raise run_dir_error(*problem)

    def _size(self, step: int) -> int:
        if step not in self._sizes:
            self._sizes[step] = self.checkpoints.bytes_on_disk(step)
        return self._sizes[step]

    def _raise_failed(self, step: int, error: Exception) -> None:
        """Raises ``error`` of the save of ``step``: as a :class:`RunDirectoryError` when the
        operating system's (a full disk...), else as it is."""
        converted = as_run_dir_error(os.path.join(self.checkpoints.directory, str(step)), error)
        if converted is None:
            raise error
        self._told = True
        raise converted from error

    def _tell_on(self, write: Callable[[], None]) -> None:
        """Runs ``write`` (of a log); a :class:`RunDirectoryError` from it is told once."""
        try:
            write()
        except RunDirectoryError:
            self._told = True
            raise

    def confirm(self, *, block: bool) -> None:
        """Logs the events of saves that have completed (``block``: wait for them first).

        A save that failed (a full disk, ...) raises a one-line
        :class:`RunDirectoryError` naming its step here, the first time it is
        known: at the first call after it ended, or when ``block`` waits for it.
        """
        if not self.primary:  # nothing to log; and no collective here (calls may differ)
            self._unconfirmed.clear()
            return
        if not self._unconfirmed or (not block and self.checkpoints.is_saving()):
            return
        error = None
        try:
            self.checkpoints.wait()  # this process's part; the commit is process 0's, i.e. ours
        except Exception as e:  # noqa: BLE001 - raised below, once the completed ones are logged
            error = e
        where = self.checkpoints.directory
        on_disk = [os.path.isdir(os.path.join(where, str(s))) for s, _ in self._unconfirmed]
        done = [save for save, ok in zip(self._unconfirmed, on_disk, strict=True) if ok]
        failed = [s for (s, _), ok in zip(self._unconfirmed, on_disk, strict=True) if not ok]
        last = failed[-1] if failed else self._unconfirmed[-1][0]
        self._unconfirmed.clear()
        self._tell_on(lambda: self._log_completed(done))
        if error is not None:
            self._raise_failed(last, error)

    def _open_log(self) -> RunLog | NullRunLog:
        assert self.log is not None, "open_log() comes before anything is logged"
        return self.log

    def _log_completed(self, saves: list[tuple[int, list[dict]]]) -> None:
        log = self._open_log()
        for step, events in saves:
            for e in events:
                log.event(e["kind"], step=step, **{k: v for k, v in e.items() if k != "kind"})

    def recover_events(self, step: int, meta: Mapping[str, Any]) -> None:
        """Writes the completion events of checkpoint ``step`` that a kill kept from the log."""
        log = self._open_log()
        for e in meta.get("on_complete", []):
            if not log.has_event(e["kind"], step):
                fields = {k: v for k, v in e.items() if k not in ("kind", "latency_s")}
                log.event(e["kind"], step=step, recovered=True, **fields)

    def restore_newest_intact(self, load: Callable[[int], Any]) -> tuple[int, Any, list[dict]]:
        """Calls ``load(step)`` on checkpoints newest first until one verifies.

        Returns ``(step, load(step), skipped)``; ``skipped`` lists ``{"step",
        "reason", "moved_to"}`` for each checkpoint that failed, each of them
        moved to ``run_dir/quarantine/``. Entries named like a step that are not
        complete checkpoints (:meth:`RunCheckpoints.strays`) are moved there
        first, so that the run can write their steps. Raises a one-line
        ``ValueError`` when no checkpoint is intact.
        """
        strays = self.checkpoints.strays() if self.primary else {}
        if jax.process_count() > 1:
            strays = broadcast_json(strays)
        skipped = [
            self._quarantine(name, f"{os.path.join(self.checkpoints.directory, name)} is {why}")
            for name, why in strays.items()
        ]
        for step in reversed(self.checkpoints.all_steps()):
            try:
                return step, load(step), skipped
            except CorruptCheckpointError as e:
                skipped.append(self._quarantine(str(step), str(e)))
        where = os.path.join(self.path, CHECKPOINTS)
        if skipped:
            raise ValueError(
                f"no intact checkpoint in {where}: {len(skipped)} failed verification and were "
                f"moved to {os.path.join(self.path, QUARANTINE)}; start a new run"
            )
        raise ValueError(f"no complete checkpoint in {where} to resume from")

    def _quarantine(self, name: str, reason: str) -> dict:
        """Moves checkpoint ``name`` to ``quarantine/``, warns, returns its ``skipped`` entry."""
        into = os.path.join(self.path, QUARANTINE)
        if self.primary:
            moved = self.checkpoints.quarantine(name, into)
        barrier(f"adaptjax-quarantine-{name}")
        if not self.primary:
            self.checkpoints.reload()
            moved = os.path.join(into, name)
        warnings.warn(
            f"skipped checkpoint {name}: {reason} (moved to {moved})",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        return {"step": int(name), "reason": reason, "moved_to": moved}

    def close(self) -> None:
        """Finishes or discards the in-flight checkpoint, syncs the logs, releases the lock.

        Safe to call after an exception or Ctrl-C: a save that cannot complete is
        discarded (its temporary directory removed) and never logged. Every step
        runs whatever the others do; then a :class:`RunDirectoryError` nobody
        was told of yet (a save or a log write that failed just now) is raised,
        once. Other errors of a failed save are not raised here (as before).
        """
        if not self._open:
            return
        self._open = False
        told = self._told or getattr(self.log, "failed", False)
        errors: list[BaseException] = []

        def attempt(step: Callable[[], Any]) -> None:
            try:
                step()
            except BaseException as e:  # noqa: BLE001 - every step of closing runs (Ctrl-C too)
                errors.append(e)

        try:
            if self.log is not None:
                attempt(lambda: self.confirm(block=True))
                attempt(self.log.close)
            else:
                attempt(self.checkpoints.wait)
            if self.primary:
                attempt(self.checkpoints.discard_incomplete)
            attempt(self.checkpoints.close)
        finally:
            if self.lock is not None:
                self.lock.release()
        interrupted = [e for e in errors if not isinstance(e, Exception)]
        if interrupted:  # Ctrl-C while closing: closed all the same, then raised
            raise interrupted[0]
        untold = [e for e in errors if isinstance(e, RunDirectoryError)]
        if untold and not told:
            self._told = True
            raise untold[0]


def _nbytes(tree) -> int:
    """The bytes of the arrays in ``tree`` (their global values)."""
    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree)))


def _warn_repair(repair, step: int) -> None:
    """One warning per damaged log file; metrics rows missing up to ``step`` are said in the
    metrics file's warning, or in one of their own."""
    missing, n = repair.missing_steps, len(repair.missing_steps)
    lacks = (
        f"the rows of {n} step{'s' if n > 1 else ''} up to the checkpoint's step {step} "
        f"({step_ranges(missing)}): they were lost before this resume and are not recomputed"
    )
    said = []
    for path, count in repair.damaged.items():
        text = (f"resume: dropped {count} damaged line{'s' if count > 1 else ''} of {path} "
                "(not whole UTF-8 JSON rows)")
        if missing and os.path.basename(path) == "metrics.jsonl":
            text += f"; it lacks {lacks}"
            said.append(path)
        warnings.warn(text, UserWarning, stacklevel=user_stacklevel())
    if missing and not said:
        warnings.warn(f"resume: metrics.jsonl lacks {lacks}", UserWarning,
                      stacklevel=user_stacklevel())


def user_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel of the first caller outside adaptjax (for the caller)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("adaptjax"):
        frame, level = frame.f_back, level + 1
    return level


def elapsed(t0: float) -> float:
    """Seconds since ``t0`` (a ``time.perf_counter()`` reading)."""
    return time.perf_counter() - t0
