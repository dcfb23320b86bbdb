"""Seesaw over a synthetic step-decay schedule: the batch doubles and the rate falls by √2."""

import math

import pytest
from adaptjax.policies import Context, Seesaw, SetBatchSize, SetHyperparams


def _schedule(step, base=0.1, milestones=(10, 20), decay=0.5):
    """A step-decay schedule: ``base × decay^(milestones passed)``."""
    return base * decay ** sum(step >= m for m in milestones)


def _run(policy, steps, batch=16, max_devices=8):
    """Drives ``policy`` as the controller would: the rate seen is schedule × factor."""
    factor, seen = 1.0, []
    for step in range(steps):
        rate = _schedule(step) * factor
        ctx = Context(step=step, batch_size=batch, microbatches=1, devices=8,
                      max_devices=max_devices, hyperparams={"learning_rate": rate})
        for action in policy.decide({}, ctx):
            if isinstance(action, SetBatchSize):
                batch = action.batch_size
            elif isinstance(action, SetHyperparams):
                factor = action.values["learning_rate"] / _schedule(step)
        seen.append((step, batch, _schedule(step + 1) * factor))  # what the next step runs at
    return seen


def test_the_batch_doubles_and_the_rate_falls_by_root_two_where_the_schedule_halves():
    seen = _run(Seesaw(milestones=(10, 20), growths=None), steps=30)
    for step, batch, rate in seen:
        passed = sum(step >= m for m in (10, 20))
        assert batch == 16 * 2**passed
        if step + 1 not in (10, 20):  # the next step's rate, once the policy has seen the decay
            assert rate == pytest.approx(0.1 / math.sqrt(2) ** passed, rel=1e-12)


@pytest.mark.parametrize("limit", [{"max_batch_size": 32}, {"growths": 1}, {}],
                         ids=["max_batch_size", "growths", "default"])
def test_past_its_limit_the_schedule_decays_alone(limit):
    seen = dict((s, (b, r)) for s, b, r in _run(Seesaw((10, 20), **{"growths": None, **limit})
                                                if limit else Seesaw((10, 20)), steps=30))
    assert seen[15] == (32, pytest.approx(0.1 / math.sqrt(2)))
    assert seen[25] == (32, pytest.approx(0.1 / math.sqrt(2) / 2))  # halved by the schedule


def test_two_milestones_passed_at_once_grow_only_as_far_as_growths_allows():
    policy = Seesaw(milestones=(10, 20), growths=1)
    ctx = Context(step=25, batch_size=16, microbatches=1, devices=8, max_devices=8,
                  hyperparams={"learning_rate": 0.025})  # the schedule halved 0.1 twice
    batch, rate = policy.decide({}, ctx)
    assert batch.batch_size == 32  # one doubling: the second halving stays the schedule's
    assert rate.values["learning_rate"] == pytest.approx(0.025 * math.sqrt(2), rel=1e-12)


def test_a_resumed_policy_does_not_act_twice():
    policy = Seesaw(milestones=(10,))
    ctx = Context(step=12, batch_size=16, microbatches=1, devices=8, max_devices=8,
                  hyperparams={"learning_rate": 0.05})
    assert len(policy.decide({}, ctx)) == 2
    again = Seesaw(milestones=(10,))
    again.load_state_dict(policy.state_dict())
    assert again.decide({}, ctx) == []


@pytest.mark.parametrize("kwargs,message", [
    ({"milestones": ()}, "Seesaw: milestones must name at least one step, got ()"),
    ({"milestones": (5,), "decay": 0.3},
     "Seesaw: decay must be 1/n for an integer n >= 2 (0.5: the batch doubles), got 0.3"),
    ({"milestones": (5,), "decay": 1.0},
     "Seesaw: decay must be 1/n for an integer n >= 2 (0.5: the batch doubles), got 1.0"),
    ({"milestones": (5,), "growths": -1}, "Seesaw: growths must be an int >= 0, got -1"),
])
def test_bad_arguments_are_one_line(kwargs, message):
    with pytest.raises(ValueError) as e:
        Seesaw(**kwargs)
    assert str(e.value) == message
