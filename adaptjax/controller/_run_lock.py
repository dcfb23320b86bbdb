"""One owner per run directory: an advisory lock that names its holder."""

from __future__ import annotations

import os


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
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
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
