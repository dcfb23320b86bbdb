"""Orbax checkpoints of a whole training snapshot, restorable onto another mesh.

A checkpoint is one Orbax step directory with two items:

* ``state``: the :class:`adaptjax.TrainState` arrays (Orbax ``PyTreeSave``;
  per-replica leaves are saved in their global view, ``(n_replicas, ...)``);
* ``meta``: one JSON document holding the caller's ``meta`` dict (data cursor,
  configuration, policy states, ...) and what a restore must check before it
  reads any array: a fingerprint of the model (path, shape and dtype of every
  parameter), one of the optimizer state, and the saved replica count.

Orbax writes every byte and makes a checkpoint atomic: it writes into
``<step>.orbax-checkpoint-tmp-<n>`` and renames the directory to ``<step>``
when everything is on disk, and only such final directories count as
checkpoints. A process killed mid-save leaves a temporary directory that
:meth:`RunCheckpoints.latest_step` and :meth:`RunCheckpoints.restore`
ignore; the previous complete checkpoint is restored.

Every leaf's bytes are hashed at save (BLAKE2b of its global value) and the
digests travel in ``meta``; a restore recomputes them and refuses a checkpoint
whose arrays changed on disk (:class:`CorruptCheckpointError`), as it refuses
one that Orbax cannot read. Step directories without both items (a stray
``checkpoints/999/``) are not checkpoints: they are ignored with a warning
(:meth:`RunCheckpoints.strays` lists them; a controller's resume moves them
to ``quarantine/``).

Ctrl-C is held back while a save is started or waited for, and while a
checkpoint is deleted or moved (:func:`deferred_interrupts`): Orbax runs part
of a save in the caller's thread, and a ``KeyboardInterrupt`` there would
abandon writes its threads go on with.

Restoring onto a mesh with a different replica count reads replicated leaves
straight onto the new mesh and per-replica leaves at their saved count (as host
arrays), maps them to the new count with :func:`adaptjax.sync.merge_replicas`
(each marker's rule, e.g. error-feedback debt's mean is preserved) and places
the result with :func:`adaptjax.train_state_shardings`. Every leaf lands on the
target's own sharding when it has one (a state from :func:`adaptjax.init_state`
or :func:`adaptjax.abstract_state` on the new mesh), so a checkpoint written on
a (2, 4) ``("data", "fsdp")`` mesh restores onto (4, 2), (8,) or (1,) and back:
Orbax reads each device's shard of the saved global arrays.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from adaptjax._data import check_count
from adaptjax._mesh import check_mesh
from adaptjax._per_replica import merge_replicas, state_partition_specs
from adaptjax._state import TrainState, train_state_specs
from adaptjax.controller._options import check_max_to_keep
from adaptjax.launch._distributed import broadcast_json

_FORMAT = "adaptjax-checkpoint/1"
_FIX = "point run_dir elsewhere"


def _is_spec(x) -> bool:
    return isinstance(x, P)


_deferring = threading.local()


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Holds Ctrl-C (``SIGINT``) back until the block is done; a second Ctrl-C acts at once.

    The held-back signal is handed to the handler that was in place (Python's:
    ``KeyboardInterrupt``) as the block ends, so a checkpoint save is started
    or waited for whole, never abandoned half-way in this thread while Orbax's
    threads go on writing. Only the main thread receives signals: elsewhere, in
    a nested block, or when ``SIGINT`` is ignored, the block runs as it is.

    Example:
      >>> import signal
      >>> from adaptjax.controller._checkpoint import deferred_interrupts
      >>> before = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own
      >>> done = []
      >>> try:
      ...     with deferred_interrupts():
      ...         signal.raise_signal(signal.SIGINT)  # Ctrl-C
      ...         done.append("the block ran to its end")
      ... except KeyboardInterrupt:
      ...     done.append("then KeyboardInterrupt")
      >>> _ = signal.signal(signal.SIGINT, before)
      >>> done
      ['the block ran to its end', 'then KeyboardInterrupt']
    """
    before = signal.getsignal(signal.SIGINT)
    main = threading.current_thread() is threading.main_thread()
    if not main or getattr(_deferring, "on", False) or before == signal.SIG_IGN:
        yield
        return
    got: list = []

    def deliver(frame) -> None:
        if callable(before):
            before(signal.SIGINT, frame)
        else:  # SIG_DFL (or set outside Python): the default action
            os.kill(os.getpid(), signal.SIGINT)

    def hold_back(signum, frame):
        got.append(frame)
        if len(got) > 1:  # a second Ctrl-C: act now
            signal.signal(signal.SIGINT, before)
            deliver(frame)

    signal.signal(signal.SIGINT, hold_back)
    _deferring.on = True
    try:
        yield
    finally:
        _deferring.on = False
        if signal.getsignal(signal.SIGINT) is hold_back:
            signal.signal(signal.SIGINT, before)
        if len(got) == 1:
            deliver(got[0])


def _fmt(dtype: str, shape) -> str:
    return f"{dtype}[{', '.join(str(int(d)) for d in shape)}]"


class CorruptCheckpointError(ValueError):
    """A checkpoint on disk is damaged or incomplete: unreadable, or its bytes changed.

    Example:
      >>> import adaptjax
      >>> issubclass(adaptjax.CorruptCheckpointError, ValueError)
      True
    """


def leaf_checksum(x) -> str:
    """A hex BLAKE2b digest of an array's global value: its dtype, shape and bytes.

    Example:
      >>> import numpy as np
      >>> from adaptjax.controller._checkpoint import leaf_checksum
      >>> leaf_checksum(np.zeros(3, np.float32)) == leaf_checksum(np.zeros(3, np.float32))
      True
      >>> leaf_checksum(np.zeros(3, np.float32)) == leaf_checksum(np.ones(3, np.float32))
      False
    """
    if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.ascontiguousarray(_host_value(x))
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def _host_value(x) -> np.ndarray:
    """``x`` as a numpy array, read shard by shard.

    ``np.asarray`` of a whole ``jax.Array`` on CPU leaves a host view of its
    buffers behind (jax >= 0.11), and the next step that donates them copies
    instead: a checkpoint would cost a spare copy of the state. Temporary
    per-shard arrays leave nothing behind.
    """
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    shards = x.addressable_shards
    if x.is_fully_replicated:
        return np.asarray(shards[0].data)
    out = np.empty(x.shape, x.dtype)
    for shard in shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def _global_value(x):
    """``x``'s global value on this host; across processes every process must call it."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        return multihost_utils.process_allgather(x, tiled=True)
    return x


def tree_checksums(tree) -> dict[str, str]:
    """``{path: leaf_checksum}`` for every leaf of ``tree`` (paths as ``jax.tree_util.keystr``).

    A leaf sharded over several processes is gathered first (a collective: in a
    multi-process job every process calls this, with the same tree).
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): leaf_checksum(_global_value(leaf)) for path, leaf in flat}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}".rstrip(": ")


def tree_fingerprint(tree, prefix: str = "", per_replica=None) -> list[list]:
    """``[path, shape, dtype]`` for every leaf of ``tree`` (JSON-able).

    Args:
      tree: a pytree of arrays (or ``jax.ShapeDtypeStruct``s).
      prefix: prepended to each ``jax.tree_util.keystr`` path.
      per_replica: optional list of booleans, one per leaf; a ``True`` leaf's
        leading (replica) axis is left out of its shape and the entry gets a
        fourth element ``"per_replica"``.

    Returns:
      One ``[path, shape, dtype]`` (or ``[..., "per_replica"]``) list per leaf.
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    flags = per_replica if per_replica is not None else [False] * len(flat)
    out = []
    for (path, leaf), marked in zip(flat, flags, strict=True):
        shape = [int(d) for d in np.shape(leaf)]
        entry = [prefix + jax.tree_util.keystr(path), shape, str(np.dtype(leaf.dtype))]
        if marked:
            entry[1] = shape[1:]
            entry.append("per_replica")
        out.append(entry)
    return out


def _per_replica_flags(opt_state) -> list[bool]:
    specs = jax.tree.leaves(state_partition_specs(opt_state), is_leaf=_is_spec)
    return [len(s) > 0 for s in specs]


def _opt_fingerprint(opt_state) -> list[list]:
    return tree_fingerprint(opt_state, "opt_state", _per_replica_flags(opt_state))


def _replica_count(opt_state) -> int | None:
    leaves = jax.tree.leaves(opt_state)
    counts = {
        int(np.shape(x)[0]) for x, m in zip(leaves, _per_replica_flags(opt_state), strict=True) if m
    }
    if len(counts) > 1:
        raise ValueError(
            f"per-replica leaves disagree on the replica count {sorted(counts)}; save a state "
            "built by adaptjax.init_state and stepped by data_parallel_step"
        )
    return counts.pop() if counts else None


def _first_difference(saved: list, here: list) -> str | None:
    """Describes the first entry where two fingerprints disagree, or ``None``."""
    if [list(e) for e in saved] == [list(e) for e in here]:
        return None
    s = {e[0]: e for e in saved}
    h = {e[0]: e for e in here}
    for path in s:
        if path not in h:
            return f"{path} is in the checkpoint but not in target_state"
    for path in h:
        if path not in s:
            return f"{path} is in target_state but not in the checkpoint"
    for path, e in s.items():
        if list(e) != list(h[path]):
            return f"{path} is {_fmt(e[2], e[1])} there, {_fmt(h[path][2], h[path][1])} here"
    return "the leaves are in a different order"


def _check_writable(directory: str) -> None:
    """One-line ``ValueError`` unless ``directory`` exists writable or can be created."""
    probe = directory
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ValueError(
            f"checkpoint directory {directory} cannot be created: {probe} is a file, not a "
            f"directory; {_FIX} (a writable directory)"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(
            f"checkpoint directory {directory} is not writable ({probe} denies write access); "
            f"{_FIX} (a writable directory) or fix its permissions"
        )


def _check_train_state(state, name: str) -> None:
    if not isinstance(state, TrainState):
        raise ValueError(
            f"{name} must be an adaptjax.TrainState (from adaptjax.init_state), got "
            f"{type(state).__name__}"
        )


def _target_shardings(leaves, specs, mesh) -> list:
    """Each target leaf's own ``NamedSharding`` on ``mesh`` (an array's, or a
    ``ShapeDtypeStruct``'s from :func:`adaptjax.abstract_state`: sharded meshes
    place parameters by their rule), else its replicated or per-replica spec."""
    out = []
    for leaf, spec in zip(leaves, specs, strict=True):
        own = getattr(leaf, "sharding", None)
        usable = isinstance(own, NamedSharding) and own.mesh == mesh
        out.append(own if usable else NamedSharding(mesh, spec))
    return out


def _handler_registry():
    """Orbax handlers for our two items, with replica-parallel saving off in one process.

    Orbax's replica-parallel save slices every replicated array so that each
    replica writes a part; in a single process that means compiling dozens of
    small slice programs the first time a mesh saves (measured: 4.4 of 6 s of a
    rescale). Orbax already turns it off on GPU; here it is off whenever the
    job is one process, and on across processes, where it spreads the writing.
    """
    array = ocp.type_handlers.ArrayHandler(use_replica_parallel=jax.process_count() > 1)
    types = ocp.type_handlers.create_type_handler_registry(
        (int, ocp.type_handlers.ScalarHandler()),
        (float, ocp.type_handlers.ScalarHandler()),
        (np.number, ocp.type_handlers.ScalarHandler()),
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
        (jax.Array, array),
        (str, ocp.type_handlers.StringHandler()),
    )
    state = ocp.PyTreeCheckpointHandler(type_handler_registry=types)
    meta = ocp.JsonCheckpointHandler()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", ocp.args.PyTreeSave, state)
    registry.add("state", ocp.args.PyTreeRestore, state)
    registry.add("meta", ocp.args.JsonSave, meta)
    registry.add("meta", ocp.args.JsonRestore, meta)
    return registry


def unfinished_saves(directory: str | os.PathLike) -> list[str]:
    """The temporary directories of saves in ``directory`` that never completed (Orbax's
    ``<step>.orbax-checkpoint-tmp*``): no restore reads them."""
    pattern = os.path.join(glob.escape(os.fspath(directory)), "*.orbax-checkpoint-tmp*")
    return sorted(glob.glob(pattern))


@contextlib.contextmanager
def _quiet_listing() -> Iterator[None]:
    """Orbax's absl warnings muted while it lists the checkpoints (in its threads too).

    Listing a step directory that is not a checkpoint (junk in ``checkpoints/40/``)
    logs ``Metadata file does not exist`` from Orbax's threads; adaptjax says so
    itself, once (:meth:`RunCheckpoints.all_steps`, a resume's quarantine).
    """
    logger = logging.getLogger("absl")
    before = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(before)


def _join_orphan_writers(timeout: float) -> None:
    """Waits (up to ``timeout`` seconds in all) for Orbax's writer threads still running."""
    try:
        from orbax.checkpoint._src.futures.future import _SignalingThread
    except ImportError:  # another Orbax: nothing known to wait for
        return
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if isinstance(thread, _SignalingThread) and thread.is_alive():
            with contextlib.suppress(Exception):  # its join re-raises what failed it
                thread.join(max(0.0, deadline - time.monotonic()))


class RunCheckpoints:
    """Saves and restores whole training snapshots with Orbax.

    A thin wrapper around ``orbax.checkpoint.CheckpointManager``: each step
    directory holds the :class:`adaptjax.TrainState` arrays and one JSON
    document (your ``meta`` dict plus the model fingerprint). Saving is
    asynchronous inside Orbax; ``save(..., wait=True)`` (the default) returns
    once the checkpoint is complete on disk. In a multi-process job every
    process calls every method.

    Args:
      directory: a local (or mounted) checkpoint directory, created on the
        first save.
      max_to_keep: how many most recent checkpoints to keep (``None``: all).

    Example:
      >>> import tempfile, jax.numpy as jnp, optax, adaptjax
      >>> tx = optax.chain(adaptjax.sync_gradients("data"), optax.sgd(0.1))
      >>> state = adaptjax.init_state({"w": jnp.arange(8.0)}, tx, adaptjax.make_mesh(8))
      >>> run_dir = tempfile.mkdtemp()
      >>> with adaptjax.RunCheckpoints(run_dir + "/ckpt") as ckpt:
      ...     ckpt.save(10, state, {"cursor": 640})
      ...     new_mesh = adaptjax.make_mesh(4)
      ...     target = adaptjax.init_state({"w": jnp.zeros(8)}, tx, new_mesh)
      ...     restored, meta = ckpt.restore(target_state=target, mesh=new_mesh)
      >>> ckpt.latest_step(), meta, restored.params["w"][3].item()
      (10, {'cursor': 640}, 3.0)
      >>> restored.params["w"].sharding.mesh.shape["data"]
      4
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3):
        max_to_keep = check_max_to_keep(max_to_keep)
        directory = os.fspath(directory)
        if "://" in directory:
            raise ValueError(
                f"RunCheckpoints takes a local directory, got {directory}; mount the bucket "
                "(e.g. with gcsfuse) or use orbax.checkpoint directly"
            )
        self._directory = os.path.abspath(directory)
        self._max_to_keep = None if max_to_keep is None else int(max_to_keep)
        self._warned: set[str] = set()
        options = ocp.CheckpointManagerOptions(
            create=False,  # created by save(), after the writability check
            # Retention is ours (_retain): Orbax's would count a stray "999/" as a checkpoint.
            preservation_policy=ocp.checkpoint_managers.LatestN(n=None),
            # A save's directories are made in the caller's thread, so that a failure to make
            # them (no space, no inode left) is raised by save() itself. Made by Orbax's
            # threads, it left the writers waiting for them until a 5-minute timeout, which
            # also held the process at exit.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        )
        # Constructing the Orbax manager reads the directory (if it exists) and
        # writes nothing: no root metadata is passed and create=False.
        with _quiet_listing():
            self._manager = ocp.CheckpointManager(
                self._directory, options=options, handler_registry=_handler_registry()
            )

    def _reload(self) -> None:
        with _quiet_listing():
            self._manager.reload()

    @property
    def directory(self) -> str:
        """The absolute checkpoint directory."""
        return self._directory

    def _settle(self) -> None:
        """Waits for an in-flight save and re-reads the list of complete checkpoints.

        Across processes every process calls this at the same points: after the
        waits, a barrier, so that none reads the directory before process 0 has
        committed (renamed) the save and all of them see the same checkpoints.
        """
        self.wait()
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("adaptjax-checkpoint-settle")
        self._reload()

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, ascending (waits for a pending save).

        A step directory without both items (``state`` and ``meta``) is not a
        checkpoint: it is left alone and ignored, with a warning naming it once.
        """
        self._settle()
        steps = []
        primary = jax.process_index() == 0
        for step in sorted(int(s) for s in self._manager.all_steps()):
            where = os.path.join(self._directory, str(step))
            if all(os.path.isdir(os.path.join(where, item)) for item in ("state", "meta")):
                steps.append(step)
            elif where not in self._warned and primary:
                self._warned.add(where)
                warnings.warn(
                    f"{where} is not an adaptjax checkpoint (no state/meta items); ignored",
                    UserWarning,
                    stacklevel=2,
                )
        if jax.process_count() > 1:
            # Process 0 committed every save and deletes old ones as soon as it has this list:
            # its list (read before any of that) is the one every process acts on.
            steps = broadcast_json(steps)
        return steps

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None`` (waits for a pending save)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def strays(self) -> dict[str, str]:
        """Entries named like a step that are not complete checkpoints: ``{name: why}``.

        A file, or a directory without the ``state`` or the ``meta`` item (a
        checkpoint deleted by hand in part, junk left in ``checkpoints/150/``):
        no restore reads it, and a save of that step would find it in the way.
        Temporary directories of unfinished saves are not listed.
        """
        out: dict[str, str] = {}
        if not os.path.isdir(self._directory):
            return out
        for name in sorted(os.listdir(self._directory), key=lambda n: (len(n), n)):
            where = os.path.join(self._directory, name)
            if not name.isdigit():
                continue
            if not os.path.isdir(where):
                out[name] = "a file, not a checkpoint directory"
                continue
            missing = [i for i in ("state", "meta") if not os.path.isdir(os.path.join(where, i))]
            if missing:
                out[name] = f"not a complete checkpoint (no {' or '.join(missing)} item)"
        return out

    def bytes_on_disk(self, step: int) -> int:
        """The space checkpoint ``step`` takes on disk (allocated blocks of all its files)."""
        total = 0
        for root, _, files in os.walk(os.path.join(self._directory, str(step))):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
        return total

    def dropped_by_next_save(self) -> list[int]:
        """The checkpoints :meth:`save` deletes before it writes (``max_to_keep``)."""
        if self._max_to_keep is None:
            return []
        steps = self.all_steps()
        return steps[: max(0, len(steps) - (self._max_to_keep - 1))]

    def save(
        self, step: int, state: TrainState, meta: Mapping[str, Any], *, wait: bool = True
    ) -> None:
        """Writes a complete checkpoint of ``state`` and ``meta`` at ``step``.

        Everything is checked before anything is written: the arguments, that
        the directory is writable, and that ``step`` is newer than the latest
        checkpoint. The values saved are those ``state`` holds at the call:
        with ``wait=False`` it may be passed to a donating step right away
        (while Orbax still reads the buffers, XLA copies instead of donating).

        Args:
          step: the checkpoint's step number; must exceed :meth:`latest_step`.
          state: the :class:`adaptjax.TrainState` to save.
          meta: a JSON-serialisable dict (data cursor, configuration, policy
            states, ...). It comes back through JSON: tuples become lists and
            dict keys strings.
          wait: block until the checkpoint is complete on disk; with ``False``
            Orbax finishes writing in the background (the next call to any
            method of this manager waits for it).
        """
        step = check_count(step, "step")
        _check_train_state(state, "state")
        if not isinstance(meta, Mapping):
            raise ValueError(f"meta must be a dict, got {type(meta).__name__}")
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"meta must be JSON-serialisable ({e}); convert arrays with .tolist() and "
                "numpy scalars with float()/int()"
            ) from None
        _check_writable(self._directory)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(
                f"checkpoint step {step} is not after the latest step {latest} in "
                f"{self._directory}; save a later step or {_FIX}"
            )
        with deferred_interrupts():
            self._retain(keep=None if self._max_to_keep is None else self._max_to_keep - 1)
            self._write(step, state, meta, wait=wait)

    def _write(self, step: int, state: TrainState, meta: Mapping[str, Any], *, wait: bool):
        """Orbax's save of ``step`` (checked by :meth:`save`)."""
        payload = {
            "format": _FORMAT,
            "meta": dict(meta),
            "replicas": _replica_count(state.opt_state),
            "model": tree_fingerprint(state.params, "params"),
            "opt_state": _opt_fingerprint(state.opt_state),
            "model_state": tree_fingerprint(state.model_state, "model_state"),
            "checksums": tree_checksums(state),
        }
        os.makedirs(self._directory, exist_ok=True)
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(payload)
            ),
            force=True,  # we decided to save; skip Orbax's interval policy
        )
        if wait:
            self._manager.wait_until_finished()

    def _resolve_step(self, step) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise ValueError(
                    f"no complete checkpoint in {self._directory}; save one first or {_FIX}"
                )
            return steps[-1]
        step = check_count(step, "step")
        if step not in steps:
            raise ValueError(
                f"no complete checkpoint for step {step} in {self._directory}; "
                f"complete steps: {steps}"
            )
        return step

    def _payload(self, step: int) -> dict:
        where = os.path.join(self._directory, str(step))
        if not os.path.isdir(os.path.join(where, "meta")):
            raise ValueError(
                f"checkpoint at {where} was not written by adaptjax.RunCheckpoints (it has "
                f"no 'meta' item); {_FIX}"
            )
        payload = self._read(step, "an unreadable meta item", meta=ocp.args.JsonRestore())["meta"]
        if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
            raise ValueError(
                f"checkpoint at {where} has meta format "
                f"{payload.get('format') if isinstance(payload, dict) else None!r}, expected "
                f"{_FORMAT!r}; {_FIX}"
            )
        return payload

    def read_meta(self, step: int | None = None) -> dict:
        """The ``meta`` dict saved at ``step`` (default: the latest), reading no array.

        Use it to rebuild the configuration (mesh, batch size, codec, ...) before
        building the ``target_state`` for :meth:`restore`.
        """
        return self._payload(self._resolve_step(step))["meta"]

    def restore(
        self,
        step: int | None = None,
        *,
        target_state: TrainState,
        mesh: jax.sharding.Mesh,
        axis_name: str | tuple[str, ...] = "data",
    ) -> tuple[TrainState, dict]:
        """Restores the checkpoint at ``step`` (default: the latest) onto ``mesh``.

        ``mesh`` may have a different replica count than the mesh the
        checkpoint was saved from: per-replica leaves are read at the saved
        count and mapped with :func:`adaptjax.sync.merge_replicas`. Before any array
        is read, the checkpoint's fingerprints are compared with
        ``target_state``'s (a different model or optimizer state raises a
        one-line ``ValueError``); nothing on disk is changed by a restore.

        Args:
          step: the step to restore; ``None`` for the latest complete one.
          target_state: a :class:`adaptjax.TrainState` for the new mesh (e.g.
            from :func:`adaptjax.init_state`, or its ``jax.eval_shape``): it
            gives the tree structure, dtypes and the NNX ``graphdef``; its
            values are not used.
          mesh: the mesh to place the restored state on.
          axis_name: the data-parallel axis of ``mesh``.

        Returns:
          ``(state, meta)``: the placed state and the saved ``meta`` dict.
        """

        n_new = check_mesh(mesh, axis_name)
        _check_train_state(target_state, "target_state")
        step = self._resolve_step(step)
        payload = self._payload(step)
        where = os.path.join(self._directory, str(step))
        diff = _first_difference(payload["model"], tree_fingerprint(target_state.params, "params"))
        if diff is not None:
            raise ValueError(
                f"checkpoint at {where} was written for a different model: {diff}; {_FIX}"
            )
        diff = _first_difference(
            payload["model_state"], tree_fingerprint(target_state.model_state, "model_state")
        ) or _first_difference(payload["opt_state"], _opt_fingerprint(target_state.opt_state))
        if diff is not None:
            raise ValueError(
                f"checkpoint at {where} was written with a different optimizer or model state: "
                f"{diff}; build target_state with the same optimizer, or {_FIX}"
            )
        n_old: int | None = payload["replicas"]
        rescale = n_old is not None and n_old != n_new
        saved_rows = n_old if n_old is not None and rescale else n_new  # per-replica leaves

        leaves, treedef = jax.tree.flatten(target_state)
        specs = jax.tree.leaves(train_state_specs(target_state, axis_name), is_leaf=_is_spec)
        placed = _target_shardings(leaves, specs, mesh)
        abstract, restore_args = [], []
        for leaf, spec, sharding in zip(leaves, specs, placed, strict=True):
            dtype = np.dtype(leaf.dtype)
            shape = tuple(int(d) for d in np.shape(leaf))
            if len(spec) > 0:  # per-replica: leading axis = replica count
                shape = (saved_rows, *shape[1:])
            if len(spec) > 0 and rescale:
                # read all saved replicas to the host; merged below
                abstract.append(jax.ShapeDtypeStruct(shape, dtype))
                restore_args.append(ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype))
            else:
                abstract.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
                restore_args.append(
                    ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)
                )
        restored = self._read(
            step,
            "unreadable arrays",
            state=ocp.args.PyTreeRestore(
                item=treedef.unflatten(abstract), restore_args=treedef.unflatten(restore_args)
            ),
        )["state"]
        self._verify(restored, payload, where)
        if rescale:
            restored = merge_replicas(restored, n_new)
            restored = jax.device_put(restored, treedef.unflatten(placed))
        return restored, payload["meta"]

    def _read(self, step: int, what: str, **items):
        """Orbax's restore of ``items``; its errors (TensorStore, JSON) become one line naming
        the step and the fix."""
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:
            where = os.path.join(self._directory, str(step))
            raise CorruptCheckpointError(
                f"checkpoint at {where} has {what} ({_first_line(e)}); "
                "restore an earlier step or move this one away"
            ) from e

    @staticmethod
    def _verify(restored, payload: dict, where: str) -> None:
        saved = payload.get("checksums")
        if saved is None:
            raise CorruptCheckpointError(
                f"checkpoint at {where} has no checksums, so its arrays cannot be verified; "
                "restore an earlier step or move this one away"
            )
        for path, digest in tree_checksums(restored).items():
            if saved.get(path) != digest:
                raise CorruptCheckpointError(
                    f"checkpoint at {where} is corrupt: {path} does not match the checksum "
                    "written at save; restore an earlier step or move this one away"
                )

    def _retain(self, keep: int | None) -> None:
        """Deletes the oldest complete checkpoints beyond the newest ``keep``."""
        if keep is None:
            return
        steps = self.all_steps()
        for step in steps[: max(0, len(steps) - keep)]:
            self._delete(step)

    def _delete(self, step: int) -> None:
        if jax.process_count() == 1:
            with deferred_interrupts():
                self._manager.delete(step)
            return
        # Across processes Orbax's delete needs identical cached listings and barrier counts on
        # every process; process 0 removes the directory, then everyone re-reads the listing.
        if jax.process_index() == 0:
            shutil.rmtree(os.path.join(self._directory, str(step)), ignore_errors=True)
        multihost_utils.sync_global_devices("adaptjax-checkpoint-delete")
        self._reload()

    def delete(self, step: int) -> None:
        """Deletes the checkpoint of ``step`` (waits for a pending save first)."""
        self._settle()
        self._delete(step)

    def is_saving(self) -> bool:
        """Whether a save is still being written in the background (does not wait)."""
        return bool(self._manager.is_saving_in_progress())

    def wait(self) -> None:
        """Blocks until a pending save is complete on disk (or has failed: it raises)."""
        with deferred_interrupts():
            self._manager.wait_until_finished()

    def discard_incomplete(self) -> list[str]:
        """Removes the temporary directories of saves that never completed; returns them.

        Call it only when no save is in flight (after :meth:`wait`): an interrupted
        process leaves ``<step>.orbax-checkpoint-tmp*`` behind, which no restore reads.
        A save that failed may leave Orbax's writers of its other items running
        (Orbax stops waiting at the first error): they are waited for first, so
        that none writes into the directory after it is removed.
        """
        _join_orphan_writers(timeout=60.0)
        gone = unfinished_saves(self._directory)
        for path in gone:
            shutil.rmtree(path, ignore_errors=True)
        return gone

    def reload(self) -> None:
        """Re-reads the list of checkpoints on disk (after another process changed it)."""
        self._reload()

    def quarantine(self, step: int | str, into: str | os.PathLike) -> str:
        """Moves checkpoint ``step`` out of the directory (into ``into``) and returns its new path.

        Used for a checkpoint that failed verification: it is kept for
        inspection, never deleted, and no longer counts as a checkpoint.
        """
        into = os.fspath(into)
        os.makedirs(into, exist_ok=True)
        target = os.path.join(into, str(step))
        n = 1
        while os.path.exists(target):
            target = os.path.join(into, f"{step}.{n}")
            n += 1
        with deferred_interrupts():
            shutil.move(os.path.join(self._directory, str(step)), target)
        self._reload()
        return target

    def close(self) -> None:
        """Waits for a pending save, applies ``max_to_keep`` and releases Orbax's resources."""
        try:
            self.wait()
            self._retain(self._max_to_keep)
        finally:
            self._manager.close()

    def __enter__(self) -> RunCheckpoints:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RunCheckpoints({self._directory!r})"
