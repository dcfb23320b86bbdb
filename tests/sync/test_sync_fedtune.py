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
