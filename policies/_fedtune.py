"""FedTune's mapping: a replica's heterogeneity metric -> its inner learning rate.

FedTune (Yi, 2022) tunes on proxy data the server holds: simulated clients
at several heterogeneity levels, the best inner learning rate of each level
found by a Bayesian tuner (:func:`adaptjax.sync._fedtune.fedtune_search`, which needs
scikit-learn and so lives outside this pure layer), and a fitted mapping
from the measured metric to the rate. Here is the mapping and how it reads
the replicas' metrics: pure numpy, no jax.

The fit is least squares of ``log(lr)`` on the metric (a straight line;
constant when every point has the same metric), and a prediction is clipped
to the metrics the proxy search saw: a replica beyond them gets the rate of
the nearest level, never an extrapolation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class LrMapping:
    """``lr(m) = exp(intercept + slope * clip(m, low, high))``: a metric to an inner rate.

    Build it with :meth:`fit`; apply it to the replicas with :meth:`replica_factors`.

    Attributes:
      intercept: ``log(lr)`` at metric 0.
      slope: change of ``log(lr)`` per unit of the metric.
      low: the smallest metric the fit saw (predictions clip to ``[low, high]``).
      high: the largest.
      metric: the metric's name in the step's metrics (``"{metric}/{replica}"``).

    Example:
      >>> from adaptjax.policies._fedtune import LrMapping
      >>> m = LrMapping.fit([0.0, 1.0], [0.1, 0.01])
      >>> [round(m(x), 6) for x in (0.0, 0.5, 1.0, 7.0)]
      [0.1, 0.031623, 0.01, 0.01]
    """

    intercept: float
    slope: float
    low: float
    high: float
    metric: str = "grad_dissimilarity"

    @classmethod
    def fit(
        cls,
        metrics: Sequence[float],
        learning_rates: Sequence[float],
        metric: str = "grad_dissimilarity",
    ) -> LrMapping:
        """Least squares of ``log(lr)`` on the metric over the proxy levels.

        Args:
          metrics: each level's measured metric (finite).
          learning_rates: each level's best inner learning rate (``> 0``).
          metric: the metric's name.

        Returns:
          The fitted :class:`LrMapping`.
        """
        m = np.asarray(metrics, np.float64)
        lr = np.asarray(learning_rates, np.float64)
        if m.ndim != 1 or m.shape != lr.shape or m.size < 1:
            raise ValueError(
                f"fit needs one learning rate per metric value (1-D, same length), got "
                f"{m.shape} metrics and {lr.shape} rates"
            )
        if not np.all(np.isfinite(m)) or not np.all(np.isfinite(lr)) or np.any(lr <= 0):
            raise ValueError("fit needs finite metrics and finite learning rates > 0")
        y = np.log(lr)
        spread = m - m.mean()
        denom = float(spread @ spread)
        slope = 0.0 if denom == 0.0 else float(spread @ (y - y.mean())) / denom
        intercept = float(y.mean() - slope * m.mean())
        return cls(intercept, slope, float(m.min()), float(m.max()), metric)

    def __call__(self, value: float) -> float:
        """The learning rate for a metric value (clipped to the fitted range)."""
        return math.exp(self.intercept + self.slope * min(max(float(value), self.low), self.high))

    def replica_factors(self, metrics: Mapping[str, float], base_lr: float) -> np.ndarray:
        """Each replica's rate over ``base_lr``, from ``metrics["{metric}/{i}"]``, i = 0, 1, ...

        The factors are what ``adaptjax.sync.set_replica_lr`` takes (the
        optimizer's own rate stays ``base_lr``).

        Args:
          metrics: the replicas' metrics (``adaptjax.sync.replica_metrics``).
          base_lr: the optimizer's learning rate (``> 0``).

        Returns:
          float64 factors, one per replica.
        """
        if not base_lr > 0:
            raise ValueError(f"base_lr must be > 0, got {base_lr!r}")
        values = []
        while f"{self.metric}/{len(values)}" in metrics:
            values.append(float(metrics[f"{self.metric}/{len(values)}"]))
        if not values:
            raise ValueError(
                f"metrics hold no {self.metric}/0; pass adaptjax.sync.replica_metrics(opt_state) "
                "of a local SGD or DiLoCo run"
            )
        return np.array([self(v) / base_lr for v in values])
