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


# --- the FedTune policy (issue 49 item 4): pure, on a hand-built Context ------------------
from adaptjax.policies import Context, SetHyperparams  # noqa: E402
from adaptjax.policies._fedtune import FedTune  # noqa: E402

# lr(m) = 0.5 * 0.25**m on [0, 1]: dyadic rates, so every factor below is exact
MAPPING = LrMapping.fit([0.0, 1.0], [0.5, 0.125])


def ctx(step, factors, lr=0.5):
    hyper = {"learning_rate": lr, **{f"replica_lr/{i}": f for i, f in enumerate(factors)}}
    return Context(step=step, batch_size=8, microbatches=1, devices=len(factors),
                   max_devices=len(factors), hyperparams=hyper)


def set_values(actions):
    """The one SetHyperparams' values (the fit's log/exp round trip is exact to ~1e-16)."""
    assert len(actions) == 1 and isinstance(actions[0], SetHyperparams)
    return dict(actions[0].values)


def measured(values, loss=1.0):
    out = {f"grad_dissimilarity/{i}": v for i, v in enumerate(values)}
    return {**out, **{f"replica_loss/{i}": loss for i in range(len(values))}, "loss": 2.0}


def test_the_policy_sets_each_factor_to_the_mapped_rate_over_the_base_rate():
    # factor_i = 0.5 * 0.25**m_i / 0.5; the replica at m = 7 clips to m = 1
    actions = FedTune(MAPPING).decide(measured([0.0, 0.5, 1.0, 7.0]), ctx(4, [1.0] * 4))
    assert set_values(actions) == pytest.approx({"replica_lr/0": 1.0, "replica_lr/1": 0.5,
                                                 "replica_lr/2": 0.25, "replica_lr/3": 0.25})
    assert actions[0].reason.startswith("FedTune: grad_dissimilarity/2 = 1 maps to lr 0.125")
    # a base rate of 0.25 doubles every factor: the effective rates stay the mapping's
    twice = FedTune(MAPPING).decide(measured([0.0, 0.5]), ctx(4, [1.0, 1.0], lr=0.25))
    assert set_values(twice) == pytest.approx({"replica_lr/0": 2.0, "replica_lr/1": 1.0})


def test_the_policy_refits_as_metrics_drift_and_is_quiet_within_rtol():
    policy = FedTune(MAPPING, rtol=0.01)
    in_force = [1.0, 0.5]
    assert policy.decide(measured([0.0, 0.5]), ctx(8, in_force)) == []
    # 0.5 * 0.25**0.504 / 0.5 = 0.4965: 0.7% below 0.5, within 1%
    assert policy.decide(measured([0.0, 0.504]), ctx(9, in_force)) == []
    drifted = policy.decide(measured([0.0, 1.0]), ctx(12, in_force))
    assert set_values(drifted) == pytest.approx({"replica_lr/0": 1.0, "replica_lr/1": 0.25})


def test_the_policy_waits_for_a_sync_and_its_cadence():
    policy = FedTune(MAPPING, every=4)
    zeros = measured([0.0, 0.0], loss=0.0)  # the state before the first sync (or a rescale)
    assert policy.decide(zeros, ctx(4, [1.0, 1.0])) == []
    assert policy.decide({"loss": 1.0}, ctx(4, [1.0, 1.0])) == []  # S-SGD: no replicas
    assert policy.decide(measured([0.0, 1.0]), ctx(6, [1.0, 1.0])) == []  # not a multiple of 4
    assert policy.decide(measured([0.0, 1.0]), ctx(8, [1.0, 1.0])) != []
    assert policy.state_dict() == {}  # the factors in force are read from the context


def test_policy_errors_are_one_line():
    with pytest.raises(ValueError, match="^FedTune: mapping must be an LrMapping"):
        FedTune(lambda m: 0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^FedTune: every must be an int >= 1, got 0$"):
        FedTune(MAPPING, every=0)
    no_factors = Context(step=1, batch_size=8, microbatches=1, devices=1, max_devices=1,
                         hyperparams={"learning_rate": 0.5})
    with pytest.raises(ValueError) as e:
        FedTune(MAPPING).decide(measured([0.5]), no_factors)
    assert str(e.value) == (
        "FedTune: ctx.hyperparams has no 'replica_lr/0' (has ['learning_rate']); it runs under "
        "a Controller whose sync is adaptjax.sync.LocalSGD or DiLoCo, with a known learning_rate")
