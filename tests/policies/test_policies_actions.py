"""The action vocabulary, the Context, and validate_actions: validation and messages."""

import pickle

import numpy as np
import pytest
from adaptjax.policies._actions import ACTION_TYPES
from adaptjax.policies._policy import validate_actions

from adaptjax import policies as ajp


def test_action_types_and_union():
    assert ACTION_TYPES == (
        ajp.SetHyperparams,
        ajp.SetBatchSize,
        ajp.Rescale,
        ajp.SetCodec,
        ajp.Checkpoint,
        ajp.Stop,
        ajp.Rollback,
        ajp.SetSync,
        ajp.SetPrecision,
        ajp.Probe,
    )
    assert set(ajp.Action.__args__) == set(ACTION_TYPES)


def test_actions_are_frozen_equal_and_hashable():
    a = ajp.SetHyperparams({"learning_rate": 0.1, "b1": 0.9})
    b = ajp.SetHyperparams({"b1": 0.9, "learning_rate": 0.1})
    assert a == b and hash(a) == hash(b)
    assert a.values == {"learning_rate": 0.1, "b1": 0.9}
    with pytest.raises(AttributeError):
        a.values = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        a.values["learning_rate"] = 1.0  # type: ignore[index]
    actions = {
        a,
        ajp.SetBatchSize(128, microbatches=2),
        ajp.Rescale(devices=4),
        ajp.Rescale(mesh_shape=(2, 2)),
        ajp.SetCodec(None),
        ajp.SetCodec("codec"),
        ajp.Checkpoint(),
        ajp.Stop("done"),
        ajp.Rollback("nan"),
    }
    assert len(actions) == 9
    assert pickle.loads(pickle.dumps(a)) == a


def test_fields_are_normalised():
    source = {"learning_rate": np.float32(0.5)}
    action = ajp.SetHyperparams(source)
    source["learning_rate"] = 9.0  # the action holds a copy
    assert action.values["learning_rate"] == 0.5
    assert type(action.values["learning_rate"]) is float
    batch = ajp.SetBatchSize(np.int64(256), microbatches=np.int32(4))
    assert (type(batch.batch_size), type(batch.microbatches)) == (int, int)
    assert ajp.Rescale(mesh_shape=[2, np.int64(4)]).mesh_shape == (2, 4)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ajp.SetHyperparams({}), "SetHyperparams: values must name at least one"),
        (lambda: ajp.SetHyperparams([("lr", 1.0)]), "SetHyperparams: values must be a mapping"),
        (lambda: ajp.SetHyperparams({"lr": float("nan")}), "values['lr'] must be finite"),
        (lambda: ajp.SetHyperparams({"lr": "fast"}), "values['lr'] must be a number"),
        (lambda: ajp.SetHyperparams({3: 1.0}), "every key of values must be a str"),
        (lambda: ajp.SetBatchSize(0), "SetBatchSize: batch_size must be an int >= 1, got 0"),
        (lambda: ajp.SetBatchSize(64.0), "SetBatchSize: batch_size must be an int, got 64.0"),
        (lambda: ajp.SetBatchSize(True), "batch_size must be an int, got True"),
        (lambda: ajp.SetBatchSize(64, microbatches=0), "microbatches must be an int >= 1"),
        (
            lambda: ajp.SetBatchSize(100, microbatches=3),
            "SetBatchSize: batch_size=100 is not divisible by microbatches=3; use a multiple of 3",
        ),
        (lambda: ajp.Rescale(), "Rescale: give exactly one of devices and mesh_shape"),
        (lambda: ajp.Rescale(devices=2, mesh_shape=(2,)), "give exactly one of devices"),
        (lambda: ajp.Rescale(devices=0), "Rescale: devices must be an int >= 1, got 0"),
        (lambda: ajp.Rescale(mesh_shape=()), "mesh_shape must have at least one dimension"),
        (lambda: ajp.Rescale(mesh_shape=(2, 0)), "every mesh_shape dimension must be an int >= 1"),
        (lambda: ajp.Rescale(mesh_shape="2x4"), "mesh_shape must be a tuple of ints"),
        (lambda: ajp.Stop(3), "Stop: reason must be a str, got 3"),
        (lambda: ajp.Rollback(None), "Rollback: reason must be a str, got None"),
    ],
)
def test_bad_action_fields(build, message):
    with pytest.raises(ValueError) as info:
        build()
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def _ctx(**overrides):
    fields = dict(
        step=0, batch_size=64, microbatches=1, devices=8, max_devices=8,
        hyperparams={"learning_rate": 0.1},
    )
    fields.update(overrides)
    return ajp.Context(**fields)


def test_context_copies_hyperparams_read_only():
    source = {"learning_rate": np.float64(0.1)}
    ctx = _ctx(hyperparams=source)
    source["learning_rate"] = 1.0
    assert ctx.hyperparams == {"learning_rate": 0.1}
    with pytest.raises(TypeError):
        ctx.hyperparams["learning_rate"] = 2.0  # type: ignore[index]
    assert ctx.codec is None and ctx.samples_seen == 0 and ctx.base_batch_size is None
    assert ctx.compiled_batch_sizes == frozenset()
    assert _ctx(compiled_batch_sizes=[np.int64(64), 128, 64]).compiled_batch_sizes == {64, 128}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"step": -1}, "Context: step must be an int >= 0, got -1"),
        ({"batch_size": 0}, "Context: batch_size must be an int >= 1, got 0"),
        ({"microbatches": 0}, "Context: microbatches must be an int >= 1, got 0"),
        ({"devices": 0}, "Context: devices must be an int >= 1, got 0"),
        (
            {"max_devices": 4},
            "Context: max_devices=4 is below devices=8; max_devices must be >= devices",
        ),
        ({"samples_seen": -5}, "Context: samples_seen must be an int >= 0, got -5"),
        ({"base_batch_size": 0}, "Context: base_batch_size must be an int >= 1, got 0"),
        ({"hyperparams": None}, "Context: hyperparams must be a mapping"),
        ({"hyperparams": {"lr": "x"}}, "Context: hyperparams['lr'] must be a number"),
        ({"compiled_batch_sizes": 64}, "Context: compiled_batch_sizes must be an iterable of"),
        ({"compiled_batch_sizes": [64, 0]},
         "Context: every compiled batch size must be an int >= 1, got 0"),
        ({"micro_batch_sizes": "32"}, "Context: micro_batch_sizes must be an iterable of"),
        ({"micro_batch_sizes": [32, -1]},
         "Context: every micro-batch size must be an int >= 1, got -1"),
    ],
)
def test_bad_context(overrides, message):
    with pytest.raises(ValueError) as info:
        _ctx(**overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_validate_actions_accepts_lists_and_tuples():
    actions = (ajp.Checkpoint(), ajp.Stop())
    assert validate_actions(actions) == [ajp.Checkpoint(), ajp.Stop()]
    assert validate_actions([]) == []


def test_validate_actions_names_the_offending_type_and_the_allowed_ones():
    allowed = (
        "SetHyperparams, SetBatchSize, Rescale, SetCodec, Checkpoint, Stop, Rollback, SetSync, "
        "SetPrecision, Probe"
    )
    with pytest.raises(ValueError) as info:
        validate_actions([ajp.Checkpoint(), {"batch_size": 128}])
    text = str(info.value)
    assert text == (
        "a policy returned an action of type dict ({'batch_size': 128}); allowed: " + allowed
    )


def test_validate_actions_names_the_policy_and_hints_the_fix():
    source = ajp.EarlyStop("loss", target=0.1, mode="min")
    with pytest.raises(ValueError, match=r"^EarlyStop returned NoneType \(None\) instead of a "
                                         r"list of actions; return \[\] for no action$"):
        validate_actions(None, source=source)
    with pytest.raises(ValueError, match=r"wrap it in a list: \[Checkpoint\(...\)\]$"):
        validate_actions(ajp.Checkpoint())
    with pytest.raises(ValueError, match=r"^a policy returned str \('stop'\) instead of a list"):
        validate_actions("stop")
