"""The overhead benchmarks' standard errors: the bootstrap against what can be stated exactly."""

from __future__ import annotations

import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from monitor_overhead import bootstrap_standard_error, ratio_of_medians  # noqa: E402


def test_the_median_of_normal_samples_has_its_asymptotic_standard_error():
    # SE(median) -> sqrt(pi / 2) * sigma / sqrt(n) for normal samples
    n, sigma = 400, 1.0
    rng = np.random.default_rng(0)
    estimates = [bootstrap_standard_error(np.median, rng.normal(0.0, sigma, n), seed=s)
                 for s in range(8)]
    expected = math.sqrt(math.pi / 2) * sigma / math.sqrt(n)
    assert abs(np.mean(estimates) / expected - 1.0) < 0.25, (np.mean(estimates), expected)


def test_a_ratio_that_every_pair_shares_has_no_sampling_error():
    plain = np.random.default_rng(1).uniform(40.0, 60.0, 250)
    # doubling is exact in floating point, so every resample's ratio is exactly 2
    assert bootstrap_standard_error(ratio_of_medians, 2.0 * plain, plain) == 0.0
    shifted = plain + np.random.default_rng(2).normal(0.0, 1.0, 250)
    assert bootstrap_standard_error(ratio_of_medians, shifted, plain) > 0.0
