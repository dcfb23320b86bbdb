"""Buckets (CaSync): reverse leaf order, one exchange each, the results of one exchange.

A bucket's encode, collective and decode read only its own leaves, so XLA can
schedule its collective before the backward pass has finished; and a leaf's
seeds, blocks and owners are its own, so bucketing changes which collective
carries it and nothing else.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from adaptjax.compression._lanes import bucket_leaves
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import adaptjax
from adaptjax import compression as ajc
from adaptjax._per_replica import stack_replicas, state_partition_specs
from adaptjax._run_config import codec_key
from adaptjax.costs._schedule import buckets

# a: under min_size (the float32 psum); b: a small leaf of the codec's lane. In reverse
# leaf order (w, v, u, b) buckets of 8000 floats are [w], [v], [u, b]: three exchanges per
# lane, each of more than 5000 elements (so the bf16 lane takes owner-compute at N = 4
# for a bucket as for the whole lane).
SHAPES = {"a": (5,), "b": (1500,), "u": (96, 64), "v": (5001,), "w": (80, 64)}
BUCKET = 4 * 8000
BIG = ("b", "u", "v", "w")


def _fn(codec, mesh, axis, state):
    specs = state_partition_specs(state, axis)

    def f(g, s, step):
        g = jax.tree.map(lambda x: x[0], g)
        out, s = codec.sync(g, adaptjax.sync.to_local(s), axis_name=axis, step=step)
        return out, adaptjax.sync.to_global(s)

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(axis), specs, P()),
                                 out_specs=(P(), specs), check_vma=False))


def _mesh(n, fast=None):
    devs = np.array(jax.devices()[:n])
    if fast is None:
        return Mesh(devs, ("data",)), "data"
    return Mesh(devs.reshape(n // fast, fast), ("slow", "fast")), ("slow", "fast")


def _state(codec, n):
    return stack_replicas(codec.init({k: jnp.zeros(s) for k, s in SHAPES.items()}), n)


def _run(codec, n, steps=2, fast=None, seed=0):
    """Outputs of ``steps`` syncs and the state after them."""
    mesh, axis = _mesh(n, fast)
    state = _state(codec, n)
    fn = _fn(codec, mesh, axis, state)
    rng = np.random.default_rng(seed)
    outs = []
    for t in range(steps):
        g = {k: rng.normal(size=(n, *s)).astype(np.float32) for k, s in SHAPES.items()}
        o, state = fn(g, state, jnp.int32(t))
        outs.append(jax.tree.map(np.asarray, o))
    return outs, jax.tree.map(np.asarray, state)


# Every codec and transport; block codecs pinned to a transport (None picks one per bucket
# by predicted time, which may differ between a small bucket and the whole lane).
CODECS = {
    "onebit/owner": (ajc.onebit(min_size=100, transport="owner"), 4, None),
    "onebit/allgather": (ajc.onebit(min_size=100, transport="allgather"), 4, None),
    "onebit-ef21": (ajc.onebit(min_size=100, error_feedback="ef21", transport="owner"), 4, None),
    "bf16+ef/owner": (ajc.bf16(min_size=100, error_feedback="ef14", transport="owner"), 4, None),
    "terngrad/owner": (ajc.terngrad(min_size=100, transport="owner"), 4, None),
    "qsgd+ef/allgather": (
        ajc.qsgd(min_size=100, error_feedback="ef14", transport="allgather"), 2, None),
    "natural/owner": (ajc.natural(min_size=100, transport="owner"), 4, None),
    "onebit-2level": (ajc.onebit(min_size=100, fast_axis="fast"), 8, 2),
    "topk/owner-routing": (ajc.topk(0.05, min_size=100), 4, None),
    "topk/allgather": (ajc.topk(0.05, min_size=100), 2, None),
    "topk->bf16 lane": (ajc.topk(0.3, min_size=100), 4, None),
    "dgc": (ajc.dgc(0.05, min_size=100), 4, None),
    # every warm-up stage is its own top-k per bucket (lax.switch), each compiled: two
    # stages (0.25, then the final 0.05), one step each, so both branches also run
    "dgc-warmup": pytest.param((ajc.dgc(0.05, min_size=100, warmup_steps=1,
                                        warmup_densities=(0.25,)), 4, None),
                               marks=pytest.mark.slow),
    "randomk+ef": (ajc.randomk(0.1, min_size=100, error_feedback="ef14"), 4, None),
    "powersgd": (ajc.powersgd(3, min_size=100), 4, None),
    "powersgd-alternate": (ajc.powersgd(3, min_size=100, alternate=True), 2, None),
}


@pytest.mark.parametrize("case", [CODECS[k] for k in sorted(CODECS)], ids=sorted(CODECS))
def test_bucketed_equals_one_exchange_per_lane(case):
    codec, n, fast = case
    one = _run(codec, n, fast=fast)
    many = _run(dataclasses.replace(codec, bucket_bytes=BUCKET), n, fast=fast)
    # outputs at every step, and every buffer of the state (per replica: residuals,
    # EF21 estimates, DGC velocities, PowerSGD factors)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many), strict=True):
        scale = max(1.0, float(np.abs(a).max()))
        np.testing.assert_allclose(b, a, rtol=0, atol=4 * np.finfo(np.float32).eps * scale)


def test_the_ef14_identity_holds_in_buckets():
    """Σ_t out_t + mean_i(e_i,T) = Σ_t mean_i(g_i,t): nothing is lost between buckets."""
    n, steps = 4, 3
    codec = ajc.onebit(min_size=100, bucket_bytes=BUCKET)  # each bucket's own transport
    outs, state = _run(codec, n, steps=steps, seed=3)
    rng = np.random.default_rng(3)
    mean = {k: np.zeros(s) for k, s in SHAPES.items()}
    for _ in range(steps):
        for k, s in SHAPES.items():
            mean[k] += rng.normal(size=(n, *s)).astype(np.float32).astype(np.float64).mean(0)
    for k in BIG:
        out = sum(np.asarray(o[k], np.float64) for o in outs)
        debt = np.asarray(state.worker.value["ef"][k], np.float64).mean(axis=0)
        tol = 5 * steps * np.finfo(np.float32).eps * max(np.abs(debt).max(), np.abs(out).max())
        np.testing.assert_allclose(out + debt, mean[k], atol=tol, rtol=0)
        assert np.abs(out - mean[k]).max() > 1e-3  # something was lost and is owed


@pytest.mark.parametrize("n", [2, 4])
def test_each_bucket_is_one_exchange_in_reverse_leaf_order(n):
    codec = ajc.qsgd(min_size=100, bucket_bytes=BUCKET, transport="owner")
    mesh, axis = _mesh(n)
    state = _state(codec, n)
    g = {k: jax.ShapeDtypeStruct((n, *s), jnp.float32) for k, s in SHAPES.items()}
    report = adaptjax.wire_bytes(_fn(codec, mesh, axis, state), g, state, jnp.int32(0))
    count = len(bucket_leaves([int(np.prod(SHAPES[k])) for k in reversed(BIG)], BUCKET))
    assert count == 3
    assert report.count("all-to-all") == count and report.count("all-gather") == count
    assert report.count("all-reduce") == 1  # the small leaf's float32 psum
    plan = ajc.plan({k: jnp.zeros(s) for k, s in SHAPES.items()}, codec, n, show=False)
    assert plan.buckets == 1 + count
    bucket_of = {r.path: r.bucket for r in plan.rows}
    # lanes in table order (f32 first), each lane's leaves from the last to the first
    assert [bucket_of[f"['{k}']"] for k in ("a", "w", "v", "u", "b")] == [0, 1, 2, 3, 3]
    assert str(plan).splitlines()[-1].startswith("4 exchanges of at most 32,000 float32 bytes")


def test_bucket_leaves_are_the_cost_models_buckets_of_whole_leaves():
    rng = np.random.default_rng(0)
    for _ in range(50):
        sizes = [int(s) for s in rng.integers(1, 5000, rng.integers(1, 8))]
        unit = int(rng.integers(5000, 9000))  # no leaf over a bucket: nothing to split
        got = [4.0 * sum(sizes[j] for j in b) for b in bucket_leaves(sizes, 4 * unit)]
        assert got == buckets([4 * s for s in sizes], 4 * unit)
        assert [j for b in bucket_leaves(sizes, 4 * unit) for j in b] == list(range(len(sizes)))
    # a leaf larger than a bucket is a bucket of its own, never split
    assert bucket_leaves([10, 3000, 10], 400) == [[0], [1], [2]]
    assert bucket_leaves([10, 20], None) == [[0, 1]]


@pytest.mark.parametrize("bad", [0, 6, -4, 2.5, True, "4096"])
@pytest.mark.parametrize("make", [ajc.onebit, ajc.topk, ajc.powersgd, ajc.randomk, ajc.dgc])
def test_bad_bucket_bytes_is_one_line(bad, make):
    with pytest.raises(ValueError, match=r"^bucket_bytes must be None or a positive multiple "
                                         r"of 4 \(bytes of float32 gradient per exchange\), "
                                         r"got .*; e\.g\. 4 << 20$"):
        make(bucket_bytes=bad)


def test_bucket_bytes_shows_in_the_key_only_when_set():
    assert "bucket_bytes" not in codec_key(ajc.topk())
    assert codec_key(ajc.topk(bucket_bytes=4096)) == "topk(0.01, bucket_bytes=4096)"
    assert ajc.powersgd(bucket_bytes=4096) != ajc.powersgd()


# ---------------------------------------------------------------- the schedule
LAYERS = (256, 512, 512, 256, 10)


def _entry_order(hlo: str) -> list[tuple[str, str, str]]:
    """(name, op, result type) of each instruction of the scheduled entry computation."""
    entry = hlo[hlo.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    out = []
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?(%\S+) = (\S+) ([\w-]+)\(", line)
        if m:
            out.append((m.group(1), m.group(3), m.group(2)))
    return out


def _compiled_step(codec):
    keys = jax.random.split(jax.random.key(0), len(LAYERS) - 1)
    params = [{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
              for k, a, b in zip(keys, LAYERS[:-1], LAYERS[1:], strict=True)]

    def loss(p, x):
        h = x
        for layer in p[:-1]:
            h = jax.nn.relu(h @ layer["w"] + layer["b"])
        return jnp.mean((h @ p[-1]["w"] + p[-1]["b"]) ** 2)

    state = codec.init(params)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))

    def step(p, x):
        g = jax.grad(loss)(jax.lax.pcast(p, "data", to="varying"), x)
        return codec.sync(g, state, axis_name="data")[0]

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                              check_vma=False))
    return f.lower(params, jnp.ones((16, LAYERS[0]))).compile().as_text()


def _first_collective_and_last_gradient(hlo):
    order = _entry_order(hlo)
    coll = [i for i, (_, op, _) in enumerate(order) if op in ("all-gather", "all-to-all")]
    # the first layer's weight gradient, f32[256,512]: the last gradient the backward
    # pass computes (the forward pass makes [8,512] activations, the codec (2,...) views)
    first_w = f"f32[{LAYERS[0]},{LAYERS[1]}]"
    grad = [i for i, (_, op, ty) in enumerate(order)
            if ty.startswith(first_w) and op in ("dot", "fusion", "custom-call")]
    return coll[0], grad[0], order


def test_the_first_buckets_collective_is_scheduled_before_the_last_backward_fusion():
    """XLA:CPU's scheduled HLO (is_scheduled=true): the entry computation's order."""
    bucketed = _compiled_step(ajc.onebit(min_size=100, bucket_bytes=4 << 10))
    assert "is_scheduled=true" in bucketed
    first, last_grad, order = _first_collective_and_last_gradient(bucketed)
    assert first < last_grad, (order[first], order[last_grad])
    # one exchange for the whole lane waits for every gradient, the first layer's too
    first, last_grad, _ = _first_collective_and_last_gradient(_compiled_step(ajc.onebit(
        min_size=100)))
    assert first > last_grad
