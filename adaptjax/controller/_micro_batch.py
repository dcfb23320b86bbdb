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
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence

import jax

from adaptjax._run_config import RunConfig
from adaptjax.controller._background import BackgroundCompiler, but_batch
from adaptjax.controller._step_cache import StepCache


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
    """How to carry a batch: ``micro_batch`` (``None``: whole), whether it compiles, why."""

    micro_batch: int | None
    compiles: bool
    reason: str


def choose_micro_batch(
    batch: int, unit: int, programs: Sequence[Program], *, device_memory: int | None,
    compile_seconds: float | None, steps_left: int,
) -> Choice:
    """How to carry a step of ``batch`` global samples, given the compiled ``programs``.

    ``unit``: replicas x micro-batches, which every call's batch is a multiple of.
    In order: a compiled whole-batch program that fits; else, when the whole batch
    fits, its compile unless the largest compiled program dividing the batch would
    lose less than the compile's ``compile_seconds`` over ``steps_left`` steps; else
    (it does not fit ``device_memory``) micro-steps of the largest compiled program
    that divides it and fits, or of the largest batch dividing it that fits, compiled.

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
                         "micro-batch): raise CompileOptions.device_memory or add devices")
    return Choice(m, True, f"{over}: {batch // m} micro-steps of {m}, compiled")


def _compile_or_accumulate(batch: int, m: int, programs: Sequence[Program],
                           compile_seconds: float | None, steps_left: int) -> Choice:
    """Compile ``batch`` whole, or run ``batch // m`` micro-steps of the compiled ``m``."""
    k = batch // m
    saving = _saving(programs, m, k)
    if saving is None or compile_seconds is None:
        return Choice(None, True, f"a step of {batch} is not timed against {k} micro-steps "
                                  f"of {m}: compile it")
    gain = saving * steps_left
    if gain > compile_seconds:
        return Choice(None, True, f"its compile (~{compile_seconds:.3g} s) pays: it saves "
                                  f"~{gain:.3g} s over {k} micro-steps of {m} in "
                                  f"{steps_left} steps")
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
    read = [p for p in programs if p.memory is not None]
    if len({p.samples for p in read}) >= 2:
        a, b = _line([(p.samples, p.memory) for p in read])
        return a + b * samples
    p = read[0]
    return p.memory - p.temp + p.temp * samples / p.samples


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
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


def carry(config: RunConfig, *, steps: StepCache, data, compiler: BackgroundCompiler,
          times: Mapping[RunConfig, float], compile_seconds: float | None,
          device_memory: int | None, steps_left: int) -> tuple[RunConfig, dict]:
    """``config`` (a changed step's, whole) with the micro-batch :func:`choose_micro_batch`
    picks from the programs compiled in it, and the ``carry_batch`` event that says why.

    ``times``: the median seconds per step of the configurations run
    (:meth:`MetricsReader.step_times`); bytes are read (:meth:`StepCache.memory`) only
    under a ``device_memory`` and from a dataset with ``batch_at``.
    """
    programs = _programs(config, steps, data, compiler, times, device_memory)
    choice = choose_micro_batch(
        config.batch_size, config.devices * config.microbatches, programs,
        device_memory=device_memory, compile_seconds=compile_seconds, steps_left=steps_left)
    new = config.replace(micro_batch=choice.micro_batch)
    event = {"kind": "carry_batch", "batch_size": new.batch_size,
             "micro_batch": steps.compiled(new).batch_size,
             "micro_steps": steps.micro_steps(new), "compiles": choice.compiles,
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
        memory, temp = (steps.memory(config.replace(batch_size=m, micro_batch=None), data)
                        if read else (None, 0))
        seconds = statistics.median(per_call[m]) if m in per_call else None
        out.append(Program(m, seconds=seconds, memory=memory, temp=temp))
    return out
