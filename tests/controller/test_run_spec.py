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


def _code():
    import jax.numpy as jnp
    import numpy as np
    import optax

    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    return dict(model={"w": jnp.zeros(3)},
                loss_fn=lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
                optimizer=optax.sgd(optax.linear_schedule(0.1, 0.0, 100)),
                data=adaptjax.ArrayDataset({"x": x, "y": x.sum(1)}, seed=0))


def test_a_resume_reads_the_saved_spec_and_asks_for_what_it_could_not_save(tmp_path):
    import optax

    spec = adaptjax.RunSpec(run_dir=tmp_path, devices=2, batch_size=8, policy_every=3,
                            learning_rate=optax.linear_schedule(0.1, 0.0, 100),
                            compile=adaptjax.CompileOptions(cache_dir=None))
    ctrl = adaptjax.Controller(**_code(), spec=spec, hooks=[])
    ctrl.run(2)
    ctrl.close()
    assert json.loads((tmp_path / "spec.json").read_text())["unsaved"] == ["learning_rate"]
    with pytest.raises(ValueError) as e:
        adaptjax.Controller.resume(tmp_path, **_code(), hooks=[])
    assert str(e.value) == (f"{tmp_path / 'spec.json'} set learning_rate, which cannot be "
                            "saved; pass spec=RunSpec(..., learning_rate=...) again")
    resumed = adaptjax.Controller.resume(tmp_path, **_code(), spec=spec, hooks=[])
    assert resumed.step == 2 and resumed.spec is spec
    resumed.close()


def test_a_resume_without_a_spec_continues_with_the_saved_one(tmp_path):
    spec = adaptjax.RunSpec(run_dir=tmp_path / "a", devices=2, batch_size=8, policy_every=3,
                            compile=adaptjax.CompileOptions(cache_dir=None))
    ctrl = adaptjax.Controller(**_code(), spec=spec, hooks=[])
    ctrl.run(2)
    ctrl.close()
    (tmp_path / "a").rename(tmp_path / "b")  # a moved run directory keeps its spec
    resumed = adaptjax.Controller.resume(tmp_path / "b", **_code(), hooks=[])
    assert resumed.spec == spec.replace(run_dir=tmp_path / "b") and resumed.step == 2
    resumed.close()


def test_a_resume_names_the_spec_fields_that_differ_in_one_warning(tmp_path):
    spec = adaptjax.RunSpec(run_dir=tmp_path, devices=2, batch_size=8,
                            compile=adaptjax.CompileOptions(cache_dir=None))
    ctrl = adaptjax.Controller(**_code(), spec=spec, hooks=[])
    ctrl.run(2)
    ctrl.close()
    changed = spec.replace(policy_every=5, max_nonfinite_steps=None)
    with pytest.warns(UserWarning) as record:
        adaptjax.Controller.resume(tmp_path, **_code(), spec=changed, hooks=[]).close()
    assert [str(w.message) for w in record] == [
        f"resume: the spec passed differs from {tmp_path / 'spec.json'} in policy_every, "
        "max_nonfinite_steps; the passed values are used (the configuration continues as "
        "checkpointed)"]


def test_a_resume_needs_a_spec_where_none_was_saved(tmp_path):
    with pytest.raises(ValueError) as e:
        adaptjax.Controller.resume(tmp_path, **_code())
    assert str(e.value) == (f"{tmp_path / 'spec.json'} does not exist: pass spec=RunSpec(...) "
                            "to Controller.resume")


def test_policies_are_code_a_resume_asks_for_again(tmp_path):
    from adaptjax import policies as ajp

    policy = ajp.Schedule({1: ajp.SetBatchSize(16)})
    spec = adaptjax.RunSpec(run_dir=tmp_path, devices=2, batch_size=8, policy_every=1,
                            policies=[policy], compile=adaptjax.CompileOptions(cache_dir=None))
    assert spec.policies == (policy,)
    ctrl = adaptjax.Controller(**_code(), spec=spec, hooks=[])
    ctrl.run(3)
    ctrl.close()
    assert ctrl.config.batch_size == 16  # the spec's policy decided
    assert json.loads((tmp_path / "spec.json").read_text())["unsaved"] == ["policies"]
    with pytest.raises(ValueError) as e:
        adaptjax.Controller.resume(tmp_path, **_code(), hooks=[])
    assert str(e.value) == (f"{tmp_path / 'spec.json'} set policies, which cannot be "
                            "saved; pass spec=RunSpec(..., policies=...) again")
    resumed = adaptjax.Controller.resume(tmp_path, **_code(), spec=spec, hooks=[])
    assert (resumed.step, resumed.config.batch_size) == (3, 16)
    resumed.close()


@pytest.mark.parametrize("policies, message", [
    ("AdaptiveBatchSize", "RunSpec.policies must be a sequence of adaptjax.policies.Policy, "
                          "got str"),
    ([print], "RunSpec.policies must hold adaptjax.policies.Policy objects, "
              "got builtin_function_or_method"),
])
def test_policies_that_are_not_policies_are_one_line(tmp_path, policies, message):
    with pytest.raises(ValueError) as e:
        adaptjax.RunSpec(run_dir=tmp_path, batch_size=8, policies=policies)
    assert str(e.value) == message
    assert list(tmp_path.iterdir()) == []
