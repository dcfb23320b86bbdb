"""AdaptiveBatchSize: decisions checked against the goodput model they are defined by."""

import math

import pytest
from adaptjax.policies._policy import upcoming

from adaptjax import policies as ajp


def ctx(batch=64, *, step=0, lr=0.1, key="learning_rate", devices=8, microbatches=1, base=64,
        codec=None):
    hyper = {} if lr is None else {key: lr}
    return ajp.Context(
        step=step, batch_size=batch, microbatches=microbatches, devices=devices, max_devices=8,
        hyperparams=hyper, codec=codec, base_batch_size=base,
    )


def observe(policy, alpha, beta, sizes, **kw):
    """Feeds exact step times T(M) = alpha + beta*M at each size (no noise scale: no decision)."""
    for m in sizes:
        assert policy.decide({"step_time": alpha + beta * m}, ctx(m, **kw)) == []


def brute_force_best(alpha, beta, phi, current, low, high, step, m0=64):
    def g(m):
        return ajp.goodput(m, noise_scale=phi, alpha=alpha, beta=beta, base_batch_size=m0)
    best = max(range(low, high + 1, step), key=lambda m: (g(m), -m))
    return best, g(best) / g(current) - 1.0


def test_nothing_without_metrics():
    policy = ajp.AdaptiveBatchSize(1024)
    assert policy.decide({}, ctx()) == []
    assert policy.decide({"noise_scale": 1e6}, ctx()) == []  # no step time yet
    assert policy.decide({"step_time": 0.2, "noise_scale": float("nan")}, ctx()) == []
    assert policy.decide({"step_time": float("inf"), "loss": 1.0}, ctx()) == []


def test_zero_noise_scale_never_grows_the_batch():
    # phi = 0: E(M) = M0/M, so goodput = M0 / T(M) falls with M whatever T is.
    policy = ajp.AdaptiveBatchSize(1024)
    observe(policy, 1.0, 0.001, [128, 256])
    assert policy.decide({"noise_scale": 0.0, "step_time": 1.064}, ctx(64)) == []
    # The same measurements with a huge noise scale do grow it: the test above is not vacuous.
    policy = ajp.AdaptiveBatchSize(1024)
    observe(policy, 1.0, 0.001, [128, 256])
    assert policy.decide({"noise_scale": 1e6, "step_time": 1.064}, ctx(64))[0] == (
        ajp.SetBatchSize(1024)
    )


def test_invalid_noise_scale_readings_are_ignored():
    # The same measurements as the huge-noise-scale case below, which grows the batch to
    # 1024 when the reading is valid; flagged invalid (a held value, or a smoothed
    # |G|^2 <= 0 read as ~1e31), the policy must not act on it.
    for valid, flag in ((False, 0.0), (False, float("nan")), (True, 1.0)):
        policy = ajp.AdaptiveBatchSize(1024, lr_rule="linear")
        observe(policy, 1.0, 0.001, [64, 128])
        metrics = {"noise_scale": 1e31, "noise_scale_valid": flag, "step_time": 1.064}
        actions = policy.decide(metrics, ctx(64))
        assert (actions != []) == valid, (flag, actions)
    # The variance pair is not a way around the flag.
    policy = ajp.AdaptiveBatchSize(1024)
    observe(policy, 1.0, 0.001, [64, 128])
    metrics = {"grad_variance": 1e6, "grad_sqnorm": 1.0, "noise_scale_valid": 0.0}
    assert policy.decide(metrics, ctx(64)) == []
    # Step times are still recorded while the reading is invalid: a later valid
    # reading decides from the fitted model (not the one-point prior, which would
    # only double the batch to 128).
    policy = ajp.AdaptiveBatchSize(1024, lr_rule="none")
    for m in (64, 128):
        metrics = {"noise_scale": 1e6, "noise_scale_valid": 0.0, "step_time": 1.0 + 0.001 * m}
        assert policy.decide(metrics, ctx(m)) == []
    assert policy.decide({"noise_scale": 1e6, "noise_scale_valid": 1.0}, ctx(64)) == [
        ajp.SetBatchSize(1024)
    ]


def test_huge_noise_scale_and_fixed_overhead_grow_to_the_goodput_peak():
    # T(M) = 1 + 0.001 M, phi = 1e6: M* = sqrt(alpha*phi/beta) = 31623 > max, so max wins.
    policy = ajp.AdaptiveBatchSize(1024, lr_rule="linear")
    observe(policy, 1.0, 0.001, [64, 128])
    actions = policy.decide({"noise_scale": 1e6}, ctx(64))
    assert actions == [
        ajp.SetBatchSize(1024),
        ajp.SetHyperparams({"learning_rate": 0.1 * 1024 / 64}),
    ]


@pytest.mark.parametrize(
    ("alpha", "beta", "phi", "step"),
    [
        (0.5, 0.001, 2000.0, 8),
        (0.3, 0.0007, 5000.0, 16),
        (1.0, 0.01, 700.0, 8),
        (2.0, 0.0, 50.0, 8),
    ],
)
def test_proposal_is_the_argmax_over_valid_multiples(alpha, beta, phi, step):
    microbatches = step // 8
    policy = ajp.AdaptiveBatchSize(4096, gain_threshold=0.0)
    observe(policy, alpha, beta, [256, 512], microbatches=microbatches)
    actions = policy.decide({"noise_scale": phi}, ctx(256, microbatches=microbatches))
    best, gain = brute_force_best(alpha, beta, phi, 256, 64, 4096, step)
    if best == 256:
        assert actions == []
    else:
        assert gain > 0 and actions[0] == ajp.SetBatchSize(best)
    if (alpha, beta, phi) == (0.5, 0.001, 2000.0):
        assert best == 1000  # = sqrt(0.5 * 2000 / 0.001), a multiple of 8


def test_gain_below_threshold_proposes_nothing():
    # T = 1 + 0.01 M, phi = 64: M* = 80; goodput(80)/goodput(64) - 1 =
    # (80/(1.8*144)) / (64/(1.64*128)) - 1 = 1.23% < 5%.
    expected_gain = (80 / (1.8 * 144)) / (64 / (1.64 * 128)) - 1
    assert 0.01 < expected_gain < 0.05
    assert brute_force_best(1.0, 0.01, 64.0, 64, 64, 1024, 8) == (80, pytest.approx(expected_gain))
    policy = ajp.AdaptiveBatchSize(1024)
    observe(policy, 1.0, 0.01, [64, 128])
    assert policy.decide({"noise_scale": 64.0}, ctx(64)) == []
    eager = ajp.AdaptiveBatchSize(1024, gain_threshold=0.01, lr_rule="none")
    observe(eager, 1.0, 0.01, [64, 128])
    assert eager.decide({"noise_scale": 64.0}, ctx(64)) == [ajp.SetBatchSize(80)]


def test_prior_explores_one_doubling_and_needs_enough_noise():
    # One batch size measured: alpha = f*T, beta = (1-f)*T/M, only M/2 and 2M considered.
    # Doubling predicts goodput x 2/(2-f) * (phi+M)/(phi+2M); with f = 0.5 and the 5%
    # threshold that is >= 1.05 iff phi >= 0.575/0.2125 * M = 173.2 for M = 64.
    def decide(phi):
        policy = ajp.AdaptiveBatchSize(4096, lr_rule="none")
        return policy.decide({"noise_scale": phi, "step_time": 0.2}, ctx(64))

    assert decide(1e9) == [ajp.SetBatchSize(128)]  # one step, not straight to the max
    assert decide(190.0) == [ajp.SetBatchSize(128)]
    assert decide(160.0) == []
    assert decide(0.0) == []


def test_prior_overhead_changes_the_prior():
    # f = 0: T proportional to M; doubling gains only (phi+M)/(phi+2M) < 1: never.
    policy = ajp.AdaptiveBatchSize(4096, prior_overhead=0.0)
    assert policy.decide({"noise_scale": 1e9, "step_time": 0.2}, ctx(64)) == []


def test_throughput_metric_is_used_when_step_time_is_missing():
    a = ajp.AdaptiveBatchSize(1024)
    b = ajp.AdaptiveBatchSize(1024)
    out_a = a.decide({"noise_scale": 1e4, "step_time": 0.25}, ctx(64))
    out_b = b.decide({"noise_scale": 1e4, "throughput": 64 / 0.25}, ctx(64))
    assert out_a == out_b and out_a


def test_multiple_of_is_combined_with_devices_times_microbatches():
    # devices 8 * microbatches 2 = 16, multiple_of = 24: proposals are multiples of lcm = 48.
    policy = ajp.AdaptiveBatchSize(4096, multiple_of=24, gain_threshold=0.0, lr_rule="none")
    observe(policy, 0.5, 0.001, [96, 192], microbatches=2, base=96)
    [action] = policy.decide({"noise_scale": 2000.0}, ctx(96, microbatches=2, base=96))
    best, _ = brute_force_best(0.5, 0.001, 2000.0, 96, 96, 4080, 48, m0=96)
    assert action == ajp.SetBatchSize(best) and best % 48 == 0


def test_never_below_min_or_above_max():
    # phi = 0 wants the smallest batch; the default minimum is the base batch M0.
    policy = ajp.AdaptiveBatchSize(1024, lr_rule="none")
    observe(policy, 1.0, 0.01, [256, 512])
    assert policy.decide({"noise_scale": 0.0}, ctx(256)) == [ajp.SetBatchSize(64)]
    policy = ajp.AdaptiveBatchSize(1024, min_batch_size=100, lr_rule="none")
    observe(policy, 1.0, 0.01, [256, 512])
    assert policy.decide({"noise_scale": 0.0}, ctx(256)) == [ajp.SetBatchSize(104)]
    policy = ajp.AdaptiveBatchSize(1000, lr_rule="none")
    observe(policy, 1.0, 0.0001, [64, 128])
    assert policy.decide({"noise_scale": 1e9}, ctx(64)) == [ajp.SetBatchSize(1000)]


def test_no_valid_batch_means_no_decision():
    policy = ajp.AdaptiveBatchSize(4)  # smaller than devices*microbatches = 8
    assert policy.decide({"noise_scale": 1e9, "step_time": 0.1}, ctx(8, base=8)) == []


def test_adascale_lr_for_sgd_and_adam():
    # sigma^2 = grad_variance / M0, mu^2 = grad_sqnorm, r = (s2 + m2) / (s2/S + m2).
    metrics = {"noise_scale": 1e6, "grad_variance": 6400.0, "grad_sqnorm": 2.0}
    s2, m2, scale = 6400.0 / 64, 2.0, 1024 / 64
    r = (s2 + m2) / (s2 / scale + m2)
    for kind, factor in (("sgd", r), ("adam", math.sqrt(r))):
        policy = ajp.AdaptiveBatchSize(1024, optimizer_kind=kind)
        observe(policy, 1.0, 0.001, [64, 128])
        assert policy.decide(metrics, ctx(64))[1] == ajp.SetHyperparams(
            {"learning_rate": 0.1 * factor}
        )


def test_adascale_from_noise_scale_alone():
    # Without the variance pair, sigma^2/mu^2 = phi/M0 and r = (phi + M0) / (phi/S + M0).
    phi = 1e4
    policy = ajp.AdaptiveBatchSize(1024, optimizer_kind="sgd")
    observe(policy, 1.0, 0.001, [64, 128])
    actions = policy.decide({"noise_scale": phi}, ctx(64))
    r = (phi + 64) / (phi / 16 + 64)
    assert actions == [ajp.SetBatchSize(1024), ajp.SetHyperparams({"learning_rate": 0.1 * r})]


@pytest.mark.parametrize(("rule", "factor"), [("sqrt", 2.0), ("linear", 4.0)])
def test_sqrt_and_linear_rules(rule, factor):
    policy = ajp.AdaptiveBatchSize(256, lr_rule=rule, lr_key="lr")
    observe(policy, 1.0, 0.001, [64, 128], lr=0.3, key="lr")
    assert policy.decide({"noise_scale": 1e6}, ctx(64, lr=0.3, key="lr")) == [
        ajp.SetBatchSize(256), ajp.SetHyperparams({"lr": 0.3 * factor})
    ]


def test_lr_rule_none_leaves_lr_alone_and_needs_no_lr():
    policy = ajp.AdaptiveBatchSize(256, lr_rule="none")
    observe(policy, 1.0, 0.001, [64, 128], lr=None)
    assert policy.decide({"noise_scale": 1e6}, ctx(64, lr=None)) == [ajp.SetBatchSize(256)]


def test_missing_learning_rate_is_a_clear_error():
    policy = ajp.AdaptiveBatchSize(256)
    with pytest.raises(ValueError, match=r"^AdaptiveBatchSize\(lr_rule='adascale'\): "
                                         r"ctx.hyperparams has no 'learning_rate' \(has \[\]\); "
                                         r"pass lr_key=... or lr_rule='none'$"):
        policy.decide({}, ctx(lr=None))


def test_lr_follows_base_times_rule_and_keeps_other_policies_changes():
    def run(lr_at_128):
        policy = ajp.AdaptiveBatchSize(1024, lr_rule="linear")
        first = policy.decide({"noise_scale": 1e9, "step_time": 1.064}, ctx(64, lr=0.1))
        assert first == [ajp.SetBatchSize(128), ajp.SetHyperparams({"learning_rate": 0.2})]
        # The controller applied the batch; the learning rate is 0.2, or was halved since.
        return policy.decide({"noise_scale": 1e9, "step_time": 1.128}, ctx(128, lr=lr_at_128))

    # new_lr = base_lr * S = 0.1 * 1024/64.
    assert run(0.2) == [ajp.SetBatchSize(1024), ajp.SetHyperparams({"learning_rate": 1.6})]
    # Someone halved it (e.g. ReduceLROnPlateau): the halving is kept, 0.05 * 16.
    assert run(0.1) == [ajp.SetBatchSize(1024), ajp.SetHyperparams({"learning_rate": 0.8})]


def test_unapplied_proposal_does_not_change_the_base():
    # Proposals that were never applied (e.g. held back by hysteresis) leave the LR base alone.
    policy = ajp.AdaptiveBatchSize(1024, lr_rule="linear")
    for _ in range(3):
        out = policy.decide({"noise_scale": 1e9, "step_time": 1.064}, ctx(64, lr=0.1))
        assert out == [ajp.SetBatchSize(128), ajp.SetHyperparams({"learning_rate": 0.2})]


def test_a_new_device_count_starts_a_new_throughput_model():
    policy = ajp.AdaptiveBatchSize(4096, lr_rule="none")
    observe(policy, 1.0, 0.001, [64, 128])
    # 4 devices: only one size measured there, so the prior limits the move to a doubling.
    out = policy.decide({"noise_scale": 1e9, "step_time": 0.5}, ctx(64, devices=4))
    assert out == [ajp.SetBatchSize(128)]
    # A codec likewise: observations with compression on are kept apart.
    out = policy.decide({"noise_scale": 1e9, "step_time": 0.5}, ctx(64, codec="onebit"))
    assert out == [ajp.SetBatchSize(128)]


def test_median_of_the_window_resists_an_outlier():
    policy = ajp.AdaptiveBatchSize(1024, window=3, lr_rule="none")
    for t in (1.064, 50.0, 1.064):  # one compile-time spike at batch 64
        policy.decide({"step_time": t}, ctx(64))
    observe(policy, 1.0, 0.001, [128])
    assert policy.decide({"noise_scale": 1e6}, ctx(64)) == [ajp.SetBatchSize(1024)]
    times = [o["step_times"] for o in policy.state_dict()["observations"]]
    assert max(len(t) for t in times) == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0}, "AdaptiveBatchSize: max_batch_size must be an int >= 1, got 0"),
        (
            {"max_batch_size": 64, "min_batch_size": 128},
            "AdaptiveBatchSize: min_batch_size=128 exceeds max_batch_size=64; "
            "make min_batch_size <= max_batch_size",
        ),
        (
            {"max_batch_size": 64, "lr_rule": "cubic"},
            "AdaptiveBatchSize: unknown lr_rule 'cubic'; use one of 'adascale', 'sqrt', "
            "'linear', 'none'",
        ),
        (
            {"max_batch_size": 64, "optimizer_kind": "lamb"},
            "AdaptiveBatchSize: unknown optimizer_kind 'lamb'; use one of 'adam', 'sgd'",
        ),
        (
            {"max_batch_size": 64, "gain_threshold": -0.1},
            "AdaptiveBatchSize: gain_threshold must be in [0, inf), got -0.1",
        ),
        ({"max_batch_size": 64, "lr_key": ""}, "AdaptiveBatchSize: lr_key must be a non-empty"),
        (
            {"max_batch_size": 64, "multiple_of": 0},
            "AdaptiveBatchSize: multiple_of must be an int >= 1, got 0",
        ),
        (
            {"max_batch_size": 64, "prior_overhead": 1.0},
            "AdaptiveBatchSize: prior_overhead must be in [0, 1), got 1",
        ),
        ({"max_batch_size": 64, "window": 0}, "AdaptiveBatchSize: window must be an int >= 1"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError) as info:
        ajp.AdaptiveBatchSize(**kwargs)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def _prior_doubling_gain(phi, m0=64, t0=0.2, overhead=0.5):
    """Goodput gain of 2·m0 over m0 under the prior T(M) = f·t0 + (1 - f)·t0·M/m0."""
    def g(m):
        return ajp.goodput(m, noise_scale=phi, alpha=overhead * t0,
                           beta=(1 - overhead) * t0 / m0, base_batch_size=m0)
    return g(2 * m0) / g(m0) - 1.0


@pytest.mark.parametrize("of_boundary", [0.3, 0.9, 0.99, 1.01, 1.2, 4.0])
def test_a_move_to_a_batch_not_compiled_pays_for_its_compile(of_boundary):
    phi, compile_s, threshold = 1e4, 1.0, 0.05
    gain = _prior_doubling_gain(phi)
    # After a compile of C s a run A s old keeps (A - C)/A of the next A s: the
    # doubling pays from (1 + gain)(1 - C/A) = 1 + threshold on.
    boundary = compile_s / (1 - (1 + threshold) / (1 + gain))
    age = of_boundary * boundary
    moves = of_boundary > 1
    metrics = {"noise_scale": phi, "step_time": 0.2, "compile_seconds": compile_s,
               "train_seconds": age}
    got = ajp.AdaptiveBatchSize(1024, gain_threshold=threshold).decide(metrics, ctx())
    assert (got[:1] == [ajp.SetBatchSize(128)]) == moves
    if moves:
        assert f"after its compile (~1 s of a run {age:.3g} s old" in got[0].reason
    # without counting compiles (or without the metrics) the gain alone decides
    off = ajp.AdaptiveBatchSize(1024, gain_threshold=threshold, count_compiles=False)
    assert off.decide(metrics, ctx())[:1] == [ajp.SetBatchSize(128)]
    plain = {"noise_scale": phi, "step_time": 0.2}
    assert ajp.AdaptiveBatchSize(1024).decide(plain, ctx())[:1] == [ajp.SetBatchSize(128)]


def test_a_run_younger_than_a_compile_moves_only_to_batches_already_compiled():
    alpha, beta = 0.1, 0.1 / 64
    policy = ajp.AdaptiveBatchSize(1024)
    observe(policy, alpha, beta, [64, 128])  # both compiled in this configuration
    young = {"compile_seconds": 5.0, "train_seconds": 4.0}
    got = policy.decide({"noise_scale": 1e4, "step_time": alpha + beta * 64, **young}, ctx(64))
    # the goodput peak (~800) would need a compile the run cannot pay back: 128 it can
    assert brute_force_best(alpha, beta, 1e4, 64, 64, 1024, 8)[0] > 128
    assert got[0] == ajp.SetBatchSize(128)
    # on 4 devices nothing is compiled yet: no move at all
    policy = ajp.AdaptiveBatchSize(1024)
    observe(policy, alpha, beta, [64, 128])
    assert policy.decide({"noise_scale": 1e4, "step_time": 0.2, **young},
                         ctx(64, devices=4)) == []


def test_count_compiles_must_be_a_bool():
    with pytest.raises(TypeError) as excinfo:
        ajp.AdaptiveBatchSize(512, count_compiles="yes")
    assert str(excinfo.value) == (
        "AdaptiveBatchSize: count_compiles must be True or False, got 'yes'")


def test_with_a_planner_a_move_also_pays_for_its_compile():
    class Linear:  # T(M) = 0.1 + 0.1·M/64 s: the prior's model above
        def step_time(self, cand):
            return 0.1 + 0.1 * cand.batch_size / 64

        def observe(self, cand, t):
            pass

    gain = _prior_doubling_gain(1e4)  # the best move, to 128 of candidates up to 128
    boundary = 1.0 / (1 - 1.05 / (1 + gain))
    for age, moves in ((0.9 * boundary, False), (1.1 * boundary, True)):
        policy = ajp.AdaptiveBatchSize(128, planner=Linear())
        metrics = {"noise_scale": 1e4, "compile_seconds": 1.0, "train_seconds": age}
        assert (policy.decide(metrics, ctx())[:1] == [ajp.SetBatchSize(128)]) == moves


@pytest.mark.parametrize("metrics", [
    {"compile_seconds": 0.0, "train_seconds": 0.5},  # nothing compiled so far costs a wait
    {"compile_seconds": 1.0},  # no age: nothing to weigh it against
    {"train_seconds": 0.5},
])
def test_without_both_metrics_or_a_cost_nothing_is_discounted(metrics):
    got = ajp.AdaptiveBatchSize(1024).decide(
        {"noise_scale": 1e4, "step_time": 0.2, **metrics}, ctx())
    assert got[:1] == [ajp.SetBatchSize(128)]


def test_a_run_of_age_zero_moves_nowhere_new():
    metrics = {"noise_scale": 1e4, "step_time": 0.2, "compile_seconds": 1.0, "train_seconds": 0.0}
    assert ajp.AdaptiveBatchSize(1024).decide(metrics, ctx()) == []


def test_compiled_sizes_that_are_not_valid_multiples_are_not_candidates():
    alpha, beta = 0.1, 0.1 / 64
    policy = ajp.AdaptiveBatchSize(1024, multiple_of=64)
    observe(policy, alpha, beta, [64, 96])  # 96: set by someone else, not a multiple of 64
    young = {"compile_seconds": 5.0, "train_seconds": 4.0}
    assert policy.decide({"noise_scale": 1e4, "step_time": alpha + beta * 64, **young},
                         ctx(64)) == []


def test_with_a_planner_the_sizes_already_run_are_candidates_too():
    class Linear:
        def step_time(self, cand):
            return 0.1 + 0.1 * cand.batch_size / 64

        def observe(self, cand, t):
            pass

    policy = ajp.AdaptiveBatchSize(1024, planner=Linear())
    assert policy.decide({"step_time": 0.25}, ctx(96)) == []  # 96 has run: compiled
    young = {"noise_scale": 1e4, "compile_seconds": 5.0, "train_seconds": 4.0}
    # off the planner's grid of powers of two times 64, and the only move a young run affords
    assert policy.decide(young, ctx(64))[0] == ajp.SetBatchSize(96)


# ------------------------------------------------------- announced sizes, compiled ahead
def test_upcoming_announces_half_and_double_once_a_step_time_is_known():
    policy = ajp.AdaptiveBatchSize(1024, min_batch_size=16)
    assert upcoming(policy, ctx(64)) == []  # nothing measured: it cannot move yet
    policy.decide({"step_time": 0.2}, ctx(64))
    assert upcoming(policy, ctx(64)) == [ajp.SetBatchSize(32), ajp.SetBatchSize(128)]
    # within the bounds: not below min_batch_size, not above max_batch_size
    assert upcoming(policy, ctx(16)) == [ajp.SetBatchSize(32)]
    assert upcoming(policy, ctx(1024)) == [ajp.SetBatchSize(512)]
    # the default minimum is M0, the batch of the first decision
    policy = ajp.AdaptiveBatchSize(1024)
    policy.decide({"step_time": 0.2}, ctx(64))
    assert upcoming(policy, ctx(64)) == [ajp.SetBatchSize(128)]


def test_a_batch_compiled_ahead_is_not_held_back_by_the_compile_discount():
    # The run is younger than a compile: a move to a batch never compiled keeps nothing of
    # the next A seconds, so the policy stays (see the test above). Compiled ahead (in the
    # background, from upcoming), the same move costs no compile and the gain decides.
    metrics = {"noise_scale": 1e4, "step_time": 0.2, "compile_seconds": 5.0,
               "train_seconds": 4.0}
    policy = ajp.AdaptiveBatchSize(1024)
    assert policy.decide(metrics, ctx(64)) == []
    fields = dict(step=0, batch_size=64, microbatches=1, devices=8, max_devices=8,
                  hyperparams={"learning_rate": 0.1}, base_batch_size=64)
    ahead = ajp.Context(**fields, compiled_batch_sizes=[128])
    policy = ajp.AdaptiveBatchSize(1024)
    got = policy.decide(metrics, ahead)
    assert got[0] == ajp.SetBatchSize(128) and "after its compile" not in got[0].reason
    assert got[0].reason.endswith("; its step is compiled: no compile to wait for")
    # the same decision as when compiles are not counted at all
    assert got == ajp.AdaptiveBatchSize(1024, count_compiles=False).decide(metrics, ctx(64))


def test_a_multiple_of_a_compiled_micro_batch_is_not_held_back_by_the_compile_discount():
    # Under RunSpec.micro_batch_size the controller runs 128 as 2 micro-steps of the
    # compiled 64 (ctx.micro_batch_sizes): no compile, so the gain alone decides, as above.
    metrics = {"noise_scale": 1e4, "step_time": 0.2, "compile_seconds": 5.0,
               "train_seconds": 4.0}
    fields = dict(step=0, batch_size=64, microbatches=1, devices=8, max_devices=8,
                  hyperparams={"learning_rate": 0.1}, base_batch_size=64)
    got = ajp.AdaptiveBatchSize(1024).decide(metrics, ajp.Context(**fields, micro_batch_sizes=[64]))
    assert got[0] == ajp.SetBatchSize(128)
    assert got[0].reason.endswith("; it runs in micro-steps of a compiled step: no compile to "
                                  "wait for")
    assert got == ajp.AdaptiveBatchSize(1024, count_compiles=False).decide(metrics, ctx(64))
    # a micro-batch that 128 is no multiple of leaves the discount in force
    assert ajp.AdaptiveBatchSize(1024).decide(
        metrics, ajp.Context(**fields, micro_batch_sizes=[96])) == []
