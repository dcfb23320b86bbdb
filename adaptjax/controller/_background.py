"""Compiling announced configurations in a background thread, off the training's path."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Sequence

from adaptjax import policies as ajp
from adaptjax._run_config import RunConfig
from adaptjax.controller._step_cache import StepCache

#: The actions whose configuration a background compile can prepare (a ``Probe``: its branches').
#: A ``SetPrecision``'s step compiles from the abstract state of its own precision (float16's
#: wraps the optimizer state in its loss scale), the structure the transition converts to.
_COMPILABLE = (ajp.SetBatchSize, ajp.Rescale, ajp.SetCodec, ajp.SetPrecision, ajp.Probe)


LOWEST = 19  # the nice value of the compiling thread while nothing waits for it


def set_thread_priority(thread_id: int | None, nice: int | None = None) -> None:
    """Sets the nice value of the thread ``thread_id`` (Linux: per thread); else nothing.

    ``nice=None``: the calling thread's. Lowering a nice value needs the
    privilege to (``CAP_SYS_NICE``); without it the thread keeps its own.
    """
    if thread_id is None:
        return
    try:
        value = os.getpriority(os.PRIO_PROCESS, 0) if nice is None else nice
        os.setpriority(os.PRIO_PROCESS, thread_id, value)
    except (AttributeError, OSError):  # not Linux, or not allowed
        pass


def lower_thread_priority() -> None:
    """Lowest CPU priority for the calling thread (see :func:`set_thread_priority`).

    The background compiler then takes only the cycles the training steps leave.
    """
    set_thread_priority(threading.get_native_id(), LOWEST)


def announced_configs(
    hints: Sequence[ajp.Action],
    steps: StepCache,
    plan: Callable[[list[ajp.Action]], RunConfig],
) -> list[RunConfig]:
    """The configurations ``hints`` (``Policy.upcoming``) lead to, by ``plan``; each once.

    Only batch, device, codec and precision changes name a configuration to compile, and
    a ``Probe`` names its branches' (one batch change each); a hint the
    controller would refuse is left out (the action itself says why, when it
    comes).
    """
    out: list[RunConfig] = []
    for hint in hints:
        if not isinstance(hint, _COMPILABLE):
            continue
        each = ([ajp.SetBatchSize(b) for b in hint.batch_sizes] if isinstance(hint, ajp.Probe)
                else [hint])
        for action in each:
            try:
                if isinstance(action, ajp.SetCodec):
                    steps.add_codec(action.codec)
                config = plan([action])
            except Exception:  # a hint never stops training
                continue
            if config not in out:
                out.append(config)
    return out


class BackgroundCompiler:
    """One low-priority thread that compiles configurations before their steps run.

    :meth:`submit` queues a configuration (its arguments' shapes are read on
    the caller's thread: the thread touches neither the model nor the
    dataset); :meth:`wait_for` (before a step is dispatched) makes sure that
    step's compile is not done twice: a queued one is dropped for the step to
    compile now, one under way is waited for; :meth:`finished` hands back,
    once each, the ``background_compile`` events of compiles that ended.
    :attr:`compiled_ahead` holds the configurations compiled before their first
    step (here or by :meth:`adaptjax.Controller.precompile`), whose first
    step's wait says nothing of what a compile costs. :meth:`compiled_batch_sizes`
    tells policies which batch sizes of a configuration cost no compile
    (``Context.compiled_batch_sizes``).

    Args:
      steps: the controller's :class:`StepCache`.
      enabled: whether the controller asks for background compiles at all
        (``precompile_upcoming``, one process, a dataset with ``batch_at``).

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, adaptjax
      >>> from adaptjax.controller._background import BackgroundCompiler
      >>> from adaptjax.controller._step_cache import StepCache
      >>> steps = StepCache(model={"w": jnp.zeros(2)}, optimizer=optax.sgd(0.1),
      ...                   loss_fn=lambda p, b: jnp.sum(b["x"] @ p["w"]))
      >>> data = adaptjax.ArrayDataset({"x": np.ones((8, 2), np.float32)})
      >>> compiler = BackgroundCompiler(steps)
      >>> compiler.submit([adaptjax.RunConfig(2, 4)], data)
      >>> compiler.wait_for(adaptjax.RunConfig(2, 4))
      >>> [e["kind"] for e in compiler.finished()], compiler.finished()
      (['background_compile'], [])
      >>> compiler.shutdown()
    """

    def __init__(self, steps: StepCache, *, enabled: bool = True):
        self.steps, self.enabled = steps, bool(enabled)
        self.compiled_ahead: set[RunConfig] = set()
        self.ran: set[RunConfig] = set()  # every configuration whose step was dispatched
        self._last: RunConfig | None = None
        # None: finished and its event handed back
        self._futures: dict[RunConfig, concurrent.futures.Future | None] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._thread_id: int | None = None  # the compiling thread's, once it started

    def submit(self, configs: Iterable[RunConfig], data) -> None:
        """Compiles each of ``configs`` not compiled or submitted yet, in the thread."""
        for config in configs:
            if config in self._futures or self.steps.has_run(config):
                continue
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="adaptjax-compile",
                    initializer=self._start_thread,
                )
            try:
                args = self.steps.abstract_args(config, data)
            except Exception as error:  # a hint never stops training; the action would say why
                future: concurrent.futures.Future = concurrent.futures.Future()
                future.set_exception(error)
            else:
                future = self._pool.submit(self.steps.compile, config, args=args)
            self._futures[config] = future

    def _start_thread(self) -> None:
        """The compiling thread's start: its id noted, its priority the lowest."""
        self._thread_id = threading.get_native_id()
        lower_thread_priority()

    def wait_for(self, config: RunConfig) -> None:
        """Before ``config``'s step runs: its compile, if one was submitted, is not done twice.

        Still queued (behind compiles of configurations announced but not
        due): it is taken out of the queue, and the step compiles it on this
        thread at the training's priority. Under way: the step waits for it,
        the compiling thread at the training's priority meanwhile (where the
        process may raise it). Called before every step; notes ``config``
        among those that ran.
        """
        if config is not self._last:  # per change of configuration, not per step
            self._last = config
            self.ran.add(config)
        pending = self._futures.get(config)
        if pending is None:
            return
        if pending.cancel():  # queued: the step's own call compiles it, now
            self._futures[config] = None
            return
        if not pending.done():
            set_thread_priority(self._thread_id)  # the training's, while it waits
            concurrent.futures.wait([pending])
            set_thread_priority(self._thread_id, LOWEST)
        if pending.exception() is None:
            self.compiled_ahead.add(config)

    def compile_now(self, now: RunConfig, data, codec=..., **changes) -> tuple[RunConfig, float]:
        """:meth:`adaptjax.Controller.precompile`: ``now`` with ``changes`` (``None``: kept)
        and ``codec`` (``...``: kept), compiled on this thread; ``(config, seconds)``."""
        codec = now.codec if codec is ... else self.steps.add_codec(codec)
        config = now.replace(**{k: v for k, v in changes.items() if v is not None}, codec=codec)
        if not hasattr(data, "batch_at"):
            raise ValueError("precompile needs a dataset with batch_at (e.g. ArrayDataset)")
        seconds = self.steps.compile(config, data)
        self.compiled_ahead.add(config)  # its first step's wait is no compile's cost
        return config, seconds

    def finished(self) -> list[dict]:
        """``background_compile`` events (without their step) of compiles that ended, once each."""
        events = []
        for config, future in self._futures.items():
            if future is None or not future.done():
                continue
            self._futures[config] = None
            if future.cancelled():
                continue
            event = {"kind": "background_compile", "config": dataclasses.asdict(config)}
            error = future.exception()
            if error is not None:
                event["error"] = f"{type(error).__name__}: {error}".splitlines()[0]
            else:
                event["latency_s"] = future.result()
                self.compiled_ahead.add(config)
            events.append(event)
        return events

    def wait_all(self) -> None:
        """Waits for every compile submitted so far (for a caller that must know them done)."""
        concurrent.futures.wait([f for f in self._futures.values() if f is not None])

    def compiled_batch_sizes(self, config: RunConfig) -> frozenset[int]:
        """The batch sizes whose step is compiled in ``config`` but for its batch size.

        Those of the configurations that ran (:meth:`wait_for`), that were
        compiled ahead, or whose background compile finished without error.
        """
        return frozenset(c.batch_size for c in self._compiled_like(config))

    def compiled_programs(self, config: RunConfig) -> frozenset[int]:
        """The batches of the programs compiled in ``config`` but for its batch: those of
        :meth:`compiled_batch_sizes`, a step of micro-steps counting as its micro-batch's."""
        return frozenset(self.steps.compiled(c).batch_size for c in self._compiled_like(config))

    def _compiled_like(self, config: RunConfig) -> set[RunConfig]:
        """The configurations compiled (see :meth:`compiled_batch_sizes`) but for the batch."""
        done = {c for c, f in self._futures.items()
                if f is not None and f.done() and not f.cancelled() and f.exception() is None}
        here = but_batch(config)
        return {c for c in self.ran | self.compiled_ahead | done if but_batch(c) == here}

    def submit_upcoming(self, hints: Sequence[ajp.Action], plan, data) -> None:
        """Compiles the configurations ``hints`` lead to (:func:`announced_configs`).

        The controller asks after each decision, unless background compiles
        are off (``precompile_upcoming=False``, several processes, a dataset
        without ``batch_at``); right after a change, the hints wait until the
        new configuration's own step has compiled in the foreground.
        """
        self.submit(announced_configs(hints, self.steps, plan), data)

    def shutdown(self) -> None:
        """A compile under way finishes; queued ones are dropped."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def but_batch(config: RunConfig) -> dict:
    """``config``'s fields but its batch size (and micro-batch): what a batch size's step is
    compiled for."""
    fields = dataclasses.asdict(config)
    del fields["batch_size"], fields["micro_batch"]
    return fields
