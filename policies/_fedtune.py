"""FedTune's mapping: a replica's heterogeneity metric -> its inner learning rate.

FedTune (Yi, 2022) tunes on proxy data the server holds: simulated clients
at several heterogeneity levels, the best inner learning rate of each level
found by a Bayesian tuner (:func:`adaptjax.sync._fedtune.fedtune_search`, which needs
scikit-learn and so lives outside this pure layer), and a fitted mapping
from the measured metric to the rate. Here is the mapping and how it reads
the replicas' metrics, and :class:`FedTune`, the policy that applies it to
each replica at run time: pure numpy, no jax.

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
from adaptjax.policies._actions import Action, SetHyperparams
from adaptjax.policies._checks import check_float, check_int
from adaptjax.policies._context import Context
from adaptjax.policies._policy import Policy

#: The hyperparameter of replica ``i``'s learning-rate factor under the controller.
REPLICA_LR = "replica_lr/{}"


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


@dataclasses.dataclass(frozen=True, eq=False)
class FedTune(Policy):
    """Sets each replica's inner learning rate from its measured heterogeneity.

    Under local SGD or DiLoCo the controller passes each replica's metrics
    (``grad_dissimilarity/i``, ...; :func:`adaptjax.sync.replica_metrics`, as
    measured at the latest sync) and shows each replica's rate factor as the
    hyperparameter ``replica_lr/i``. At every ``every``-th step this policy
    maps replica ``i``'s metric to a rate with ``mapping`` and returns
    ``SetHyperparams({"replica_lr/i": mapping(metric_i) / learning_rate})``:
    the factor that makes the replica's effective rate the mapping's. As the
    metrics drift (they change at each sync) the mapping is simply applied
    again; a decision whose factors are all within ``rtol`` of the ones in
    force returns ``[]``, so the log holds one change per real move.

    Nothing is done before the first sync measured anything: while every
    replica's metric and ``replica_loss/i`` read 0 (the state's values at the
    start and after a rescale, which measures afresh). The metrics only move
    at a sync, so a decision between two syncs finds the factors in force and
    costs nothing; ``every`` only thins out the checks. The policy keeps no
    state: the factors in force are read from ``ctx.hyperparams``, so a resumed
    run decides as the uninterrupted one did.

    Args:
      mapping: the :class:`LrMapping` from the metric to a rate
        (:func:`adaptjax.sync.fedtune_search` fits one on proxy data).
      every: check at steps that are multiples of it, >= 1.
      rtol: the relative change of a factor below which nothing is set, >= 0.

    References:
      Yi, *FedTune: Automatic Tuning of Federated Learning Hyper-Parameters
      from System Perspective*, 2022.

    Example:
      >>> from adaptjax.policies import Context
      >>> from adaptjax.policies._fedtune import FedTune, LrMapping
      >>> policy = FedTune(LrMapping.fit([0.0, 1.0], [0.1, 0.025]))
      >>> ctx = Context(step=8, batch_size=8, microbatches=1, devices=2, max_devices=2,
      ...               hyperparams={"learning_rate": 0.1, "replica_lr/0": 1.0,
      ...                            "replica_lr/1": 1.0})
      >>> metrics = {"grad_dissimilarity/0": 0.0, "grad_dissimilarity/1": 0.5}
      >>> [action] = policy.decide(metrics, ctx)  # replica 1's rate: 0.1 * 0.25**0.5 = 0.05
      >>> {key: round(factor, 9) for key, factor in action.values.items()}
      {'replica_lr/0': 1.0, 'replica_lr/1': 0.5}
    """

    mapping: LrMapping
    every: int = 1
    rtol: float = dataclasses.field(default=0.01, kw_only=True)

    def __post_init__(self) -> None:
        owner = "FedTune"
        if not isinstance(self.mapping, LrMapping):
            raise ValueError(
                f"{owner}: mapping must be an LrMapping (LrMapping.fit or "
                f"adaptjax.sync.fedtune_search(...).mapping), got {type(self.mapping).__name__}"
            )
        object.__setattr__(self, "every", check_int(self.every, owner=owner, name="every",
                                                    minimum=1))
        object.__setattr__(self, "rtol", check_float(self.rtol, owner=owner, name="rtol",
                                                     low=0.0))

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        """``SetHyperparams`` of every replica's factor, when one moved by more than ``rtol``."""
        name = self.mapping.metric
        if ctx.step % self.every or f"{name}/0" not in metrics or not _measured(metrics, name):
            return []
        base = _read(ctx.hyperparams, "learning_rate")
        factors = self.mapping.replica_factors(metrics, base)
        keys = [REPLICA_LR.format(i) for i in range(len(factors))]
        current = np.array([_read(ctx.hyperparams, k) for k in keys])
        if np.all(np.abs(factors - current) <= self.rtol * np.abs(current)):
            return []
        moved = int(np.argmax(np.abs(factors - current)))
        reason = (f"FedTune: {name}/{moved} = {float(metrics[f'{name}/{moved}']):.4g} maps to "
                  f"lr {float(factors[moved] * base):.4g} (factor {float(factors[moved]):.4g}, "
                  f"was {float(current[moved]):.4g})")
        values = {k: float(f) for k, f in zip(keys, factors, strict=True)}
        return [SetHyperparams(values, reason=reason)]


def _measured(metrics: Mapping[str, float], name: str) -> bool:
    """Whether any replica's ``name/i`` or ``replica_loss/i`` is non-zero (a sync measured)."""
    heads = (f"{name}/", "replica_loss/")
    return any(v != 0 for k, v in metrics.items() if k.startswith(heads))


def _read(hyperparams: Mapping[str, float], key: str) -> float:
    """``hyperparams[key]``, or a one-line error naming what there is."""
    if key not in hyperparams:
        raise ValueError(
            f"FedTune: ctx.hyperparams has no {key!r} (has {sorted(hyperparams)}); it runs "
            "under a Controller whose sync is adaptjax.sync.LocalSGD or DiLoCo, with a known "
            "learning_rate"
        )
    return float(hyperparams[key])
