"""The launcher's reaper: the workers of an attempt die with the launcher, however it ends.

``adaptjax launch`` starts this script first, in a new process group, with the
read end of a pipe as its stdin; every worker of the attempt then joins that
group. The launcher never writes to the pipe and holds its only write end, so
the read returns end-of-file exactly when the launcher is gone — a normal
exit, an exception, or ``kill -9`` alike (the kernel closes a dead process's
files). The reaper then sends SIGKILL to its group: every worker and whatever
the workers started, and the reaper itself. They resume from the latest
checkpoint when launched again (the same contract as a ``kill -9`` of a worker).

It ignores SIGINT, SIGTERM and SIGHUP: the launcher forwards SIGTERM to the
whole group (a preemption the workers handle), which must not end the reaper;
it writes one byte to stdout once they are ignored, and the launcher starts
no worker before it has read it. It imports nothing but the standard library
and runs as ``python -I -S``. This needs POSIX process groups (Linux, macOS);
``adaptjax launch`` does not run on Windows.
"""

import os
import signal


def main() -> None:
    """Waits for end-of-file on stdin, then kills this process group."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    os.write(1, b"R")  # ready: the launcher may start the workers
    os.close(1)
    while os.read(0, 4096):
        pass
    os.killpg(0, signal.SIGKILL)


if __name__ == "__main__":
    main()
