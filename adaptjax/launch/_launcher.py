"""``adaptjax launch``: N local processes of one training script, restarted as a unit.

``adaptjax launch -n N [--devices-per-process K] [--max-restarts R] -- python train.py ARGS``

* starts ``N`` copies of the command with ``jax.distributed``'s coordinator on
  ``127.0.0.1`` at a free port, listening there only (loopback: nothing
  outside this machine can reach it); each learns its place from the
  environment (``ADAPTJAX_COORDINATOR_ADDRESS``, ``ADAPTJAX_NUM_PROCESSES``,
  ``ADAPTJAX_PROCESS_ID``), which :func:`adaptjax.initialize_distributed` reads;
  ``--devices-per-process K`` gives each process ``K`` simulated CPU devices
  (``--xla_force_host_platform_device_count``);
* prefixes every output line with its rank (``[1] ...``);
* when a process dies (non-zero exit or a signal) kills the others at once
  (their collectives could never finish) and starts all of them again, up to
  ``R`` times with a doubling backoff; the script resumes from its latest
  checkpoint (``Controller.resume``);
* when every process exits with :data:`adaptjax.EXIT_RESCALE` (76), reads the
  process count the run asks for and starts that many (not counted as a
  restart);
* when a process finds its run directory held by another job
  (``RunDirectoryLocked``) it exits with :data:`EXIT_LOCKED` (73); the
  launcher ends the others first (at once), says so in one line and exits
  with 73: never restarted, since a restart would find the directory locked
  again, or "resume" the other job's run once it ended;
* on SIGTERM/SIGINT forwards SIGTERM to every process (the controller
  checkpoints and exits with ``EXIT_PREEMPTED``, 75) and exits with their code;
* when the launcher itself dies, even by ``kill -9``, its processes die with it
  within a moment (``adaptjax/launch/_reaper.py``), so none is left holding
  the run directory and a new launch resumes from the latest checkpoint.

Timeouts, so nothing hangs silently: a process that has not reached
``initialize_distributed`` within ``--start-timeout`` seconds (120), that gave
no sign of life for ``--hang-timeout`` seconds (60: stopped, e.g. by SIGSTOP,
or frozen), or that made no step for ``--step-timeout`` seconds (600: stuck in
a collective) ends the attempt and counts as a failure.

How a stopped process is told apart from a long compile: after
``initialize_distributed`` each process touches ``<rank>.alive`` every
:data:`HEARTBEAT_S` seconds (or a quarter of ``--hang-timeout``, if less) from
a host thread of its own. XLA releases Python's lock while it compiles (and
while a collective waits), so that thread beats on through any compile; a
stopped process stops all its threads. A step's progress (``<rank>``, touched
after every step) cannot tell a long compile from a hung collective, hence its
own, longer timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

#: Exit code of every process after a transition checkpoint to a replica count that the
#: current processes cannot give: relaunch with the process count the run asks for.
EXIT_RESCALE = 76
#: Exit code of a process whose run directory another job holds (``RunDirectoryLocked``,
#: uncaught, after :func:`adaptjax.initialize_distributed`): never restarted (sysexits'
#: EX_CANTCREAT). Wait for the other job to end, or choose another run directory.
EXIT_LOCKED = 73

ENV_COORDINATOR = "ADAPTJAX_COORDINATOR_ADDRESS"
#: ``HOST:PORT`` the coordinator (process 0) listens on; default: the coordinator's address.
ENV_COORDINATOR_BIND = "ADAPTJAX_COORDINATOR_BIND_ADDRESS"
ENV_NUM_PROCESSES = "ADAPTJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ADAPTJAX_PROCESS_ID"
#: The most processes the launcher may start (so a policy may ask for more devices than exist now).
ENV_MAX_PROCESSES = "ADAPTJAX_MAX_PROCESSES"
#: Where process 0 writes ``{"processes": P, "devices": n}`` before exiting with EXIT_RESCALE.
ENV_RESCALE_FILE = "ADAPTJAX_RESCALE_FILE"
#: A directory in which each process touches ``<rank>`` after initialize and after every step,
#: and ``<rank>.alive`` every ``ADAPTJAX_HEARTBEAT_PERIOD`` seconds from a thread.
ENV_HEARTBEAT_DIR = "ADAPTJAX_HEARTBEAT_DIR"
#: Seconds between two touches of ``<rank>.alive``.
ENV_HEARTBEAT_PERIOD = "ADAPTJAX_HEARTBEAT_PERIOD"
#: ``1``: compare a digest of every decision across processes (a debug check).
ENV_CHECK_DECISIONS = "ADAPTJAX_CHECK_DECISIONS"
#: ``0`` on the first start; ``k > 0`` on the k-th restart or relaunch (the script resumes).
ENV_ATTEMPT = "ADAPTJAX_ATTEMPT"

#: The address the launcher's coordinator listens on and its processes connect to. Every
#: process runs on this machine, so loopback is enough, and nothing else can reach it.
COORDINATOR_HOST = "127.0.0.1"

#: The launcher's exit code for bad arguments (nothing was started).
EXIT_USAGE = 2
#: Seconds between a process's beats of life (``<rank>.alive``), at most.
HEARTBEAT_S = 5.0
#: Default ``--hang-timeout``: a stopped process is reported within it of its last beat, so
#: within two minutes of being stopped with room to spare (at most ``120 - HEARTBEAT_S``).
HANG_TIMEOUT_S = 60.0
#: Default ``--step-timeout``: long enough for the longest compile between two steps.
STEP_TIMEOUT_S = 600.0
#: Default ``--start-timeout``.
START_TIMEOUT_S = 120.0
_EXIT_PREEMPTED = 75  # adaptjax.EXIT_PREEMPTED, without importing the controller (and jax)
_REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reaper.py")


class LaunchError(ValueError):
    """A bad argument to ``adaptjax launch`` (one line, naming the fix)."""


def free_port(host: str = COORDINATOR_HOST) -> int:
    """A TCP port on ``host`` that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_in_use(host: str, port: int) -> bool:
    """Whether the coordinator's own bind (``host:port``, address reuse on) would fail."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_command(command: list[str]) -> None:
    """One-line :class:`LaunchError` when the command or its Python script cannot be found."""
    if not command:
        raise LaunchError("no command to launch; give it after --, e.g. -- python train.py")
    exe = command[0]
    if shutil.which(exe) is None and not os.path.isfile(exe):
        raise LaunchError(f"command {exe!r} not found; give a program on PATH or a path to one")
    if os.path.basename(exe).startswith("python"):
        rest = command[1:]
        i = 0
        while i < len(rest) and rest[i].startswith("-"):
            if rest[i] in ("-m", "-c"):
                return
            i += 2 if rest[i] in ("-W", "-X") else 1
        if i < len(rest) and not os.path.isfile(rest[i]):
            raise LaunchError(f"script {rest[i]!r} not found; check the path of the script")


def _xla_flags(existing: str, devices: int) -> str:
    key = "--xla_force_host_platform_device_count"
    flags = [f for f in existing.split() if not f.startswith(key)]
    flags.append(f"{key}={devices}")
    return " ".join(flags)


@dataclasses.dataclass(frozen=True)
class _Options:
    """``launch``'s arguments (``max_processes`` resolved after the check)."""

    processes: int
    devices_per_process: int | None
    max_restarts: int
    max_processes: int | None
    port: int | None
    start_timeout: float
    hang_timeout: float
    step_timeout: float
    backoff: float
    check_decisions: bool

    @property
    def process_cap(self) -> int:
        """``max_processes`` as :func:`launch` resolved it before starting anything."""
        assert self.max_processes is not None
        return self.max_processes


def _check_options(command: list[str], o: _Options) -> None:
    """One-line :class:`LaunchError` for each bad argument, before anything starts."""
    for name, value, low in (
        ("-n", o.processes, 1),
        ("--devices-per-process", o.devices_per_process, 1),
        ("--max-restarts", o.max_restarts, 0),
        ("--max-processes", o.max_processes, 1),  # None: as many as -n
    ):
        if value is not None and (not isinstance(value, int) or value < low):
            raise LaunchError(f"{name} must be an integer >= {low}, got {value!r}")
    for name, value in (("--start-timeout", o.start_timeout), ("--hang-timeout", o.hang_timeout),
                        ("--step-timeout", o.step_timeout)):
        if not value > 0:
            raise LaunchError(f"{name} must be > 0 seconds, got {value!r}")
    check_command(command)
    if o.port is not None:
        if not 0 < o.port < 65536:
            raise LaunchError(f"--port must be in 1..65535, got {o.port}")
        if _port_in_use(COORDINATOR_HOST, o.port):
            raise LaunchError(
                f"port {o.port} on {COORDINATOR_HOST} is in use; choose another --port or "
                "leave it out (a free one is picked)"
            )


class _Attempt:
    """One start of N processes: their output, liveness and how they ended.

    The processes share one process group, led by the reaper (``_reaper.py``),
    which kills the group when the launcher is gone: signalling the group
    reaches every process and whatever it started.
    """

    def __init__(self, command, n, *, env, port, workdir, out, err, lock):
        self.n = n
        self.out = out
        self.err = err
        self.lock = lock
        self.heartbeats = os.path.join(workdir, "heartbeat")
        os.makedirs(self.heartbeats, exist_ok=True)
        self.rescale_file = os.path.join(workdir, "rescale.json")
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []
        self.started = time.monotonic()
        # Its stdin's only write end stays here: end-of-file when this process is gone.
        # Same session, new group (workers can join it; a terminal's Ctrl-C does not reach it).
        self.reaper = subprocess.Popen(
            [sys.executable, "-I", "-S", _REAPER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            process_group=0,
        )
        self.group = self.reaper.pid
        ready = self.reaper.stdout
        assert ready is not None  # stdout=PIPE
        with ready:  # it ignores SIGTERM from here on: the group may be signalled
            if ready.read(1) != b"R":
                self.kill_all()
                raise RuntimeError(f"adaptjax launch's reaper did not start ({_REAPER})")
        address = f"{COORDINATOR_HOST}:{port}"
        for rank in range(n):
            child = dict(env)
            child.update(
                {
                    ENV_COORDINATOR: address,
                    ENV_COORDINATOR_BIND: address,  # an inherited value must not move it
                    ENV_NUM_PROCESSES: str(n),
                    ENV_PROCESS_ID: str(rank),
                    ENV_HEARTBEAT_DIR: self.heartbeats,
                    ENV_RESCALE_FILE: self.rescale_file,
                    "PYTHONUNBUFFERED": "1",
                }
            )
            proc = subprocess.Popen(
                command,
                env=child,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                process_group=self.group,
            )
            self.procs.append(proc)
            t = threading.Thread(target=self._pump, args=(rank, proc), daemon=True)
            t.start()
            self.readers.append(t)

    def _pump(self, rank: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None  # stdout=PIPE
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            with self.lock:
                self.out.write(f"[{rank}] {line}\n")
                self.out.flush()

    def say(self, text: str) -> None:
        with self.lock:
            self.err.write(f"adaptjax launch: {text}\n")
            self.err.flush()

    def signal_all(self, sig) -> None:
        """Sends ``sig`` to every process and what it started (the reaper ignores SIGTERM).

        Only until the reaper is reaped: until then its pid, the group's id, cannot
        be reused, so no other process can get the signal.
        """
        if self.reaper.returncode is None:  # never poll() the reaper: that would reap it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.group, sig)

    def kill_all(self) -> None:
        """Kills the group (the reaper too) and waits for every process and output reader."""
        self.signal_all(signal.SIGKILL)
        for p in (*self.procs, self.reaper):
            p.wait()
        assert self.reaper.stdin is not None  # stdin=PIPE
        with contextlib.suppress(OSError):
            self.reaper.stdin.close()
        for t in self.readers:
            t.join(timeout=2)

    def locked(self, rank: int) -> bool:
        """Whether process ``rank`` found its run directory locked (it waits for SIGTERM)."""
        return os.path.exists(os.path.join(self.heartbeats, f"{rank}.locked"))

    def end_locked(self, rank: int) -> int:
        """Ends the others, then process ``rank`` (which found its run directory locked).

        In that order: ``rank`` may be process 0, whose coordinator the others
        talk to; gone first, it would leave each a gloo error and a traceback.
        On SIGTERM it exits with :data:`EXIT_LOCKED`; returns that.
        """
        others = [p for r, p in enumerate(self.procs) if r != rank]
        for p in others:
            p.kill()
        for p in others:
            p.wait()
        self.procs[rank].terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.procs[rank].wait(timeout=10)
        self.kill_all()
        return EXIT_LOCKED

    def beats(self, suffix: str = "") -> dict[int, float]:
        """The time of each rank's latest step (``suffix=".alive"``: latest sign of life)."""
        out = {}
        for rank in range(self.n):
            try:
                out[rank] = os.path.getmtime(os.path.join(self.heartbeats, f"{rank}{suffix}"))
            except OSError:
                pass
        return out


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def _ended(codes: list[int]) -> int:
    """The attempt's code once every process ended: 0, EXIT_RESCALE, 75, EXIT_LOCKED or the
    first failure's."""
    if EXIT_LOCKED in codes:
        return EXIT_LOCKED
    for agreed in (0, EXIT_RESCALE, _EXIT_PREEMPTED):
        if all(c == agreed for c in codes):
            return agreed
    bad = next(c for c in codes if c != 0)
    return bad if bad > 0 else 128 - bad


def _older(beats: dict[int, float], codes, timeout: float) -> list[int]:
    """The running ranks whose beat in ``beats`` is older than ``timeout`` seconds."""
    now = time.time()
    return [r for r, t in beats.items() if codes[r] is None and now - t > timeout]


def _stuck(attempt: _Attempt, codes, o: _Options) -> int | None:
    """The attempt's code when a process failed, never started, stopped or hung (said, unless
    it is :data:`EXIT_LOCKED`: the caller says that; all killed)."""
    failed = [(r, c) for r, c in enumerate(codes) if c is not None and c not in (0, EXIT_RESCALE)]
    locked = [r for r in range(attempt.n) if codes[r] is None and attempt.locked(r)]
    if locked:
        return attempt.end_locked(locked[0])
    beats = attempt.beats()
    missing = [r for r in range(attempt.n) if r not in beats and codes[r] is None]
    stopped = _older(attempt.beats(".alive"), codes, o.hang_timeout)
    stale = _older(beats, codes, o.step_timeout)
    code = 1
    if failed:
        rank, rc = next((f for f in failed if f[1] == EXIT_LOCKED), failed[0])
        if rc != EXIT_LOCKED:
            attempt.say(f"process {rank} ended ({_describe(rc)}); stopping the others")
        code = rc if rc > 0 else 128 - rc
    elif missing and time.monotonic() - attempt.started > o.start_timeout:
        attempt.say(
            f"process(es) {missing} did not reach initialize_distributed within "
            f"{o.start_timeout:.0f} s; stopping all"
        )
    elif stopped:
        attempt.say(
            f"process {stopped[0]} gave no sign of life for {o.hang_timeout:.0f} s (stopped, "
            "e.g. by SIGSTOP, or frozen); stopping all"
        )
    elif not missing and stale:
        attempt.say(
            f"process {stale[0]} made no step for {o.step_timeout:.0f} s (hung in a "
            "collective?); stopping all"
        )
    else:
        return None
    attempt.kill_all()
    return code


def _run_attempt(attempt: _Attempt, o: _Options, *, stop_event) -> int:
    """Watches one attempt until it ends; returns 0, EXIT_RESCALE, 75 or a failure code."""
    forwarded_at = None
    while True:
        time.sleep(0.1)
        codes = [p.poll() for p in attempt.procs]
        if stop_event.is_set() and forwarded_at is None:
            attempt.say("forwarding SIGTERM to every process (they checkpoint and exit)")
            attempt.signal_all(signal.SIGTERM)
            forwarded_at = time.monotonic()
        ended = [c for c in codes if c is not None]
        if len(ended) == len(codes):
            attempt.kill_all()  # joins the output readers
            return _ended(ended)
        if forwarded_at is not None:  # they checkpoint: as long as a step may take
            if time.monotonic() - forwarded_at > o.step_timeout:
                attempt.say(
                    f"processes did not exit {o.step_timeout:.0f} s after SIGTERM; killing"
                )
                attempt.kill_all()
                return _EXIT_PREEMPTED
        else:
            code = _stuck(attempt, codes, o)
            if code is not None:
                return code


def _attempt_env(o: _Options, n: int, attempt: int) -> dict[str, str]:
    """The environment every process of the ``attempt``-th start gets (before its rank's)."""
    env = dict(os.environ)
    env[ENV_ATTEMPT] = str(attempt)
    env[ENV_HEARTBEAT_PERIOD] = repr(min(HEARTBEAT_S, o.hang_timeout / 4))
    env[ENV_MAX_PROCESSES] = str(max(o.process_cap, n))
    if o.check_decisions:
        env[ENV_CHECK_DECISIONS] = "1"
    if o.devices_per_process is not None:
        env["XLA_FLAGS"] = _xla_flags(env.get("XLA_FLAGS", ""), o.devices_per_process)
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _requested_processes(attempt: _Attempt, max_processes: int) -> int | None:
    """The process count an EXIT_RESCALE asks for; None (said why) when it cannot be had."""
    try:
        with open(attempt.rescale_file) as f:
            wanted = int(json.load(f)["processes"])
    except (OSError, ValueError, KeyError) as e:
        attempt.say(f"processes exited with EXIT_RESCALE but left no request ({e})")
        return None
    if wanted > max_processes:
        attempt.say(
            f"the run asks for {wanted} processes, above --max-processes {max_processes}; stopping"
        )
        return None
    return wanted


@contextlib.contextmanager
def _stop_on_signals():
    """An event set by SIGTERM/SIGINT while inside (main thread only; elsewhere never set)."""
    stop = threading.Event()
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            handlers[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        yield stop
    finally:
        for sig, previous in handlers.items():
            signal.signal(sig, previous)


def _supervise(command, o: _Options, *, stop, workdir, out, err) -> int:
    """Starts attempts until one finishes, a signal stops them or the restarts run out."""
    lock = threading.Lock()
    n, restarts, attempts = o.processes, 0, 0
    while True:
        attempt = _Attempt(
            command,
            n,
            env=_attempt_env(o, n, attempts),
            port=o.port if o.port is not None else free_port(),
            workdir=tempfile.mkdtemp(dir=workdir),
            out=out,
            err=err,
            lock=lock,
        )
        attempts += 1
        attempt.say(f"started {n} process(es): {shlex.join(command)}")
        try:
            rc = _run_attempt(attempt, o, stop_event=stop)
        finally:
            attempt.kill_all()
        if rc == 0:
            attempt.say(f"all {n} process(es) finished")
            return 0
        if rc == EXIT_LOCKED:
            attempt.say(
                f"the run directory is in use by another job (a process exited with {rc}, "
                "RunDirectoryLocked); not restarting: wait for that job to end or choose "
                "another run directory"
            )
            return rc
        if stop.is_set():
            attempt.say(f"stopped by a signal (exit code {rc})")
            return rc
        if rc == EXIT_RESCALE:
            wanted = _requested_processes(attempt, o.process_cap)
            if wanted is None:
                return EXIT_RESCALE
            attempt.say(f"rescale: relaunching with {wanted} process(es) (was {n})")
            n = wanted
            continue
        restarts += 1
        if restarts > o.max_restarts:
            attempt.say(f"giving up after {o.max_restarts} restart(s) (exit code {rc})")
            return rc
        wait = min(o.backoff * 2 ** (restarts - 1), 30.0)
        attempt.say(f"restart {restarts}/{o.max_restarts} in {wait:.1f} s (resume)")
        if stop.wait(wait):
            return _EXIT_PREEMPTED


def launch(
    command: list[str],
    *,
    processes: int,
    devices_per_process: int | None = None,
    max_restarts: int = 3,
    max_processes: int | None = None,
    port: int | None = None,
    start_timeout: float = START_TIMEOUT_S,
    hang_timeout: float = HANG_TIMEOUT_S,
    step_timeout: float = STEP_TIMEOUT_S,
    backoff: float = 1.0,
    check_decisions: bool = False,
    out=None,
    err=None,
) -> int:
    """Runs ``command`` as ``processes`` processes until they finish; returns the exit code.

    See the module docstring (``adaptjax launch -h``) for the behaviour. Raises
    :class:`LaunchError` (one line) for bad arguments before starting anything.
    The processes' lines go to ``out`` (default stdout), the launcher's own to
    ``err`` (default stderr).

    Example:
      >>> import io, sys
      >>> from adaptjax.launch._launcher import launch
      >>> launch([sys.executable, "-c", "print('hi')"], processes=1, out=sys.stdout,
      ...        err=io.StringIO())
      [0] hi
      0
    """
    options = _Options(
        processes=processes,
        devices_per_process=devices_per_process,
        max_restarts=max_restarts,
        max_processes=max_processes,
        port=port,
        start_timeout=start_timeout,
        hang_timeout=hang_timeout,
        step_timeout=step_timeout,
        backoff=backoff,
        check_decisions=check_decisions,
    )
    command = list(command)
    _check_options(command, options)
    options = dataclasses.replace(options, max_processes=max(max_processes or 0, processes))
    workdir = tempfile.mkdtemp(prefix="adaptjax-launch-")
    try:
        with _stop_on_signals() as stop:
            return _supervise(
                command,
                options,
                stop=stop,
                workdir=workdir,
                out=sys.stdout if out is None else out,
                err=sys.stderr if err is None else err,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``adaptjax launch`` from the command line; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        options, command = argv[:i], argv[i + 1 :]
    else:
        options, command = argv, []
    parser = argparse.ArgumentParser(
        prog="adaptjax launch",
        description=(__doc__ or "").splitlines()[0],
        epilog="Exit codes: 0 done; 75 preempted (resume later); 76 a process-count change the "
        "launcher could not carry out; 73 the run directory is in use by another job (never "
        "restarted); 2 bad arguments; otherwise the failing process's code.",
    )
    parser.add_argument("-n", "--processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=None)
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--max-processes", type=int, default=None)
    parser.add_argument(
        "--port", type=int, default=None,
        help=f"the coordinator's port on {COORDINATOR_HOST} (default: a free one)",
    )
    parser.add_argument("--start-timeout", type=float, default=START_TIMEOUT_S)
    parser.add_argument(
        "--hang-timeout", type=float, default=HANG_TIMEOUT_S,
        help="seconds without a sign of life (a stopped process)",
    )
    parser.add_argument(
        "--step-timeout", type=float, default=STEP_TIMEOUT_S,
        help="seconds without a step (a hung collective; longer than any compile)",
    )
    parser.add_argument("--backoff", type=float, default=1.0)
    parser.add_argument("--check-decisions", action="store_true")
    args = parser.parse_args(options)
    try:
        return launch(
            command,
            processes=args.processes,
            devices_per_process=args.devices_per_process,
            max_restarts=args.max_restarts,
            max_processes=args.max_processes,
            port=args.port,
            start_timeout=args.start_timeout,
            hang_timeout=args.hang_timeout,
            step_timeout=args.step_timeout,
            backoff=args.backoff,
            check_decisions=args.check_decisions,
        )
    except LaunchError as e:
        print(f"adaptjax launch: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
