"""The transport of quantised payloads at two replicas: one all-gather instead of owner-compute.

Bytes per device for an encoded gradient of E bytes: owner-compute (all-to-all +
all-gather) 2(N-1)/N * E, one all-gather of the whole payload (N-1) * E; equal at N = 2,
where the all-gather needs one collective instead of two.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from adaptjax.compression import _collectives as col
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import adaptjax
from adaptjax import compression as ajc

MESH2 = Mesh(np.array(jax.devices()[:2]), ("data",))
SHAPES = [(64, 33), (130,), (7,)]  # a main view with a tail, a tail only, a tiny leaf


def _run(fmt, xs, transport, residual=True):
    """owner_compute_leaves on 2 replicas; returns (outs, residuals) with a leading replica axis."""

    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=MESH2, in_specs=P("data"), out_specs=P("data"), check_vma=False
    )
    def f(*leaves):
        outs, res = col.owner_compute_leaves(
            [x[0] for x in leaves],
            fmt,
            names=("data",),
            n=2,
            seed_worker=jnp.uint32(1),
            seed_server=jnp.uint32(2),
            residual=residual,
            fold=residual,
            transport=transport,
        )
        return [o[None] for o in outs], [r[None] for r in res]

    return f(*xs)


def _grads(seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=(2, *s)), jnp.float32) for s in SHAPES]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_choose_transport_takes_the_allgather_only_where_it_sends_no_more_bytes(n):
    owner, gather = 2 * (n - 1) / n, n - 1  # bytes per encoded byte
    expect = "allgather" if n >= 2 and gather <= owner else "owner"
    assert col.choose_transport(n) == expect


@pytest.mark.parametrize("transport", ["owner", "allgather"])
@pytest.mark.parametrize("fmt_name", ["onebit", "bf16"])
def test_mean_plus_mean_residual_is_the_exact_mean(transport, fmt_name):
    fmt = {"onebit": ajc.onebit(block=32).fmt, "bf16": col.BF16}[fmt_name]
    xs = _grads()
    outs, res = _run(fmt, xs, transport)
    for x, o, r in zip(xs, outs, res, strict=True):
        np.testing.assert_array_equal(o[0], o[1])  # the same mean on both replicas
        np.testing.assert_allclose(o[0] + r.mean(0), x.mean(0), atol=2e-6)


@pytest.mark.parametrize("codec", ["onebit", "terngrad", "qsgd", "natural", "bf16"])
def test_sum_decoded_is_the_sum_of_the_decoded_rows(codec):
    # decoding row by row (fast on XLA:CPU) must give the sum of one decode of all rows
    fmt = {"onebit": ajc.onebit(block=64).fmt, "terngrad": ajc.terngrad(block=64).fmt,
           "qsgd": ajc.qsgd(7, block=64).fmt, "natural": ajc.natural(block=64).fmt,
           "bf16": col.BF16}[codec]
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 4, fmt.block)), jnp.float32)
    rows = fmt.encode(x, jnp.uint32(7))
    whole = np.asarray(fmt.decode(rows, 4), np.float64).sum(0)
    got = col.sum_decoded(lambda r: fmt.decode(r, 4), rows)
    assert got.shape == (4, fmt.block)
    np.testing.assert_allclose(got, whole, rtol=1e-6, atol=1e-6)


def test_allgather_mean_is_the_mean_of_each_replicas_onebit_decoding():
    # onebit with block B decodes x to sign(x) * mean|x| over its block; the all-gather
    # transport averages the two replicas' decodings and re-encodes nothing
    b = 32
    fmt = ajc.onebit(block=b).fmt
    x = np.random.default_rng(1).normal(size=(2, 4 * b)).astype(np.float32)
    (out,), _ = _run(fmt, [jnp.asarray(x)], "allgather")
    blocks = x.reshape(2, -1, b)
    dec = np.sign(blocks) * np.abs(blocks).mean(-1, keepdims=True)
    np.testing.assert_allclose(out[0], dec.mean(0).reshape(-1), rtol=1e-6, atol=1e-6)


def test_onebit_step_on_two_replicas_sends_one_all_gather_of_owner_compute_bytes():
    codec = ajc.onebit(min_size=16)
    params = {"w": jnp.zeros((256, 64)), "b": jnp.zeros((8,))}
    tx = adaptjax.sync_gradients("data", codec=codec)
    state = adaptjax.stack_replicas(tx.init(params), 2)
    specs = adaptjax.state_partition_specs(state)

    def body(g, s):
        g = jax.tree.map(lambda x: x[0], g)
        out, s = tx.update(g, adaptjax.to_local(s))
        return out, adaptjax.to_global(s)

    f = jax.jit(
        jax.shard_map(
            body, mesh=MESH2, in_specs=(P("data"), specs), out_specs=(P(), specs),
            check_vma=False,
        )
    )  # fmt: skip
    grads = jax.tree.map(lambda p: jnp.zeros((2, *p.shape)), params)
    report = adaptjax.wire_bytes(f, grads, state)
    assert report.count("all-to-all") == 0
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    assert len(gathers) == 1
    # one encoded copy: 1 bit per element plus one f32 scale per block, both leaves in one row
    fmt = codec.fmt
    encoded = 256 * 64 * (1 / 8 + 4 / fmt.block) + 8 * 4 * (1 + 32 / fmt.block) / 8
    assert gathers[0].bytes == pytest.approx(2 * (2 - 1) / 2 * encoded, rel=0.05)


def test_bad_transport_is_a_one_line_error():
    with pytest.raises(ValueError, match="transport must be one of"):
        _run(col.BF16, _grads(), "ring")
