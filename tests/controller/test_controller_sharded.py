"""The controller on sharded meshes: rescales over either axis, and the bad inputs.

A rescale moves numbers between devices and changes nothing else, so the
state after it holds exactly the values it held before (bit for bit), and a
run rescaled through several shapes reaches the parameters of the run that
never moved, up to float32 reassociation (each mesh sums the gradients over
its devices in its own order).
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _controller_args import make_controller, resume_controller  # noqa: E402
from jax.sharding import PartitionSpec as P

import adaptjax
from adaptjax import compression as ajc
from adaptjax import policies as ajp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import controller_job as job  # noqa: E402

RULE = adaptjax.FSDP(min_size=16)  # the job's MLP is tiny: shard every leaf of >= 16 elements


def sharded_kwargs(mesh_shape, **overrides):
    kwargs = job.job_kwargs(
        devices=None, mesh_shape=mesh_shape, sharding=RULE, policies=[], policy_every=1,
        checkpoint_every=None,
    )
    kwargs.update(overrides)
    return kwargs


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_shards(ctrl):
    """Each device holds 1/size of every sharded parameter and optimizer leaf."""
    mesh = ctrl.steps.mesh(ctrl.config)
    for x in jax.tree.leaves((ctrl.state.params, ctrl.state.opt_state)):
        assert x.sharding.mesh == mesh
        split = int(np.prod([mesh.shape[a] for e in x.sharding.spec if e for a in
                             (e if isinstance(e, tuple) else (e,))]))
        for shard in x.addressable_shards:
            assert shard.data.size * split == x.size


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


def test_a_run_rescaled_2x4_1x4_2x2_2x4_equals_the_run_that_never_moved(tmp_path):
    moves = {3: {"data": 1, "fsdp": 4}, 6: {"data": 2, "fsdp": 2}, 9: {"data": 2, "fsdp": 4}}
    policy = ajp.Schedule({s: ajp.Rescale(mesh_shape=m) for s, m in moves.items()})
    moved = make_controller(run_dir=tmp_path / "moved",
                                **sharded_kwargs({"data": 2, "fsdp": 4}, policies=[policy]))
    moved.run(12)
    still = make_controller(run_dir=tmp_path / "still",
                                **sharded_kwargs({"data": 2, "fsdp": 4}))
    still.run(12)
    rescales = [e for e in moved.log.events if e["kind"] == "rescale"]
    assert [e["mesh_to"] for e in rescales] == list(moves.values())
    assert moved.config == still.config and moved.data.cursor == still.data.cursor
    got, want = host(moved.state.params), host(still.state.params)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert moved.state.params["w1"].sharding.spec == P(None, "fsdp")
    assert_shards(moved)
    moved.close()
    still.close()


@pytest.mark.parametrize(
    ("start", "target"),
    [
        ({"data": 2, "fsdp": 4}, {"data": 1, "fsdp": 4}),  # the data axis
        ({"data": 2, "fsdp": 4}, {"data": 2, "fsdp": 2}),  # the fsdp axis
        ({"data": 2, "fsdp": 4}, {"data": 4, "fsdp": 2}),  # both
        ({"data": 8, "fsdp": 1}, {"data": 2, "fsdp": 4}),
        ({"data": 8}, {"data": 2, "fsdp": 4}),  # from the 1-D mesh, and back
        ({"data": 2, "fsdp": 4}, {"data": 8}),
    ],
)
def test_a_rescale_moves_the_state_and_changes_no_value(tmp_path, start, target):
    ctrl = make_controller(run_dir=tmp_path, **sharded_kwargs(start))
    ctrl.run(2)
    before, cursor = host(ctrl.state), ctrl.data.cursor
    ctrl.apply([ajp.Rescale(mesh_shape=target)])
    assert ctrl.config.axes == target and ctrl.config.devices == target["data"]
    after = host(ctrl.state)
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(x, y)  # nothing per replica here: every value kept
    assert ctrl.data.cursor == cursor
    assert_shards(ctrl)
    ctrl.run(3)  # the step compiles and runs on the new mesh
    assert np.isfinite(ctrl.latest_metrics["loss"])
    (event,) = [e for e in ctrl.log.events if e["kind"] == "rescale"]  # once its checkpoint is
    assert event["mesh_from"] == start and event["mesh_to"] == target
    ctrl.close()


@pytest.mark.filterwarnings("ignore:onebit.*trains worse than dense sync:UserWarning")
def test_error_feedback_debt_is_preserved_when_the_data_axis_shrinks(tmp_path):
    ctrl = make_controller(
        run_dir=tmp_path, **sharded_kwargs({"data": 2, "fsdp": 4}, codec=ajc.onebit(min_size=16))
    )
    ctrl.run(3)

    def residuals(state):
        marked = [x for x in jax.tree.leaves(state.opt_state, is_leaf=lambda n: isinstance(
            n, adaptjax.PerReplica)) if isinstance(x, adaptjax.PerReplica)]
        return [np.asarray(jax.device_get(v)) for m in marked for v in jax.tree.leaves(m.value)]

    old = residuals(ctrl.state)
    assert old and all(r.shape[0] == 2 for r in old) and any(np.any(r[0] != r[1]) for r in old)
    ctrl.apply([ajp.Rescale(mesh_shape={"data": 1, "fsdp": 4})])
    new = residuals(ctrl.state)
    for o, n in zip(old, new, strict=True):
        assert n.shape == (1, *o.shape[1:])
        # the debt still owed to the averaged gradient, mean_i(e_i), is what one replica owes
        np.testing.assert_array_equal(n[0], o.mean(axis=0, dtype=np.float64).astype(o.dtype))
    specs = [x.sharding.spec for x in jax.tree.leaves(ctrl.state.opt_state)
             if len(x.sharding.spec) and x.sharding.spec[0] == "data"]
    assert P("data", None, "fsdp") in specs  # w1's residual: per replica, sharded like w1
    ctrl.run(5)
    ctrl.close()


def test_policies_see_the_mesh_and_count_replicas(tmp_path):
    seen = []

    class Look(ajp.Policy):
        def decide(self, metrics, ctx):
            seen.append((ctx.devices, ctx.max_devices, dict(ctx.mesh_shape)))
            return [ajp.Rescale(devices=1)] if ctx.step == 2 else []

    ctrl = make_controller(run_dir=tmp_path,
                               **sharded_kwargs({"data": 2, "fsdp": 4}, policies=[Look()]))
    ctrl.run(4)
    assert seen[0] == (2, 2, {"data": 2, "fsdp": 4})
    assert seen[-1] == (1, 2, {"data": 1, "fsdp": 4})  # Rescale(devices=1) kept fsdp
    ctrl.close()


def test_resume_restores_onto_the_checkpoints_mesh(tmp_path):
    kwargs = sharded_kwargs({"data": 2, "fsdp": 4}, checkpoint_every=2)
    ctrl = make_controller(run_dir=tmp_path, **kwargs)
    ctrl.run(2)
    ctrl.apply([ajp.Rescale(mesh_shape={"data": 4, "fsdp": 2})])
    saved = host(ctrl.state)
    ctrl.close()
    back = resume_controller(tmp_path, **kwargs)  # the same spec: the checkpoint's mesh, quietly
    assert back.config.axes == {"data": 4, "fsdp": 2}
    for x, y in zip(jax.tree.leaves(saved), jax.tree.leaves(host(back.state)), strict=True):
        np.testing.assert_array_equal(x, y)
    assert_shards(back)
    back.close()


# ------------------------------------------------------------------ bad inputs


def twelve_wide():
    """w1 is (8, 12): an fsdp axis of 4 (or 2) divides it, one of 8 does not."""
    rng = np.random.default_rng(0)
    return {"w1": jnp.asarray(rng.normal(size=(8, 12)).astype(np.float32)), "b1": jnp.zeros(12),
            "w2": jnp.asarray(rng.normal(size=(12, 2)).astype(np.float32))}


TWELVE = {"w1": P(None, "fsdp"), "b1": P(), "w2": P()}


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"mesh_shape": {"data": 4, "fsdp": 4}}, "asked for 16 devices but only 8 exist"),
        ({"mesh_shape": {"fsdp": 8}}, "has no 'data' axis"),
        ({"mesh_shape": {"data": 2, "tensor": 4}}, "unknown mesh axis 'tensor'"),
        ({"mesh_shape": {"data": 2, "fsdp": 4}, "devices": 8}, "has data=2 but devices=8"),
        ({"mesh_shape": {"data": 3, "fsdp": 2}},
         "batch_size 64 is not divisible by replicas x microbatches = 3 x 1"),
        ({"sharding": {"w1": P("model"), "b1": P(), "w2": P()}},
         "parameter ['w1'] names axis 'model', which the mesh {'data': 2, 'fsdp': 4} lacks"),
        ({"model": twelve_wide(), "mesh_shape": {"data": 1, "fsdp": 8}, "sharding": TWELVE},
         "parameter ['w1'] of shape (8, 12) cannot be split over ('fsdp',) (size 8) along "
         "dimension 1 (12)"),
    ],
)
def test_bad_meshes_are_refused_in_one_line_before_the_disk_is_touched(tmp_path, overrides,
                                                                       words):
    kwargs = sharded_kwargs({"data": 2, "fsdp": 4})
    kwargs.update(overrides)
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError) as e:
        make_controller(run_dir=run_dir, **kwargs)
    assert words in one_line(e)
    assert not run_dir.exists() or not os.listdir(run_dir)


def test_a_rescale_the_shardings_cannot_take_names_the_leaf_and_changes_nothing(tmp_path):
    ctrl = make_controller(
        run_dir=tmp_path,
        **sharded_kwargs({"data": 2, "fsdp": 4}, model=twelve_wide(), sharding=TWELVE),
    )
    ctrl.run(2)
    before = host(ctrl.state)
    with pytest.raises(ValueError) as e:
        ctrl.apply([ajp.Rescale(mesh_shape={"data": 1, "fsdp": 8})])
    msg = one_line(e)
    assert msg.startswith("Rescale to a shape the model's shardings cannot take")
    assert "parameter ['w1'] of shape (8, 12)" in msg and "dimension 1 (12)" in msg
    with pytest.raises(ValueError) as e:
        ctrl.apply([ajp.Rescale(mesh_shape={"data": 4, "fsdp": 4})])
    assert "it needs 16 devices and the job has 8" in one_line(e)
    with pytest.raises(ValueError) as e:
        ctrl.apply([ajp.Rescale(mesh_shape=(2, 2, 2))])
    assert "gives 3 sizes for the run's mesh axes ('data', 'fsdp')" in one_line(e)
    assert ctrl.config.axes == {"data": 2, "fsdp": 4}
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(host(ctrl.state)), strict=True):
        np.testing.assert_array_equal(x, y)
    assert not [e for e in ctrl.log.events if e["kind"] == "rescale"]
    assert ctrl.checkpoints.all_steps() == [2]  # the end of run(2): nothing written since
    ctrl.apply([ajp.Rescale(mesh_shape=(4, 2))])  # the run's own axes, in order
    assert ctrl.config.axes == {"data": 4, "fsdp": 2}
    ctrl.close()


def test_the_configuration_keys_its_mesh():
    a = adaptjax.RunConfig(2, 64, mesh_shape={"data": 2, "fsdp": 4})
    b = adaptjax.RunConfig(2, 64, mesh_shape=[["data", 2], ["fsdp", 4]])  # as JSON gives it
    assert a == b and hash(a) == hash(b)
    assert adaptjax.RunConfig(8, 64, mesh_shape={"data": 8}) == adaptjax.RunConfig(8, 64)
    assert a != adaptjax.RunConfig(2, 64, mesh_shape={"fsdp": 4, "data": 2})  # another layout
    assert a.replace(devices=4).axes == {"data": 4, "fsdp": 4}
    assert a.device_count == 8 and adaptjax.RunConfig(8, 64).device_count == 8
    with pytest.raises(ValueError) as e:
        adaptjax.RunConfig(2, 64, mesh_shape="data=2")
    assert "mesh_shape must be a dict" in one_line(e)
