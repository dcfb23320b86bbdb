"""FedTune's proxy search: the GP-EI tuner finds a known optimum; the search maps metric -> rate."""

import math

import pytest

from adaptjax.sync._fedtune import ProxyRun, fedtune_search, tune_learning_rate


def test_tuner_finds_the_minimum_of_a_known_curve():
    """Loss (log10 lr − log10 0.03)²: the minimum is lr = 0.03, inside [1e-4, 1]."""
    target = math.log10(0.03)
    result = tune_learning_rate(lambda lr: (math.log10(lr) - target) ** 2, 1e-4, 1.0, probes=10)
    assert len(result.trials) == 10
    # the grid's spacing is 4 decades / 255: within two grid steps of the optimum
    assert abs(math.log10(result.best_lr) - target) < 2 * 4 / 255
    assert result.best_loss == min(loss for _, loss in result.trials)


def test_a_diverged_probe_does_not_send_the_search_away_from_the_optimum():
    """Loss 2.8 + (log10 lr − log10 0.8)² below lr 1.5, 1e20 (diverged) above, range [0.03, 3].

    The third probe (lr 3) diverges; uncapped, its 1e20 flattened the GP and
    the search spent every later probe below 0.3 (best 0.303 of 8 probes).
    """
    target = math.log10(0.8)

    def loss(lr):
        return 1e20 if lr > 1.5 else 2.8 + (math.log10(lr) - target) ** 2

    result = tune_learning_rate(loss, 0.03, 3.0, probes=8)
    assert result.trials[2] == (pytest.approx(3.0), 1e20)
    assert abs(math.log10(result.best_lr) - target) < 0.05  # within 12% of 0.8


def test_search_maps_each_level_to_its_best_rate_and_counts_steps():
    """Level α has metric 1/α and best rate 0.1 exp(−metric): the mapping is that line."""

    def run_proxy(alpha, lr):
        metric = 1.0 / alpha
        best = 0.1 * math.exp(-metric)
        return ProxyRun(metric, (math.log(lr) - math.log(best)) ** 2, steps=50)

    search = fedtune_search(run_proxy, [0.5, 1.0, 10.0], 1e-4, 1.0, probes=10)
    assert search.steps == 3 * 10 * 50
    tolerance = 2 * math.log(1e4) / 255  # two grid steps in log(lr)
    for metric, lr in search.points:
        assert abs(math.log(lr) - (math.log(0.1) - metric)) < tolerance
    assert search.mapping.slope == pytest.approx(-1.0, abs=tolerance)
    assert math.log(search.mapping(1.0)) == pytest.approx(math.log(0.1) - 1.0, abs=tolerance)


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(ValueError, match="needs 0 < low < high"):
        tune_learning_rate(lambda lr: 0.0, 1.0, 0.1)
    with pytest.raises(ValueError, match="probes must be an int >= 3"):
        tune_learning_rate(lambda lr: 0.0, 0.1, 1.0, probes=2)
    with pytest.raises(ValueError, match="return a finite loss"):
        tune_learning_rate(lambda lr: float("nan"), 0.1, 1.0)
    with pytest.raises(ValueError, match="at least one heterogeneity level"):
        fedtune_search(lambda a, lr: ProxyRun(0.0, 0.0, 1), [], 0.1, 1.0)
