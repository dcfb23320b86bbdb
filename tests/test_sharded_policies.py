"""Policies on a sharded mesh: ElasticScale names mesh shapes, and its planner compares them.

Pure decisions over plain numbers (adaptjax.policies imports no jax).
"""

import pytest

from adaptjax import policies as ajp


def ctx(step=0, devices=2, max_devices=2, shape=None, batch=64):
    shape = {"data": 2, "fsdp": 4} if shape is None else shape
    return ajp.Context(step=step, batch_size=batch, microbatches=1, devices=devices,
                       max_devices=max_devices, hyperparams={}, mesh_shape=shape)


def test_a_schedule_names_mesh_shapes_and_counts_replicas():
    policy = ajp.ElasticScale({10: {"data": 4, "fsdp": 2}, 20: 1, 30: {"data": 2, "fsdp": 4}})
    assert policy.upcoming(ctx()) == [ajp.Rescale(mesh_shape={"data": 4, "fsdp": 2})]
    assert policy.decide({}, ctx(step=10)) == [ajp.Rescale(mesh_shape={"data": 4, "fsdp": 2})]
    # a count is a replica count: the controller keeps the model axes
    assert policy.decide({}, ctx(step=20, devices=4, max_devices=4,
                                 shape={"data": 4, "fsdp": 2})) == [ajp.Rescale(devices=1)]
    # the shape the run is in already: nothing to do
    assert policy.decide({}, ctx(step=30)) == []


def test_a_predicate_may_answer_with_a_mesh_shape():
    policy = ajp.ElasticScale(predicate=lambda m, c: {"data": 1, "fsdp": 8})
    (action,) = policy.decide({}, ctx())
    assert action.mesh_shape == {"data": 1, "fsdp": 8} and "mesh" in action.reason


def test_bad_shapes_are_refused_in_one_line():
    with pytest.raises(ValueError, match="has no 'data' axis") as e:
        ajp.ElasticScale({10: {"fsdp": 8}})
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"mesh_shape\['fsdp'\] must be an int >= 1"):
        ajp.Rescale(mesh_shape={"data": 2, "fsdp": 0})
    with pytest.raises(ValueError, match="mesh_shape {'data': 3} must have 'data' = devices"):
        ctx(shape={"data": 3})


class Times:
    """Predicted seconds per step by mesh shape (a fixed table; None: unknown)."""

    def __init__(self, table):
        self.table, self.asked = table, []

    def step_time(self, candidate):
        key = tuple(candidate.mesh_shape.values()) if candidate.mesh_shape else candidate.devices
        self.asked.append(key)
        return self.table.get(key)


def test_the_planner_compares_every_shape_of_the_devices_and_picks_the_fastest():
    planner = Times({(2, 4): 1.0, (4, 2): 0.5, (8, 1): 0.7, (1, 8): None})
    policy = ajp.ElasticScale(planner=planner)
    assert policy.decide({}, ctx()) == [ajp.Rescale(mesh_shape={"data": 4, "fsdp": 2})]
    # every factorisation of 8 devices (and of its divisors) whose data size divides 64
    assert {(4, 2), (8, 1), (1, 8), (1, 4), (2, 2), (1, 1)} <= set(planner.asked)
    slow = ajp.ElasticScale(planner=Times({(2, 4): 1.0, (4, 2): 0.99}))  # < min_gain
    assert slow.decide({}, ctx()) == []
