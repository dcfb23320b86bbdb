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

    def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = True):
        self.run_dir = os.fspath(run_dir)
        self._metrics = open(os.path.join(self.run_dir, "metrics.jsonl"), "a", buffering=1 << 16)
        self._events = open(os.path.join(self.run_dir, "events.jsonl"), "a", buffering=1)
        self._writer = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(os.path.join(self.run_dir, "tensorboard"))
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

    def truncate_metrics_after(self, step: int) -> None:
        """Drops metric lines of steps after ``step`` (they are recomputed on resume)."""
        self._metrics.flush()
        path = os.path.join(self.run_dir, "metrics.jsonl")
        with open(path) as f:
            keep = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, path)
        self._metrics.close()
        self._metrics = open(path, "a", buffering=1 << 16)

    def flush(self) -> None:
        self._metrics.flush()
        self._events.flush()
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        self.flush()
        self._metrics.close()
        self._events.close()
        if self._writer is not None:
            self._writer.close()
