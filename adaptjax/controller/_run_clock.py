"""What a change of configuration costs: the run's compile waits and its age."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np


class RunClock:
    """The waits of a run's compiles and the run's age, carried across resumes.

    Policies that weigh a change against its compile (``AdaptiveBatchSize``)
    read two metrics from it, which every recorded row carries (so that a
    replay, :func:`adaptjax.costs.simulate`, sees them too):

    * ``compile_seconds``: the median wait of the run's compiles, those whose
      program was compiled ahead left out (their wait says nothing of a
      compile's cost);
    * ``train_seconds``: the run's age, the checkpoint's (before this process)
      plus the time since this process's first step.

    Example:
      >>> from adaptjax.controller._run_clock import RunClock
      >>> clock = RunClock.from_state({"train_seconds": 5.0, "compile_waits": [1.0, 3.0]})
      >>> clock.metrics()  # no step in this process yet
      {}
      >>> clock.started(0.0)
      >>> clock.metrics()["compile_seconds"], clock.train_seconds() > 5.0
      (2.0, True)
    """

    def __init__(self, age_before: float = 0.0, compile_waits=()):
        self.age_before = float(age_before)
        self.compile_waits = [float(w) for w in compile_waits]
        self.first_step: float | None = None  # perf_counter() at this process's first step

    @classmethod
    def from_state(cls, meta: Mapping[str, Any]) -> RunClock:
        """The clock a checkpoint's ``meta`` continues (both keys absent in older ones)."""
        return cls(meta.get("train_seconds", 0.0), meta.get("compile_waits", []))

    def state_dict(self) -> dict:
        """What a checkpoint keeps for :meth:`from_state`."""
        return {"train_seconds": self.train_seconds(), "compile_waits": list(self.compile_waits)}

    def started(self, t0: float) -> None:
        """Notes a step dispatched at ``t0``; the first one starts this process's clock."""
        if self.first_step is None:
            self.first_step = t0

    def compiled(self, seconds: float) -> None:
        """Notes the wait of a compile that was not done ahead."""
        self.compile_waits.append(float(seconds))

    def train_seconds(self) -> float:
        """The run's age: before this process plus since its first step."""
        now = 0.0 if self.first_step is None else time.perf_counter() - self.first_step
        return self.age_before + now

    def metrics(self) -> dict[str, float]:
        """``compile_seconds`` and ``train_seconds`` (``{}`` before a compile or a step)."""
        if not self.compile_waits or self.first_step is None:
            return {}
        return {
            "compile_seconds": float(np.median(self.compile_waits)),
            "train_seconds": self.train_seconds(),
        }
