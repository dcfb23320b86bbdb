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


def test_the_best_rate_is_the_lowest_final_loss_and_a_tie_goes_to_the_rule(fr):
    assert fr.best_multiplier({0.5: 2.10, 1.0: 2.00, 2.0: 1.95}) == 2.0
    assert fr.best_multiplier({0.5: 2.00, 1.0: 2.00, 2.0: 2.00}) == 1.0  # the rule's own rate
    assert fr.best_multiplier({0.5: 2.00, 1.0: 2.10, 2.0: 2.00}) == 0.5  # equally near: smaller
    assert fr.best_multiplier({0.5: math.nan, 1.0: math.inf, 2.0: 3.0}) == 2.0  # diverged runs


def test_best_rate_bad_inputs_are_one_line(fr):
    with pytest.raises(ValueError, match="^best_multiplier needs at least one rate's final loss$"):
        fr.best_multiplier({})
    with pytest.raises(ValueError, match=r"^no rate gave a finite final loss: \{0.5: nan\}$"):
        fr.best_multiplier({0.5: math.nan})


def test_steps_at_follows_a_batch_that_grows(fr):
    sizes = [8] * 10 + [16] * 5 + [32] * 5  # 80 samples at step 10, 160 at 15, 320 at 20
    assert fr.steps_at(sizes, [8, 80, 81, 96, 161, 240, 320]) == [1, 10, 11, 11, 16, 18, 20]
    with pytest.raises(ValueError, match="^the run saw 320 samples, fewer than 321$"):
        fr.steps_at(sizes, [321])


def test_milestones_of_a_doubling_batch_come_in_fewer_steps(fr):
    # 1/2 of 3200 samples at batch 16: step 100; then batch 32 for 1/4 more: 25 steps
    assert fr.milestone_steps([0.5, 0.75], 3200, 16) == [100, 150]
    assert fr.milestone_steps([0.75, 0.5], 3200, 16, growth=2) == [100, 125]
    with pytest.raises(ValueError, match="^every milestone fraction must be in"):
        fr.milestone_steps([1.0], 3200, 16)


def test_seesaw_against_its_schedule_on_synthetic_curves(fr):
    """Equal losses at equal samples, the batch doubled after half the samples: on
    the curves against steps the Seesaw run reaches the baseline's final loss at
    (N/2 + N/4) / N = 3/4 of the baseline's steps."""
    n = 400
    steps = list(range(0, n + 1, 10))
    losses = [3.0 - s / n for s in steps]  # linear in samples, ends at 2.0
    seesaw_steps = [s if s <= n // 2 else n // 2 + (s - n // 2) / 2 for s in steps]
    target, ratios = fr.paired_steps_ratio([(steps, losses)], [(seesaw_steps, losses)],
                                           margin=0.0)
    assert target == 2.0
    assert ratios == [pytest.approx(0.75)]
    _, never = fr.paired_steps_ratio([(steps, losses)], [(steps, [x + 0.5 for x in losses])])
    assert never == [math.inf]
    with pytest.raises(ValueError, match="^baseline and other need one run per seed each"):
        fr.paired_steps_ratio([(steps, losses)], [])
