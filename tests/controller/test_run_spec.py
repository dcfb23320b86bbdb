"""adaptjax.RunSpec: checked when built, written to JSON and read back equal."""

import dataclasses
import json

import pytest

import adaptjax


def _spec(**kw):
    return adaptjax.RunSpec(run_dir="/tmp/run", batch_size=64, **kw)


def test_a_spec_of_saveable_fields_reads_back_equal():
    spec = _spec(devices=4, mesh_shape={"data": 2, "fsdp": 2}, microbatches=2,
                 learning_rate=0.1, has_aux=True, sync="diloco", precision="bf16",
                 norm_chunks=4, loss_scale={"period": 200}, policy_every=5, max_devices=8,
                 link_bandwidth=1e9, max_nonfinite_steps=None,
                 checkpoint=adaptjax.CheckpointOptions(every=10, max_to_keep=None),
                 compile=adaptjax.CompileOptions(cache_dir=None, precompile_upcoming=False))
    assert spec.unsaved() == []
    back = adaptjax.RunSpec.from_json(spec.to_json())
    assert back == spec and back.differences(spec) == []


def test_precision_is_kept_by_its_key():
    assert _spec(precision="bf16").precision == "bfloat16"
    assert _spec(precision=adaptjax.Precision("float32")).precision is None


def test_unsaveable_fields_are_named_and_asked_for_again():
    spec = _spec(sharding=lambda path, leaf: None, learning_rate=lambda step: 0.1)
    assert spec.unsaved() == ["learning_rate", "sharding"]
    saved = json.loads(spec.to_json())
    assert "sharding" not in saved and saved["unsaved"] == ["learning_rate", "sharding"]
    with pytest.raises(ValueError, match=r"^the saved spec set learning_rate, sharding, which "
                       r"cannot be saved; pass spec=RunSpec\(\.\.\., learning_rate=\.\.\.\) "
                       r"again$"):
        adaptjax.RunSpec.from_json(spec.to_json())


def test_differences_name_the_fields():
    assert _spec(devices=4).differences(_spec(devices=2, policy_every=3)) == [
        "devices", "policy_every"]


@pytest.mark.parametrize("kw, message", [
    (dict(policy_every=0), "RunSpec.policy_every must be a positive integer, got 0"),
    (dict(devices=2.0), "RunSpec.devices must be a positive integer, got 2.0"),
    (dict(max_nonfinite_steps=-1), "RunSpec.max_nonfinite_steps must be a positive integer"),
    (dict(has_aux=1), "RunSpec.has_aux must be True or False, got 1"),
    (dict(link_bandwidth=0), "RunSpec.link_bandwidth must be a positive number of bytes/s"),
    (dict(precision=16), "precision must be an adaptjax.Precision"),
    (dict(checkpoint=3), "RunSpec.checkpoint must be an adaptjax.CheckpointOptions, got int"),
])
def test_bad_fields_are_refused_in_one_line(kw, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(".", r"\.")):
        _spec(**kw)


def test_run_dir_must_be_a_path():
    with pytest.raises(ValueError, match=r"^RunSpec\.run_dir must be a path, got 3$"):
        adaptjax.RunSpec(run_dir=3, batch_size=8)


def test_the_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _spec().devices = 2
