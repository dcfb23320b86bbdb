"""PrecisionPolicy on synthetic metrics, and the SetPrecision action."""

import dataclasses
import json

import pytest
from adaptjax.policies._policy import validate_actions

from adaptjax import policies as ajp

BASE = ajp.Context(step=0, batch_size=64, microbatches=1, devices=8, max_devices=8,
                   hyperparams={})


def _at(step, **kw):
    return dataclasses.replace(BASE, step=step, **kw)


def _run(policy, trace):
    """``trace``: (step, metrics) pairs; returns {step: decided precision} where it acted."""
    out = {}
    for step, metrics in trace:
        actions = policy.decide(metrics, _at(step))
        assert all(isinstance(a, ajp.SetPrecision) for a in actions) and len(actions) <= 1
        if actions:
            assert actions[0].reason.startswith("PrecisionPolicy: ")
            out[step] = actions[0].precision
    return out


def _loss_curve(steps, every=10, start=4.0):
    return [(t, {"loss": start / (1 + t / 100), "nonfinite_count": 0.0})
            for t in range(0, steps, every)]


def test_moves_to_low_once_warm_and_stable_and_stays_there():
    policy = ajp.PrecisionPolicy(warmup=200, stable_steps=100, window=300)
    assert _run(policy, _loss_curve(1000)) == {200: "bfloat16"}


def test_waits_for_stable_steps_after_a_late_start():
    policy = ajp.PrecisionPolicy(warmup=0, stable_steps=100)
    trace = [(t, m) for t, m in _loss_curve(400) if t >= 50]  # first evaluation at step 50
    assert _run(policy, trace) == {150: "bfloat16"}


def test_non_finite_steps_send_it_back_for_a_window_then_it_returns():
    policy = ajp.PrecisionPolicy(warmup=100, stable_steps=50, window=200)
    trace = _loss_curve(1000)
    # the controller's cumulative count grows at step 300 (a skipped step since step 290)
    trace = [(t, {**m, "nonfinite_count": 0.0 if t < 300 else 1.0}) for t, m in trace]
    # low at 100; back at 300; 200 steps later (and 50 calm ones) low again
    assert _run(policy, trace) == {100: "bfloat16", 300: "float32", 500: "bfloat16"}
    assert policy.state_dict()["incidents"] == 1


def test_incidents_in_high_extend_the_window():
    policy = ajp.PrecisionPolicy(warmup=0, stable_steps=10, window=100)
    trace = [(0, {"loss": 1.0}), (10, {"loss": 1.0}), (20, {"loss": float("nan")}),
             (30, {"loss": 1.0}), (110, {"loss": 1.0, "nonfinite": 1.0}), (200, {"loss": 1.0}),
             (210, {"loss": 1.0})]
    # low at 10; NaN loss at 20 -> high until 120; the skipped step at 110 -> until 210
    assert _run(policy, trace) == {10: "bfloat16", 20: "float32", 210: "bfloat16"}


def test_a_loss_spike_is_an_incident_and_does_not_enter_the_average():
    policy = ajp.PrecisionPolicy(warmup=0, stable_steps=20, window=50, spike=1.5, decay=0.5)
    trace = [(t, {"loss": 1.0}) for t in range(0, 40, 10)]
    trace += [(40, {"loss": 1.6})]  # > 1.5 x the average of 1.0
    trace += [(t, {"loss": 1.4}) for t in range(50, 120, 10)]  # below 1.5 x 1.0
    assert _run(policy, trace) == {20: "bfloat16", 40: "float32", 90: "bfloat16"}
    assert policy.state_dict()["loss_average"] > 1.0  # 1.4s entered, the 1.6 did not
    assert policy.state_dict()["loss_average"] < 1.4


def test_a_metric_rule_gates_the_move():
    policy = ajp.PrecisionPolicy(warmup=0, stable_steps=10, metric="grad_snr", below=1.0)
    trace = [(t, {"loss": 1.0, "grad_snr": 5.0 - t / 10}) for t in range(0, 100, 10)]
    # grad_snr 5, 4, 3, 2, 1, 0 at steps 0..50: below 1.0 first at step 50
    assert _run(policy, trace) == {50: "bfloat16"}
    assert policy.required_metrics() == {"loss", "grad_snr"}


def _fp16_trace(skips_and_scales, every=10, start=20):
    """Evaluations at ``start``, ``start + every``, ...: the cumulative skip count and the
    ``loss_scale`` the float16 step reported, with a finite loss."""
    return [(start + every * i, {"loss": 1.0, "nonfinite_count": float(n), "loss_scale": scale})
            for i, (n, scale) in enumerate(skips_and_scales)]


def test_float16_skips_while_the_loss_scale_settles_are_not_incidents():
    policy = ajp.PrecisionPolicy("float16", warmup=0, stable_steps=10, window=100)
    start = [(0, {"loss": 1.0}), (10, {"loss": 1.0})]  # float32: moves to float16 at 10
    # the scale halves from 2**15 on each skip (3, then 2 more), then grows back and a
    # growth's overflow halves it again: every skip is the scale's own
    settling = _fp16_trace([(3, 2.0**12), (5, 2.0**10), (5, 2.0**11), (6, 2.0**10)])
    assert _run(policy, start + settling) == {10: "float16"}
    assert policy.state_dict()["incidents"] == 0
    assert policy.state_dict()["nonfinite_count"] == 6.0  # counted, so later growth is new
    # at the floor the scale cannot fall further: the next skip is an incident
    assert _run(policy, _fp16_trace([(7, 1.0)], start=60)) == {60: "float32"}
    # the same skips without a loss scale (bfloat16 reports none) are incidents at once
    bf16 = ajp.PrecisionPolicy(warmup=0, stable_steps=10, window=100)
    trace = start + [(t, {k: v for k, v in m.items() if k != "loss_scale"})
                     for t, m in settling]
    assert _run(bf16, trace) == {10: "bfloat16", 20: "float32"}


def test_a_non_finite_loss_under_float16_is_an_incident_whatever_the_scale():
    policy = ajp.PrecisionPolicy("float16", warmup=0, stable_steps=10, window=100)
    trace = [(0, {"loss": 1.0}), (10, {"loss": 1.0}),
             (20, {"loss": float("inf"), "nonfinite_count": 1.0, "loss_scale": 2.0**14})]
    assert _run(policy, trace) == {10: "float16", 20: "float32"}


def test_the_loss_scale_floor_is_the_users():
    policy = ajp.PrecisionPolicy("float16", warmup=0, stable_steps=10, window=100,
                                 loss_scale_floor=128.0)
    trace = [(0, {"loss": 1.0}), (10, {"loss": 1.0})]
    trace += _fp16_trace([(1, 256.0), (2, 128.0)])  # above the floor, then at it
    assert _run(policy, trace) == {10: "float16", 30: "float32"}


def test_the_running_precision_in_the_context_wins_when_present():
    """A Context that carries the running precision (ctx.precision) is believed."""
    policy = ajp.PrecisionPolicy(low="bfloat16", high="float32", warmup=0, stable_steps=10)

    class WithPrecision:  # a context of a later controller, duck-typed
        def __init__(self, step, precision):
            self.step, self.precision = step, precision

    assert policy.decide({"loss": 1.0}, WithPrecision(0, "float32")) == []
    # someone else already moved the run to bfloat16: nothing to ask for
    assert policy.decide({"loss": 1.0}, WithPrecision(10, "bfloat16")) == []
    assert policy.decide({"loss": 1.0, "nonfinite": 1.0}, WithPrecision(20, "bfloat16")) == [
        ajp.SetPrecision("float32")
    ]


def test_opaque_precisions_and_state_through_json():
    class Prec:  # stands in for adaptjax.Precision: the policy reads only .key
        def __init__(self, key):
            self.key = key

    low, high = Prec("bfloat16"), Prec("float32")
    policy = ajp.PrecisionPolicy(low, high, warmup=0, stable_steps=10, window=30)
    assert _run(policy, [(0, {"loss": 1.0}), (10, {"loss": 1.0})]) == {10: low}
    state = json.loads(json.dumps(policy.state_dict()))
    again = ajp.PrecisionPolicy(low, high, warmup=0, stable_steps=10, window=30)
    again.load_state_dict(state)
    trace = [(20, {"loss": float("inf")}), (50, {"loss": 1.0})]
    assert _run(again, trace) == _run(policy, trace) == {20: high, 50: low}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"low": "int8"}, "SetPrecision: unknown precision 'int8'; use one of 'float32', "
                          "'bfloat16', 'float16' or an adaptjax.Precision"),
        ({"low": "float32"}, "PrecisionPolicy: low and high are the same precision "
                             "('float32'); give two different ones"),
        ({"high": None}, "SetPrecision: precision is None"),
        ({"spike": 1.0}, "PrecisionPolicy: spike must be in (1, inf), got 1"),
        ({"decay": 1.0}, "PrecisionPolicy: decay must be in (0, 1), got 1"),
        ({"window": 0}, "PrecisionPolicy: window must be an int >= 1, got 0"),
        ({"warmup": 1.5}, "PrecisionPolicy: warmup must be an int, got 1.5"),
        ({"below": 1.0}, "PrecisionPolicy: below= and above= need metric="),
        ({"metric": "grad_snr"}, "PrecisionPolicy: with metric=, give exactly one of below="),
        ({"loss_scale_floor": 0}, "PrecisionPolicy: loss_scale_floor must be in (0, inf), got 0"),
    ],
)
def test_bad_configuration_one_line(kwargs, message):
    with pytest.raises(ValueError) as info:
        ajp.PrecisionPolicy(**kwargs)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_set_precision_action():
    a = ajp.SetPrecision("bfloat16", reason="why")
    assert a == ajp.SetPrecision("bfloat16") and hash(a) == hash(ajp.SetPrecision("bfloat16"))
    assert ajp.SetPrecision("float16,output=float16").precision == "float16,output=float16"
    assert ajp._actions.action_signature(a) == ["SetPrecision", "bfloat16"]
    with pytest.raises(ValueError, match="reason must be a str"):
        ajp.SetPrecision("bfloat16", reason=3)
    # part of the action vocabulary: a policy may return it
    assert validate_actions([a]) == [a]
