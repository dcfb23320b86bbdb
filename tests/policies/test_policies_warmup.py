"""BatchSizeWarmup on synthetic metrics: the batch follows fraction x noise scale by doublings."""

import json
import math

import pytest
from adaptjax.policies._policy import upcoming

from adaptjax import policies as ajp


def ctx(batch=8, *, step=0, lr=1e-3, devices=2, microbatches=1):
    return ajp.Context(step=step, batch_size=batch, microbatches=microbatches, devices=devices,
                       max_devices=8, hyperparams={} if lr is None else {"learning_rate": lr})


def warmup(max_batch_size, **kw):
    """Fraction 1 (the target is the noise scale itself) and shrinking on, unless given."""
    return ajp.BatchSizeWarmup(max_batch_size=max_batch_size,
                               **{"fraction": 1.0, "shrink": True, **kw})


def drive(policy, readings, batch=8, **kw):
    """Feeds readings one per evaluation, applying every SetBatchSize; returns the batches."""
    batches = []
    for i, phi in enumerate(readings):
        for action in policy.decide({"noise_scale": phi}, ctx(batch, step=10 * i, **kw)):
            if isinstance(action, ajp.SetBatchSize):
                batch = action.batch_size
        batches.append(batch)
    return batches


def expected(target, batch, low, high):
    """The band rule: one doubling if 2M <= T, one halving if T < M/2, within [low, high]."""
    if 2 * batch <= min(target, high):
        return 2 * batch
    if target < batch / 2 and batch // 2 >= low:
        return batch // 2
    return batch


def test_a_rising_noise_scale_grows_the_batch_one_doubling_at_a_time():
    policy = warmup(128, window=1)
    readings = [4, 12, 17, 30, 33, 70, 140, 300, 1000, 1000]
    batches = drive(policy, readings)
    batch, want = 8, []
    for phi in readings:
        batch = expected(phi, batch, 8, 128)
        want.append(batch)
    assert batches == want == [8, 8, 16, 16, 32, 64, 128, 128, 128, 128]
    # a jump in the reading still moves one doubling per decision
    assert drive(warmup(128, window=1), [1e4] * 5) == [
        16, 32, 64, 128, 128]


def test_fraction_scales_the_target():
    # fraction 0.25: the target is a quarter of the noise scale.
    policy = warmup(1024, window=1, fraction=0.25)
    assert drive(policy, [63.0, 64.0, 200.0, 200.0]) == [8, 16, 32, 32]


def test_a_falling_noise_scale_never_shrinks_below_the_minimum():
    policy = warmup(512, window=1)
    batches = drive(policy, [1e4] * 6 + [100.0, 20.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert batches == [16, 32, 64, 128, 256, 512, 256, 128, 64, 32, 16, 8, 8, 8]
    policy = warmup(512, min_batch_size=32, window=1)
    assert drive(policy, [0.0] * 3, batch=128) == [64, 32, 32]
    # by default the warm-up only grows: the same fall leaves the batch where it got to
    policy = warmup(512, window=1, shrink=False)
    assert drive(policy, [1e4] * 3 + [0.0] * 3) == [16, 32, 64, 64, 64, 64]


def test_hysteresis_a_reading_inside_the_band_moves_nothing():
    # At batch 32 the band is [16, 64): a noise scale wandering anywhere in it holds the batch.
    policy = warmup(512, window=1)
    wander = [16.0, 63.9, 20.0, 60.0, 16.0, 50.0]
    assert drive(policy, wander, batch=32) == [32] * len(wander)
    # Just past either edge it moves, so the band is what holds it (not a dead policy).
    assert drive(warmup(512, window=1), [64.0], batch=32) == [64]
    assert drive(warmup(512, window=1, min_batch_size=8),
                 [15.9], batch=32) == [16]


def test_after_a_move_the_band_is_around_the_new_batch():
    # 32 -> 64 at phi 64; phi back at 40 is inside [32, 128): no move back.
    policy = warmup(512, window=1)
    assert drive(policy, [64.0, 40.0, 33.0, 127.0], batch=32) == [64, 64, 64, 64]


def test_the_median_of_the_window_resists_an_outlier():
    policy = warmup(512, window=5)
    readings = [20.0, 20.0, 1e6, 20.0, 20.0, 20.0]  # an outlier, median 20
    assert drive(policy, readings, batch=16) == [16] * 6
    # window readings are needed before the first move
    policy = warmup(512, window=3)
    assert drive(policy, [100.0, 100.0, 100.0]) == [8, 8, 16]


def test_readings_start_afresh_after_each_change():
    # The noise scale measured depends on the batch trained at: readings taken at 8 do not
    # decide at 16.
    policy = warmup(512, window=2)
    batches = drive(policy, [20.0, 20.0, 1000.0, 1000.0, 1000.0, 1000.0])
    assert batches == [8, 16, 16, 32, 32, 64]


def test_invalid_readings_are_skipped():
    policy = warmup(512, window=1)
    c = ctx(8)
    assert policy.decide({"noise_scale": 1e4, "noise_scale_valid": 0.0}, c) == []
    assert policy.decide({"noise_scale": float("nan")}, c) == []
    assert policy.decide({"loss": 1.0}, c) == []
    assert policy.decide({"noise_scale": 1e4, "noise_scale_valid": 1.0}, c) == [
        ajp.SetBatchSize(16)]


def test_another_metric_can_be_followed():
    policy = warmup(512, window=1, metric="critical_batch")
    assert policy.required_metrics() == {"critical_batch"}
    assert policy.decide({"noise_scale": 1e4}, ctx(8)) == []
    assert policy.decide({"critical_batch": 40.0}, ctx(8)) == [ajp.SetBatchSize(16)]


@pytest.mark.parametrize(("rule", "factor"), [("sqrt", math.sqrt(8)), ("linear", 8.0)])
def test_learning_rate_rules(rule, factor):
    # base_lr x rule(M / M0) with M0 = 8, the batch of the first decision; at 64 S = 8.
    policy = warmup(512, window=1, lr_rule=rule)
    lr, batch = 0.01, 8
    for _ in range(3):
        actions = policy.decide({"noise_scale": 1e4}, ctx(batch, lr=lr))
        batch, lr = actions[0].batch_size, actions[1].values["learning_rate"]
    assert actions[0] == ajp.SetBatchSize(64)
    assert actions[1].values["learning_rate"] == pytest.approx(0.01 * factor, rel=1e-12)


def test_the_default_rule_keeps_the_learning_rate_and_needs_none():
    policy = warmup(512, window=1)
    assert policy.decide({"noise_scale": 70.0}, ctx(8, lr=None)) == [ajp.SetBatchSize(16)]


def test_the_lr_base_keeps_another_policys_change():
    policy = warmup(512, window=1, lr_rule="linear")
    first = policy.decide({"noise_scale": 20.0}, ctx(8, lr=0.01))
    assert first == [ajp.SetBatchSize(16), ajp.SetHyperparams({"learning_rate": 0.02})]
    # applied, then halved by someone else (0.01 at 16): the base becomes 0.005
    out = policy.decide({"noise_scale": 70.0}, ctx(16, lr=0.01))
    assert out == [ajp.SetBatchSize(32), ajp.SetHyperparams({"learning_rate": 0.005 * 4})]


def test_proposals_are_multiples_of_replicas_times_microbatches():
    # 3 devices x 2 micro-batches: valid batches are multiples of 6 (and of multiple_of).
    policy = warmup(100, window=1)
    assert drive(policy, [1e4] * 4, batch=12, devices=3, microbatches=2) == [24, 48, 96, 96]
    policy = warmup(100, window=1, multiple_of=8)
    assert drive(policy, [1e4] * 3, batch=24, devices=3, microbatches=2) == [48, 96, 96]
    # the maximum itself need not be a valid batch: the doubling stops below it
    policy = warmup(90, window=1)
    assert drive(policy, [1e4] * 3, batch=12, devices=3, microbatches=2) == [24, 48, 48]
    # no valid batch at all: nothing to propose
    policy = warmup(4, window=1)
    assert policy.decide({"noise_scale": 1e4}, ctx(8, devices=8)) == []


def test_upcoming_announces_the_next_doubling_and_halving():
    policy = warmup(64)
    assert upcoming(policy, ctx(8)) == [ajp.SetBatchSize(16)]  # 4 is below the minimum
    drive(policy, [100.0] * 5, batch=8)  # M0 = 8, now at 64
    assert upcoming(policy, ctx(32)) == [ajp.SetBatchSize(64), ajp.SetBatchSize(16)]
    assert upcoming(policy, ctx(64)) == [ajp.SetBatchSize(32)]
    # without shrinking only the doubling
    assert upcoming(warmup(64, shrink=False), ctx(32)) == [ajp.SetBatchSize(64)]


def test_a_resumed_policy_decides_as_the_uninterrupted_one():
    readings = [12.0, 18.0, 30.0, 40.0, 90.0, 130.0, 20.0, 300.0]
    whole = warmup(256, window=2, lr_rule="sqrt")
    first = drive(whole, readings)
    part = warmup(256, window=2, lr_rule="sqrt")
    head = drive(part, readings[:4])
    resumed = warmup(256, window=2, lr_rule="sqrt")
    resumed.load_state_dict(json.loads(json.dumps(part.state_dict())))
    tail = []
    batch = head[-1]
    for i, phi in enumerate(readings[4:], start=4):
        for a in resumed.decide({"noise_scale": phi}, ctx(batch, step=10 * i)):
            if isinstance(a, ajp.SetBatchSize):
                batch = a.batch_size
        tail.append(batch)
    assert head + tail == first and len(set(first)) > 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0}, "BatchSizeWarmup: max_batch_size must be"),
        ({"max_batch_size": 64, "min_batch_size": 128},
         "BatchSizeWarmup: min_batch_size=128 exceeds max_batch_size=64; make min_batch_size "
         "<= max_batch_size"),
        ({"max_batch_size": 64, "fraction": 0.0},
         "BatchSizeWarmup: fraction must be > 0, got 0.0; try 1.0"),
        ({"max_batch_size": 64, "window": 0}, "BatchSizeWarmup: window must be"),
        ({"max_batch_size": 64, "lr_rule": "cubic"},
         "BatchSizeWarmup: unknown lr_rule 'cubic'; use one of 'adascale', 'sqrt'"),
        ({"max_batch_size": 64, "metric": ""}, "BatchSizeWarmup: metric must be"),
        ({"max_batch_size": 64, "shrink": 1},
         "BatchSizeWarmup: shrink must be True or False, got 1"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises((ValueError, TypeError)) as error:
        ajp.BatchSizeWarmup(**kwargs)
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


def test_a_learning_rate_rule_without_a_learning_rate_is_a_clear_error():
    policy = warmup(64, lr_rule="sqrt")
    with pytest.raises(ValueError, match=r"^BatchSizeWarmup\(lr_rule='sqrt'\): ctx.hyperparams "
                                         r"has no 'learning_rate' \(has \[\]\); pass lr_key=\.\.\. "
                                         r"or lr_rule='none'$"):
        policy.decide({"noise_scale": 1e3}, ctx(8, lr=None))
