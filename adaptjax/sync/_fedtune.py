"""FedTune's proxy search: the best inner learning rate per heterogeneity level, by GP-EI.

FedTune (Yi, 2022) customises each client's hyperparameters on the server:
on proxy data it holds (never a replica's), it simulates clients at several
heterogeneity levels, finds each level's best inner learning rate with a
Bayesian tuner, and fits the mapping from the measured heterogeneity metric
to the rate (:class:`adaptjax.policies._fedtune.LrMapping`, pure numpy).

The tuner is a Gaussian process over ``log(lr)`` (scikit-learn's
``GaussianProcessRegressor``, Matérn 5/2 plus white noise, as
:func:`adaptjax.costs.search_deployment` uses; one dimension needs nothing
larger such as BoTorch) with expected improvement, probing the best of 256
log-spaced candidates each time after three spread over the range. Each
probe is one proxy run the caller provides; the search reports the steps
they cost.

References:
  Yi, "FedTune: automatic tuning of federated learning hyper-parameters from
  system perspective", 2022. Jones, Schonlau and Welch, "Efficient global
  optimization of expensive black-box functions", 1998 (expected improvement).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from adaptjax.policies._fedtune import LrMapping

_GRID = 256
_FIRST = 3  # probes spread over the range before the GP decides


class ProxyRun(NamedTuple):
    """What one proxy run reports: its heterogeneity metric, its final loss, its steps."""

    metric: float
    loss: float
    steps: int


class TuneResult(NamedTuple):
    """The tuner's answer: the best rate, its loss, and every ``(lr, loss)`` probed in order."""

    best_lr: float
    best_loss: float
    trials: tuple[tuple[float, float], ...]


class FedTuneSearch(NamedTuple):
    """The proxy search: the mapping, each level's ``(metric, best lr)``, the steps spent."""

    mapping: LrMapping
    points: tuple[tuple[float, float], ...]
    steps: int


def _check_range(low, high) -> None:
    if not (isinstance(low, int | float) and isinstance(high, int | float) and 0 < low < high):
        raise ValueError(
            f"the learning-rate range needs 0 < low < high, got low={low!r}, high={high!r}"
        )


def _expected_improvement(mu: np.ndarray, sigma: np.ndarray, best: float) -> np.ndarray:
    """``E[(best − f)⁺]`` for ``f ~ N(mu, sigma²)`` (minimisation)."""
    from scipy.stats import norm  # scipy comes with jax

    z = (best - mu) / sigma
    return (best - mu) * norm.cdf(z) + sigma * norm.pdf(z)


def _capped(ys: np.ndarray) -> np.ndarray:
    """``ys`` with every loss above ``median + 3 (median − best)`` set to that cap.

    A diverged probe's loss (1e20, or a large stand-in) would otherwise set
    the scale ``normalize_y`` divides by, flatten the GP over every other
    probe and send the search away from the good side of the range.
    """
    median, best = float(np.median(ys)), float(ys.min())
    return np.minimum(ys, median + 3.0 * (median - best))


def _next_probe(grid: np.ndarray, xs: list[float], ys: list[float], seed: int) -> float:
    """The candidate of ``grid`` (log rates) with the most expected improvement."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel

    span = grid[-1] - grid[0]
    kernel = ConstantKernel(1.0, (1e-3, 1e3)) * Matern(
        0.25 * span, (0.02 * span, 4.0 * span), nu=2.5
    ) + WhiteKernel(1e-4, (1e-8, 1e-1))
    gp = GaussianProcessRegressor(kernel, normalize_y=True, random_state=seed)
    capped = _capped(np.array(ys))
    with warnings.catch_warnings():  # a length scale at its bound is no error of the search
        warnings.simplefilter("ignore", ConvergenceWarning)
        gp.fit(np.array(xs)[:, None], capped)
    left = np.array([g for g in grid if not np.any(np.isclose(g, xs))])
    mu, sigma = gp.predict(left[:, None], return_std=True)
    ei = _expected_improvement(mu, np.maximum(sigma, 1e-9), float(capped.min()))
    return float(left[int(np.argmax(ei))])


def tune_learning_rate(
    objective: Callable[[float], float],
    low: float,
    high: float,
    *,
    probes: int = 10,
    seed: int = 0,
) -> TuneResult:
    """Minimises ``objective(lr)`` over ``[low, high]`` by GP expected improvement in ``log(lr)``.

    Args:
      objective: a proxy run's loss at inner learning rate ``lr`` (finite).
      low: the smallest rate (``> 0``).
      high: the largest (``> low``).
      probes: calls of ``objective``, ``>= 3``.
      seed: seeds the GP's optimiser restarts.

    Returns:
      A :class:`TuneResult`.

    Example:
      >>> import math
      >>> from adaptjax.sync._fedtune import tune_learning_rate
      >>> r = tune_learning_rate(lambda lr: (math.log10(lr) + 2) ** 2, 1e-4, 1.0, probes=8)
      >>> abs(math.log10(r.best_lr) + 2) < 0.05
      True
    """
    _check_range(low, high)
    if isinstance(probes, bool) or not isinstance(probes, int) or probes < _FIRST:
        raise ValueError(f"probes must be an int >= {_FIRST}, got {probes!r}")
    grid = np.linspace(np.log(low), np.log(high), _GRID)
    xs: list[float] = []
    ys: list[float] = []
    for i in range(probes):
        x = float(grid[[0, _GRID // 2, -1][i]]) if i < _FIRST else _next_probe(grid, xs, ys, seed)
        y = float(objective(float(np.exp(x))))
        if not np.isfinite(y):
            raise ValueError(
                f"the objective returned {y} at lr={np.exp(x):.3g}; return a finite loss "
                "(e.g. a large one for a diverged run)"
            )
        xs.append(x)
        ys.append(y)
    best = int(np.argmin(ys))
    trials = tuple((float(np.exp(x)), y) for x, y in zip(xs, ys, strict=True))
    return TuneResult(float(np.exp(xs[best])), ys[best], trials)


def fedtune_search(
    run_proxy: Callable[[float, float], ProxyRun],
    levels: Sequence[float],
    low: float,
    high: float,
    *,
    probes: int = 10,
    metric: str = "grad_dissimilarity",
    seed: int = 0,
) -> FedTuneSearch:
    """FedTune's proxy search: each level's best rate, and the mapping metric -> rate.

    For each heterogeneity level (e.g. a Dirichlet α of
    :func:`adaptjax.sync.dirichlet_split` over the *proxy* data),
    ``tune_learning_rate`` (GP-EI, see the module) searches the inner rate minimising
    ``run_proxy(level, lr).loss``; the level's metric is the one measured at
    its best rate. :meth:`LrMapping.fit` then maps metric to rate.

    Args:
      run_proxy: ``(level, lr) -> ProxyRun`` (a short local SGD / DiLoCo run on proxy data).
      levels: the heterogeneity levels, at least one.
      low: the smallest rate searched.
      high: the largest.
      probes: proxy runs per level.
      metric: the metric's name (what the mapping reads per replica).
      seed: seeds the tuner.

    Returns:
      A ``FedTuneSearch(mapping, points, steps)``: the fitted :class:`LrMapping`, each
      level's ``(metric, best lr)``, and every proxy run's steps, summed.

    Example:
      >>> import math
      >>> from adaptjax.sync import fedtune_search
      >>> from adaptjax.sync import ProxyRun
      >>> def run_proxy(level, lr):  # a toy proxy: the best rate is 0.1 / 2**level
      ...     return ProxyRun(metric=level, loss=math.log(lr * 10 * 2**level) ** 2, steps=10)
      >>> search = fedtune_search(run_proxy, [0.0, 2.0], 1e-3, 1.0, probes=6)
      >>> [abs(math.log2(lr / want)) < 0.1 for (_, lr), want in zip(search.points, [0.1, 0.025])]
      [True, True]
      >>> search.steps, search.mapping.metric
      (120, 'grad_dissimilarity')
    """
    if len(levels) < 1:
        raise ValueError("fedtune_search needs at least one heterogeneity level")
    points, steps = [], 0
    for level in levels:
        runs: dict[float, ProxyRun] = {}

        def loss_at(lr: float, level=level, runs=runs) -> float:
            runs[lr] = run_proxy(level, lr)
            return runs[lr].loss

        result = tune_learning_rate(loss_at, low, high, probes=probes, seed=seed)
        steps += sum(int(r.steps) for r in runs.values())
        points.append((float(runs[result.best_lr].metric), result.best_lr))
    mapping = LrMapping.fit([m for m, _ in points], [lr for _, lr in points], metric)
    return FedTuneSearch(mapping, tuple(points), steps)
