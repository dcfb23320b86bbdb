"""SIGTERM while training (a preemption): asked for at any instant, agreed on at a step."""

from __future__ import annotations

import contextlib
import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

#: Exit code after SIGTERM: a checkpoint of the current step was written; start again to resume.
EXIT_PREEMPTED = 75


class Preemption:
    """Turns SIGTERM into a request the training loop acts on between two steps.

    While :meth:`armed` (the loop of :meth:`adaptjax.Controller.run`, on the
    main thread) a SIGTERM only sets a flag; the loop asks :meth:`agreed`
    after each step and, when it says so, checkpoints the step and exits with
    :data:`EXIT_PREEMPTED`. Across processes every process must stop at the
    same step: they agree at policy steps, where any one's flag stops all.

    Example:
      >>> from adaptjax.controller._preemption import Preemption
      >>> p = Preemption()
      >>> with p.armed():  # no SIGTERM came: training goes on
      ...     p.agreed(step=3, every=10)
      False
    """

    def __init__(self):
        self._asked = threading.Event()

    @contextlib.contextmanager
    def armed(self):
        """While inside, SIGTERM asks for a checkpoint and a clean exit (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGTERM, lambda *_: self._asked.set())
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def agreed(self, step: int, every: int) -> bool:
        """Whether to stop now, at ``step``; across processes all agree, every ``every`` steps."""
        if jax.process_count() == 1:
            return self._asked.is_set()
        if step % every:
            return False
        flags = multihost_utils.process_allgather(np.int32(self._asked.is_set()))
        return bool(np.asarray(flags).any())
