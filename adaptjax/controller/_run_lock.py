"""One owner per run directory (an advisory lock that names its holder), and the errors
that say a run directory cannot be used."""

from __future__ import annotations

import errno
import os
import re
import shutil
import time

#: How long a contender waits for a holder that has the lock but has not written its pid.
PID_WAIT_S = 2.0


class RunDirectoryLocked(ValueError):
    """Another controller (another process, or an unclosed one in this process) owns the run dir.

    Example:
      >>> import adaptjax
      >>> issubclass(adaptjax.RunDirectoryLocked, ValueError)
      True
    """


class RunLock:
    """An exclusive advisory lock (``flock``) on ``RUN_DIR/.adaptjax.lock``.

    The lock file holds the owner's pid. The operating system releases the
    lock when the owner exits, however it exits (``kill -9`` included), so a
    stale lock never blocks a resume. A second owner gets a one-line
    :class:`RunDirectoryLocked` naming the holder's pid.

    Args:
      run_dir: an existing directory.

    Example:
      >>> import tempfile
      >>> from adaptjax.controller._run_lock import RunLock
      >>> d = tempfile.mkdtemp()
      >>> lock = RunLock(d)
      >>> RunLock(d)
      Traceback (most recent call last):
      ...
      adaptjax...RunDirectoryLocked: run_dir ... is in use by another controller ...
      >>> lock.release()
      >>> RunLock(d).release()
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.path = os.path.join(os.fspath(run_dir), ".adaptjax.lock")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        _lock_or_raise(fd, self.path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    @staticmethod
    def check_free(run_dir: str | os.PathLike) -> None:
        """Raises :class:`RunDirectoryLocked` if a live owner holds ``run_dir``.

        Changes nothing on disk (no lock file is created), so a caller can ask
        before any other check and report the owner first.
        """
        import fcntl  # POSIX only: imported where a lock is taken, not with adaptjax

        path = os.path.join(os.fspath(run_dir), ".adaptjax.lock")
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        _lock_or_raise(fd, path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        """Releases the lock (idempotent)."""
        if self._fd is not None:
            import fcntl  # POSIX only (see check_free)

            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _lock_or_raise(fd: int, path: str) -> None:
    """Takes ``flock(fd)`` exclusively or closes ``fd`` and raises naming the holder."""
    import fcntl  # POSIX only (see RunLock.check_free)

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _holder(fd)
        os.close(fd)
        where = (
            "this process: close() the other Controller first"
            if holder == str(os.getpid())
            else "wait for it to finish, stop it, or choose another run_dir"
        )
        raise RunDirectoryLocked(
            f"run_dir {os.path.dirname(path)} is in use by another controller "
            f"(pid {holder}); {where}"
        ) from None


def _holder(fd: int) -> str:
    """The pid in a held lock's file, read again while its holder is still writing it.

    The holder writes its pid just after taking the lock, so a read in between
    sees an empty file: it is read again every 10 ms, for up to
    :data:`PID_WAIT_S`, before the pid is called unknown.
    """
    deadline = time.monotonic() + PID_WAIT_S
    while True:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
        if holder or time.monotonic() > deadline:
            return holder or "unknown"
        time.sleep(0.01)


class RunDirectoryError(OSError):
    """The run directory cannot be written: a full disk, a read-only or unwritable path.

    Its message is one line naming the path, the cause and what to do, e.g.
    ``cannot write RUN/checkpoints/120: no space left on device (1.2 MiB free on
    RUN/checkpoints, a checkpoint takes about 3.4 MiB); free some space or point
    run_dir elsewhere, then resume: the run continues from its last checkpoint``.
    Nothing already on disk is lost: the run resumes from its newest checkpoint.

    ``errno`` and ``filename`` say the cause and the path, as an ``OSError``'s do.

    Example:
      >>> from adaptjax.controller._run_lock import RunDirectoryError
      >>> issubclass(RunDirectoryError, OSError)
      True
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


#: The causes a run directory's writes fail with, as their messages say them.
_CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "input/output error",
}
_FIXES = {
    errno.ENOSPC: "free some space or point run_dir elsewhere",
    errno.EDQUOT: "free some space or point run_dir elsewhere",
    errno.EROFS: "remount it read-write or point run_dir elsewhere",
    errno.EACCES: "make it writable (chmod) or point run_dir elsewhere",
    errno.EPERM: "make it writable (chmod, chattr -i) or point run_dir elsewhere",
}
_THEN = "then resume: the run continues from its last checkpoint"


def os_error_code(error: BaseException) -> int | None:
    """The ``errno`` behind ``error``: its own, a cause's, or one its message names.

    Orbax and TensorStore report a failed write as a ``ValueError`` whose
    message carries the operating system's (``[os_error_code='28']``, ``No
    space left on device``); ``None`` when nothing says it was the OS.
    """
    seen = 0
    e: BaseException | None = error
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno:
            return e.errno
        text = str(e)
        code = re.search(r"os_error_code='?(\d+)", text)
        if code:
            return int(code.group(1))
        for number in _CAUSES:
            if os.strerror(number).lower() in text.lower():
                return number
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def free_space(path: str | os.PathLike) -> int:
    """Bytes free to this user on the file system of ``path`` (or of its nearest parent)."""
    return shutil.disk_usage(_existing(path)).free


def _existing(path: str | os.PathLike) -> str:
    """``path``, or its nearest parent that exists."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return probe


def free_inodes(path: str | os.PathLike) -> int | None:
    """Inodes free on the file system of ``path`` (or its nearest parent); ``None``: unknown."""
    probe = _existing(path)
    try:
        stat = os.statvfs(probe)
    except OSError:
        return None
    return stat.f_favail if stat.f_files else None  # f_files == 0: the fs does not count them


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units, e.g. ``'48.0 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def run_dir_error(path: str | os.PathLike, code: int, detail: str = "") -> RunDirectoryError:
    """The one-line :class:`RunDirectoryError` for a write to ``path`` that failed with ``code``.

    ``detail`` goes in the parentheses after the cause; for a full disk it
    defaults to the free space there.

    Example:
      >>> import errno
      >>> from adaptjax.controller._run_lock import run_dir_error
      >>> print(run_dir_error("RUN/checkpoints/20", errno.EROFS))
      cannot write RUN/checkpoints/20: read-only file system; remount it read-write or point run_dir elsewhere, then resume: the run continues from its last checkpoint
    """  # noqa: E501
    path = os.fspath(path)
    cause = _CAUSES.get(code) or os.strerror(code).lower()
    if code in (errno.ENOSPC, errno.EDQUOT) and not detail:
        detail = f"{human_bytes(free_space(path))} free"
        if free_inodes(path) == 0:
            detail += ", no inode free"
    fix = _FIXES.get(code, "fix the run directory or point run_dir elsewhere")
    error = RunDirectoryError(
        f"cannot write {path}: {cause}{f' ({detail})' if detail else ''}; {fix}, {_THEN}"
    )
    error.errno, error.filename = code, path
    return error


def as_run_dir_error(path: str | os.PathLike, error: BaseException) -> RunDirectoryError | None:
    """``error`` (a failed write to ``path``) as a :class:`RunDirectoryError`, or ``None``
    when it is not the operating system's (a bug's error stays what it is)."""
    if isinstance(error, RunDirectoryError):
        return error
    code = os_error_code(error)
    return None if code is None else run_dir_error(path, code)
