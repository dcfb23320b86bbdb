"""ElasticScale, SwitchCompression, ReduceLROnPlateau, Schedule and EarlyStop."""

import pytest

from adaptjax import policies as ajp


def ctx(step=0, *, devices=4, max_devices=8, codec=None, lr=0.1):
    return ajp.Context(
        step=step, batch_size=64, microbatches=1, devices=devices, max_devices=max_devices,
        hyperparams={"learning_rate": lr}, codec=codec,
    )


def check_message(build, message):
    with pytest.raises(ValueError) as info:
        build()
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


# --- ElasticScale -------------------------------------------------------------------------


def test_schedule_entries_fire_once_when_due():
    policy = ajp.ElasticScale({100: 8, 200: 2})
    assert policy.decide({}, ctx(99)) == []
    assert policy.decide({}, ctx(100)) == [ajp.Rescale(devices=8)]
    assert policy.decide({}, ctx(150, devices=8)) == []
    assert policy.decide({}, ctx(250, devices=8)) == [ajp.Rescale(devices=2)]
    assert policy.decide({}, ctx(300, devices=2)) == []
    assert policy.state_dict() == {"fired": [100, 200]}


def test_latest_due_entry_wins_and_equal_counts_are_dropped():
    policy = ajp.ElasticScale({10: 2, 20: 8, 30: 6})
    assert policy.decide({}, ctx(25)) == [ajp.Rescale(devices=8)]
    assert policy.state_dict() == {"fired": [10, 20]}
    policy = ajp.ElasticScale({10: 4})
    assert policy.decide({}, ctx(10, devices=4)) == []  # already at 4 devices
    assert policy.decide({}, ctx(11, devices=2)) == []  # fired, not repeated


def test_requests_are_capped_at_max_devices():
    policy = ajp.ElasticScale({0: 64})
    assert policy.decide({}, ctx(0, devices=4, max_devices=8)) == [ajp.Rescale(devices=8)]
    policy = ajp.ElasticScale({0: 64})
    assert policy.decide({}, ctx(0, devices=8, max_devices=8)) == []


def test_predicate_asks_for_devices():
    def more_when_slow(metrics, c):
        return 2 * c.devices if metrics.get("step_time", 0.0) > 1.0 else None

    policy = ajp.ElasticScale(predicate=more_when_slow)
    assert policy.decide({"step_time": 0.5}, ctx()) == []
    strict = ajp.ElasticScale(predicate=lambda m, c: 8 if m["step_time"] > 1.0 else None)
    assert strict.decide({}, ctx()) == []  # KeyError: the metric is not there yet
    assert policy.decide({"step_time": 2.0}, ctx(devices=2)) == [ajp.Rescale(devices=4)]
    both = ajp.ElasticScale({50: 2}, predicate=lambda m, c: 8)
    assert both.decide({}, ctx(50)) == [ajp.Rescale(devices=2)]  # the schedule entry wins
    assert both.decide({}, ctx(51)) == [ajp.Rescale(devices=8)]


def test_elastic_bad_arguments():
    check_message(lambda: ajp.ElasticScale(), "ElasticScale: give a schedule {step: devices}")
    check_message(
        lambda: ajp.ElasticScale({-1: 2}),
        "ElasticScale: every schedule step must be an int >= 0, got -1",
    )
    check_message(
        lambda: ajp.ElasticScale({10: 0}), "ElasticScale: schedule[10] must be an int >= 1, got 0"
    )
    check_message(lambda: ajp.ElasticScale([(10, 2)]), "ElasticScale: schedule must be a mapping")
    check_message(
        lambda: ajp.ElasticScale(predicate=3),
        "ElasticScale: predicate must be a callable (metrics, ctx) -> int | None, got 3",
    )
    policy = ajp.ElasticScale(predicate=lambda m, c: 2.5)
    check_message(
        lambda: policy.decide({}, ctx()),
        "ElasticScale: predicate must return an int device count or None, got 2.5",
    )


# --- SwitchCompression --------------------------------------------------------------------


def test_codec_on_above_threshold_off_below():
    codec = object()
    policy = ajp.SwitchCompression(codec, when_comm_share_above=0.3, off_below=0.1)
    assert policy.decide({}, ctx()) == []
    assert policy.decide({"comm_share": 0.3}, ctx()) == []  # strictly above
    assert policy.decide({"comm_share": 0.31}, ctx()) == [ajp.SetCodec(codec)]
    assert policy.decide({"comm_share": 0.5}, ctx(codec=codec)) == []  # already on
    assert policy.decide({"comm_share": 0.2}, ctx(codec=codec)) == []  # inside the band
    assert policy.decide({"comm_share": 0.05}, ctx(codec=codec)) == [ajp.SetCodec(None)]
    assert policy.decide({"comm_share": 0.05}, ctx()) == []  # already off


def test_codec_never_switched_off_without_off_below():
    policy = ajp.SwitchCompression("codec")
    assert policy.when_comm_share_above == 0.3
    assert policy.decide({"comm_share": 0.0}, ctx(codec="codec")) == []


def test_switch_compression_bad_arguments():
    check_message(
        lambda: ajp.SwitchCompression(None),
        "SwitchCompression: codec must be a codec object, got None; to switch compression "
        "off, use off_below=...",
    )
    check_message(
        lambda: ajp.SwitchCompression("c", when_comm_share_above=1.0),
        "SwitchCompression: when_comm_share_above must be in [0, 1), got 1",
    )
    check_message(
        lambda: ajp.SwitchCompression("c", when_comm_share_above=0.3, off_below=0.3),
        "SwitchCompression: off_below must be in [0, 0.3), got 0.3",
    )


# --- ReduceLROnPlateau --------------------------------------------------------------------


def test_plateau_reduces_after_patience_steps_and_waits_again():
    policy = ajp.ReduceLROnPlateau(patience=100, factor=0.5)
    assert policy.decide({"loss": 1.0}, ctx(0)) == []
    assert policy.decide({"loss": 0.9}, ctx(50)) == []  # improvement: best at step 50
    assert policy.decide({"loss": 0.95}, ctx(149)) == []
    assert policy.decide({"loss": 0.95}, ctx(150)) == [
        ajp.SetHyperparams({"learning_rate": 0.05})
    ]
    assert policy.decide({"loss": 0.95}, ctx(200, lr=0.05)) == []
    assert policy.decide({"loss": 0.95}, ctx(250, lr=0.05)) == [
        ajp.SetHyperparams({"learning_rate": 0.025})
    ]
    assert policy.state_dict() == {"best": 0.9, "best_step": 250, "reductions": 2}


def test_plateau_min_delta_mode_and_floor():
    policy = ajp.ReduceLROnPlateau(patience=10, min_delta=0.1)
    policy.decide({"loss": 1.0}, ctx(0))
    assert policy.decide({"loss": 0.95}, ctx(10)) == [  # 0.05 < min_delta: no improvement
        ajp.SetHyperparams({"learning_rate": 0.05})
    ]
    policy = ajp.ReduceLROnPlateau("eval_accuracy", mode="max", patience=10, min_value=0.08)
    policy.decide({"eval_accuracy": 0.5}, ctx(0))
    assert policy.decide({"eval_accuracy": 0.6}, ctx(10)) == []  # higher is better
    assert policy.decide({"eval_accuracy": 0.6}, ctx(20)) == [
        ajp.SetHyperparams({"learning_rate": 0.08})  # max(0.1 * 0.5, 0.08)
    ]
    assert policy.decide({"eval_accuracy": 0.6}, ctx(30, lr=0.08)) == []  # at the floor


def test_plateau_skips_missing_metric_and_needs_the_key():
    policy = ajp.ReduceLROnPlateau(patience=1, key="lr")
    hyper = ajp.Context(step=5, batch_size=64, microbatches=1, devices=1, max_devices=1,
                        hyperparams={"lr": 1.0})
    assert policy.decide({}, hyper) == []
    check_message(
        lambda: policy.decide({"loss": 1.0}, ctx()),
        "ReduceLROnPlateau: ctx.hyperparams has no 'lr' (has ['learning_rate']); pass key=...",
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"factor": 1.0}, "ReduceLROnPlateau: factor must be in (0, 1), got 1"),
        ({"factor": 0.0}, "ReduceLROnPlateau: factor must be in (0, 1), got 0"),
        ({"patience": 0}, "ReduceLROnPlateau: patience must be an int >= 1, got 0"),
        ({"min_delta": -1.0}, "ReduceLROnPlateau: min_delta must be in [0, inf), got -1"),
        ({"min_value": -1.0}, "ReduceLROnPlateau: min_value must be in [0, inf), got -1"),
        ({"mode": "up"}, "ReduceLROnPlateau: unknown mode 'up'; use one of 'min', 'max'"),
        ({"metric": ""}, "ReduceLROnPlateau: metric must be a non-empty str"),
    ],
)
def test_plateau_bad_arguments(kwargs, message):
    check_message(lambda: ajp.ReduceLROnPlateau(**kwargs), message)


# --- Schedule -----------------------------------------------------------------------------


def test_schedule_fires_each_entry_once_in_step_order():
    policy = ajp.Schedule({
        300: ajp.Stop("done"),
        100: [ajp.SetHyperparams({"learning_rate": 0.01}), ajp.Checkpoint()],
        200: ajp.Checkpoint(),
    })
    assert policy.decide({}, ctx(99)) == []
    assert policy.decide({}, ctx(100)) == [
        ajp.SetHyperparams({"learning_rate": 0.01}), ajp.Checkpoint()
    ]
    assert policy.decide({}, ctx(100)) == []
    assert policy.decide({}, ctx(400)) == [ajp.Checkpoint(), ajp.Stop("done")]
    assert policy.decide({}, ctx(500)) == []


def test_schedule_bad_arguments():
    check_message(
        lambda: ajp.Schedule({10: "checkpoint"}),
        "Schedule: entry at step 10: a policy returned str ('checkpoint') instead of a list",
    )
    check_message(
        lambda: ajp.Schedule({10: [ajp.Checkpoint(), 3]}),
        "Schedule: entry at step 10: a policy returned an action of type int (3); allowed: "
        "SetHyperparams,",
    )
    check_message(lambda: ajp.Schedule({-5: ajp.Checkpoint()}),
                  "Schedule: every step must be an int >= 0, got -5")
    check_message(lambda: ajp.Schedule([ajp.Checkpoint()]), "Schedule: actions must be a mapping")


# --- EarlyStop ----------------------------------------------------------------------------


def test_early_stop_on_target():
    policy = ajp.EarlyStop("loss", target=0.1, mode="min")
    assert policy.decide({"loss": 0.2}, ctx(10)) == []
    assert policy.decide({"loss": 0.1}, ctx(20)) == [
        ajp.Stop("loss reached 0.1 (target 0.1) at step 20")
    ]


def test_early_stop_on_patience():
    policy = ajp.EarlyStop("eval_accuracy", patience=100, min_delta=0.01)
    assert policy.decide({"eval_accuracy": 0.5}, ctx(0)) == []
    assert policy.decide({"eval_accuracy": 0.505}, ctx(60)) == []  # below min_delta
    assert policy.decide({"loss": 0.1}, ctx(150)) == []  # metric absent: skipped
    assert policy.decide({"eval_accuracy": 0.505}, ctx(100)) == [
        ajp.Stop("eval_accuracy did not improve for 100 steps (best 0.5 at step 0)")
    ]


def test_early_stop_bad_arguments():
    check_message(lambda: ajp.EarlyStop("loss"),
                  "EarlyStop: give target=..., patience=..., or both")
    check_message(lambda: ajp.EarlyStop("loss", patience=0),
                  "EarlyStop: patience must be an int >= 1, got 0")
    check_message(lambda: ajp.EarlyStop("loss", target=float("inf")),
                  "EarlyStop: target must be finite, got inf")
    check_message(lambda: ajp.EarlyStop("loss", target=1.0, mode="lower"),
                  "EarlyStop: unknown mode 'lower'; use one of 'min', 'max'")
