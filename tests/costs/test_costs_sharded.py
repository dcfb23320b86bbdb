"""The cost model on sharded meshes: links per axis, collectives moved between mesh shapes,
bytes of state per device, and ``adaptjax plan`` ranking mesh shapes."""

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _controller_args import make_controller  # noqa: E402
from adaptjax.policies import Candidate

import adaptjax
from adaptjax import Collective, RunConfig
from adaptjax.cli._main import main
from adaptjax.costs import (
    CannotPredict,
    ComputeModel,
    LinkModel,
    Planner,
    StepTimeModel,
    reshape_report,
    state_bytes_per_device,
)
from adaptjax.costs._meshes import mesh_shapes
from adaptjax.costs._model import Observation
from adaptjax.costs._simulate import wire_for

RULE = adaptjax.FSDP(min_size=16)


def coll(kind, axes, n, sent):
    return Collective(kind, "f32", (1,), 1, n, sent, sent, "f32", axes=axes)


def ring(kind, n, message):
    """Bytes per device of a ring collective of ``message`` (the gathered result for
    all-gather) over ``n`` devices."""
    return {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n,
            "reduce-scatter": (n - 1) / n}[kind] * message


# ------------------------------------------------------------------ moving collectives


def test_reshape_report_follows_the_shards_and_the_ring_formula():
    grads, weights = 4e6, 8e6  # a replica's gradient shard on (2, 4); a layer's whole weights
    report = [
        coll("all-reduce", ("data",), 2, ring("all-reduce", 2, grads)),
        coll("all-gather", ("fsdp",), 4, ring("all-gather", 4, weights)),
        coll("reduce-scatter", ("fsdp",), 4, ring("reduce-scatter", 4, weights)),
    ]
    old = {"data": 2, "fsdp": 4}
    for new in ({"data": 4, "fsdp": 2}, {"data": 8, "fsdp": 1}, {"data": 1, "fsdp": 8}):
        got = reshape_report(report, old, new)
        want = []
        if new["data"] > 1:  # the shard each device holds grows as fsdp shrinks
            want.append(("all-reduce", new["data"],
                         ring("all-reduce", new["data"], grads * 4 / new["fsdp"])))
        if new["fsdp"] > 1:
            want += [("all-gather", new["fsdp"], ring("all-gather", new["fsdp"], weights)),
                     ("reduce-scatter", new["fsdp"], ring("reduce-scatter", new["fsdp"], weights))]
        assert [(c.kind, c.group_size) for c in got.collectives] == [w[:2] for w in want]
        for c, w in zip(got.collectives, want, strict=True):
            assert c.bytes == pytest.approx(w[2]) and c.compiled_bytes == pytest.approx(w[2])
        assert got.num_devices == 8
    with pytest.raises(CannotPredict, match="axes are unknown"):
        reshape_report([coll("all-reduce", (), 2, 1.0)], old, {"data": 4, "fsdp": 2})


def test_links_per_axis_price_their_collectives():
    slow, fast = LinkModel(alpha=1e-3, beta=1e-8), LinkModel(alpha=1e-6, beta=1e-10)
    model = StepTimeModel({"all-gather": slow, "all-gather@fsdp": fast})
    on_fsdp, on_data = coll("all-gather", ("fsdp",), 4, 3e6), coll("all-gather", ("data",), 2, 3e6)
    assert model.comm_time([on_fsdp])[0] == pytest.approx(fast.time("all-gather", 4, 3e6))
    assert model.comm_time([on_data])[0] == pytest.approx(slow.time("all-gather", 2, 3e6))
    assert model.link("all-gather", "fsdp") is fast and model.link("all-gather") is slow


def test_the_sync_of_a_compiled_step_moves_to_other_shapes_by_its_shards():
    """The data axis's all-reduce on (4, 2) and (8, 1) from (2, 4)'s: every leaf is split on
    every mesh here, so only the few scalars riding with the gradients do not scale."""

    def mlp():
        k = jax.random.split(jax.random.key(0), 2)
        return {"w1": jax.random.normal(k[0], (16, 64)), "w2": jax.random.normal(k[1], (64, 8))}

    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    tx = optax.chain(adaptjax.sync_gradients("data"), optax.adam(0.05))
    batch = {"x": np.ones((32, 16), np.float32), "y": np.ones((32, 8), np.float32)}
    reports = {}
    for shape in ({"data": 2, "fsdp": 4}, {"data": 4, "fsdp": 2}, {"data": 8, "fsdp": 1}):
        mesh = adaptjax.make_mesh(shape)
        step = adaptjax.data_parallel_step(loss, tx, mesh, sharding=RULE)
        state = adaptjax.abstract_state(mlp(), tx, mesh, sharding=RULE)
        reports[tuple(shape.values())] = (shape, adaptjax.wire_bytes(step.jitted, state, batch))
    old, report = reports[(2, 4)]
    for key in ((4, 2), (8, 1)):
        shape, actual = reports[key]
        predicted = reshape_report(report, old, shape).axis_totals["data"]
        assert predicted == pytest.approx(actual.axis_totals["data"], rel=0.01)


def test_wire_for_a_mesh_needs_a_step_that_spanned_its_axes():
    def report(n, f):
        return [coll("all-reduce", ("data",), n, ring("all-reduce", n, 4e6 / f))] + (
            [coll("all-gather", ("fsdp",), f, ring("all-gather", f, 8e6))] if f > 1 else [])

    step = RunConfig(2, 64, mesh_shape={"data": 2, "fsdp": 4})
    model = StepTimeModel({"*": LinkModel(0.0, 1e-9)}, observations=(
        Observation(step, report(2, 4), 0.1),))
    moved = wire_for(model, RunConfig(4, 64, mesh_shape={"data": 4, "fsdp": 2}))
    assert [c.group_size for c in moved.collectives] == [4, 2]
    flat = wire_for(model, RunConfig(8, 64))  # to the 1-D mesh: the sync of whole leaves
    assert [(c.axes, c.group_size) for c in flat.collectives] == [(("data",), 8)]
    assert flat.collectives[0].bytes == pytest.approx(ring("all-reduce", 8, 4e6))
    one = StepTimeModel({}, observations=(Observation(RunConfig(8, 64, mesh_shape={
        "data": 8, "fsdp": 1}), report(8, 1), 0.1),))
    with pytest.raises(CannotPredict, match="no recorded step spans each of its axes"):
        wire_for(one, step)


# ------------------------------------------------------------------ memory


def test_mesh_shapes_are_the_factorisations_the_batch_allows():
    assert [tuple(s.values()) for s in mesh_shapes(8, ("data", "fsdp", "model"), 8)] == [
        (a, b, c) for a in (1, 2, 4, 8) for b in (1, 2, 4, 8) for c in (1, 2, 4, 8)
        if a * b * c == 8]
    assert mesh_shapes(12, ("data", "fsdp"), 64, 3) == []  # no data size splits 64 into 3s
    with pytest.raises(ValueError, match="no 'data' axis"):
        mesh_shapes(8, ("fsdp",), 64)


@pytest.mark.filterwarnings("ignore:onebit.*trains worse than dense sync:UserWarning")
@pytest.mark.parametrize("shape", [{"data": 2, "fsdp": 4}, {"data": 4, "fsdp": 2},
                                   {"data": 8}, {"data": 1, "fsdp": 8}])
def test_state_bytes_per_device_is_what_init_state_places(shape):
    from adaptjax import compression as ajc

    params = {"w1": jnp.zeros((16, 64)), "b1": jnp.zeros(64), "w2": jnp.zeros((64, 4))}
    tx = optax.chain(adaptjax.sync_gradients("data", codec=ajc.onebit(min_size=16)),
                     optax.adam(0.1))  # error feedback: per-replica residuals too
    state = adaptjax.init_state(params, tx, adaptjax.make_mesh(shape), sharding=RULE)
    device = jax.devices()[0]
    placed = sum(s.data.nbytes for x in jax.tree.leaves((state.params, state.opt_state))
                 for s in x.addressable_shards if s.device == device)
    assert state_bytes_per_device(params, tx, shape, sharding=RULE) == placed


# ------------------------------------------------------------------ the planner and plan


def test_planner_predicts_mesh_shapes_and_plan_ranks_them(tmp_path):
    link, compute = LinkModel(alpha=0.0, beta=1e-9), ComputeModel(fixed=0.01, per_sample=1e-3)

    def wire(config):
        n, f = config.axes["data"], config.axes.get("fsdp", 1)
        out = [coll("all-reduce", ("data",), n, ring("all-reduce", n, 4e6 / f))] if n > 1 else []
        return out + ([coll("all-gather", ("fsdp",), f, ring("all-gather", f, 4e6))] if f > 1
                      else [])

    def truth(config):
        return (compute.time(devices=config.device_count, batch_size=config.batch_size)
                + sum(link.time(c.kind, c.group_size, c.bytes) for c in wire(config)))

    planner = Planner({"*": link}, wire_of=wire)
    planner.run_dir = str(tmp_path)
    planner.memory = {"data=1,fsdp=8": 100, "data=2,fsdp=4": 200, "data=4,fsdp=2": 400,
                      "data=8,fsdp=1": 800}
    for b in (32, 64):
        c = Candidate(2, b, mesh_shape={"data": 2, "fsdp": 4})
        planner.observe(c, truth(planner.config_of(c)))
    target = Candidate(4, 64, mesh_shape={"data": 4, "fsdp": 2})
    assert planner.step_time(target) == pytest.approx(truth(planner.config_of(target)))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", str(tmp_path)]) == 0
    rows = [line.split() for line in out.getvalue().splitlines()[2:] if line[:3].strip().isdigit()]
    batch64 = [r for r in rows if r[4] == "64"]
    shapes = [r[2] for r in batch64]
    assert sorted(shapes) == sorted(planner.memory)  # every factorisation of 8 devices

    def config(label):
        axes = {a: int(n) for a, n in (p.split("=") for p in label.split(","))}
        return RunConfig(axes["data"], 64, mesh_shape=axes)

    # best predicted step first (the same batch: goodput is 1 / step time), and exact
    assert shapes == sorted(shapes, key=lambda label: truth(config(label)))
    for r in batch64:
        assert float(r[6]) == pytest.approx(truth(config(r[2])) * 1e3, abs=0.01)
    assert {r[2]: int(r[3]) for r in batch64} == planner.memory


def test_a_planner_attached_to_a_sharded_run_knows_each_shapes_state(tmp_path):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import controller_job as job

    planner = Planner(bandwidth=1e9)  # pinned: nothing to calibrate
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(
        devices=None, mesh_shape={"data": 2, "fsdp": 4}, sharding=RULE, policies=[]))
    planner.attach(ctrl)
    tx = ctrl.steps.tx(None)
    assert planner.memory == {
        ",".join(f"{a}={n}" for a, n in s.items()): state_bytes_per_device(
            job.init_params(), tx, s, sharding=RULE)
        for s in mesh_shapes(8, ("data", "fsdp"), 64)
    }
    assert planner.memory["data=1,fsdp=8"] < planner.memory["data=8,fsdp=1"]
    ctrl.close()
