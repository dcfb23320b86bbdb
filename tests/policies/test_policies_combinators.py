"""cooldown, hysteresis, when and any_of: semantics, nesting, state and messages."""

import pytest

from adaptjax import policies as ajp


def ctx(step=0):
    return ajp.Context(step=step, batch_size=64, microbatches=1, devices=8, max_devices=8,
                       hyperparams={"learning_rate": 0.1})


class Scripted(ajp.Policy):
    """Returns the given decisions in turn (then []), counting the calls."""

    def __init__(self, *decisions):
        self.decisions = list(decisions)
        self.calls = 0

    def decide(self, metrics, c):
        self.calls += 1
        return self.decisions.pop(0) if self.decisions else []


class Always(ajp.Policy):
    def __init__(self, *actions):
        self.actions = list(actions)
        self.calls = 0

    def decide(self, metrics, c):
        self.calls += 1
        return list(self.actions)


def check_message(build, message):
    with pytest.raises(ValueError) as info:
        build()
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


# --- cooldown -----------------------------------------------------------------------------


def test_cooldown_suppresses_and_does_not_consult_the_inner_policy():
    inner = Always(ajp.Checkpoint())
    policy = ajp.cooldown(inner, steps=100)
    fired = [s for s in range(0, 301, 10) if policy.decide({}, ctx(s))]
    assert fired == [0, 100, 200, 300]
    assert inner.calls == 4  # never asked during a cooldown
    assert policy.state_dict() == {"last_action_step": 300, "policy": {}}


def test_cooldown_starts_only_after_an_action():
    inner = Scripted([], [], [ajp.Checkpoint()], [ajp.Checkpoint()], [ajp.Checkpoint()])
    policy = ajp.cooldown(inner, steps=5)
    out = [policy.decide({}, ctx(s)) for s in range(8)]
    assert [bool(o) for o in out] == [False, False, True, False, False, False, False, True]


def test_cooldown_delays_schedule_entries_instead_of_losing_them():
    schedule = ajp.Schedule({0: ajp.Checkpoint(), 50: ajp.Stop("end")})
    policy = ajp.cooldown(schedule, steps=100)
    assert policy.decide({}, ctx(0)) == [ajp.Checkpoint()]
    assert policy.decide({}, ctx(60)) == []
    assert policy.decide({}, ctx(100)) == [ajp.Stop("end")]


def test_cooldown_zero_steps_passes_everything():
    policy = ajp.cooldown(Always(ajp.Checkpoint()), steps=0)
    assert all(policy.decide({}, ctx(s)) for s in range(5))


def test_cooldown_bad_arguments():
    check_message(lambda: ajp.cooldown(Always(), steps=-1),
                  "cooldown: steps must be an int >= 0, got -1")
    check_message(lambda: ajp.cooldown(lambda m, c: [], steps=1),
                  "cooldown: expected a Policy (an object with decide(metrics, ctx)), got "
                  "<function")


# --- hysteresis ---------------------------------------------------------------------------


def test_hysteresis_needs_the_same_decision_times_in_a_row():
    a, b = [ajp.SetBatchSize(128)], [ajp.SetBatchSize(256)]
    policy = ajp.hysteresis(Scripted(a, a, b, a, [], a, a, a, a), times=3)
    out = [policy.decide({}, ctx(s)) for s in range(9)]
    assert out == [[], [], [], [], [], [], [], a, []]  # passes at the 3rd a in a row, then restarts


def test_hysteresis_compares_types_and_values():
    x = [ajp.SetBatchSize(128), ajp.SetHyperparams({"learning_rate": 0.2})]
    reordered = [ajp.SetHyperparams({"learning_rate": 0.2}), ajp.SetBatchSize(128)]
    policy = ajp.hysteresis(Scripted(x, reordered), times=2)
    assert [policy.decide({}, ctx()) for _ in range(2)] == [[], []]
    policy = ajp.hysteresis(Scripted(x, list(x)), times=2)
    assert [policy.decide({}, ctx()) for _ in range(2)] == [[], x]


def test_hysteresis_float_tolerance_is_relative_to_the_first_of_the_streak():
    def lr(v):
        return [ajp.SetHyperparams({"learning_rate": v})]

    # Within 5% of 1.0: 1.04, 0.96 count as the same; the last proposal is passed.
    policy = ajp.hysteresis(Scripted(lr(1.0), lr(1.04), lr(0.96)), times=3)
    assert [policy.decide({}, ctx()) for _ in range(3)] == [[], [], lr(0.96)]
    # 1.04 then 1.08: each within 5% of its predecessor, but 1.08 is 8% from 1.0.
    policy = ajp.hysteresis(Scripted(lr(1.0), lr(1.04), lr(1.08)), times=3)
    assert [policy.decide({}, ctx()) for _ in range(3)] == [[], [], []]
    # rtol=0: exact.
    policy = ajp.hysteresis(Scripted(lr(1.0), lr(1.0 + 1e-12)), times=2, rtol=0.0)
    assert [policy.decide({}, ctx()) for _ in range(2)] == [[], []]
    # Batch sizes are ints: compared exactly whatever rtol.
    policy = ajp.hysteresis(Scripted([ajp.SetBatchSize(100)], [ajp.SetBatchSize(101)]), times=2,
                            rtol=0.5)
    assert [policy.decide({}, ctx()) for _ in range(2)] == [[], []]


def test_hysteresis_ignores_stop_reasons_and_passes_times_one():
    policy = ajp.hysteresis(Scripted([ajp.Stop("loss 0.3")], [ajp.Stop("loss 0.2")]), times=2)
    assert [policy.decide({}, ctx()) for _ in range(2)] == [[], [ajp.Stop("loss 0.2")]]
    policy = ajp.hysteresis(Always(ajp.Checkpoint()), times=1)
    assert policy.decide({}, ctx()) == [ajp.Checkpoint()]


def test_hysteresis_bad_arguments():
    check_message(lambda: ajp.hysteresis(Always(), times=0),
                  "hysteresis: times must be an int >= 1, got 0")
    check_message(lambda: ajp.hysteresis(Always(), times=2, rtol=-0.1),
                  "hysteresis: rtol must be in [0, inf), got -0.1")


# --- when ---------------------------------------------------------------------------------


def test_when_emits_while_the_predicate_holds():
    policy = ajp.when(lambda m, c: m["loss"] > 5.0, [ajp.Rollback("diverged"), ajp.Checkpoint()])
    assert policy.decide({}, ctx()) == []  # KeyError: the metric is not there yet
    assert policy.decide({"loss": 1.0}, ctx()) == []
    assert policy.decide({"loss": 9.0}, ctx()) == [ajp.Rollback("diverged"), ajp.Checkpoint()]
    assert policy.decide({"loss": 9.0}, ctx()) == [ajp.Rollback("diverged"), ajp.Checkpoint()]
    by_step = ajp.when(lambda m, c: c.step % 100 == 0, ajp.Checkpoint())
    assert [bool(by_step.decide({}, ctx(s))) for s in (99, 100, 101)] == [False, True, False]


def test_when_propagates_other_predicate_errors():
    policy = ajp.when(lambda m, c: 1 / 0, ajp.Checkpoint())
    with pytest.raises(ZeroDivisionError):
        policy.decide({}, ctx())


def test_when_bad_arguments():
    check_message(lambda: ajp.when(True, ajp.Checkpoint()),
                  "when: predicate must be a callable (metrics, ctx) -> bool, got True")
    check_message(lambda: ajp.when(lambda m, c: True, []),
                  "when: actions must hold at least one action, got []")
    check_message(lambda: ajp.when(lambda m, c: True, ["stop"]),
                  "when: actions: a policy returned an action of type str ('stop'); allowed:")


# --- any_of -------------------------------------------------------------------------------


def test_any_of_concatenates_and_keeps_the_first_of_each_type():
    policy = ajp.any_of(
        Always(ajp.SetBatchSize(128)),
        Always(ajp.SetBatchSize(512), ajp.Checkpoint()),
        Always(ajp.Rescale(devices=4), ajp.Checkpoint()),
    )
    assert policy.decide({}, ctx()) == [
        ajp.SetBatchSize(128), ajp.Checkpoint(), ajp.Rescale(devices=4)
    ]


def test_any_of_merges_hyperparameters_first_wins():
    policy = ajp.any_of(
        Always(ajp.SetHyperparams({"learning_rate": 0.2})),
        Always(ajp.SetHyperparams({"learning_rate": 0.05, "weight_decay": 1e-4})),
        Always(ajp.SetHyperparams({"learning_rate": 0.07})),
    )
    assert policy.decide({}, ctx()) == [
        ajp.SetHyperparams({"learning_rate": 0.2, "weight_decay": 1e-4})
    ]


def test_any_of_consults_every_policy_and_names_a_bad_one():
    first, second = Always(ajp.Checkpoint()), Always(ajp.Checkpoint())
    ajp.any_of(first, second).decide({}, ctx())
    assert (first.calls, second.calls) == (1, 1)

    class Broken(ajp.Policy):
        def decide(self, metrics, c):
            return [ajp.Checkpoint, "x"]

    check_message(lambda: ajp.any_of(first, Broken()).decide({}, ctx()),
                  "Broken returned an action of type type (<class")


def test_any_of_bad_arguments():
    check_message(lambda: ajp.any_of(), "any_of: give at least one policy")
    check_message(lambda: ajp.any_of(Always(), 3),
                  "any_of: expected a Policy (an object with decide(metrics, ctx)), got 3")


# --- state of nested combinators -----------------------------------------------------------


def test_state_nests_inner_states():
    policy = ajp.any_of(
        ajp.cooldown(ajp.hysteresis(ajp.ElasticScale({0: 2}), times=1), steps=10),
        ajp.when(lambda m, c: False, ajp.Checkpoint()),
    )
    policy.decide({}, ctx(3))
    assert policy.state_dict() == {
        "policies": [
            {
                "last_action_step": 3,
                "policy": {"signature": None, "count": 0, "policy": {"fired": [0]}},
            },
            {},
        ]
    }


def test_loading_a_mismatched_state_is_a_clear_error():
    policy = ajp.any_of(ajp.cooldown(ajp.ElasticScale({0: 2}), steps=10))
    check_message(lambda: policy.load_state_dict({"policies": [{}, {}]}),
                  "AnyOf.load_state_dict: state holds 2 policy states, expected 1")
    check_message(lambda: policy.load_state_dict({"policies": [{"fired": []}]}),
                  "Cooldown.load_state_dict: state has keys ['fired'], expected "
                  "['last_action_step', 'policy']")
    check_message(
        lambda: policy.load_state_dict({"policies": [{"last_action_step": 1, "policy": {}}]}),
        "ElasticScale.load_state_dict: state has keys [], expected ['fired']; was it saved by a "
        "different policy",
    )
