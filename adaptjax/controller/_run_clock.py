"""What adapting costs and what it measured: compile waits, probe time, the run's age."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping
from typing import Any


class RunClock:
    """The waits of a run's compiles, its probes and its age, carried across resumes.

    Policies that weigh a change against its compile (``AdaptiveBatchSize``)
    read two metrics from it, which every recorded row carries (so that a
    replay, :func:`adaptjax.costs.simulate`, sees them too):

    * ``compile_seconds``: the median wait of the run's compiles, those whose
      program was compiled ahead left out (their wait says nothing of a
      compile's cost);
    * ``train_seconds``: the run's age, the checkpoint's (before this process)
      plus the time since this process's first step.

    After a critical-batch probe (:meth:`probed`) every row also carries
    ``probe_seconds`` (the run's probes so far, their share of
    ``train_seconds`` is what probing costs) and, once a probe's fit gave
    one, ``critical_batch`` with ``critical_batch_step``, the step it was
    measured at (policies act on it as on ``noise_scale``).

    Example:
      >>> from adaptjax.controller._run_clock import RunClock
      >>> clock = RunClock.from_state({"train_seconds": 5.0, "compile_waits": [1.0, 3.0]})
      >>> clock.metrics()  # no step in this process yet
      {}
      >>> clock.started(0.0)
      >>> clock.metrics()["compile_seconds"], clock.train_seconds() > 5.0
      (2.0, True)
      >>> clock.probed(0.5, critical_batch=96.0, step=40)
      >>> {k: v for k, v in clock.metrics().items() if "_seconds" not in k}
      {'critical_batch': 96.0, 'critical_batch_step': 40.0}
    """

    def __init__(self, age_before: float = 0.0, compile_waits=(), probe_seconds: float = 0.0,
                 critical_batch: tuple[float, int] | None = None):
        self.age_before = float(age_before)
        self.compile_waits = [float(w) for w in compile_waits]
        self.first_step: float | None = None  # perf_counter() at this process's first step
        self.probe_seconds = float(probe_seconds)
        # (value, step) of the latest probe whose fit gave a value
        self.critical_batch = None if critical_batch is None else (
            float(critical_batch[0]), int(critical_batch[1]))

    @classmethod
    def from_state(cls, meta: Mapping[str, Any]) -> RunClock:
        """The clock a checkpoint's ``meta`` continues (keys absent in older ones)."""
        return cls(meta.get("train_seconds", 0.0), meta.get("compile_waits", []),
                   meta.get("probe_seconds", 0.0), meta.get("critical_batch"))

    def state_dict(self) -> dict:
        """What a checkpoint keeps for :meth:`from_state`."""
        state = {"train_seconds": self.train_seconds(), "compile_waits": list(self.compile_waits)}
        if self.probe_seconds or self.critical_batch is not None:
            state.update(probe_seconds=self.probe_seconds,
                         critical_batch=None if self.critical_batch is None
                         else list(self.critical_batch))
        return state

    def started(self, t0: float) -> None:
        """Notes a step dispatched at ``t0``; the first one starts this process's clock."""
        if self.first_step is None:
            self.first_step = t0

    def compiled(self, seconds: float) -> None:
        """Notes the wait of a compile that was not done ahead."""
        self.compile_waits.append(float(seconds))

    def probed(self, seconds: float, critical_batch: float, step: int) -> None:
        """Notes a probe of ``seconds`` at ``step``; a NaN ``critical_batch`` is no fit."""
        self.probe_seconds += float(seconds)
        if not math.isnan(critical_batch):
            self.critical_batch = (float(critical_batch), int(step))

    def train_seconds(self) -> float:
        """The run's age: before this process plus since its first step."""
        now = 0.0 if self.first_step is None else time.perf_counter() - self.first_step
        return self.age_before + now

    def metrics(self) -> dict[str, float]:
        """``compile_seconds`` and ``train_seconds`` (not before a compile or a step), and
        after a probe ``probe_seconds``, ``critical_batch`` and ``critical_batch_step``."""
        out = {}
        if self.compile_waits and self.first_step is not None:
            out["compile_seconds"] = float(statistics.median(self.compile_waits))
            out["train_seconds"] = self.train_seconds()
        if self.probe_seconds:
            out["probe_seconds"] = self.probe_seconds
        if self.critical_batch is not None:
            out["critical_batch"], step = self.critical_batch
            out["critical_batch_step"] = float(step)
        return out
