"""Tests for adaptjax.wire_bytes: collective bytes read from the compiled HLO.

Every expected value comes from the ring formulas, with N the group size and S the
per-device operand bytes: all-reduce 2(N-1)/N*S, all-gather (N-1)*S, all-to-all and
reduce-scatter (N-1)/N*S, collective-permute S.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import adaptjax
from adaptjax import Collective, wire_bytes
from adaptjax._wire import WireReport, parse_collectives

F32, BF16 = 4, 2  # bytes per element


def all_reduce(n, s):
    return 2 * (n - 1) / n * s


def all_gather(n, s):
    return (n - 1) * s


def all_to_all(n, s):
    return (n - 1) / n * s


reduce_scatter = all_to_all


def sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) >= 8, "tests/conftest.py must give 8 simulated devices"
    return Mesh(np.array(jax.devices()[:8]), ("d",))


def smap(fn, mesh, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def only(report, kind):
    found = [c for c in report.collectives if c.kind == kind]
    assert len(found) == 1, str(report)
    return found[0]


# --------------------------------------------------------------------------------------
# Compiled programs on 8 simulated CPU devices
# --------------------------------------------------------------------------------------


def test_psum_f32_on_8_devices(mesh):
    f = smap(lambda x: lax.psum(x, "d"), mesh, P("d"), P())
    report = wire_bytes(f, sds((8 * 1000,)))
    c = only(report, "all-reduce")
    assert (c.dtype, c.shape, c.elements, c.group_size) == ("f32", (1000,), 1000, 8)
    assert c.bytes == pytest.approx(all_reduce(8, 1000 * F32))  # 2*7/8*4000 = 7000
    assert report.total == pytest.approx(all_reduce(8, 1000 * F32))
    assert report.compiled_total == report.total
    assert not c.widened
    assert isinstance(report, WireReport) and isinstance(c, Collective)
    assert report.num_devices == 8


def test_psum_on_a_subset_of_devices():
    sub = Mesh(np.array(jax.devices()[:4]), ("d",))
    f = smap(lambda x: lax.psum(x, "d"), sub, P("d"), P())
    report = wire_bytes(f, sds((4 * 1000,)))
    c = only(report, "all-reduce")
    assert c.group_size == 4
    assert report.total == pytest.approx(all_reduce(4, 1000 * F32))


def test_psum_accepts_concrete_arrays(mesh):
    f = smap(lambda x: lax.psum(x, "d"), mesh, P("d"), P())
    report = wire_bytes(f, jnp.ones((8 * 10,), jnp.float32))
    assert report.total == pytest.approx(all_reduce(8, 10 * F32))


def test_pmean_bf16_reports_program_dtype_despite_widening(mesh):
    f = smap(lambda x: lax.pmean(x, "d"), mesh, P("d"), P())
    report = wire_bytes(f, sds((8 * 1000,), jnp.bfloat16))
    c = only(report, "all-reduce")
    assert c.dtype == "bf16"
    assert c.bytes == pytest.approx(all_reduce(8, 1000 * BF16))
    compiled_item = {"f32": F32, "bf16": BF16}[c.compiled_dtype]
    assert c.compiled_bytes == pytest.approx(all_reduce(8, 1000 * compiled_item))
    if jax.default_backend() == "cpu":  # XLA:CPU runs bf16 all-reduces in f32
        assert c.compiled_dtype == "f32" and c.widened
        assert report.compiled_total == pytest.approx(2 * report.total)
    f32 = wire_bytes(f, sds((8 * 1000,), jnp.float32))
    assert report.total == pytest.approx(f32.total / 2)


def test_all_gather(mesh):
    f = smap(lambda x: lax.all_gather(x, "d", tiled=True), mesh, P("d"), P("d"))
    report = wire_bytes(f, sds((8 * 125,)))
    c = only(report, "all-gather")
    assert c.shape == (125,) and c.group_size == 8
    assert report.total == pytest.approx(all_gather(8, 125 * F32))  # 7 * 500


def test_all_gather_bf16_is_widened_on_cpu_but_reported_at_bf16(mesh):
    f = smap(lambda x: lax.all_gather(x, "d", tiled=True), mesh, P("d"), P("d"))
    c = only(wire_bytes(f, sds((8 * 125,), jnp.bfloat16)), "all-gather")
    assert c.dtype == "bf16"
    assert c.bytes == pytest.approx(all_gather(8, 125 * BF16))


def test_all_to_all(mesh):
    f = smap(lambda x: lax.all_to_all(x, "d", 0, 0, tiled=True), mesh, P("d"), P("d"))
    report = wire_bytes(f, sds((8 * 64,)))
    c = only(report, "all-to-all")
    assert c.elements == 64 and c.group_size == 8
    assert report.total == pytest.approx(all_to_all(8, 64 * F32))
    bf16 = only(wire_bytes(f, sds((8 * 64,), jnp.bfloat16)), "all-to-all")
    assert bf16.dtype == "bf16"
    assert bf16.bytes == pytest.approx(all_to_all(8, 64 * BF16))


def test_psum_scatter(mesh):
    f = smap(lambda x: lax.psum_scatter(x, "d", tiled=True), mesh, P("d"), P("d"))
    report = wire_bytes(f, sds((8 * 64,)))
    c = only(report, "reduce-scatter")
    assert c.shape == (64,) and c.group_size == 8  # the full per-device operand
    assert report.total == pytest.approx(reduce_scatter(8, 64 * F32))


def test_tuple_psum_counts_every_operand_once(mesh):
    f = smap(lambda x, y: lax.psum((x, y), "d"), mesh, (P("d"), P("d")), (P(), P()))
    report = wire_bytes(f, sds((8 * 10,)), sds((8 * 2, 8), jnp.bfloat16))
    assert report.count("all-reduce") >= 1
    assert sum(c.elements for c in report.collectives) == 10 + 2 * 8
    assert sorted(d for c in report.collectives for d in c.operand_dtypes) == ["bf16", "f32"]
    # Linear in S, so the total is the same whether or not XLA combined them.
    assert report.total == pytest.approx(all_reduce(8, 10 * F32 + 16 * BF16))


def test_two_bf16_psums_combined_by_xla_stay_bf16(mesh):
    f = smap(
        lambda x, y: (lax.psum(x, "d"), lax.psum(2 * y, "d")),
        mesh,
        (P("d"), P("d")),
        (P(), P()),
    )
    report = wire_bytes(f, sds((8 * 10,), jnp.bfloat16), sds((8 * 20,), jnp.bfloat16))
    assert all(c.dtype == "bf16" for c in report.collectives)
    assert report.total == pytest.approx(all_reduce(8, 30 * BF16))


def test_ppermute(mesh):
    ring = [(i, (i + 1) % 8) for i in range(8)]
    f = smap(lambda x: lax.ppermute(x, "d", ring), mesh, P("d"), P("d"))
    report = wire_bytes(f, sds((8 * 10,)))
    assert only(report, "collective-permute").bytes == pytest.approx(10 * F32)


def test_2d_mesh_psum_over_one_axis():
    mesh2 = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    x = sds((8, 40))  # per device (4, 10)
    over_b = jax.jit(
        jax.shard_map(
            lambda v: lax.psum(v, "b"), mesh=mesh2, in_specs=P("a", "b"), out_specs=P("a")
        )
    )
    c = only(wire_bytes(over_b, x), "all-reduce")
    assert c.group_size == 4 and c.shape == (4, 10)
    assert c.bytes == pytest.approx(all_reduce(4, 40 * F32))
    over_a = jax.jit(
        jax.shard_map(
            lambda v: lax.psum(v, "a"), mesh=mesh2, in_specs=P("a", "b"), out_specs=P(None, "b")
        )
    )
    c = only(wire_bytes(over_a, x), "all-reduce")
    assert c.group_size == 2
    assert c.bytes == pytest.approx(all_reduce(2, 40 * F32))


def test_auto_sharded_bf16_reduction_is_reported_at_bf16(mesh):
    # No collective in the program text: the SPMD partitioner inserts it, and
    # XLA:CPU widens it (renaming its reduction "*_promoted").
    @jax.jit
    def total(x):
        return lax.reduce(x, jnp.bfloat16(0), lax.add, (0,))

    x = jax.ShapeDtypeStruct((8, 100), jnp.bfloat16, sharding=NamedSharding(mesh, P("d")))
    c = only(wire_bytes(total, x), "all-reduce")
    assert c.dtype == "bf16" and c.group_size == 8
    assert c.bytes == pytest.approx(all_reduce(8, 100 * BF16))

    # jnp.sum of bf16 accumulates in f32 in the program itself: that is not widening.
    @jax.jit
    def jnp_total(x):
        return jnp.sum(x, axis=0)

    c = only(wire_bytes(jnp_total, x), "all-reduce")
    assert c.dtype == "f32" and not c.widened
    assert c.bytes == pytest.approx(all_reduce(8, 100 * F32))


def test_no_collectives_total_zero():
    report = wire_bytes(jax.jit(lambda x: 2 * x + 1), sds((16,)))
    assert report.collectives == ()
    assert report.total == 0 and report.compiled_total == 0
    assert report.count() == 0
    assert "0 collective(s)" in str(report)
    with pytest.raises(ValueError, match=r"no collectives: check report.count\(\) first"):
        report.largest()


def test_lowered_and_compiled_inputs(mesh):
    f = smap(lambda x: lax.psum(x, "d"), mesh, P("d"), P())
    lowered = f.lower(sds((8 * 10,)))
    expected = all_reduce(8, 10 * F32)
    assert wire_bytes(lowered).total == pytest.approx(expected)
    assert wire_bytes(lowered.compile()).total == pytest.approx(expected)
    with pytest.raises(ValueError, match=r"already lowered: call wire_bytes\(lowered\) with no"):
        wire_bytes(lowered, sds((8 * 10,)))
    with pytest.raises(ValueError, match=r"already compiled: call wire_bytes\(compiled\) with"):
        wire_bytes(lowered.compile(), sds((8 * 10,)))


def test_plain_function_error():
    def step(x):
        return x

    with pytest.raises(ValueError, match=r"needs a jitted function, got 'step': wrap it in jax"):
        wire_bytes(step, jnp.ones(3))


def test_report_helpers_and_table(mesh):
    def fn(x, y):
        return lax.psum(x, "d"), lax.all_gather(y, "d", tiled=True)

    f = smap(fn, mesh, (P("d"), P("d")), (P(), P("d")))
    report = wire_bytes(f, sds((8 * 1000,)), sds((8 * 3,)))
    big, small = all_reduce(8, 1000 * F32), all_gather(8, 3 * F32)
    assert report.total == pytest.approx(big + small)
    assert report.count() == 2
    assert report.count("all-reduce") == 1 and report.count("all-gather") == 1
    assert report.count("all-to-all") == 0
    assert report.count(min_bytes=small + 1) == 1
    assert report.largest().kind == "all-reduce"
    text = str(report)
    assert text.splitlines()[0].startswith("WireReport: 2 collective(s)")
    assert "all-reduce" in text and "all-gather" in text and f"{big:,.0f}" in text
    with pytest.raises(ValueError, match=r"unknown collective kind 'allreduce': use one of"):
        report.count("allreduce")
    with pytest.raises(ValueError, match=r"min_bytes must be >= 0, got -1"):
        report.count(min_bytes=-1)


def test_public_names():
    assert {"wire_bytes", "Collective"} <= set(adaptjax.__all__)


# --------------------------------------------------------------------------------------
# Handwritten HLO
# --------------------------------------------------------------------------------------

ADD = "add {\n  a = f32[] parameter(0)\n  b = f32[] parameter(1)\n  ROOT c = f32[] add(a, b)\n}\n"


def module(body, header="HloModule m, num_partitions=8"):
    return f"{header}\n\n{ADD}\nENTRY e {{\n{body}\n}}\n"


def test_async_all_reduce_start_done_counted_once():
    text = module(
        "  p = f32[1000]{0} parameter(0)\n"
        "  s = f32[1000]{0} all-reduce-start(p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}},"
        " use_global_device_ids=true, to_apply=add\n"
        "  ROOT d = f32[1000]{0} all-reduce-done(s)"
    )
    (c,) = parse_collectives(text)
    assert c.kind == "all-reduce" and c.is_async and c.name == "s"
    assert c.bytes == pytest.approx(all_reduce(8, 1000 * F32))


def test_async_tuple_all_reduce_start():
    text = module(
        "  p = f32[10]{0} parameter(0)\n  q = bf16[4,4]{1,0} parameter(1)\n"
        "  s = (f32[10]{0}, bf16[4,4]{1,0}) all-reduce-start(p, q), channel_id=1,"
        " replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=add\n"
        "  ROOT d = (f32[10]{0}, bf16[4,4]{1,0}) all-reduce-done(s)"
    )
    (c,) = parse_collectives(text)
    assert c.shape == ((10,), (4, 4)) and c.num_operands == 2 and c.dtype == "f32,bf16"
    assert c.group_size == 4
    assert c.bytes == pytest.approx(all_reduce(4, 10 * F32 + 16 * BF16))


def test_async_all_gather_and_permute_start_use_their_operands():
    text = module(
        "  p = f32[125]{0} parameter(0)\n"
        "  g = (f32[125]{0}, f32[1000]{0}) all-gather-start(p), channel_id=1,"
        " replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true\n"
        "  h = f32[1000]{0} all-gather-done(g)\n"
        "  c = (f32[125]{0}, f32[125]{0}, u32[], u32[]) collective-permute-start(p),"
        " channel_id=2, source_target_pairs={{0,1},{1,0}}\n"
        "  ROOT e = f32[125]{0} collective-permute-done(c)"
    )
    gather, permute = parse_collectives(text)
    assert gather.kind == "all-gather" and gather.shape == (125,)
    assert gather.bytes == pytest.approx(all_gather(8, 125 * F32))
    assert permute.kind == "collective-permute" and permute.group_size == 2
    assert permute.bytes == pytest.approx(125 * F32)


def test_async_wrapped_reduce_scatter_start():
    text = module(
        "  p = f32[64]{0} parameter(0)\n"
        "  s = ((f32[64]{0}), f32[8]{0}) reduce-scatter-start(p), channel_id=1,"
        " replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, dimensions={0},"
        " to_apply=add\n"
        "  ROOT d = f32[8]{0} reduce-scatter-done(s)"
    )
    (c,) = parse_collectives(text)
    assert c.shape == (64,)
    assert c.bytes == pytest.approx(reduce_scatter(8, 64 * F32))


def test_iota_replica_groups_with_transpose():
    text = module(
        "  p = f32[2,50]{1,0} parameter(0)\n"
        "  ROOT s = f32[2,50]{1,0} all-reduce(p), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0),"
        " use_global_device_ids=true, to_apply=add"
    )
    (c,) = parse_collectives(text)
    assert c.group_size == 4 and c.shape == (2, 50)
    assert c.bytes == pytest.approx(all_reduce(4, 100 * F32))


def test_explicit_groups_and_mesh_axes_groups():
    body = (
        "  p = f32[100]{0} parameter(0)\n"
        "  ROOT s = f32[100]{0} all-reduce(p), channel_id=1, replica_groups={GROUPS},"
        " use_global_device_ids=true, to_apply=add"
    )
    cases = {
        "{{0,1,2,3},{4,5,6,7}}": 4,
        "{{0,4},{1,5},{2,6},{3,7}}": 2,
        "mesh['a'=2,'b'=4] {'b'}": 4,
        "mesh['a'=2,'b'=4] {'a','b'}": 8,
        "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}": 4,
        "mesh['x'=8] {'x':(2)4}": 4,
    }
    for groups, n in cases.items():
        (c,) = parse_collectives(module(body.replace("{GROUPS}", groups)))
        assert c.group_size == n, groups
        assert c.bytes == pytest.approx(all_reduce(n, 100 * F32)), groups


def test_empty_replica_groups_mean_all_devices():
    gather = (
        "  p = f32[10]{0} parameter(0)\n"
        "  ROOT g = f32[{R}]{0} all-gather(p), channel_id=1, replica_groups={}, dimensions={0}"
    )
    # Cross-partition form (channel id, no global ids): N = num_partitions.
    (c,) = parse_collectives(module(gather.replace("{R}", "80")))
    assert c.group_size == 8 and c.shape == (10,)
    assert c.bytes == pytest.approx(all_gather(8, 10 * F32))
    # Cross-replica form (no channel id): N = replica_count.
    reduce = (
        "  p = f32[10]{0} parameter(0)\n"
        "  ROOT s = f32[10]{0} all-reduce(p), replica_groups={}, to_apply=add"
    )
    (c,) = parse_collectives(module(reduce, header="HloModule m, replica_count=4"))
    assert c.group_size == 4
    assert c.bytes == pytest.approx(all_reduce(4, 10 * F32))
    # No header counts: num_devices says.
    (c,) = parse_collectives(module(reduce, header="HloModule m"), num_devices=2)
    assert c.group_size == 2
    assert c.bytes == pytest.approx(all_reduce(2, 10 * F32))
    with pytest.raises(ValueError, match=r"replica_groups=\{\} means every device, but the HLO"):
        parse_collectives(module(reduce, header="HloModule m"))


def test_scalar_layouts_index_comments_and_singleton_groups():
    text = module(
        "  p = f32[]{:T(128)} parameter(0)\n"
        "  q = f32[4,4]{1,0} parameter(1)\n"
        "  s = (f32[], f32[4,4]{1,0}, /*index=2*/s8[8]{0}) all-reduce(p, q, q), channel_id=1,"
        " replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=add\n"
        "  ROOT t = f32[4,4]{1,0} all-reduce(q), channel_id=2, replica_groups={{0},{1},{2},{3}},"
        " use_global_device_ids=true, to_apply=add"
    )
    combined, single = parse_collectives(text)
    assert combined.shape == ((), (4, 4), (8,)) and combined.elements == 1 + 16 + 8
    assert combined.dtype == "f32,s8"
    assert combined.bytes == pytest.approx(all_reduce(8, 1 * F32 + 16 * F32 + 8 * 1))
    assert single.group_size == 1 and single.bytes == 0


def test_widening_read_from_the_program_text():
    program = module(
        "  p = bf16[10]{0} parameter(0)\n  q = bf16[20]{0} parameter(1)\n"
        "  r = f32[20]{0} parameter(2)\n"
        "  a = bf16[10]{0} all-reduce(p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}},"
        " use_global_device_ids=true, to_apply=add\n"
        "  b = bf16[20]{0} all-reduce(q), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}},"
        " use_global_device_ids=true, to_apply=add\n"
        "  ROOT c = f32[20]{0} all-reduce(r), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}},"
        " use_global_device_ids=true, to_apply=add"
    )
    compiled = module(
        "  p = f32[10]{0} parameter(0)\n  q = f32[20]{0} parameter(1)\n"
        "  r = f32[20]{0} parameter(2)\n"
        "  ROOT s = (f32[10]{0}, f32[20]{0}, f32[20]{0}) all-reduce(p, q, r), channel_id=1,"
        " replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=add"
    )
    (plain,) = parse_collectives(compiled)
    assert plain.dtype == "f32" and not plain.widened
    (c,) = parse_collectives(compiled, program_text=program)
    assert sorted(c.operand_dtypes) == ["bf16", "bf16", "f32"]
    assert c.dtype in ("bf16,f32", "f32,bf16") and c.compiled_dtype == "f32" and c.widened
    assert c.bytes == pytest.approx(all_reduce(8, 30 * BF16 + 20 * F32))
    assert c.compiled_bytes == pytest.approx(all_reduce(8, 50 * F32))


def test_collective_inside_a_malformed_shape_is_an_error():
    text = module(
        "  p = f32[?]{0} parameter(0)\n"
        "  ROOT s = f32[?]{0} all-reduce(p), replica_groups={}, to_apply=add"
    )
    with pytest.raises(ValueError, match=r"cannot parse HLO shape in"):
        parse_collectives(text)


# --------------------------------------------------------------------------------------
# Branches of lax.cond / lax.switch: one runs per call (issue 10 item 4)
# --------------------------------------------------------------------------------------


def test_cond_branches_are_averaged_not_summed(mesh):
    n = 8

    def f(x, s):
        always = lax.psum(x[:5], "d").sum()
        return always + lax.cond(
            s[0] % 2 == 0, lambda: lax.psum(x[:10], "d"), lambda: lax.psum(x[:20], "d")[:10]
        )

    report = wire_bytes(smap(f, mesh, (P("d"), P()), P()), sds((8 * 100,)), sds((1,), jnp.int32))
    always, true_b, false_b = (all_reduce(n, F32 * k) for k in (5, 10, 20))
    (name, branches), = report.conditionals
    assert branches == 2
    # lax.cond lowers to a conditional on int(pred): branch 0 is the false function
    assert report.branch_totals() == pytest.approx((always + false_b, always + true_b))
    assert report.total == pytest.approx(always + (true_b + false_b) / 2)
    assert report.max_total == pytest.approx(always + false_b)
    assert report.static_total == pytest.approx(always + true_b + false_b)
    assert sorted(c.branch for c in report.collectives) == [(), ((name, 0),), ((name, 1),)]
    assert "branch 0, 1" in str(report)


def test_the_nonfinite_guards_cond_counts_its_update_branch():
    # data_parallel_step runs the update (and its gradient all-reduce) inside
    # lax.cond(ok, update, skip): a step sends what the update sends, not half of it.
    n = 8
    mesh = adaptjax.make_mesh(n)
    tx = optax.chain(adaptjax.sync_gradients("data"), optax.sgd(0.1))
    params = {"w": jnp.zeros((1000,)), "b": jnp.zeros((24,))}
    batch = {"x": sds((8 * 2, 8)), "y": sds((8 * 2,))}

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"][:8] + p["b"][0] - b["y"]) ** 2)

    totals = {}
    for guard in (True, False):
        step = adaptjax.data_parallel_step(loss, tx, mesh, skip_nonfinite=guard)
        report = wire_bytes(step.jitted, adaptjax.abstract_state(params, tx, mesh), batch)
        assert report.conditionals == ()
        totals[guard] = report.total
    grads = all_reduce(n, F32 * 1024)
    assert totals[False] == pytest.approx(grads + all_reduce(n, F32))  # + the loss
    assert totals[True] == pytest.approx(grads + all_reduce(n, 2 * F32))  # + loss and |g|^2


def test_switch_with_a_branch_without_collectives_and_a_nested_cond(mesh):
    n = 8

    def f(x, s):
        def inner():
            return lax.cond(s[0] > 5, lambda: lax.psum(x[:40], "d")[:10], lambda: x[:10])

        return lax.switch(s[0] % 3, [lambda: lax.psum(x[:10], "d"), lambda: x[:10] * 2, inner])

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("d"), P()), out_specs=P(),
                               check_vma=False))
    report = wire_bytes(fn, sds((8 * 100,)), sds((1,), jnp.int32))
    b10, b40 = all_reduce(n, F32 * 10), all_reduce(n, F32 * 40)
    outer = next(name for name, k in report.conditionals if k == 3)
    # branch 2 holds a cond whose branches send 0 and b40: b40 / 2 on average
    assert report.branch_totals(outer) == pytest.approx((b10, 0.0, b40 / 2))
    assert report.total == pytest.approx((b10 + b40 / 2) / 3)
    assert report.max_total == pytest.approx(b40)
    with pytest.raises(ValueError, match="pass one of"):
        report.branch_totals()
