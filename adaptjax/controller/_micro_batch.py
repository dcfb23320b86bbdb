"""How a batch is carried under ``RunSpec(micro_batch_size="auto")``: one compiled step of
the whole batch, or accumulated micro-steps of a program compiled already.

A batch change that compiles a program for the new batch is worth it only when the
program fits a device's memory and saves, over the steps left, more seconds than its
compile waits. :func:`choose_micro_batch` weighs that from what the run measured of the
programs compiled in the configuration: seconds per call, and bytes per device from XLA's
memory analysis of each compiled step. A call of ``m`` samples is modelled as
``T(m) = alpha + beta * m`` (Pollux's step-time model, fitted over the measured programs), so
``k`` micro-steps of ``m`` take ``k * T(m)``, one step of ``k * m`` takes
``alpha + beta * k * m``, and the compile saves ``(k - 1) * alpha`` per step; while one
program is measured, ``alpha <= T(m)`` bounds it. A step's bytes are modelled as its
arguments and outputs (the state, fixed) plus temporaries growing in proportion to the
batch, or with two programs measured as the line through their totals.

A compile that may pay does not stall the run where it can be avoided: with
compiles in the background on (``CompileOptions.precompile_upcoming``) the step
runs as micro-steps of the compiled program while the whole batch's compiles,
and goes whole at the first decision after it is done (:meth:`Carrier.whole`).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from adaptjax._run_config import RunConfig
from adaptjax._transition import Transition
from adaptjax.controller._background import BackgroundCompiler, but_batch
from adaptjax.controller._carry_out import Carried
from adaptjax.controller._metrics_reader import MetricsReader
from adaptjax.controller._run_clock import RunClock
from adaptjax.controller._step_cache import StepCache
from adaptjax.launch._distributed import broadcast_json


@dataclasses.dataclass(frozen=True)
class Program:
    """A step compiled in the configuration, for ``samples`` global samples per call.

    Attributes:
      samples: the global batch one call takes.
      seconds: the median seconds of one call (``None``: not timed yet).
      memory: bytes per device while it runs (``None``: not read).
      temp: of ``memory``, the temporaries (those that grow with the batch).
    """

    samples: int
    seconds: float | None = None
    memory: int | None = None
    temp: int = 0


@dataclasses.dataclass(frozen=True)
class Choice:
    """How to carry a batch: ``micro_batch`` (``None``: whole), whether it compiles, why;
    ``meanwhile``: a compiled micro-batch that can run while the compile is under way."""

    micro_batch: int | None
    compiles: bool
    reason: str
    meanwhile: int | None = None


def choose_micro_batch(
    batch: int, unit: int, programs: Sequence[Program], *, device_memory: int | None,
    compile_seconds: float | None, steps_left: int,
) -> Choice:
    """How to carry a step of ``batch`` global samples, given the compiled ``programs``.

    ``unit``: replicas x micro-batches, which every call's batch is a multiple of.
    In order: a compiled whole-batch program that fits; else, when the whole batch
    fits, its compile unless the largest compiled program dividing the batch would
    lose less than the compile's ``compile_seconds`` over ``steps_left`` steps (that
    program is then :attr:`Choice.meanwhile`); else (it does not fit
    ``device_memory``) micro-steps of the largest compiled program that divides it
    and fits, or of the largest batch dividing it that fits, compiled.

    Example:
      >>> from adaptjax.controller._micro_batch import Program, choose_micro_batch
      >>> progs = [Program(32, seconds=0.1), Program(64, seconds=0.12)]
      >>> c = choose_micro_batch(256, 8, progs, device_memory=None, compile_seconds=30.0,
      ...                        steps_left=100)
      >>> c.micro_batch, c.compiles
      (64, False)
      >>> choose_micro_batch(256, 8, progs, device_memory=None, compile_seconds=30.0,
      ...                    steps_left=10_000).micro_batch is None
      True
    """
    fits = _fits(programs, device_memory)
    compiled = {p.samples: p for p in programs}
    if batch in compiled and fits(batch):
        return Choice(None, False, f"a step of {batch} is compiled")
    usable = sorted(m for m in compiled
                    if m < batch and batch % m == 0 and m % unit == 0 and fits(m))
    if fits(batch):
        if not usable:
            return Choice(None, True, f"no compiled step divides {batch}: compile it")
        m = usable[-1]
        return _compile_or_accumulate(batch, m, programs, compile_seconds, steps_left)
    need = _bytes(programs, batch)
    over = f"a step of {batch} would need ~{need:.3g} bytes per device, over {device_memory}"
    if usable:
        m = usable[-1]
        return Choice(m, False, f"{over}: {batch // m} micro-steps of {m} (compiled)")
    m = next((d for d in range(batch - unit, 0, -unit) if batch % d == 0 and fits(d)), None)
    if m is None:
        raise ValueError(f"{over}, and so would one of {unit} samples (one per replica and "
                         "micro-batch): raise CompileOptions.device_memory or shard the model "
                         "(RunSpec.mesh_shape)")
    return Choice(m, True, f"{over}: {batch // m} micro-steps of {m}, compiled")


def _compile_or_accumulate(batch: int, m: int, programs: Sequence[Program],
                           compile_seconds: float | None, steps_left: int) -> Choice:
    """Compile ``batch`` whole, or run ``batch // m`` micro-steps of the compiled ``m``."""
    k = batch // m
    saving = _saving(programs, m, k)
    if saving is None or compile_seconds is None:
        return Choice(None, True, f"a step of {batch} is not timed against {k} micro-steps "
                                  f"of {m}: compile it", meanwhile=m)
    gain = saving * steps_left
    if gain > compile_seconds:
        return Choice(None, True, f"its compile (~{compile_seconds:.3g} s) may pay: it saves "
                                  f"up to ~{gain:.3g} s over {k} micro-steps of {m} in "
                                  f"{steps_left} steps", meanwhile=m)
    return Choice(m, False, f"{k} micro-steps of {m} (compiled): a compile (~"
                            f"{compile_seconds:.3g} s) would save at most ~{gain:.3g} s in "
                            f"{steps_left} steps")


def _saving(programs: Sequence[Program], m: int, k: int) -> float | None:
    """Seconds per step that one call of ``k * m`` saves over ``k`` calls of ``m``: ``(k - 1)
    * alpha`` of the fitted ``T = alpha + beta * samples`` (``alpha <= T(m)`` from one program)."""
    timed = {p.samples: p.seconds for p in programs if p.seconds is not None}
    if m not in timed:
        return None
    alpha = timed[m]
    if len(timed) >= 2:
        alpha = min(max(_line(list(timed.items()))[0], 0.0), timed[m])
    return (k - 1) * alpha


def _fits(programs: Sequence[Program], device_memory: int | None):
    """``samples -> bool``: whether a step of that many samples fits ``device_memory``."""
    if device_memory is None or not any(p.memory is not None for p in programs):
        return lambda samples: True
    return lambda samples: _bytes(programs, samples) <= device_memory


def _bytes(programs: Sequence[Program], samples: int) -> float:
    """Bytes per device of a step of ``samples`` (see the module's model)."""
    read = [(p.samples, float(p.memory), p.temp) for p in programs if p.memory is not None]
    if len({m for m, _, _ in read}) >= 2:
        a, b = _line([(m, memory) for m, memory, _ in read])
        if b > 0:
            return a + b * samples
    m, memory, temp = max(read)  # one step, or bytes that do not grow: the largest's share
    return memory - temp + temp * samples / m


def _line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``y = a + b * x`` through ``points`` (two x's at least)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    b = (sum((x - mx) * (y - my) for x, y in points)
         / sum((x - mx) ** 2 for x, _ in points))
    return my - b * mx, b


def device_memory_limit(given: int | None) -> int | None:
    """``CompileOptions.device_memory``, else the first device's ``bytes_limit`` (None on CPU)."""
    if given is not None:
        return given
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


@dataclasses.dataclass
class Carrier:
    """The controller's side of ``RunSpec(micro_batch_size="auto")``: what it reads to
    choose (:func:`choose_micro_batch`) how a changed step runs.

    ``reader`` gives the median seconds per step of the configurations run
    (:meth:`MetricsReader.step_times`), ``clock`` the run's median compile wait;
    bytes are read (:meth:`StepCache.memory`) only under a ``device_memory`` (its
    :func:`device_memory_limit`) and from a dataset with ``batch_at``. A compile
    has to pay for itself in as many steps as the run has taken (Pollux's
    horizon, as ``AdaptiveBatchSize``'s compile discount).
    """

    steps: StepCache
    data: Any
    compiler: BackgroundCompiler
    reader: MetricsReader
    clock: RunClock
    device_memory: int | None

    def carry(self, plan: Transition, config: RunConfig, step: int) -> tuple[Transition, list]:
        """``plan`` from ``config`` at ``step`` with its step's micro-batch chosen
        (:meth:`choose`) when its step changed, and the events that say how."""
        if plan.config.micro_batch is not None or plan.config == config:
            return plan, []
        new, event = self.choose(plan.config, step)
        return dataclasses.replace(plan, config=new), [event]

    def whole(self, state, config: RunConfig, step: int) -> Carried:
        """``state`` and ``config`` run whole, if they run in micro-steps and :meth:`choose`
        now says whole: the whole step was compiled in the background and fits, or (with
        background compiles off) its compile pays by now; as they are otherwise."""
        if config.micro_batch is not None:
            new, event = self.choose(config.replace(micro_batch=None), step)
            if new.micro_batch is None:
                return Carried(self.steps.with_micro_steps(state, new), new, (event,))
        return Carried(state, config, ())

    def choose(self, config: RunConfig, step: int) -> tuple[RunConfig, dict]:
        """``config`` (a step's, whole) with the micro-batch chosen at ``step``, and the
        ``carry_batch`` event that says which and why."""
        limit = device_memory_limit(self.device_memory)
        programs = _programs(config, self.steps, self.data, self.compiler,
                             self.reader.step_times(), limit)
        if limit is not None and hasattr(self.data, "batch_at") and not any(
                p.memory is not None for p in programs):
            # nothing measured in this configuration (a new codec, mesh, precision): compile
            # the whole batch's step ahead, the compile it needs anyway, and read its bytes
            self.compiler.compile_now(config, self.data)
            programs = _programs(config, self.steps, self.data, self.compiler,
                                 self.reader.step_times(), limit)
        choice = choose_micro_batch(
            config.batch_size, config.devices * config.microbatches, programs,
            device_memory=limit, compile_seconds=self.clock.metrics().get("compile_seconds"),
            steps_left=step)
        if choice.meanwhile is not None and self.compiler.enabled:  # compile off the path
            self.compiler.submit([config], self.data)
            k = config.batch_size // choice.meanwhile
            choice = Choice(choice.meanwhile, False, f"{choice.reason}; compiling it in the "
                            f"background, {k} micro-steps of {choice.meanwhile} meanwhile")
        micro = choice.micro_batch
        if jax.process_count() > 1:  # every process runs process 0's choice
            agreed = broadcast_json({"micro": micro, "compiles": choice.compiles,
                                     "reason": choice.reason})
            micro, choice = agreed["micro"], Choice(agreed["micro"], agreed["compiles"],
                                                    agreed["reason"])
        new = config.replace(micro_batch=micro)
        event = {"kind": "carry_batch", "batch_size": new.batch_size,
                 "micro_batch": self.steps.compiled(new).batch_size,
                 "micro_steps": self.steps.micro_steps(new), "compiles": choice.compiles,
                 "reason": choice.reason}
        return new, event


def _programs(config: RunConfig, steps: StepCache, data, compiler: BackgroundCompiler,
              times: Mapping[RunConfig, float], device_memory: int | None) -> list[Program]:
    """The programs compiled in ``config``'s configuration, with what was measured of them."""
    here = but_batch(config)
    per_call: dict[int, list[float]] = {}
    for c, seconds in times.items():
        if but_batch(c) == here:
            per_call.setdefault(steps.compiled(c).batch_size, []).append(
                seconds / steps.micro_steps(c))
    read = device_memory is not None and hasattr(data, "batch_at")
    out = []
    for m in sorted(compiler.compiled_programs(config)):
        use = steps.memory(config.replace(batch_size=m, micro_batch=None), data) if read else None
        memory, temp = use if use is not None else (None, 0)
        seconds = statistics.median(per_call[m]) if m in per_call else None
        out.append(Program(m, seconds=seconds, memory=memory, temp=temp))
    return out
