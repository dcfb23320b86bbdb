"""What a controller run leaves behind: metrics, events, TensorBoard, a progress bar."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any


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
      tensorboard: also write TensorBoard event files.

    Example:
      >>> import json, tempfile, adaptjax
      >>> d = tempfile.mkdtemp()
      >>> log = adaptjax.RunLog(d, tensorboard=False)
      >>> log.event("checkpoint", step=10, latency_s=0.5)
      >>> log.close()
      >>> json.loads(open(d + "/events.jsonl").read())["kind"]
      'checkpoint'
    """

    def __init__(
        self, run_dir: str | os.PathLike, *, tensorboard: bool = True, purge_step: int | None = None
    ):
        self.run_dir = os.fspath(run_dir)
        self._metrics = open(os.path.join(self.run_dir, "metrics.jsonl"), "a", buffering=1 << 16)
        self._events = open(os.path.join(self.run_dir, "events.jsonl"), "a", buffering=1)
        self._writer = None
        if tensorboard:
            # deferred: tensorboardX takes a third of a second to import, and the read-only
            # commands of the CLI import this module for read_jsonl_rows (standard library)
            from tensorboardX import SummaryWriter

            # purge_step: TensorBoard hides the points of steps a resumed run recomputes.
            self._writer = SummaryWriter(
                os.path.join(self.run_dir, "tensorboard"), purge_step=purge_step
            )
        self.events: list[dict] = []

    def metrics(self, step: int, values: Mapping[str, Any]) -> None:
        """Records one step's metrics."""
        row = {"step": int(step), **{k: _jsonable(v) for k, v in values.items()}}
        self._metrics.write(json.dumps(row) + "\n")
        if self._writer is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, float | int):
                    self._writer.add_scalar(key, value, int(step))

    def event(self, kind: str, *, step: int, **fields) -> None:
        """Records one event (``kind`` is e.g. ``"rescale"``), timestamped."""
        row = {"time": time.time(), "kind": kind, "step": int(step)}
        row.update({k: _jsonable(v) for k, v in fields.items()})
        self.events.append(row)
        self._events.write(json.dumps(row) + "\n")
        if self._writer is not None and "latency_s" in row:
            self._writer.add_scalar(f"latency/{kind}", row["latency_s"], int(step))

    def has_event(self, kind: str, step: int) -> bool:
        """Whether ``events.jsonl`` holds an event of ``kind`` at ``step``."""
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
        self.events = read_jsonl_rows(os.path.join(self.run_dir, "events.jsonl"))

    def flush(self) -> None:
        """Hands buffered rows to the operating system."""
        self._metrics.flush()
        self._events.flush()
        if self._writer is not None:
            self._writer.flush()

    def sync(self) -> None:
        """Flushes and fsyncs both files: rows written so far survive a kill or power loss."""
        self.flush()
        for f in (self._metrics, self._events):
            os.fsync(f.fileno())

    def close(self) -> None:
        """Syncs and closes the files."""
        if self._metrics.closed:
            return
        self.sync()
        self._metrics.close()
        self._events.close()
        if self._writer is not None:
            self._writer.close()


class NullRunLog:
    """The log of a process other than 0 in a multi-process job: events in memory, no files.

    Process 0 alone writes ``metrics.jsonl``, ``events.jsonl`` and TensorBoard;
    every other process runs the same loop against this stand-in, which keeps
    :attr:`events` (this session's events, as :class:`RunLog` does) and writes
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

    def event(self, kind: str, *, step: int, **fields) -> None:
        """Keeps the event in :attr:`events` only."""
        row = {"time": time.time(), "kind": kind, "step": int(step)}
        row.update({k: _jsonable(v) for k, v in fields.items()})
        self.events.append(row)

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


def read_jsonl_rows(path: str | os.PathLike) -> list[dict]:
    """The JSON rows of a ``.jsonl`` file, skipping a torn (unparseable) line."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def event_latencies(events: list[dict], kind: str) -> list[float]:
    """``latency_s`` of each event of ``kind`` that has one (a failed compile has none).

    Example:
      >>> from adaptjax.controller._run_log import event_latencies
      >>> event_latencies([{"kind": "compile", "latency_s": 2.5}, {"kind": "compile"},
      ...                  {"kind": "eval", "latency_s": 1.0}], "compile")
      [2.5]
    """
    return [
        float(e["latency_s"]) for e in events
        if e.get("kind") == kind and isinstance(e.get("latency_s"), int | float)
    ]


def truncate_run_logs(run_dir: str | os.PathLike, step: int) -> None:
    """Rewrites ``metrics.jsonl`` and ``events.jsonl`` without rows of steps after ``step``.

    A torn last line (the process was killed mid-write) is dropped too. Each
    file is replaced atomically (written aside, fsynced, renamed).
    """
    for name in ("metrics.jsonl", "events.jsonl"):
        path = os.path.join(os.fspath(run_dir), name)
        if not os.path.exists(path):
            continue
        keep = [r for r in read_jsonl_rows(path) if int(r.get("step", 0)) <= step]
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
