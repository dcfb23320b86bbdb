"""The critical-batch fit against data with a known B_crit, the Probe action and its policy."""

import json
import math

import numpy as np
import pytest
from adaptjax.policies._actions import ACTION_TYPES
from adaptjax.policies._critical_batch import fit_critical_batch
from adaptjax.policies._policy import upcoming, validate_actions

from adaptjax import policies as ajp

SIZES = [8, 16, 32, 64, 128, 256, 512]


def model_drops(sizes, b_crit, dl_max, steps):
    return [k * dl_max * b / (b + b_crit) for b, k in zip(sizes, steps, strict=True)]


@pytest.mark.parametrize("b_crit", [3.0, 40.0, 100.0, 1000.0])
@pytest.mark.parametrize("equal", ["tokens", "steps"])
def test_exact_model_data_give_back_b_crit_and_dl_max(b_crit, equal):
    steps = [4096 / b for b in SIZES] if equal == "tokens" else [10] * len(SIZES)
    drops = model_drops(SIZES, b_crit, 0.02, steps)
    fit = fit_critical_batch(SIZES, drops, steps)
    assert fit.critical_batch == pytest.approx(b_crit, rel=1e-6)
    assert fit.max_improvement == pytest.approx(0.02, rel=1e-6)
    assert fit.rmse == pytest.approx(0.0, abs=1e-9)


def test_noisy_drops_an_unbiased_fit_whose_error_grows_with_the_noise():
    # Relative noise of 1% and 3% on every drop (the branches' evaluation noise), the same
    # 200 normal draws: the fit is unbiased (median error < 1%), its error is linear in small
    # noise (3x the spread at 3x the noise), and at 3% nine fits in ten are within 15%.
    z = np.random.default_rng(0).standard_normal((200, len(SIZES)))
    steps = [4096 / b for b in SIZES]
    clean = np.array(model_drops(SIZES, 64.0, 0.01, steps))
    errors = {
        noise: np.array([fit_critical_batch(SIZES, clean * (1 + noise * row), steps)
                         .critical_batch / 64.0 - 1 for row in z])
        for noise in (0.01, 0.03)
    }
    assert abs(np.median(errors[0.03])) < 0.01
    assert errors[0.03].std() / errors[0.01].std() == pytest.approx(3.0, rel=0.15)
    assert np.mean(abs(errors[0.03]) < 0.15) >= 0.9


def test_the_limits_zero_and_infinity():
    # Every step alike whatever the batch: B_crit = 0. Progress proportional to B: infinite.
    steps = [10] * 4
    assert fit_critical_batch([8, 16, 32, 64], [0.5] * 4, steps).critical_batch == 0.0
    fit = fit_critical_batch([8, 16, 32, 64], [0.01 * b for b in (8, 16, 32, 64)], steps)
    assert fit.critical_batch == math.inf
    # No progress at all: nothing to measure.
    assert math.isnan(fit_critical_batch([8, 16, 32], [-0.1, -0.2, -0.1], 5).critical_batch)


def test_linear_regression_one_sgd_step_at_the_optimal_rate():
    """Linear regression at fixed parameters, whitened features (H = I).

    One SGD step of batch B at rate e lowers the loss by e|G|^2 - e^2/2 (G'HG + tr(HS)/B) on
    average; at the best rate that is |G|^4 / (2 (G'HG + tr(HS)/B)) = dL_max / (1 + B_noise/B)
    with B_noise = tr(HS)/G'HG = tr(S)/|G|^2 = B_simple. Realised steps on sampled batches
    must give back B_simple within 15%.
    """
    rng = np.random.default_rng(0)
    n, d = 8192, 6
    x = rng.standard_normal((n, d))
    x = (x - x.mean(0)) @ np.linalg.inv(np.linalg.cholesky(np.cov(x.T, bias=True))).T  # H = I
    y = x @ rng.standard_normal(d) + 0.5 * rng.standard_normal(n)
    theta = rng.standard_normal(d) * 0.3
    per_example = x * (x @ theta - y)[:, None]
    g = per_example.mean(0)
    sigma_trace = per_example.var(0).sum()
    b_simple = sigma_trace / (g @ g)
    hess = x.T @ x / n
    sizes = [4, 8, 16, 32, 64, 128, 256]
    drops = []
    for b in sizes:
        rate = (g @ g) / (g @ hess @ g + sigma_trace / b)
        idx = rng.integers(0, n, size=(4000, b))
        step = rate * per_example[idx].mean(1)  # 4000 realised batch gradients
        drops.append(np.mean(step @ g - 0.5 * np.einsum("ri,ij,rj->r", step, hess, step)))
    fit = fit_critical_batch(sizes, drops, steps=1)
    assert 2 < b_simple < 200  # the sizes bracket it
    assert fit.critical_batch == pytest.approx(b_simple, rel=0.15)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([8, 16], [0.1, 0.2], 1), "fit_critical_batch: needs branches at 3 or more distinct "
                                   "batch sizes, got [8.0, 16.0]"),
        (([8, 16, 32], [0.1, 0.2], 1), "fit_critical_batch: got 3 batch sizes but 2 loss drops; "
                                       "pass one loss drop per branch"),
        (([8, 16, 32], [0.1, 0.2, 0.3], [1, 2]), "fit_critical_batch: got 2 step counts for 3 "
                                                 "branches"),
        (([8, 0, 32], [0.1, 0.2, 0.3], 1), "fit_critical_batch: batch sizes and step counts "
                                           "must be > 0"),
        (([8, 16, 32], [0.1, float("nan"), 0.3], 1), "fit_critical_batch: every loss drop"),
    ],
)
def test_fit_errors(args, message):
    with pytest.raises(ValueError) as error:
        fit_critical_batch(*args)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


# ----------------------------------------------------------------------------- the action
def test_probe_action_is_normalised_and_checked():
    probe = ajp.Probe(batch_sizes=[np.int64(64), 16, 32, 16], steps=5, reason="why")
    assert probe == ajp.Probe((16, 32, 64), steps=5) and probe.batch_sizes == (16, 32, 64)
    assert hash(probe) == hash(ajp.Probe((16, 32, 64), steps=5))
    assert validate_actions([probe]) == [probe]
    assert ajp.Probe in ACTION_TYPES
    for kwargs, message in [
        ({"batch_sizes": (8, 16)}, "Probe: batch_sizes needs 3 or more distinct sizes"),
        ({"batch_sizes": (8, 16, 0)}, "Probe: every batch size must be"),
        ({"batch_sizes": "8,16,32"}, "Probe: batch_sizes must be a tuple of ints"),
        ({"batch_sizes": (8, 16, 32), "steps": 0}, "Probe: steps must be"),
        ({"batch_sizes": (8, 16, 32), "lr_rule": "cube"}, "Probe: unknown lr_rule 'cube'"),
        ({"batch_sizes": (8, 16, 32), "lr_multipliers": ()},
         "Probe: lr_multipliers needs at least one factor, got ()"),
        ({"batch_sizes": (8, 16, 32), "lr_multipliers": (1.0, 0.0)},
         "Probe: every lr multiplier must be in (0, inf), got 0"),
        ({"batch_sizes": (8, 16, 32), "lr_multipliers": (float("inf"),)},
         "Probe: every lr multiplier must be finite, got inf"),
        ({"batch_sizes": (8, 16, 32), "lr_multipliers": 2.0},
         "Probe: lr_multipliers must be a tuple of numbers, got 2.0"),
    ]:
        with pytest.raises(ValueError) as error:
            ajp.Probe(**kwargs)
        assert str(error.value).startswith(message), str(error.value)


# ----------------------------------------------------------------------------- the policy
def ctx(step, batch=64, devices=8, microbatches=1):
    return ajp.Context(step=step, batch_size=batch, microbatches=microbatches, devices=devices,
                       max_devices=8, hyperparams={})


def test_probe_lr_multipliers_are_sorted_distinct_floats_and_reach_the_action():
    probe = ajp.Probe((8, 16, 32), lr_multipliers=[2, np.float32(0.5), 1, 2])
    assert probe.lr_multipliers == (0.5, 1.0, 2.0)
    assert probe != ajp.Probe((8, 16, 32)) and ajp.Probe((8, 16, 32)).lr_multipliers == (1.0,)
    policy = ajp.CriticalBatchProbe(every=10, lr_multipliers=(1, 0.25))
    assert policy.lr_multipliers == (0.25, 1.0)
    [asked] = policy.decide({}, ctx(0))
    assert asked.lr_multipliers == (0.25, 1.0)
    assert upcoming(policy, ctx(5))[0].lr_multipliers == (0.25, 1.0)


def test_probe_policy_asks_every_n_steps_from_start():
    policy = ajp.CriticalBatchProbe(every=100, start=50, sizes=(32, 64, 128), steps=5)
    asked = [s for s in range(0, 400, 10) if policy.decide({}, ctx(s))]
    assert asked == [50, 150, 250, 350]
    assert upcoming(policy, ctx(360)) == [
        ajp.Probe((32, 64, 128), steps=5, lr_multipliers=(0.125, 0.25, 0.5, 1.0))]


def test_probe_policy_defaults_sweep_the_rate_over_16_steps():
    [asked] = ajp.CriticalBatchProbe(every=100).decide({}, ctx(0))
    assert (asked.steps, asked.lr_rule, asked.lr_multipliers) == (
        16, "sqrt", (0.125, 0.25, 0.5, 1.0))


def test_probe_sizes_follow_the_batch_and_the_last_measurement():
    policy = ajp.CriticalBatchProbe(every=100)
    [first] = policy.decide({}, ctx(0, batch=64))
    assert first.batch_sizes == (16, 32, 64, 128, 256)  # centred on the batch
    # a measurement of 500 (held in later rows, with the step it was made at)
    policy.decide({"critical_batch": 500.0, "critical_batch_step": 5}, ctx(50))
    [second] = policy.decide({"critical_batch": 500.0, "critical_batch_step": 5}, ctx(100))
    assert second.batch_sizes == (128, 256, 512, 1024, 2048)  # 2^round(log2(500)) = 512
    assert policy.state_dict()["measured"] == [[5, 500.0]]  # the held value counted once
    capped = ajp.CriticalBatchProbe(every=100, max_batch_size=256)
    assert capped.decide({}, ctx(0, batch=64))[0].batch_sizes == (16, 32, 64, 128, 256)
    tight = ajp.CriticalBatchProbe(every=100, max_batch_size=32)
    assert tight.decide({}, ctx(0, batch=64)) == []  # 16 and 32 alone: too few branches


def test_an_infinite_critical_batch_moves_the_next_probe_above_the_last_sizes():
    policy = ajp.CriticalBatchProbe(every=100)
    [first] = policy.decide({}, ctx(0, batch=64))
    assert first.batch_sizes == (16, 32, 64, 128, 256)
    # the drops grew with the batch up to 256: B_crit is above it, centre on 2 x 256
    held = {"critical_batch": float("inf"), "critical_batch_step": 5}
    assert policy.decide(held, ctx(50)) == []
    [second] = policy.decide(held, ctx(100))
    assert second.batch_sizes == (128, 256, 512, 1024, 2048)
    assert policy.state_dict()["measured"] == [[5, float("inf")]]
    resumed = ajp.CriticalBatchProbe(every=100)
    resumed.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    [third] = resumed.decide(held, ctx(200))  # still infinite: centred on 2 x 2048
    assert third.batch_sizes == (1024, 2048, 4096, 8192, 16384)


def test_probe_policy_resumes_where_it_stopped():
    policy = ajp.CriticalBatchProbe(every=100, sizes=(8, 16, 32))
    assert policy.decide({}, ctx(0))
    resumed = ajp.CriticalBatchProbe(every=100, sizes=(8, 16, 32))
    resumed.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert resumed.decide({}, ctx(90)) == [] and resumed.decide({}, ctx(100))


def test_probe_policy_bad_arguments():
    for kwargs, message in [
        ({"every": 0}, "CriticalBatchProbe: every must be"),
        ({"every": 10, "steps": 0}, "CriticalBatchProbe: steps must be"),
        ({"every": 10, "sizes": (8, 16)}, "Probe: batch_sizes needs 3 or more distinct sizes"),
        ({"every": 10, "sizes": ()}, "Probe: batch_sizes needs 3 or more distinct sizes"),
        ({"every": 10, "lr_rule": "x"}, "CriticalBatchProbe: unknown lr_rule 'x'"),
        ({"every": 10, "lr_multipliers": (-1.0,)},
         "Probe: every lr multiplier must be in (0, inf), got -1"),
    ]:
        with pytest.raises(ValueError) as error:
            ajp.CriticalBatchProbe(**kwargs)
        assert str(error.value).startswith(message), str(error.value)
