"""Sharded meshes: (data x fsdp [x model]) steps equal the 1-D ones; state lies in shards.

Every comparison is between the same computation on two meshes: the global
batch, the model and the optimizer are the same, only where the numbers live
changes, so the results agree up to float32 reassociation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import adaptjax
from adaptjax import compression as ajc
from adaptjax._per_replica import stack_replicas, state_partition_specs, state_shardings
from adaptjax._sync import codec_sync
from adaptjax._tree import ShardLayout

RULE = adaptjax.FSDP(min_size=64)  # the test model is small: shard everything >= 64 elements
RNG = np.random.default_rng(0)
BATCHES = [
    {
        "x": RNG.normal(size=(32, 16)).astype(np.float32),
        "y": RNG.normal(size=(32, 4)).astype(np.float32),
    }
    for _ in range(20)
]


def mlp():
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "w1": jax.random.normal(k[0], (16, 64)) * 0.3,
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(k[1], (64, 32)) * 0.3,
        "w3": jax.random.normal(k[2], (32, 4)) * 0.3,
        "s": jnp.ones(4),  # small: replicated on every mesh
    }


def loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((jnp.tanh(h @ p["w2"]) @ p["w3"] * p["s"] - b["y"]) ** 2)


def train(shape, tx, *, steps=20, microbatches=1, sync=None, sharding=RULE):
    mesh = adaptjax.make_mesh(shape)
    step = adaptjax.data_parallel_step(
        loss, tx, mesh, microbatches=microbatches, sync=sync, sharding=sharding
    )
    state = adaptjax.init_state(mlp(), tx, mesh, sharding=sharding)
    metrics = None
    for b in BATCHES[:steps]:
        state, metrics = step(state, b)
    return jax.device_get(state), jax.device_get(metrics)


def assert_trees_close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------ meshes


def test_make_mesh_named_axes_keep_their_order():
    mesh = adaptjax.make_mesh({"fsdp": 4, "data": 2})
    assert mesh.axis_names == ("fsdp", "data") and dict(mesh.shape) == {"fsdp": 4, "data": 2}
    assert list(mesh.devices.flat) == jax.devices()
    flat = adaptjax.make_mesh({"data": 8})
    assert flat.axis_names == adaptjax.make_mesh(8).axis_names
    assert list(flat.devices.flat) == list(adaptjax.make_mesh(8).devices.flat)
    assert dict(adaptjax.make_mesh({"data": 1, "fsdp": 4}).shape) == {"data": 1, "fsdp": 4}


@pytest.mark.parametrize(
    ("shape", "kwargs", "words"),
    [
        ({"data": 4, "fsdp": 4}, {}, "only 8 exist"),
        ({"data": 2, "fsdp": 2}, {"device_list": jax.devices()}, "needs 4 devices"),
        ({"fsdp": 8}, {}, "no 'data' axis"),
        ({"data": 2, "tensor": 4}, {}, "unknown mesh axis 'tensor'"),
        ({"data": 2, "fsdp": 0}, {}, "int size >= 1"),
    ],
)
def test_make_mesh_bad_shapes(shape, kwargs, words):
    with pytest.raises(ValueError) as e:
        adaptjax.make_mesh(shape, **kwargs)
    assert words in one_line(e)


# ------------------------------------------------------------------ specs


def test_fsdp_rule_largest_divisible_dimension():
    mesh = adaptjax.make_mesh({"data": 2, "fsdp": 4})
    rule = adaptjax.FSDP(min_size=16)
    assert rule.spec((6, 32), mesh) == P(None, "fsdp")  # the largest dimension
    assert rule.spec((32, 6), mesh) == P("fsdp")
    assert rule.spec((16, 16), mesh) == P("fsdp")  # a tie: the leading one
    assert rule.spec((12, 10), mesh) == P("fsdp")  # 12 % 4 == 0, 10 % 4 != 0
    assert rule.spec((10, 6), mesh) == P()  # nothing divisible: replicated
    assert rule.spec((8,), mesh) == P()  # under min_size
    assert rule.spec((8, 32), mesh, P(None, "model")) == P("fsdp", "model")
    assert adaptjax.FSDP(min_size=16).spec((8, 32), adaptjax.make_mesh(8)) == P()


def test_a_mesh_of_data_axes_replicates_as_before():
    mesh = adaptjax.make_mesh(8)
    specs = adaptjax.param_specs(mlp(), mesh, sharding={"w1": P("model")})
    assert set(jax.tree.leaves(specs)) == {P()}


def test_nnx_annotations_and_logical_rules():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(
                16, 64, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs
            )
            rules = (("mlp", "model"), ("embed", None))
            self.down = nnx.Linear(
                64,
                16,
                kernel_init=nnx.with_partitioning(init, ("mlp", "embed"), sharding_rules=rules),
                rngs=rngs,
            )

    mesh = adaptjax.make_mesh({"data": 2, "fsdp": 2, "model": 2})
    with jax.set_mesh(mesh):
        model = Net(nnx.Rngs(0))
    tx = optax.adam(0.1)
    state = adaptjax.abstract_state(model, tx, mesh, sharding=adaptjax.FSDP(min_size=16))
    assert state.params["up"]["kernel"].sharding.spec == P("fsdp", "model")
    assert state.params["down"]["kernel"].sharding.spec == P("model", "fsdp")
    assert state.params["up"]["bias"].sharding.spec == P(("fsdp", "model"))  # not annotated
    assert state.opt_state[0].mu["down"]["kernel"].sharding.spec == P("model", "fsdp")
    # the annotation names "model": a mesh without it says so, naming the leaf
    with pytest.raises(ValueError) as e:
        adaptjax.abstract_state(model, tx, adaptjax.make_mesh({"data": 2, "fsdp": 4}))
    assert "['down']['kernel']" in one_line(e) and "'model'" in one_line(e)


def specs(**given):
    return {"w1": P(), "b1": P(), "w2": P(), "w3": P(), "s": P(), **given}


@pytest.mark.parametrize(
    ("sharding", "words"),
    [
        (specs(w1=P("model")), "['w1'] names axis 'model'"),
        (specs(w1=P("data")), "replica axis 'data'"),
        (specs(s=P("fsdp")), "parameter ['s'] of shape (4,) cannot be split over ('fsdp',)"),
        (specs(w1=P(None, None, "fsdp")), "3 entries"),
        ({"w1": P()}, "sharding= must be"),
    ],
)
def test_bad_specs_name_the_leaf(sharding, words):
    mesh = adaptjax.make_mesh({"data": 1, "fsdp": 8})
    tx = optax.chain(adaptjax.sync_gradients("data"), optax.adam(0.1))
    with pytest.raises(ValueError) as e:
        adaptjax.init_state(mlp(), tx, mesh, sharding=sharding)
    assert words in one_line(e)
    with pytest.raises(ValueError) as e:
        adaptjax.data_parallel_step(loss, tx, mesh, sharding=sharding).lower(
            adaptjax.abstract_state(mlp(), tx, mesh), BATCHES[0]
        )
    assert words in one_line(e)


def test_every_device_holds_one_fsdp_share_of_a_sharded_leaf():
    mesh = adaptjax.make_mesh({"data": 2, "fsdp": 4})
    tx = adaptjax.sync.sync_chain(optax.adam(0.1), adaptjax.sync.DiLoCo(H=2))
    state = adaptjax.init_state(mlp(), tx, mesh, sharding=RULE)
    local = adaptjax.sync._strategy.find_model_sync(state.opt_state).local.value
    adam = state.opt_state[1].value[0]
    for name in ("w1", "b1", "w2", "w3"):
        for leaf, replicas in [(state.params[name], 1), (adam.mu[name], 2), (local[name], 2)]:
            shards = leaf.addressable_shards
            assert len(shards) == 8
            for shard in shards:  # 1/fsdp of a replica's copy, never the whole leaf
                assert shard.data.size * 4 * replicas == leaf.size
    for shard in state.params["s"].addressable_shards:  # small: replicated
        assert shard.data.size == 4


# ------------------------------------------------------------------ steps


def test_dense_step_equals_on_every_mesh():
    tx = optax.chain(adaptjax.sync_gradients("data"), optax.adam(1e-2))
    ref, m_ref = train(8, tx)
    for shape in ({"data": 2, "fsdp": 4}, {"data": 1, "fsdp": 1}, {"data": 1, "fsdp": 8}, 1):
        state, m = train(shape, tx)
        assert_trees_close(state.params, ref.params, atol=2e-5)
        assert m["loss"] == pytest.approx(m_ref["loss"], rel=1e-5)
    assert state.step == 20 and state.nonfinite_count == 0


def test_noise_scale_equals_the_one_dimensional_estimate():
    # 8 gradient samples of 4 rows each in every run: 2 replicas x 4
    # micro-batches, 8 replicas, or 1 replica x 8 micro-batches (and 2 x 2 x 2).
    monitors = (adaptjax.GradientNoiseScale(), adaptjax.GradientSNR())
    tx = optax.chain(
        adaptjax.sync_gradients("data", monitors=monitors, norm_chunks=1), optax.adam(1e-2)
    )
    _, ref = train(8, tx, steps=6)
    runs = [({"data": 2, "fsdp": 4}, 4), (1, 8), ({"data": 1, "fsdp": 1}, 8)]
    for shape, k in runs:
        _, m = train(shape, tx, steps=6, microbatches=k)
        for name in ("noise_scale", "grad_sqnorm", "grad_variance", "grad_snr"):
            assert m[name] == pytest.approx(ref[name], rel=2e-5), (shape, name)
        assert m["noise_scale_valid"] == ref["noise_scale_valid"] == 1.0


def test_tensor_parallel_mesh_with_a_rule_function():
    tp = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model"), "w3": P(), "s": P()}
    mesh = adaptjax.make_mesh({"data": 2, "fsdp": 2, "model": 2})
    rule = lambda path, x: RULE.spec(x.shape, mesh, tp[path[0].key])
    specs = adaptjax.param_specs(mlp(), mesh, sharding=rule)
    assert specs["w1"] == P("fsdp", "model") and specs["w2"] == P("model", "fsdp")
    tx = optax.chain(
        adaptjax.sync_gradients("data", monitors=(adaptjax.GradientNoiseScale(),), norm_chunks=1),
        optax.adam(1e-2),
    )
    ref, m_ref = train(8, tx, steps=4)
    state, m = train({"data": 2, "fsdp": 2, "model": 2}, tx, steps=4, microbatches=4, sharding=rule)
    assert_trees_close(state.params, ref.params, atol=1e-5)
    assert m["noise_scale"] == pytest.approx(m_ref["noise_scale"], rel=2e-5)


def test_diloco_equals_with_the_same_replicas():
    # DiLoCo keeps a model per replica: the same 2 replicas, laid out 3 ways.
    strategy = adaptjax.sync.DiLoCo(H=4)
    tx = adaptjax.sync.sync_chain(optax.adam(1e-2), strategy)
    ref, _ = train(2, tx, sync=strategy)
    for shape in ({"data": 2, "fsdp": 4}, {"data": 2, "fsdp": 1}):
        state, _ = train(shape, tx, sync=strategy)
        assert_trees_close(state.params, ref.params, atol=2e-5)
        assert_trees_close(state.opt_state, ref.opt_state, atol=2e-5)


@pytest.mark.parametrize(
    "strategy",
    [adaptjax.sync.ModelAveraging(), adaptjax.sync.LocalSGD(H=2), adaptjax.sync.Gossip("ring")],
    ids=repr,
)
def test_every_strategy_runs_sharded(strategy):
    tx = adaptjax.sync.sync_chain(optax.adam(1e-2), strategy)
    ref, _ = train(2, tx, steps=4, sync=strategy)
    state, _ = train({"data": 2, "fsdp": 4}, tx, steps=4, sync=strategy)
    assert_trees_close(state.opt_state, ref.opt_state, atol=1e-5)


def test_batch_not_divisible_by_the_data_axis_raises_before_compiling():
    mesh = adaptjax.make_mesh({"data": 2, "fsdp": 4})
    tx = optax.chain(adaptjax.sync_gradients("data"), optax.sgd(0.1))
    step = adaptjax.data_parallel_step(loss, tx, mesh, microbatches=2, sharding=RULE)
    state = adaptjax.init_state(mlp(), tx, mesh, sharding=RULE)
    with pytest.raises(ValueError) as e:
        step(state, {k: v[:6] for k, v in BATCHES[0].items()})
    assert "multiple of 4" in one_line(e)
    assert step.jitted._cache_size() == 0


# ------------------------------------------------------------------ norms, codecs, wire


def test_norm_over_shards_is_one_scalar_all_reduce():
    mesh = adaptjax.make_mesh({"data": 2, "fsdp": 4})
    params = mlp()
    layout = ShardLayout.of(params, mesh, sharding=RULE)
    specs = adaptjax.param_specs(params, mesh, sharding=RULE)
    placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    norm = jax.jit(layout.sq_norm)
    expected = sum(float(np.sum(np.square(x))) for x in jax.tree.leaves(params))
    assert float(norm(placed)) == pytest.approx(expected, rel=1e-6)
    report = adaptjax.wire_bytes(norm, placed)
    assert [(c.kind, c.shape, c.axes) for c in report.collectives] == [
        ("all-reduce", (), ("fsdp",))
    ]


@pytest.mark.parametrize(
    "codec",
    [
        ajc.onebit(error_feedback=True, block=32, min_size=8),
        ajc.topk(0.25, error_feedback=True, min_size=8),
    ],
    ids=["onebit", "topk"],
)
def test_codec_compresses_each_shard_over_data(codec):
    # The sharded sync equals the codec run on each fsdp position's shards
    # alone, over the 2 replicas of a 1-D mesh (a top-k keeps k per shard).
    grads = [jax.tree.map(lambda x, i=i: x * (1 + i) + 0.01 * i, mlp()) for i in range(2)]
    mesh = adaptjax.make_mesh({"data": 2, "fsdp": 4})
    layout = ShardLayout.of(grads[0], mesh, sharding=RULE)
    specs = adaptjax.param_specs(grads[0], mesh, sharding=RULE)
    stacked = jax.tree.map(lambda *g: jnp.stack(g), *grads)
    on = lambda spec: NamedSharding(mesh, P("data", *spec))
    stacked = jax.device_put(stacked, jax.tree.map(on, specs))
    state = stack_replicas(codec.init(grads[0]), 2)
    state = jax.device_put(
        state, state_shardings(state, mesh, params=grads[0], param_specs=specs)
    )

    def sharded(g, s):
        s = adaptjax.sync.to_local(s)
        mean, s = codec_sync(
            codec,
            jax.tree.map(lambda x: x[0], g),
            s,
            axis_name="data",
            step=jnp.int32(0),
            layout=layout,
        )
        return mean, adaptjax.sync.to_global(s)

    s_specs = state_partition_specs(state)
    f = jax.jit(
        jax.shard_map(
            sharded,
            mesh=mesh,
            in_specs=(P("data"), s_specs),
            out_specs=(P(), s_specs),
            axis_names={"data"},
            check_vma=False,
        )
    )
    outs = []
    for _ in range(3):  # error feedback carries residuals from step to step
        mean, state = f(stacked, state)
        outs.append(jax.device_get(mean))

    ref_mesh = adaptjax.make_mesh(2)
    for j in range(4):  # fsdp position j: its shard of every sharded leaf, the rest whole

        def cut(x, s, j=j):
            return x if not s else np.split(np.asarray(x), 4, axis=list(s).index("fsdp"))[j]

        local = [jax.tree.map(cut, g, specs) for g in grads]
        s = stack_replicas(codec.init(local[0]), 2)
        s_specs1 = state_partition_specs(s)

        def one(g, s):
            mean, s = codec.sync(
                jax.tree.map(lambda x: x[0], g),
                adaptjax.sync.to_local(s),
                axis_name="data",
                step=jnp.int32(0),
            )
            return mean, adaptjax.sync.to_global(s)

        g1 = jax.tree.map(lambda *g: jnp.stack(g), *local)
        f1 = jax.jit(
            jax.shard_map(
                one,
                mesh=ref_mesh,
                in_specs=(P("data"), s_specs1),
                out_specs=(P(), s_specs1),
                check_vma=False,
            )
        )
        for t in range(3):
            mean1, s = f1(g1, s)
            want = jax.tree.map(cut, outs[t], specs)
            assert_trees_close(mean1, want, atol=1e-6)


def test_codec_whose_state_is_not_split_like_the_gradients_falls_back_to_bf16():
    # PowerSGD's factors are shaped by whole leaves: on a sharded mesh its gradients
    # go in the bfloat16 lane (one warning), the same sums and division as the dense
    # lane with wire_dtype=bfloat16, so the params are those of that run exactly,
    # and the codec's state (its factors, its residuals) is what init made it
    codec = ajc.powersgd(rank=2, min_size=64)
    tx = optax.chain(adaptjax.sync_gradients("data", codec=codec, monitors=()),
                     optax.sgd(0.1))
    with pytest.warns(UserWarning) as caught:
        state, _ = train({"data": 2, "fsdp": 4}, tx, steps=3)
    messages = {str(w.message) for w in caught}
    assert len(messages) == 1 and "\n" not in next(iter(messages))
    assert "'powersgd' cannot run on each shard" in next(iter(messages))
    assert "travel as bfloat16 instead" in next(iter(messages))
    bf16 = optax.chain(
        adaptjax.sync_gradients("data", wire_dtype=jnp.bfloat16, monitors=()), optax.sgd(0.1))
    expected, _ = train({"data": 2, "fsdp": 4}, bf16, steps=3)
    for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    mesh = adaptjax.make_mesh({"data": 2, "fsdp": 4})
    fresh = jax.device_get(adaptjax.init_state(mlp(), tx, mesh, sharding=RULE))
    for x, y in zip(jax.tree.leaves(state.opt_state[0].codec_state),
                    jax.tree.leaves(fresh.opt_state[0].codec_state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_codec_plans_each_shard_as_a_leaf():
    # min_size 64: b1 (64) has a residual as a whole leaf, but its shards (16)
    # go in the exact float32 lane; the unused residual stays as it was.
    codec = ajc.onebit(error_feedback=True, min_size=64)
    tx = optax.chain(adaptjax.sync_gradients("data", codec=codec), optax.sgd(0.1))
    state, _ = train({"data": 2, "fsdp": 4}, tx, steps=3)
    residuals = state.opt_state[0].codec_state.worker.value["ef"]
    assert not np.any(residuals["b1"]) and np.any(residuals["w1"])


@pytest.mark.filterwarnings("ignore:onebit.*trains worse than dense sync:UserWarning")
@pytest.mark.parametrize("codec", [ajc.onebit(error_feedback=True, min_size=16), None])
def test_sharded_step_wire_bytes_by_axis(codec):
    # (with a codec, the monitors' exact sample would be the whole of this small model)
    monitors = (adaptjax.GradientNoiseScale(),) if codec is None else ()
    tx = optax.chain(
        adaptjax.sync_gradients("data", codec=codec, monitors=monitors), optax.adam(1e-2)
    )
    mesh = adaptjax.make_mesh({"data": 2, "fsdp": 4})
    step = adaptjax.data_parallel_step(loss, tx, mesh, sharding=RULE)
    state = adaptjax.init_state(mlp(), tx, mesh, sharding=RULE)
    report = adaptjax.wire_bytes(step, state, BATCHES[0])
    by_axis = report.axis_totals
    assert set(by_axis) <= {"data", "fsdp"}
    assert report.kind_totals("fsdp").get("all-gather", 0) > 0  # weights gathered for use
    shard_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params))
    dense = 2 * (2 - 1) / 2 * shard_bytes  # a ring all-reduce of each device's shards
    if codec is None:  # the gradients' shards, the guard's and monitors' scalars
        assert dense <= by_axis["data"] <= dense + 64
    else:  # compressed: well under the dense shards
        assert by_axis["data"] < 0.5 * dense
    assert by_axis["data"] + by_axis["fsdp"] == pytest.approx(report.total)


def test_differencing_monitor_needs_whole_gradients():
    mesh = adaptjax.make_mesh({"data": 1, "fsdp": 8})
    monitors = (adaptjax.GradientNoiseScale(differencing=True),)
    tx = optax.chain(adaptjax.sync_gradients("data", monitors=monitors), optax.sgd(0.1))
    step = adaptjax.data_parallel_step(loss, tx, mesh, sharding=RULE)
    with pytest.raises(ValueError) as e:
        step.lower(adaptjax.abstract_state(mlp(), tx, mesh, sharding=RULE), BATCHES[0])
    assert "need whole gradients" in one_line(e)


@pytest.mark.parametrize(
    ("groups", "axes"),
    [
        ("[2,4]<=[8]", ("fsdp",)),
        ("[4,2]<=[2,4]T(1,0)", ("data",)),
        ("{{0,4},{1,5},{2,6},{3,7}}", ("data",)),
        ("{{0,1,4,5},{2,3,6,7}}", ("data", "fsdp")),
        ("[1,8]<=[8]", ("data", "fsdp")),
        ("mesh['a'=2,'b'=4] {'b'}", ("fsdp",)),
        ("mesh['x'=8] {'x':(2)4}", ("fsdp",)),
        ("mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}", ("fsdp",)),
    ],
)
def test_collective_axes_from_replica_groups(groups, axes):
    from adaptjax._wire import parse_collectives

    text = (
        "HloModule m, num_partitions=8\nENTRY e {\n  p = f32[100]{0} parameter(0)\n"
        f"  ROOT s = f32[100]{{0}} all-reduce(p), channel_id=1, replica_groups={groups},"
        " use_global_device_ids=true, to_apply=add\n}"
    )
    (c,) = parse_collectives(text, mesh_axes={"data": 2, "fsdp": 4})
    assert c.axes == axes


@pytest.mark.parametrize(
    "kwargs",
    [{"dense_lane": "reduce-scatter+all-gather"}, {"monitor_every": 2}],
    ids=["rs+ag", "monitor_every"],
)
def test_sync_options_on_a_sharded_mesh(kwargs):
    monitors = (adaptjax.GradientNoiseScale(),)
    tx = optax.chain(
        adaptjax.sync_gradients("data", monitors=monitors, norm_chunks=1, **kwargs),
        optax.adam(1e-2),
    )
    ref, m_ref = train(8, tx, steps=3)
    state, m = train({"data": 2, "fsdp": 4}, tx, steps=3, microbatches=4)
    assert_trees_close(state.params, ref.params, atol=1e-5)
    assert m["noise_scale"] == pytest.approx(m_ref["noise_scale"], rel=2e-5)


def test_bf16_wire_on_a_sharded_mesh():
    # bf16 on the wire: each device's shard, summed over the 2 replicas
    tx = optax.chain(adaptjax.sync_gradients("data", wire_dtype=jnp.bfloat16), optax.sgd(0.1))
    ref, _ = train(2, tx, steps=2)
    state, _ = train({"data": 2, "fsdp": 4}, tx, steps=2)
    assert_trees_close(state.params, ref.params, atol=1e-6)
