"""benchmarks/frontier.py's arithmetic on synthetic curves with a known answer."""

import math

import pytest


@pytest.fixture(scope="module")
def fr(load_script):
    return load_script("benchmarks/frontier.py")


def _curve(rate, floor, steps):
    """L(s) = floor + 1 / (1 + rate·s): reaches L* at s = (1/(L* − floor) − 1) / rate."""
    return [floor + 1.0 / (1.0 + rate * s) for s in steps]


def test_steps_to_loss_interpolates_linearly_between_evaluations(fr):
    assert fr.steps_to_loss([0, 10, 20], [4.0, 3.0, 1.0], 2.0) == 15.0
    assert fr.steps_to_loss([0, 10, 20], [4.0, 3.0, 1.0], 3.0) == 10.0  # hit exactly
    assert fr.steps_to_loss([5, 10], [1.0, 0.5], 2.0) == 5.0  # below from the first point


def test_a_run_that_never_reaches_the_target_takes_infinitely_many_steps(fr):
    assert fr.steps_to_loss([0, 10, 20], [4.0, 3.0, 2.5], 2.0) == math.inf


def test_a_flat_stretch_at_the_target_takes_its_first_step(fr):
    assert fr.steps_to_loss([0, 10, 20], [2.0, 2.0, 1.0], 2.0) == 0.0
    assert fr.steps_to_loss([0, 10, 20, 30], [3.0, 2.0, 2.0, 1.0], 2.0) == 10.0


def test_on_analytic_curves_the_ratio_is_the_ratio_of_their_rates(fr):
    steps = list(range(0, 4001, 50))
    floor = 1.0
    fixed = {"fixed-8": _curve(0.01, floor, steps), "fixed-16": _curve(0.02, floor, steps)}
    # both fixed runs end near 1.0 + 1/(1 + rate·4000); the best is fixed-16's
    target = fr.target_loss({k: [v[-1]] for k, v in fixed.items()}, margin=0.05)
    assert target == pytest.approx(1.05 * (floor + 1 / (1 + 0.02 * 4000)))
    s = {k: [fr.steps_to_loss(steps, v, target)] for k, v in fixed.items()}
    exact16 = (1 / (target - floor) - 1) / 0.02
    assert s["fixed-16"][0] == pytest.approx(exact16, rel=0.01)  # linear between 50-step points
    adaptive = fr.steps_to_loss(steps, _curve(0.04, floor, steps), target)
    (ratio,) = fr.frontier_ratios(s, [adaptive])
    assert ratio == pytest.approx(0.5, rel=0.02)


def test_ties_and_missing_frontiers(fr):
    assert fr.frontier_ratios({"a": [100.0], "b": [100.0]}, [70.0]) == [0.7]
    assert math.isnan(fr.frontier_ratios({"a": [math.inf]}, [70.0])[0])  # no fixed run got there
    assert fr.frontier_ratios({"a": [100.0]}, [math.inf]) == [math.inf]
    assert fr.summary([0.5, 0.7, 0.6]) == pytest.approx((0.6, 0.5, 0.7))


def test_bad_curves_are_one_line(fr):
    with pytest.raises(ValueError, match="^steps and losses must be non-empty and of one length"):
        fr.steps_to_loss([0, 1], [1.0], 0.5)
    with pytest.raises(ValueError, match="^target_loss needs at least one fixed run$"):
        fr.target_loss({})
