"""The fixed-batch frontier: optimizer steps to a target loss, fixed batches against adaptive ones.

The measure a user cares about is how many optimizer steps it takes to reach
a given validation loss, against the best a fixed batch can do:

* the target ``L* = (1 + margin) × min over fixed batches of their final
  validation loss`` (each batch's mean over seeds; ``margin`` 0.5%);
* ``S(L*)`` of a run: the first step at which its validation loss is at most
  ``L*``, linear between evaluations, ``inf`` if it never gets there;
* the frontier ``F``: the fewest steps any fixed batch needs, per seed;
* ``frontier_steps_ratio = S_adaptive(L*) / F``, per seed, then their mean
  and spread.

This module holds that arithmetic (numbers in, numbers out); the runs that
feed it are ``benchmarks/frontier_run.py``'s (with ``benchmarks/adaptive_batch.py``'s
``train()``).
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections.abc import Mapping, Sequence


def steps_to_loss(steps: Sequence[float], losses: Sequence[float], target: float) -> float:
    """The first step at which ``losses`` reach ``target`` (linear between points), or inf.

    Example:
      >>> steps_to_loss([0, 100, 200], [3.0, 2.0, 1.0], 1.5)
      150.0
      >>> steps_to_loss([0, 100], [3.0, 2.0], 1.0)
      inf
    """
    if len(steps) != len(losses) or not steps:
        raise ValueError(f"steps and losses must be non-empty and of one length, got "
                         f"{len(steps)} and {len(losses)}")
    prev = None
    for s, loss in zip(steps, losses, strict=True):
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(s)
            s0, l0 = prev
            return float(s0 + (s - s0) * (l0 - target) / (l0 - loss))
        prev = (s, loss)
    return math.inf


def target_loss(finals: Mapping[str, Sequence[float]], margin: float = 0.005) -> float:
    """``(1 + margin) ×`` the best fixed run's final loss, each run's mean over seeds.

    Example:
      >>> round(target_loss({"fixed-8": [2.0, 2.2], "fixed-16": [2.0, 2.0]}), 6)
      2.01
    """
    if not finals:
        raise ValueError("target_loss needs at least one fixed run")
    return (1.0 + margin) * min(statistics.fmean(v) for v in finals.values())


def frontier_ratios(fixed: Mapping[str, Sequence[float]], adaptive: Sequence[float]) -> list[float]:
    """Per seed, ``S_adaptive / min over fixed runs of S``.

    Args:
      fixed: run name -> its ``S(L*)`` for each seed.
      adaptive: the adaptive run's ``S(L*)`` for each seed.

    Returns:
      One ratio per seed: ``inf`` when the adaptive run never reaches ``L*``,
      ``nan`` when no fixed run does (no frontier to compare with).

    Example:
      >>> frontier_ratios({"fixed-8": [400, 500], "fixed-16": [300, 600]}, [150, 250])
      [0.5, 0.5]
    """
    ratios = []
    for seed, s_adaptive in enumerate(adaptive):
        f = min(runs[seed] for runs in fixed.values())
        ratios.append(math.nan if math.isinf(f) else s_adaptive / f)
    return ratios


def summary(ratios: Sequence[float]) -> tuple[float, float, float]:
    """``(mean, min, max)`` of the per-seed ratios (``inf`` if any seed never got there)."""
    return statistics.fmean(ratios), min(ratios), max(ratios)


def best_multiplier(finals: Mapping[float, float]) -> float:
    """The rate multiplier with the lowest final loss; a tie goes to the one nearest 1.

    "Nearest" is in ratio (|log m|), so ½ and 2 are equally near; among those
    the smaller wins (the safer rate).

    Example:
      >>> best_multiplier({0.5: 2.1, 1.0: 2.0, 2.0: 2.05})
      1.0
      >>> best_multiplier({0.5: 2.0, 1.0: 2.1, 2.0: 2.0})
      0.5
    """
    if not finals:
        raise ValueError("best_multiplier needs at least one rate's final loss")
    finite = {m: loss for m, loss in finals.items() if math.isfinite(loss)}
    if not finite:
        raise ValueError(f"no rate gave a finite final loss: {dict(finals)}")
    return min(finite, key=lambda m: (finite[m], abs(math.log(m)), m))


def steps_at(sizes: Sequence[int], samples: Sequence[int]) -> list[int]:
    """The optimizer step at which a run with per-step batches ``sizes`` had seen ``samples``.

    The first step whose cumulative samples reach each count (the curve's
    evaluations are taken once a step passes a sample checkpoint).

    Example:
      >>> steps_at([8, 8, 16, 16], [8, 16, 32, 48])
      [1, 2, 3, 4]
    """
    cumulative = list(itertools.accumulate(sizes))
    out = []
    for n in samples:
        i = bisect.bisect_left(cumulative, n)
        if i == len(cumulative):
            raise ValueError(f"the run saw {cumulative[-1] if cumulative else 0} samples, "
                             f"fewer than {n}")
        out.append(i + 1)
    return out


def paired_steps_ratio(baseline: Sequence[tuple[Sequence[float], Sequence[float]]],
                       other: Sequence[tuple[Sequence[float], Sequence[float]]],
                       margin: float = 0.005) -> tuple[float, list[float]]:
    """Steps ``other`` takes to the baseline's final loss, over the baseline's own steps.

    Each run is ``(steps, losses)``; one per seed, in the same order. The
    target is ``(1 + margin) ×`` the baseline's mean final loss (as
    :func:`target_loss`), so the baseline itself reaches it at or before its
    last step: a ratio below 1 is fewer serial steps to the same loss.

    Returns:
      The target and the per-seed ratios (``inf`` when ``other`` never gets there).

    Example:
      >>> paired_steps_ratio([([0, 100], [3.0, 2.0])], [([0, 50], [3.0, 2.0])], margin=0.0)
      (2.0, [0.5])
    """
    if len(baseline) != len(other) or not baseline:
        raise ValueError(f"baseline and other need one run per seed each, got {len(baseline)} "
                         f"and {len(other)}")
    target = target_loss({"baseline": [losses[-1] for _, losses in baseline]}, margin)
    ratios = [steps_to_loss(*o, target) / steps_to_loss(*b, target)
              for b, o in zip(baseline, other, strict=True)]
    return target, ratios


def milestone_steps(fractions: Sequence[float], budget: int, batch: int,
                    growth: int = 1, growths: int | None = None) -> list[int]:
    """Steps at which a run starting at ``batch`` passes ``fractions`` of ``budget`` samples.

    With ``growth`` > 1 the batch is multiplied by it at each milestone, or at
    the first ``growths`` of them (the Seesaw run), so later milestones come
    in fewer steps; each step is rounded to a whole one.

    Example:
      >>> milestone_steps([0.5, 0.75], 1600, 8)
      [100, 150]
      >>> milestone_steps([0.5, 0.75], 1600, 8, growth=2)
      [100, 125]
      >>> milestone_steps([0.5, 0.75, 0.875], 1600, 8, growth=2, growths=1)
      [100, 125, 138]
    """
    steps, at, done, b = [], 0.0, 0.0, batch
    for i, f in enumerate(sorted(fractions)):
        if not 0.0 < f < 1.0:
            raise ValueError(f"every milestone fraction must be in (0, 1), got {f}")
        at += (f * budget - done) / b
        done = f * budget
        b *= growth if growths is None or i < growths else 1
        steps.append(round(at))
    return steps
