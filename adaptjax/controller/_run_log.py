"""What a controller run leaves behind: metrics, events, TensorBoard, a progress bar."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import os
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

from adaptjax._events import event_latencies  # noqa: F401 - the CLI reads it from here
from adaptjax.controller._run_lock import RunDirectoryError, as_run_dir_error


def _jsonable(value):
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)


class RunLog:
    """Appends metrics and events of a run to ``run_dir``.

    * ``metrics.jsonl``: one line per step, ``{"step": s, name: value, ...}``.
    * ``events.jsonl``: one line per decision, action, recompilation, rescale,
      checkpoint or restore, with its latency in seconds where it has one.
    * ``tensorboard/``: the same scalars as TensorBoard event files (tensorboardX).

    Args:
      run_dir: the run directory (must exist).
      tensorboard: also write TensorBoard event files (every ``tensorboard_every`` steps).

    Example:
      >>> import json, tempfile, adaptjax
      >>> d = tempfile.mkdtemp()
      >>> log = RunLog(d, tensorboard=False)
      >>> log.event("checkpoint", step=10, latency_s=0.5)
      >>> log.close()
      >>> json.loads(open(d + "/events.jsonl").read())["kind"]
      'checkpoint'
    """

    def __init__(
        self, run_dir: str | os.PathLike, *, tensorboard: bool = True,
        purge_step: int | None = None, tensorboard_every: int = 1,
    ):
        self.run_dir = os.fspath(run_dir)
        self._metrics = open(os.path.join(self.run_dir, "metrics.jsonl"), "a", buffering=1 << 16)
        self._events = open(os.path.join(self.run_dir, "events.jsonl"), "a", buffering=1)
        self._writer, self._tensorboard_every = None, tensorboard_every
        if tensorboard:
            # deferred: tensorboardX takes a third of a second to import, and the read-only
            # commands of the CLI import this module for read_jsonl_rows (standard library)
            from tensorboardX import SummaryWriter

            # purge_step: TensorBoard hides the points of steps a resumed run recomputes.
            self._writer = SummaryWriter(
                os.path.join(self.run_dir, "tensorboard"), purge_step=purge_step
            )
        self._tags: dict[str, str] = {}  # metric key -> TensorBoard tag (_scalars)
        self.events: list[dict] = []
        self.failed = False  # a write failed (and raised RunDirectoryError)

    def metrics(self, step: int, values: Mapping[str, Any]) -> None:
        """Records one step's metrics."""
        row = {"step": int(step), **{k: _jsonable(v) for k, v in values.items()}}
        with self._writing(self._metrics):
            self._metrics.write(json.dumps(row) + "\n")
        if self._writer is not None and step % self._tensorboard_every == 0:
            self._scalars(self._writer, {k: v for k, v in row.items()
                                         if k != "step" and isinstance(v, float | int)}, int(step))

    def _scalars(self, writer, values: Mapping[str, float], step: int) -> None:
        """Writes ``values`` as one TensorBoard event (a ``Summary`` with a value per key).

        ``SummaryWriter.add_scalar`` writes an event per scalar and converts each
        through numpy: ~0.1 ms a scalar on the main thread, 3.9 ms a step for 30
        metrics, most of the controller's host work in the
        controller-overhead benchmark; one event of 30 values costs 0.02 ms
        to build. Tags are cleaned as ``add_scalar`` cleans them, once per key.
        """
        from tensorboardX.proto.summary_pb2 import (  # generated: no stubs
            Summary,  # pyright: ignore[reportAttributeAccessIssue]
        )
        from tensorboardX.summary import scalar

        tags = self._tags
        for key in values:
            if key not in tags:
                tags[key] = scalar(key, 0.0).value[0].tag
        summary = Summary(value=[Summary.Value(tag=tags[k], simple_value=float(x))
                                 for k, x in values.items()])
        writer._get_file_writer().add_summary(summary, step)

    def event(self, kind: str, *, step: int, **fields: Any) -> None:
        """Records one event (``kind`` is e.g. ``"rescale"``), timestamped."""
        row = {"time": time.time(), "kind": kind, "step": int(step)}
        row.update({k: _jsonable(v) for k, v in fields.items()})
        add_event(self.events, row)
        with self._writing(self._events):
            self._events.write(json.dumps(row) + "\n")
        if self._writer is not None and "latency_s" in row:
            self._writer.add_scalar(f"latency/{kind}", row["latency_s"], int(step))

    def has_event(self, kind: str, step: int) -> bool:
        """Whether ``events.jsonl`` holds an event of ``kind`` at ``step``."""
        with self._writing(self._events):
            self._events.flush()
        return any(
            e.get("kind") == kind and e.get("step") == step
            for e in read_jsonl_rows(os.path.join(self.run_dir, "events.jsonl"))
        )

    def truncate_after(self, step: int) -> None:
        """Drops the metric rows and events of steps after ``step`` (a resume recomputes them)."""
        self.flush()
        truncate_run_logs(self.run_dir, step)
        self._metrics.close()
        self._events.close()
        self._metrics = open(os.path.join(self.run_dir, "metrics.jsonl"), "a", buffering=1 << 16)
        self._events = open(os.path.join(self.run_dir, "events.jsonl"), "a", buffering=1)
        self.events = read_events(self.run_dir)

    def flush(self) -> None:
        """Hands buffered rows to the operating system."""
        for f in (self._metrics, self._events):
            with self._writing(f):
                f.flush()
        if self._writer is not None:
            self._writer.flush()

    def sync(self) -> None:
        """Flushes and fsyncs both files: rows written so far survive a kill or power loss.

        A failed write raises a one-line :class:`adaptjax.controller._run_lock.RunDirectoryError`
        naming the file.
        """
        self.flush()
        for f in (self._metrics, self._events):
            with self._writing(f):
                os.fsync(f.fileno())

    @contextlib.contextmanager
    def _writing(self, f) -> Iterator[None]:
        try:
            with _writing(f):
                yield
        except RunDirectoryError:
            self.failed = True
            raise

    def close(self) -> None:
        """Syncs and closes the files (closed even when the sync fails).

        A failed sync raises, unless a write of this log failed before (that
        error was raised then: rows written since cannot reach the disk either).
        """
        if self._metrics.closed:
            return
        try:
            if self.failed:
                with contextlib.suppress(OSError):
                    self.sync()
            else:
                self.sync()
        finally:
            for f in (self._metrics, self._events):
                with contextlib.suppress(OSError):  # its rows could not be written: said above
                    f.close()
            if self._writer is not None:
                self._writer.close()


class NullRunLog:
    """The log of a process other than 0 in a multi-process job: events in memory, no files.

    Process 0 alone writes ``metrics.jsonl``, ``events.jsonl`` and TensorBoard;
    every other process runs the same loop against this stand-in, which keeps
    :attr:`events` (this session's events, as ``RunLog`` does) and writes
    nothing.

    Example:
      >>> from adaptjax.controller._run_log import NullRunLog
      >>> log = NullRunLog()
      >>> log.event("checkpoint", step=3)
      >>> [e["kind"] for e in log.events], log.has_event("checkpoint", 3)
      (['checkpoint'], True)
    """

    def __init__(self):
        self.events: list[dict] = []

    def metrics(self, step: int, values: Mapping[str, Any]) -> None:
        """Writes nothing."""

    def event(self, kind: str, *, step: int, **fields: Any) -> None:
        """Keeps the event in :attr:`events` only."""
        row = {"time": time.time(), "kind": kind, "step": int(step)}
        row.update({k: _jsonable(v) for k, v in fields.items()})
        add_event(self.events, row)

    def has_event(self, kind: str, step: int) -> bool:
        """True: process 0 writes recovered events, never this one."""
        return True

    def truncate_after(self, step: int) -> None:
        """Writes nothing."""

    def flush(self) -> None:
        """Writes nothing."""

    def sync(self) -> None:
        """Writes nothing."""

    def close(self) -> None:
        """Writes nothing."""


@contextlib.contextmanager
def _writing(f) -> Iterator[None]:
    """Turns an OS error writing the log file ``f`` into one line naming it and the fix."""
    try:
        yield
    except OSError as e:
        error = as_run_dir_error(f.name, e)
        if error is None:
            raise
        raise error from e


def scan_jsonl(path: str | os.PathLike) -> tuple[list[dict], int, bytes | None]:
    """``(rows, damaged, torn)``: the JSON object rows of a ``.jsonl`` file, read as bytes.

    A line that is not UTF-8 JSON of an object (bytes changed on disk, a hand
    edit) is damaged: skipped and counted. A last line without its newline that
    does not parse is torn (the writer was killed mid-row, or the file was cut
    short): skipped, not counted, and returned as ``torn`` (else ``None``);
    :func:`torn_step` reads its step. Blank lines are skipped.
    """
    if not os.path.exists(path):
        return [], 0, None
    rows: list[dict] = []
    damaged, torn = 0, None
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                row = None
            if isinstance(row, dict) and _step_of(row) is not None:
                rows.append(row)
            elif line.endswith(b"\n"):
                damaged += 1
            else:
                torn = line
    return rows, damaged, torn


def torn_step(line: bytes) -> int | None:
    """The step a torn row (:func:`scan_jsonl`) was written for, if it got that far.

    Example:
      >>> from adaptjax.controller._run_log import torn_step
      >>> torn_step(b'{"step": 31, "lo'), torn_step(b'{"step": 3'), torn_step(b'{"time": 1.5, ')
      (31, None, None)
    """
    found = re.search(rb'"step": (\d+)[,}]', line)
    return int(found.group(1)) if found else None


def _step_of(row: Mapping) -> int | None:
    step = row.get("step", 0)
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _kept_step(row: Mapping) -> int:
    """The step of a row :func:`scan_jsonl` kept (it keeps only rows with an int step)."""
    step = _step_of(row)
    assert step is not None
    return step


def read_jsonl_rows(path: str | os.PathLike) -> list[dict]:
    """The JSON rows of a ``.jsonl`` file, without damaged and torn lines (:func:`scan_jsonl`)."""
    return scan_jsonl(path)[0]


def add_event(events: list[dict], row: dict) -> None:
    """Inserts ``row`` into ``events`` (in step order) after every event of its step.

    A rescale or transition is logged with the step it took effect at, which
    can come after decisions logged for later steps (metrics are read a step
    or more behind); ``events`` stays in step order, and in time order within
    a step.
    """
    bisect.insort_right(events, row, key=lambda e: e["step"])


def read_events(run_dir: str | os.PathLike) -> list[dict]:
    """The events of ``run_dir/events.jsonl`` in step order (time order within a step)."""
    rows = read_jsonl_rows(os.path.join(run_dir, "events.jsonl"))
    return sorted(rows, key=lambda e: e.get("step", 0))


@dataclasses.dataclass(frozen=True)
class LogRepair:
    """What :func:`truncate_run_logs` found: damaged lines dropped, metric rows missing.

    Attributes:
      damaged: ``{file path: damaged lines dropped}`` for each file that had some.
      missing_steps: steps ``1..step`` without a row in ``metrics.jsonl``.
    """

    damaged: dict
    missing_steps: list


def truncate_run_logs(run_dir: str | os.PathLike, step: int) -> LogRepair:
    """Rewrites ``metrics.jsonl`` and ``events.jsonl`` without rows of steps after ``step``.

    Damaged and torn lines are dropped too (:func:`scan_jsonl`); a torn line
    counts as damaged unless it is of a step after ``step`` (a row a kill cut
    short, which the resume writes again). Each file is replaced atomically
    (written aside, fsynced, renamed). Returns what was dropped and which steps
    up to ``step`` have no metrics row.
    """
    damaged: dict[str, int] = {}
    kept_steps: set[int] = set()
    for name in ("metrics.jsonl", "events.jsonl"):
        path = os.path.join(os.fspath(run_dir), name)
        if not os.path.exists(path):
            continue
        rows, bad, torn = scan_jsonl(path)
        if torn is not None and (torn_step(torn) or 0) <= step:
            bad += 1
        if bad:
            damaged[path] = bad
        keep = [r for r in rows if _kept_step(r) <= step]
        if name == "metrics.jsonl":
            kept_steps = {_kept_step(r) for r in keep}
        tmp = path + ".tmp"
        with open(tmp, "w") as f, _writing(f):
            f.writelines(json.dumps(r) + "\n" for r in keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    missing = [s for s in range(1, step + 1) if s not in kept_steps]
    return LogRepair(damaged, missing)


def step_ranges(steps: list[int], most: int = 4) -> str:
    """``[1, 2, 3, 7]`` as ``'1-3, 7'`` (at most ``most`` ranges, then ``...``).

    Example:
      >>> from adaptjax.controller._run_log import step_ranges
      >>> step_ranges([1, 2, 3, 7, 9, 10]), step_ranges(list(range(1, 9, 2)), most=2)
      ('1-3, 7, 9-10', '1, 3, ...')
    """
    ranges: list[list[int]] = []
    for s in steps:
        if ranges and s == ranges[-1][1] + 1:
            ranges[-1][1] = s
        else:
            ranges.append([s, s])
    text = [f"{a}-{b}" if b > a else f"{a}" for a, b in ranges[:most]]
    return ", ".join(text + (["..."] if len(ranges) > most else []))
