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
feed it are those of ``benchmarks/adaptive_batch.py``.
"""

from __future__ import annotations

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
