"""Reading a step's metrics from the device a step behind, without stalling dispatch."""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from adaptjax._metric_vector import Metrics
from adaptjax._run_config import RunConfig
from adaptjax.controller._run_dir import user_stacklevel


@dataclasses.dataclass
class Snapshot:
    """One step's metrics as plain floats, with the configuration that produced them."""

    step: int
    config: RunConfig
    metrics: dict[str, float]


class MetricsReader:
    """Queues each dispatched step's device metrics and turns them into :class:`Snapshot`s.

    ``push`` after dispatching step *t*; ``read(lag=1)`` then returns the
    snapshots of every step but the newest (whose values may still be in
    flight), so reading never waits on the device; ``read(lag=0)`` drains.
    Besides the step's own values a snapshot holds ``nonfinite_count`` (the
    run's total), ``step_time`` and ``throughput`` (median interval between
    consecutive completions of this configuration, its first step skipped),
    ``batch_size``, ``devices`` and, when ``comm_time(config)`` gives a value,
    ``comm_time`` and ``comm_share``. The first skipped (non-finite) step a
    reader sees warns once, with the run's count so far.

    Example:
      >>> import numpy as np
      >>> from adaptjax import RunConfig
      >>> from adaptjax.controller._metrics_reader import MetricsReader
      >>> reader = MetricsReader()
      >>> for t in (1, 2):
      ...     reader.push(t, RunConfig(2, 4), {"loss": np.float32(t), "nonfinite": 0.0})
      >>> [s.step for s in reader.read(lag=1)], [s.step for s in reader.read(lag=0)]
      ([1], [2])
    """

    def __init__(self, comm_time: Callable[[RunConfig], float | None] | None = None):
        self._comm_time = comm_time
        self._pending: list[tuple[int, RunConfig, Any]] = []
        self._times: dict[RunConfig, list[float]] = {}
        self._last_ready: float | None = None
        self._fresh = True
        self.nonfinite_count = 0
        self.nonfinite_streak = 0
        self._warned_nonfinite = False

    def push(self, step: int, config: RunConfig, device_metrics, *, compiled: bool = False) -> None:
        """Queues step ``step``'s metrics (``compiled``: this step compiled, so it is not timed)."""
        if compiled:
            self._fresh = True
        self._pending.append((step, config, device_metrics))

    def read(self, lag: int = 1) -> list[Snapshot]:
        """Snapshots of the queued steps except the newest ``lag``, oldest first."""
        out = []
        while len(self._pending) > lag:
            out.append(self._snapshot(*self._pending.pop(0)))
        return out

    def step_times(self) -> dict[RunConfig, float]:
        """The median seconds per step of each configuration timed so far."""
        return {c: statistics.median(t) for c, t in self._times.items() if t}

    def restart_clock(self) -> None:
        """Forgets the last completion time (after evaluation, checkpoints or a new mesh)."""
        self._last_ready = None

    def _snapshot(self, step: int, config: RunConfig, device_metrics) -> Snapshot:
        values = jax.device_get(_scalar_aux(device_metrics))
        now = time.perf_counter()
        flat = _floats(values)
        skipped = flat.get("nonfinite", 0.0) > 0
        self.nonfinite_count += int(skipped)
        self.nonfinite_streak = self.nonfinite_streak + 1 if skipped else 0
        if skipped and not self._warned_nonfinite:
            self._warned_nonfinite = True
            warnings.warn(
                f"step {step} had a non-finite gradient or loss and was skipped "
                f"({self.nonfinite_count} skipped in this run so far; said once: later skips "
                "are counted in the metric nonfinite_count and listed by adaptjax report)",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        flat["nonfinite_count"] = float(self.nonfinite_count)
        if self._last_ready is not None and not self._fresh:
            times = self._times.setdefault(config, [])
            times.append(now - self._last_ready)
            del times[:-32]  # the median of the last 32 is all that is read
        self._fresh = False
        self._last_ready = now
        times = self._times.get(config)
        if times:
            step_time = statistics.median(times)
            flat["step_time"] = step_time
            flat["throughput"] = config.batch_size / step_time
            comm = self._comm_time(config) if self._comm_time is not None else None
            if comm is not None:
                flat["comm_time"] = comm
                flat["comm_share"] = comm / (step_time + comm)
        flat["batch_size"] = float(config.batch_size)
        flat["devices"] = float(config.devices)
        return Snapshot(step, config, flat)


def _scalar_aux(values: Mapping[str, Any]) -> Mapping[str, Any]:
    """``values`` with only the scalar leaves of its ``aux``: a metric is one number.

    The per-example leaves a step returns (a loss function's logits, gathered in
    batch order) are left on the device, neither fetched nor logged.
    """
    extras = values.extras if isinstance(values, Metrics) else values
    if "aux" not in extras:
        return values
    aux = jax.tree.map(lambda x: x if np.ndim(x) == 0 else None, extras["aux"])
    if isinstance(values, Metrics):
        return Metrics(values.names, values.values, {**values.extras, "aux": aux})
    return {**values, "aux": aux}


def _floats(values: Mapping[str, Any]) -> dict[str, float]:
    """A step's fetched metrics as Python floats; scalar ``aux`` leaves keyed ``aux<path>``."""
    if isinstance(values, Metrics):  # one vector: a single conversion, not one per name
        flat = dict(zip(values.names, np.asarray(values.values).tolist(), strict=True))
        rest: Mapping[str, Any] = values.extras
    else:
        flat, rest = {}, values
    for key, value in rest.items():
        if key == "aux":
            for path, leaf in jax.tree_util.tree_leaves_with_path(value):
                flat["aux" + jax.tree_util.keystr(path)] = float(np.asarray(leaf))
        else:
            flat[key] = float(np.asarray(value))
    return flat


def add_host_metrics(metrics: dict[str, float], hyperparams: Mapping[str, float],
                     link_bandwidth: float | None, clock: Mapping[str, float]) -> None:
    """Adds to a snapshot's ``metrics`` what the host knows of its step (never overwriting).

    The hyperparameters in force at its dispatch (e.g. ``learning_rate``, for
    plots and TensorBoard), ``wire_bytes`` per device (from ``comm_time`` and
    the link's bandwidth) and the run clock's ``compile_seconds`` and
    ``train_seconds``: recorded with the row, so a replay
    (:func:`adaptjax.costs.simulate`) sees them too.

    Example:
      >>> from adaptjax.controller._metrics_reader import add_host_metrics
      >>> m = {"loss": 1.0, "comm_time": 0.5}
      >>> add_host_metrics(m, {"learning_rate": 0.1}, 1e3, {"train_seconds": 2.0})
      >>> m["wire_bytes"], m["learning_rate"], m["train_seconds"]
      (500.0, 0.1, 2.0)
    """
    for key, value in hyperparams.items():
        metrics.setdefault(key, value)
    if link_bandwidth is not None and "comm_time" in metrics:
        metrics.setdefault("wire_bytes", metrics["comm_time"] * float(link_bandwidth))
    for key, value in clock.items():
        metrics.setdefault(key, value)
