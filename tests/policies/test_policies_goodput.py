"""Goodput math: statistical efficiency, AdaScale gain, LR rules, the throughput fit."""

import math
import random

import pytest
from adaptjax.policies._goodput import (
    adascale_gain,
    fit_throughput,
    lr_scale,
    statistical_efficiency,
)

from adaptjax import policies as ajp


def test_efficiency_identities():
    # E(M0) = 1 for any noise scale.
    for phi in (0.0, 1.0, 100.0, 1e9):
        assert statistical_efficiency(phi, 64, 64) == 1.0
    # phi = 0: E = M0 / M (a noise-free gradient gains nothing from a larger batch).
    for m in (64, 128, 1000):
        assert statistical_efficiency(0.0, m, 64) == pytest.approx(64 / m, rel=1e-15)
    # phi -> infinity: E -> 1 (large batches are free).
    assert statistical_efficiency(1e15, 4096, 64) == pytest.approx(1.0, abs=1e-11)
    # A negative estimate is clamped to 0.
    assert statistical_efficiency(-5.0, 128, 64) == 0.5


def test_adascale_gain_matches_formula():
    rng = random.Random(0)
    for _ in range(50):
        s, sigma_sq, mu_sq = rng.uniform(0.1, 64), rng.uniform(0, 10), rng.uniform(0, 10)
        expected = (sigma_sq + mu_sq) / (sigma_sq / s + mu_sq)
        got = adascale_gain(s, sigma_sq=sigma_sq, mu_sq=mu_sq)
        assert got == pytest.approx(expected, rel=1e-14)
        low, high = sorted((1.0, s))  # r lies between 1 and S
        assert low - 1e-12 <= got <= high + 1e-12


def test_adascale_gain_limits():
    for sigma_sq, mu_sq in ((1.0, 1.0), (5.0, 0.1), (0.0, 2.0)):
        assert adascale_gain(1.0, sigma_sq=sigma_sq, mu_sq=mu_sq) == 1.0
    # sigma^2 dominates: r -> S.
    assert adascale_gain(8.0, sigma_sq=1e12, mu_sq=1.0) == pytest.approx(8.0, rel=1e-9)
    assert adascale_gain(8.0, sigma_sq=1.0, mu_sq=0.0) == 8.0
    # mu^2 dominates: r -> 1.
    assert adascale_gain(8.0, sigma_sq=1.0, mu_sq=1e12) == pytest.approx(1.0, rel=1e-9)
    # Nothing measured: no gain.
    assert adascale_gain(8.0, sigma_sq=0.0, mu_sq=0.0) == 1.0


def test_adascale_gain_is_scale_times_efficiency():
    # r = S * E(S*M0) with phi = M0 * sigma^2 / mu^2.
    m0, sigma_sq, mu_sq = 32.0, 3.0, 0.5
    phi = m0 * sigma_sq / mu_sq
    for s in (0.5, 2.0, 4.0, 16.0):
        r = adascale_gain(s, sigma_sq=sigma_sq, mu_sq=mu_sq)
        assert r == pytest.approx(s * statistical_efficiency(phi, s * m0, m0), rel=1e-14)


def test_lr_rules():
    for s in (0.5, 1.0, 2.0, 16.0):
        assert lr_scale("linear", s) == s
        assert lr_scale("sqrt", s) == math.sqrt(s)
        assert lr_scale("none", s) == 1.0
        r = adascale_gain(s, sigma_sq=2.0, mu_sq=1.0)
        assert lr_scale("adascale", s, optimizer_kind="sgd", sigma_sq=2.0, mu_sq=1.0) == r
        assert lr_scale(
            "adascale", s, optimizer_kind="adam", sigma_sq=2.0, mu_sq=1.0
        ) == math.sqrt(r)


def test_lr_scale_errors():
    with pytest.raises(ValueError, match=r"^lr_scale: unknown rule 'cubic'; use one of "
                                         r"'adascale', 'sqrt', 'linear', 'none'$"):
        lr_scale("cubic", 2.0)
    with pytest.raises(ValueError, match=r"^lr_scale: rule 'adascale' needs sigma_sq and mu_sq$"):
        lr_scale("adascale", 2.0)


@pytest.mark.parametrize(("alpha", "beta"), [(0.5, 0.01), (0.0, 0.002), (2.0, 0.0), (0.03, 1e-5)])
def test_fit_recovers_exact_linear_data(alpha, beta):
    sizes = [32, 64, 128, 256, 512]
    times = [alpha + beta * m for m in sizes]
    a, b = fit_throughput(sizes, times)
    assert a == pytest.approx(alpha, abs=1e-12)
    assert b == pytest.approx(beta, abs=1e-14)


def test_fit_is_least_squares_for_noisy_data():
    # Symmetric noise around the line at symmetric points leaves the fit on the line.
    sizes = [64, 64, 128, 128]
    times = [1.0 + 0.1, 1.0 - 0.1, 2.0 + 0.1, 2.0 - 0.1]
    a, b = fit_throughput(sizes, times)
    assert (a, b) == (pytest.approx(0.0, abs=1e-12), pytest.approx(1.0 / 64, rel=1e-12))


def test_fit_never_returns_negative_coefficients():
    # Step time falling with batch size: the best fit with beta >= 0 is the constant mean.
    a, b = fit_throughput([64, 128, 256], [3.0, 2.0, 1.0])
    assert (a, b) == (pytest.approx(2.0), 0.0)
    # A line through negative intercept: alpha clipped to 0, beta = sum(xy) / sum(x^2).
    sizes, times = [100, 200], [0.5, 1.5]  # unconstrained: alpha = -0.5, beta = 0.01
    a, b = fit_throughput(sizes, times)
    assert a == 0.0
    assert b == pytest.approx((100 * 0.5 + 200 * 1.5) / (100**2 + 200**2))


def test_fit_errors():
    with pytest.raises(ValueError, match=r"^fit_throughput: needs at least two distinct batch "
                                         r"sizes, got \[64.0\]$"):
        fit_throughput([64, 64], [1.0, 1.1])
    with pytest.raises(ValueError, match=r"^fit_throughput: got 2 batch sizes but 1 step times"):
        fit_throughput([64, 128], [1.0])
    with pytest.raises(ValueError, match=r"^fit_throughput: every step time must be in \[0, inf\)"):
        fit_throughput([64, 128], [1.0, -1.0])


def test_goodput_definition_and_peak():
    alpha, beta, phi, m0 = 0.5, 0.001, 2000.0, 64
    for m in (64, 100, 1000):
        expected = m / (alpha + beta * m) * (phi + m0) / (phi + m)
        got = ajp.goodput(m, noise_scale=phi, alpha=alpha, beta=beta, base_batch_size=m0)
        assert got == pytest.approx(expected, rel=1e-14)
    # The peak is at M* = sqrt(alpha * phi / beta) = 1000.
    def g(m):
        return ajp.goodput(m, noise_scale=phi, alpha=alpha, beta=beta, base_batch_size=m0)
    assert g(1000) > g(999) and g(1000) > g(1001)
    assert ajp.goodput(10, noise_scale=1.0, alpha=0.0, beta=0.0, base_batch_size=1) == math.inf
