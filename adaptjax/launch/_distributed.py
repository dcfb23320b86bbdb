"""adaptjax across processes: start-up, the mesh's devices, and keeping processes in step.

Every process of a multi-process job runs the same script and the same
controller loop. This module holds what that needs and nothing else:

* :func:`initialize_distributed` starts ``jax.distributed`` from the
  environment ``adaptjax launch`` sets (``ADAPTJAX_COORDINATOR_ADDRESS``,
  ``ADAPTJAX_NUM_PROCESSES``, ``ADAPTJAX_PROCESS_ID``), or lets JAX detect a
  cluster (SLURM, Open MPI, Kubernetes, Cloud TPU) by itself. Process 0's
  coordinator listens on the coordinator's address only (or on
  ``ADAPTJAX_COORDINATOR_BIND_ADDRESS``), never on every interface unasked.
* :func:`mesh_devices` picks the devices of an ``n``-replica mesh: ``n / P``
  local devices from each of the ``P`` processes, in process order, so replica
  ``r`` holds rows ``r * b / n ...`` of the global batch and process ``p`` owns
  a contiguous block of rows.
* :func:`processes_for` is the process count a replica count runs on (the
  fewest that can give it); a rescale to another count ends every process with
  :data:`EXIT_RESCALE` after a transition checkpoint, and the launcher (or a
  scheduler that follows the same contract) starts that many again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import threading
import time

import jax
import numpy as np

from adaptjax.launch._launcher import (  # the launcher's side of the contract (imports no jax)
    ENV_CHECK_DECISIONS,
    ENV_COORDINATOR,
    ENV_COORDINATOR_BIND,
    ENV_HEARTBEAT_DIR,
    ENV_HEARTBEAT_PERIOD,
    ENV_MAX_PROCESSES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_RESCALE_FILE,
    EXIT_LOCKED,
    HEARTBEAT_S,
)
from adaptjax.launch._launcher import (
    EXIT_RESCALE as EXIT_RESCALE,  # re-exported as adaptjax.EXIT_RESCALE
)

#: How long a process that found its run directory locked waits for the launcher's SIGTERM.
LOCKED_WAIT_S = 30.0

_CLUSTER_VARS = (
    "SLURM_JOB_ID",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "JAX_COORDINATOR_ADDRESS",
    "TPU_WORKER_HOSTNAMES",
    "JOBSET_NAME",
)


class DecisionMismatch(RuntimeError):
    """Processes of one job made different decisions (a policy read per-process values).

    Example:
      >>> import adaptjax
      >>> issubclass(adaptjax.DecisionMismatch, RuntimeError)
      True
    """


def _env_int(name: str, *, positive: bool = True) -> int:
    raw = os.environ.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; set it to a number") from None
    if value < int(positive):
        raise ValueError(f"{name}={value} is out of range; set it to a value >= {int(positive)}")
    return value


def _address(name: str) -> str:
    """The ``HOST:PORT`` in environment variable ``name``; one line when it is not one."""
    value = os.environ[name]
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{name}={value!r} is not HOST:PORT; set it to e.g. 127.0.0.1:1234")
    return value


def _launched_arguments() -> dict:
    """``jax.distributed.initialize``'s arguments from ``adaptjax launch``'s environment.

    The coordinator binds the address the processes connect to (loopback under
    ``adaptjax launch``), not JAX's default of every interface;
    ``ADAPTJAX_COORDINATOR_BIND_ADDRESS`` (``HOST:PORT``) names another, e.g. a
    cluster's interface when the address processes connect to is not one of
    this host's own (a name behind NAT), or ``0.0.0.0:PORT`` on purpose.
    """
    n = _env_int(ENV_NUM_PROCESSES)
    rank = _env_int(ENV_PROCESS_ID, positive=False)
    if rank >= n:
        raise ValueError(f"{ENV_PROCESS_ID}={rank} but {ENV_NUM_PROCESSES}={n}; ids run 0..{n - 1}")
    address = _address(ENV_COORDINATOR)
    bind = _address(ENV_COORDINATOR_BIND) if os.environ.get(ENV_COORDINATOR_BIND) else address
    return dict(
        coordinator_address=address,
        num_processes=n,
        process_id=rank,
        coordinator_bind_address=bind,
    )


def initialize_distributed(*, initialization_timeout: int = 120) -> tuple[int, int]:
    """Starts ``jax.distributed`` for this process; returns ``(process_index, process_count)``.

    Call it at the top of a training script, before anything touches a device
    (a second call does nothing).
    Under ``adaptjax launch`` it reads ``ADAPTJAX_COORDINATOR_ADDRESS``,
    ``ADAPTJAX_NUM_PROCESSES`` and ``ADAPTJAX_PROCESS_ID``; on CPU it selects
    gloo collectives. Process 0's coordinator listens on
    ``ADAPTJAX_COORDINATOR_ADDRESS`` itself (``127.0.0.1`` under the launcher:
    nothing outside the machine can reach it), or on
    ``ADAPTJAX_COORDINATOR_BIND_ADDRESS`` (``HOST:PORT``) when that is set.
    Elsewhere it defers to ``jax.distributed.initialize()``'s
    own cluster detection when it sees a cluster's variables (SLURM, Open MPI,
    Kubernetes JobSet, Cloud TPU, ``JAX_COORDINATOR_ADDRESS``), passing
    ``ADAPTJAX_COORDINATOR_BIND_ADDRESS`` on if set (JAX's default binds every
    interface), and otherwise does nothing: the script runs as one process.

    From then on an uncaught ``adaptjax.RunDirectoryLocked`` (another job holds
    the run directory) prints its one line and ends the process at once with
    exit code 73 (``EXIT_LOCKED`` of ``adaptjax launch``, which never restarts
    it), instead of 1 after ``jax.distributed``'s shutdown waited for the other
    processes. Under ``adaptjax launch`` a thread of this process also beats
    (touches a file) every few seconds, so that the launcher can tell a stopped
    process from one that compiles.

    Args:
      initialization_timeout: seconds to wait for every process to connect.

    Returns:
      ``(jax.process_index(), jax.process_count())``.

    Example:
      >>> import adaptjax
      >>> adaptjax.initialize_distributed()  # not launched: one process
      (0, 1)
    """
    if jax.distributed.is_initialized():  # a second call (or the user's own initialize)
        pass
    elif ENV_COORDINATOR in os.environ:
        arguments = _launched_arguments()
        if "cpu" in os.environ.get("JAX_PLATFORMS", "cpu"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(**arguments, initialization_timeout=initialization_timeout)
    elif any(v in os.environ for v in _CLUSTER_VARS):
        bind = _address(ENV_COORDINATOR_BIND) if os.environ.get(ENV_COORDINATOR_BIND) else None
        jax.distributed.initialize(
            initialization_timeout=initialization_timeout, coordinator_bind_address=bind
        )
    heartbeat()
    _exit_locked_uncaught()
    _beat_from_a_thread()
    return jax.process_index(), jax.process_count()


def _exit_locked_uncaught() -> None:
    """Installs (once) a ``sys.excepthook`` that ends the process with :data:`EXIT_LOCKED` on
    an uncaught ``RunDirectoryLocked``; other exceptions go to the hook there was.

    ``os._exit``: the process has nothing of the run directory to close, and
    ``jax.distributed``'s shutdown at exit would wait for the other processes.
    Under the launcher it first touches ``<rank>.locked`` in the heartbeat
    directory and waits for SIGTERM (at most :data:`LOCKED_WAIT_S`): the launcher
    ends the other processes before it, so that none sees its coordinator vanish
    (a gloo error and traceback in each), then sends it.
    """
    previous = sys.excepthook
    if getattr(previous, "_adaptjax_locked", False):
        return
    where, rank = os.environ.get(ENV_HEARTBEAT_DIR), jax.process_index()

    def hook(kind, value, tb):
        lock = sys.modules.get("adaptjax.controller._run_lock")  # not imported: not raised
        if lock is None or not isinstance(value, lock.RunDirectoryLocked):
            previous(kind, value, tb)
            return
        print(f"adaptjax.RunDirectoryLocked: {value}", file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if where:
            signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_LOCKED))
            with contextlib.suppress(OSError):
                _touch(os.path.join(where, f"{rank}.locked"))
                time.sleep(LOCKED_WAIT_S)
        os._exit(EXIT_LOCKED)

    hook._adaptjax_locked = True  # pyright: ignore[reportFunctionMemberAccess]
    sys.excepthook = hook


_beating = threading.Event()


def _beat_from_a_thread() -> None:
    """Under the launcher, touches ``<rank>.alive`` now and then every heartbeat period from
    a daemon thread (once per process): a sign of life through compiles and collectives,
    which release Python's lock, that stops only when the whole process stops."""
    where = os.environ.get(ENV_HEARTBEAT_DIR)
    if not where or _beating.is_set():
        return
    _beating.set()
    period = float(os.environ.get(ENV_HEARTBEAT_PERIOD) or HEARTBEAT_S)
    path = os.path.join(where, f"{jax.process_index()}.alive")
    _touch(path)  # alive from here on, before anything else runs

    def beat() -> None:
        while True:
            time.sleep(period)
            with contextlib.suppress(OSError):  # the launcher's directory is gone: it ended
                _touch(path)

    threading.Thread(target=beat, name="adaptjax-heartbeat", daemon=True).start()


def _touch(path: str) -> None:
    with open(path, "a"):
        pass
    os.utime(path)


def heartbeat() -> None:
    """Tells the launcher this process is alive and moving (a no-op outside the launcher)."""
    where = os.environ.get(ENV_HEARTBEAT_DIR)
    if where:
        _touch(os.path.join(where, str(jax.process_index())))


def is_primary() -> bool:
    """Whether this is process 0, the one that writes logs (always true in one process)."""
    return jax.process_index() == 0


def max_processes() -> int:
    """The most processes this job may run on (``ADAPTJAX_MAX_PROCESSES``, else the current)."""
    if ENV_MAX_PROCESSES in os.environ:
        return max(_env_int(ENV_MAX_PROCESSES), jax.process_count())
    return jax.process_count()


def processes_for(devices: int, per_process: int | None = None) -> int:
    """The fewest processes that give ``devices`` replicas with equal shares.

    Each process gives ``devices / P`` of its ``per_process`` local devices
    (default ``jax.local_device_count()``), so ``P`` is the smallest count with
    ``P >= devices / per_process`` that divides ``devices``.

    Example:
      >>> from adaptjax.launch._distributed import processes_for
      >>> processes_for(8, 2), processes_for(4, 2), processes_for(6, 4), processes_for(3, 2)
      (4, 2, 2, 3)
    """
    k = jax.local_device_count() if per_process is None else int(per_process)
    p = max(1, -(-int(devices) // k))
    while devices % p:
        p += 1
    return p


def can_give(devices: int) -> bool:
    """Whether the current processes can form a ``devices``-replica mesh (equal shares)."""
    p = jax.process_count()
    return devices % p == 0 and devices // p <= jax.local_device_count()


def mesh_devices(devices: int) -> list:
    """The devices of a ``devices``-replica mesh: the first ``devices / P`` of each process.

    In one process these are ``jax.devices()[:devices]``. Raises a one-line
    ``ValueError`` when the processes cannot give equal shares.

    Example:
      >>> from adaptjax.launch._distributed import mesh_devices
      >>> len(mesh_devices(2))
      2
    """
    p = jax.process_count()
    if p == 1:
        return list(jax.devices())[:devices]
    if not can_give(devices):
        raise ValueError(
            f"devices={devices} cannot be spread evenly over {p} processes of "
            f"{jax.local_device_count()} devices; use a multiple of {p} up to "
            f"{p * jax.local_device_count()}, or relaunch with {processes_for(devices)} processes"
        )
    share = devices // p
    by_process: dict[int, list] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    ordered = (sorted(by_process[i], key=lambda d: d.id)[:share] for i in sorted(by_process))
    return [d for devs in ordered for d in devs]


def process_rows(batch_size: int, devices: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a global batch that this process feeds.

    Example:
      >>> from adaptjax.launch._distributed import process_rows
      >>> process_rows(32, 4)
      (0, 32)
    """
    p, i = jax.process_count(), jax.process_index()
    if p == 1:
        return 0, int(batch_size)
    per = int(batch_size) // p
    return i * per, (i + 1) * per


def mesh_rows(mesh, batch_size: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a global batch split over ``mesh``'s ``"data"`` axis that
    this process's devices hold (on a 1-D mesh, :func:`process_rows`).

    On a sharded mesh a process holds whole data replicas (several, one, or
    its part of one that spans processes: then every process of that replica
    feeds its rows). One-line ``ValueError`` when the rows are not contiguous
    (a mesh not built on :func:`mesh_devices`).

    Example:
      >>> import adaptjax
      >>> from adaptjax.launch._distributed import mesh_rows
      >>> mesh_rows(adaptjax.make_mesh({"data": 2, "fsdp": 4}), 32)
      (0, 32)
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if jax.process_count() == 1:
        return 0, int(batch_size)
    indices = NamedSharding(mesh, P("data")).addressable_devices_indices_map((int(batch_size),))
    firsts = []  # each device's slice of the batch axis
    for index in indices.values():
        assert index is not None  # a NamedSharding indexes every device it addresses
        firsts.append(index[0])
    rows = sorted({(s.start or 0, int(batch_size) if s.stop is None else s.stop) for s in firsts})
    if any(a[1] != b[0] for a, b in zip(rows, rows[1:], strict=False)):
        raise ValueError(
            f"this process's devices hold rows {rows} of the batch, not one block; build the "
            "mesh on adaptjax.launch's mesh_devices (devices in process order)"
        )
    return rows[0][0], rows[-1][1]


def global_batch(local, mesh, batch_size: int):
    """The global batch (sharded over ``"data"``) from this process's rows of it."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P("data"))
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(
            sharding, np.asarray(x), (int(batch_size), *np.shape(x)[1:])
        ),
        local,
    )


def _pad(data: bytes) -> np.ndarray:
    size = 4096
    while size < len(data) + 8:
        size *= 2
    buf = np.zeros(size, np.uint8)
    buf[:8] = np.frombuffer(np.int64(len(data)).tobytes(), np.uint8)
    buf[8 : 8 + len(data)] = np.frombuffer(data, np.uint8)
    return buf


def broadcast_json(value):
    """Process 0's JSON-able ``value`` on every process (every process must call it)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    data = json.dumps(value, sort_keys=True).encode() if is_primary() else b""
    # Two broadcasts: the padded size, then the bytes (sizes in powers of two: few compiles).
    buf = _pad(data) if is_primary() else None
    size = int(multihost_utils.broadcast_one_to_all(np.int64(0 if buf is None else buf.size)))
    out = multihost_utils.broadcast_one_to_all(buf if buf is not None else np.zeros(size, np.uint8))
    out = np.asarray(out, np.uint8)
    n = int(out[:8].view(np.int64)[0])
    return json.loads(out[8 : 8 + n].tobytes().decode())


def check_same(value, what: str) -> None:
    """Raises :class:`DecisionMismatch` unless every process holds the same JSON-able ``value``."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = hashlib.blake2b(json.dumps(value, sort_keys=True).encode(), digest_size=16).digest()
    mine = np.frombuffer(digest, np.uint32)
    every = np.asarray(multihost_utils.process_allgather(mine))
    if not (every == every[0]).all():
        differ = [i for i in range(every.shape[0]) if not (every[i] == every[0]).all()]
        raise DecisionMismatch(
            f"{what} differs between processes (process {differ[0]} vs 0): a policy read a "
            "per-process value; make it depend only on metrics and step numbers"
        )


def barrier(name: str) -> None:
    """Waits until every process reaches ``name`` (a no-op in one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def decisions_checked() -> bool:
    """Whether ``ADAPTJAX_CHECK_DECISIONS=1`` asks to compare decisions across processes."""
    return os.environ.get(ENV_CHECK_DECISIONS, "") not in ("", "0")


def write_rescale_request(processes: int, devices: int) -> str | None:
    """Process 0 writes the relaunch request for the launcher; returns the file (or None)."""
    path = os.environ.get(ENV_RESCALE_FILE)
    if not path or not is_primary():
        return None
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"processes": int(processes), "devices": int(devices), "time": time.time()}, f)
    os.replace(tmp, path)
    return path
