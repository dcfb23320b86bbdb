"""``Policy.upcoming``: the actions a policy already knows it will take (hints only)."""

from adaptjax.policies._policy import upcoming

from adaptjax import policies as ajp


def ctx(step=0, devices=8, max_devices=8):
    return ajp.Context(step=step, batch_size=64, microbatches=1, devices=devices,
                       max_devices=max_devices, hyperparams={"learning_rate": 0.1})


def test_a_policy_without_hints_announces_nothing():
    class Plain(ajp.Policy):
        def decide(self, metrics, c):
            return []

    class DuckTyped:  # no upcoming at all
        def decide(self, metrics, c):
            return []

    assert upcoming(Plain(), ctx()) == []
    assert upcoming(DuckTyped(), ctx()) == []
    assert upcoming(ajp.AdaptiveBatchSize(max_batch_size=512), ctx()) == []


def test_elastic_scale_announces_its_next_entry_that_changes_the_count():
    policy = ajp.ElasticScale({100: 8, 150: 4, 300: 16})
    assert [a.devices for a in upcoming(policy, ctx())] == [4]  # 100: already 8 devices
    policy.decide({}, ctx(step=150))  # fires 100 and 150
    # the next entry is capped at max_devices, as decide caps it
    assert [a.devices for a in upcoming(policy, ctx(step=150, devices=4))] == [8]
    policy.decide({}, ctx(step=300, devices=4))
    assert upcoming(policy, ctx(step=300)) == []


def test_schedule_announces_its_next_entry_and_combinators_pass_hints_through():
    schedule = ajp.Schedule({50: ajp.SetHyperparams({"learning_rate": 0.01}),
                             80: [ajp.SetBatchSize(128), ajp.Checkpoint()]})
    policy = ajp.any_of(ajp.cooldown(schedule, steps=5), ajp.ElasticScale({200: 4}))
    assert [type(a).__name__ for a in upcoming(policy, ctx())] == [
        "SetHyperparams", "Rescale"]
    policy.decide({}, ctx(step=50))
    assert [type(a).__name__ for a in upcoming(policy, ctx(step=50))] == [
        "SetBatchSize", "Checkpoint", "Rescale"]


def test_hints_are_checked_like_decisions():
    class Bad(ajp.Policy):
        def decide(self, metrics, c):
            return []

        def upcoming(self, c):
            return "Rescale(4)"

    try:
        upcoming(Bad(), ctx())
    except ValueError as error:
        assert str(error).startswith("Bad returned str ('Rescale(4)') instead of a list")
    else:
        raise AssertionError("a malformed hint was accepted")
