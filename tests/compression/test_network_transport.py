"""The transports of a block codec's payload: owner-compute, one all-gather, chosen per bucket.

Bytes per device for an encoded bucket of E bytes: owner-compute (all-to-all +
all-gather) 2(N-1)/N * E, one all-gather of the whole payload (N-1) * E; equal at
N = 2, where the all-gather needs one collective instead of two.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from adaptjax.compression._blocks import decode_rows, encode_rows
from adaptjax.compression._collectives import sum_decoded
from adaptjax.compression._exchange import TransportModel, choose_transport
from adaptjax.compression._formats import BF16
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import adaptjax
from adaptjax import compression as ajc
from adaptjax._per_replica import stack_replicas, state_partition_specs

MESH2 = Mesh(np.array(jax.devices()[:2]), ("data",))
SHAPES = {"m": (64, 33), "t": (130,), "z": (7,)}  # a main view with a tail, a tail only, tiny


def _sync(codec, g):
    """One sync on 2 replicas: (out, per-replica EF14 residuals)."""
    state = stack_replicas(codec.init(jax.tree.map(lambda x: x[0], g)), 2)
    specs = state_partition_specs(state)

    def f(g, s):
        out, s = codec.sync(jax.tree.map(lambda x: x[0], g), adaptjax.sync.to_local(s))
        return out, adaptjax.sync.to_global(s)

    f = jax.jit(jax.shard_map(f, mesh=MESH2, in_specs=(P("data"), specs),
                              out_specs=(P(), specs), check_vma=False))
    out, state = f(g, state)
    return out, state.worker.value["ef"]


def _grads(seed=0):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.normal(size=(2, *s)), jnp.float32) for k, s in SHAPES.items()}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_choose_transport_takes_the_allgather_where_it_sends_no_more_bytes(n):
    # a large bucket: bytes decide, and at 2 replicas the all-gather also saves a collective
    owner, gather = 2 * (n - 1) / n, n - 1  # bytes per encoded byte
    expect = "allgather" if n >= 2 and gather <= owner else "owner"
    assert choose_transport(n, 1e7, 8e7) == expect


def test_a_tiny_bucket_takes_one_collective():
    """From 4 replicas on the all-gather sends more, but one latency beats two for a few bytes."""
    model = TransportModel(alpha=1e-4, beta=1e-8, gamma=1e-9)
    for n in (4, 8, 16):
        assert choose_transport(n, 64, 512, model) == "allgather"
        assert choose_transport(n, 1e6, 8e6, model) == "owner"
        # the predicted times it compares
        e, d = 1e6, 8e6
        assert model.time("owner", n, e, d) == pytest.approx(
            2e-4 + 2 * (n - 1) / n * e * 1e-8 + (3 + 1 / n) * d * 1e-9)
        assert model.time("allgather", n, e, d) == pytest.approx(
            1e-4 + (n - 1) * e * 1e-8 + (1 + n) * d * 1e-9)


@pytest.mark.parametrize("transport", ["owner", "allgather"])
@pytest.mark.parametrize("make", [lambda **k: ajc.onebit(block=32, **k), ajc.bf16],
                         ids=["onebit", "bf16"])
def test_mean_plus_mean_residual_is_the_exact_mean(transport, make):
    codec = make(min_size=1, error_feedback="ef14", transport=transport)
    g = _grads()
    out, res = _sync(codec, g)
    for k in SHAPES:
        np.testing.assert_allclose(out[k] + res[k].mean(0), g[k].mean(0), atol=2e-6)


@pytest.mark.parametrize("codec", ["onebit", "terngrad", "qsgd", "natural", "bf16"])
def test_sum_decoded_is_the_sum_of_the_decoded_rows(codec):
    # decoding row by row (fast on XLA:CPU) must give the sum of one decode of all rows
    fmt = {"onebit": ajc.onebit(block=64), "terngrad": ajc.terngrad(block=64),
           "qsgd": ajc.qsgd(7, block=64), "natural": ajc.natural(block=64), "bf16": BF16}[codec]
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 4, fmt.block)), jnp.float32)
    rows, _ = encode_rows(fmt, x, ajc.Blocks.of(jnp.uint32(7), 4, fmt.block, rows=3))
    whole = np.asarray(decode_rows(fmt, rows, 4), np.float64).sum(0)
    got = sum_decoded(lambda r: decode_rows(fmt, r, 4), rows)
    assert got.shape == (4, fmt.block)
    np.testing.assert_allclose(got, whole, rtol=1e-6, atol=1e-6)


def test_allgather_mean_is_the_mean_of_each_replicas_onebit_decoding():
    # onebit with block B decodes x to sign(x) * mean|x| over its block; the all-gather
    # transport averages the two replicas' decodings and re-encodes nothing
    b = 32
    codec = ajc.onebit(block=b, min_size=1, error_feedback="ef14", transport="allgather")
    x = np.random.default_rng(1).normal(size=(2, 4 * b)).astype(np.float32)
    out, _ = _sync(codec, {"x": jnp.asarray(x)})
    blocks = x.reshape(2, -1, b)
    dec = np.sign(blocks) * np.abs(blocks).mean(-1, keepdims=True)
    np.testing.assert_allclose(out["x"], dec.mean(0).reshape(-1), rtol=1e-6, atol=1e-6)


def test_onebit_step_on_two_replicas_sends_one_all_gather_of_owner_compute_bytes():
    codec = ajc.onebit(min_size=16)
    params = {"w": jnp.zeros((256, 64)), "b": jnp.zeros((8,))}
    tx = adaptjax.sync_gradients("data", codec=codec)
    state = stack_replicas(tx.init(params), 2)
    specs = state_partition_specs(state)

    def body(g, s):
        g = jax.tree.map(lambda x: x[0], g)
        out, s = tx.update(g, adaptjax.sync.to_local(s))
        return out, adaptjax.sync.to_global(s)

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
    encoded = 256 * 64 * (1 / 8 + 4 / codec.block) + 8 * 4 * (1 + 32 / codec.block) / 8
    assert gathers[0].bytes == pytest.approx(2 * (2 - 1) / 2 * encoded, rel=0.05)


def test_bad_transport_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"^transport must be one of \('owner', 'allgather'\) "
                                         r"or None \(chosen per bucket by predicted time\), "
                                         r"got 'ring'$"):
        ajc.onebit(transport="ring")
