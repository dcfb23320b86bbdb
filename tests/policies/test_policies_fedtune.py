"""FedTune's mapping metric -> learning rate: exact least squares in log(lr), clipping, reading."""

import math

import numpy as np
import pytest
from adaptjax.policies._fedtune import LrMapping


def test_fit_recovers_an_exponential_law_exactly():
    """lr = 0.2 exp(-1.5 m) is a line in log(lr): least squares returns it."""
    m = np.array([0.0, 0.4, 1.0, 2.5])
    mapping = LrMapping.fit(m, 0.2 * np.exp(-1.5 * m))
    assert mapping.slope == pytest.approx(-1.5, rel=1e-12)
    assert mapping.intercept == pytest.approx(math.log(0.2), rel=1e-12)
    assert mapping(1.7) == pytest.approx(0.2 * math.exp(-1.5 * 1.7), rel=1e-12)


def test_predictions_clip_to_the_levels_seen():
    mapping = LrMapping.fit([0.5, 1.5], [0.1, 0.01])
    assert mapping(-3.0) == pytest.approx(0.1) and mapping(40.0) == pytest.approx(0.01)


def test_one_level_gives_a_constant_rate():
    mapping = LrMapping.fit([0.3], [0.05])
    assert mapping.slope == 0.0 and mapping(0.0) == pytest.approx(0.05)


def test_replica_factors_read_each_replica_metric():
    mapping = LrMapping.fit([0.0, 1.0], [0.1, 0.01])
    metrics = {"grad_dissimilarity/0": 0.0, "grad_dissimilarity/1": 1.0, "loss": 3.0}
    np.testing.assert_allclose(mapping.replica_factors(metrics, 0.1), [1.0, 0.1], rtol=1e-12)


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(ValueError, match="one learning rate per metric value"):
        LrMapping.fit([0.0, 1.0], [0.1])
    with pytest.raises(ValueError, match="finite learning rates > 0"):
        LrMapping.fit([0.0, 1.0], [0.1, 0.0])
    mapping = LrMapping.fit([0.0, 1.0], [0.1, 0.01])
    with pytest.raises(ValueError, match="metrics hold no grad_dissimilarity/0"):
        mapping.replica_factors({"loss": 1.0}, 0.1)
    with pytest.raises(ValueError, match="base_lr must be > 0"):
        mapping.replica_factors({"grad_dissimilarity/0": 1.0}, 0.0)
