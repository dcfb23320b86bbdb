"""Pollux-style goodput: throughput model × statistical efficiency, and LR scaling rules.

References:
  Qiao et al., "Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized
  Deep Learning", OSDI 2021 (statistical efficiency, goodput).
  Johnson et al., "AdaScale SGD: A User-Friendly Algorithm for Distributed
  Training", ICML 2020 (the gain ratio).
  McCandlish et al., "An Empirical Model of Large-Batch Training", 2018
  (the simple noise scale B_simple = tr(Σ)/‖G‖²).
"""

import math
from collections.abc import Sequence

from adaptjax.policies._checks import check_choice, check_float

LR_RULES = ("adascale", "sqrt", "linear", "none")
OPTIMIZER_KINDS = ("adam", "sgd")


def statistical_efficiency(noise_scale: float, batch_size: float, base_batch_size: float) -> float:
    """Progress per sample at ``batch_size`` relative to ``base_batch_size``.

    E(M) = (φ + M₀) / (φ + M) with φ the gradient noise scale: 1 at M = M₀,
    ≈ 1 while M ≪ φ (large batches are free), and → M₀/M when φ = 0 (noise-free
    gradients gain nothing from a larger batch).

    Args:
      noise_scale: φ, in samples (negative values are clamped to 0).
      batch_size: M, > 0.
      base_batch_size: M₀, > 0.

    Returns:
      E(M).

    Example:
      >>> statistical_efficiency(0.0, 256, 64)
      0.25
      >>> statistical_efficiency(1000.0, 64, 64)
      1.0
    """
    phi = max(float(noise_scale), 0.0)
    return (phi + base_batch_size) / (phi + batch_size)


def adascale_gain(scale: float, *, sigma_sq: float, mu_sq: float) -> float:
    """AdaScale's gain ratio r for a batch ``scale`` times the base batch.

    r = (σ² + μ²) / (σ²/S + μ²), with σ² = tr(Σ)/M₀ the gradient variance of the
    base batch and μ² = ‖G‖². r = 1 at S = 1, r → S when σ² dominates and r → 1
    when μ² dominates. Equivalently r = S · E(S·M₀) with φ = M₀·σ²/μ².

    Args:
      scale: S = M/M₀, > 0.
      sigma_sq: σ² (negative values are clamped to 0).
      mu_sq: μ² (negative values are clamped to 0).

    Returns:
      r (1.0 when both σ² and μ² are 0).

    Example:
      >>> adascale_gain(4.0, sigma_sq=1.0, mu_sq=0.0)
      4.0
      >>> adascale_gain(4.0, sigma_sq=3.0, mu_sq=1.0)
      2.2857142857142856
    """
    sigma_sq = max(float(sigma_sq), 0.0)
    mu_sq = max(float(mu_sq), 0.0)
    denominator = sigma_sq / scale + mu_sq
    if denominator == 0.0:
        return 1.0
    return (sigma_sq + mu_sq) / denominator


def lr_scale(
    rule: str,
    scale: float,
    *,
    optimizer_kind: str = "adam",
    sigma_sq: float | None = None,
    mu_sq: float | None = None,
) -> float:
    """The factor by which the base learning rate is multiplied at batch scale S.

    ``"linear"``: S. ``"sqrt"``: √S. ``"none"``: 1. ``"adascale"``: the gain r of
    :func:`adascale_gain` for SGD, √r for Adam (whose update is already
    normalised by the second moment).

    Args:
      rule: one of ``"adascale"``, ``"sqrt"``, ``"linear"``, ``"none"``.
      scale: S = M/M₀, > 0.
      optimizer_kind: ``"adam"`` or ``"sgd"`` (only used by ``"adascale"``).
      sigma_sq: σ² for ``"adascale"``.
      mu_sq: μ² for ``"adascale"``.

    Returns:
      The learning-rate factor.

    Example:
      >>> lr_scale("sqrt", 4.0), lr_scale("linear", 4.0), lr_scale("none", 4.0)
      (2.0, 4.0, 1.0)
      >>> lr_scale("adascale", 4.0, optimizer_kind="adam", sigma_sq=1.0, mu_sq=0.0)
      2.0
    """
    check_choice(rule, LR_RULES, owner="lr_scale", name="rule")
    if rule == "linear":
        return float(scale)
    if rule == "sqrt":
        return math.sqrt(scale)
    if rule == "none":
        return 1.0
    if sigma_sq is None or mu_sq is None:  # "adascale"
        raise ValueError("lr_scale: rule 'adascale' needs sigma_sq and mu_sq")
    gain = adascale_gain(scale, sigma_sq=sigma_sq, mu_sq=mu_sq)
    return gain if optimizer_kind == "sgd" else math.sqrt(gain)


def _sse(xs: Sequence[float], ys: Sequence[float], alpha: float, beta: float) -> float:
    return sum((alpha + beta * x - y) ** 2 for x, y in zip(xs, ys, strict=True))


def fit_throughput(
    batch_sizes: Sequence[float], step_times: Sequence[float]
) -> tuple[float, float]:
    """Least-squares fit of the step-time model T(M) = α + β·M with α, β >= 0.

    α is the fixed per-step cost (synchronisation, launch overhead), β the cost
    per sample. The unconstrained least-squares line is used when both
    coefficients are non-negative; otherwise the better of the two boundary
    fits (α = 0 through the origin, or β = 0 a constant), which is the exact
    non-negative least-squares solution for two coefficients.

    Args:
      batch_sizes: the batch sizes M observed, at least two distinct values.
      step_times: the seconds per step observed at each, same length.

    Returns:
      ``(alpha, beta)``.

    Example:
      >>> alpha, beta = fit_throughput([64, 128, 256], [1.14, 1.78, 3.06])
      >>> round(alpha, 9), round(beta, 9)
      (0.5, 0.01)
    """
    xs = [float(x) for x in batch_sizes]
    ys = [float(y) for y in step_times]
    if len(xs) != len(ys):
        raise ValueError(
            f"fit_throughput: got {len(xs)} batch sizes but {len(ys)} step times; "
            "pass one step time per batch size"
        )
    if len(set(xs)) < 2:
        raise ValueError(
            f"fit_throughput: needs at least two distinct batch sizes, got {sorted(set(xs))}"
        )
    for y in ys:
        check_float(y, owner="fit_throughput", name="every step time", low=0.0)
    n = len(xs)
    mean_x = sum(xs) / n
    mean_y = sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    beta = sxy / sxx
    alpha = mean_y - beta * mean_x
    if alpha >= 0.0 and beta >= 0.0:
        return alpha, beta
    sum_xx = sum(x * x for x in xs)
    through_origin = (0.0, max(sum(x * y for x, y in zip(xs, ys, strict=True)) / sum_xx, 0.0))
    constant = (max(mean_y, 0.0), 0.0)
    best = min((through_origin, constant), key=lambda ab: _sse(xs, ys, *ab))
    return best


def goodput(
    batch_size: float,
    *,
    noise_scale: float,
    alpha: float,
    beta: float,
    base_batch_size: float,
) -> float:
    """Pollux goodput: samples per second × statistical efficiency.

    goodput(M) = M / T(M) · E(M), with T(M) = α + β·M and
    E(M) = (φ + M₀)/(φ + M). In the units of "base-batch samples of progress
    per second". For α, β, φ > 0 it peaks at M* = √(αφ/β).

    Args:
      batch_size: M, > 0.
      noise_scale: φ.
      alpha: fixed seconds per step.
      beta: seconds per sample.
      base_batch_size: M₀.

    Returns:
      The goodput (``inf`` when T(M) = 0).

    Example:
      >>> goodput(100, noise_scale=0.0, alpha=1.0, beta=0.01, base_batch_size=100)
      50.0
    """
    step_time = alpha + beta * batch_size
    efficiency = statistical_efficiency(noise_scale, batch_size, base_batch_size)
    if step_time <= 0.0:
        return math.inf
    return batch_size / step_time * efficiency
