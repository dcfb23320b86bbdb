"""A codec a user writes in a page (examples/custom_codec.py): the protocol is the real one.

``sr4`` states its payload, encode, decode and that it is unbiased; everything
else (transport, buckets, error feedback, plan, wire bytes, checkpointed state,
rescale merges) comes from the library unchanged.
"""

import dataclasses
import importlib.util
import inspect
import math
import os
import sys
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import adaptjax
from adaptjax import compression as ajc
from adaptjax._per_replica import stack_replicas, state_partition_specs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "custom_codec", os.path.join(ROOT, "examples", "custom_codec.py"))
cc = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("custom_codec", cc)  # for inspect.getsource
_spec.loader.exec_module(cc)

# w: 8192 = 16 blocks of 64 per replica at N = 8 (no padding); b: under min_size
SHAPES = {"b": (10,), "w": (64, 128)}


def _fn(codec, n, state):
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    specs = state_partition_specs(state, "data")

    def f(g, s, step):
        g = jax.tree.map(lambda x: x[0], g)
        out, s = codec.sync(g, adaptjax.sync.to_local(s), axis_name="data", step=step)
        return out, adaptjax.sync.to_global(s)

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), specs, P()),
                                 out_specs=(P(), specs), check_vma=False))


def _state(codec, n):
    return stack_replicas(codec.init({k: jnp.zeros(s) for k, s in SHAPES.items()}), n)


def _grads(n, rng):
    return {k: rng.normal(size=(n, *s)).astype(np.float32) for k, s in SHAPES.items()}


def test_the_codec_and_its_factory_fit_in_40_lines():
    lines = inspect.getsource(cc.StochasticRound4) + inspect.getsource(cc.sr4)
    assert len(lines.strip().splitlines()) <= 40
    codec = cc.sr4()
    assert repr(codec) == "sr4()" and repr(cc.sr4(block=128)) == "sr4(block=128)"
    assert codec.bits == 4 + 32 / 64 and codec.unbiased


def test_decode_of_encode_is_unbiased_within_4_sigma():
    """E[out] = mean_i(g_i): the sync's mean over fresh draws, owners re-encoding too."""
    n, steps = 4, 200
    codec = dataclasses.replace(cc.sr4(min_size=100), transport="owner")
    state = _state(codec, n)
    fn = _fn(codec, n, state)
    g = _grads(n, np.random.default_rng(0))
    ys = np.stack([np.asarray(fn(g, state, jnp.int32(t))[0]["w"], np.float64).ravel()
                   for t in range(steps)])
    err = ys.mean(axis=0) - g["w"].astype(np.float64).mean(axis=0).ravel()
    se = ys.std(axis=0, ddof=1) / np.sqrt(steps)
    # each element within 4 standard errors (a few of 8192 may exceed 3), and their sum
    assert np.mean(np.abs(err) <= 4 * se + 1e-7) > 0.999
    assert abs(err.sum()) <= 4 * np.sqrt(np.sum(se**2))
    assert np.mean(se > 0) > 0.9  # really random


def test_ef14_telescoping_identity():
    """Σ_t out_t + mean_i(e_i,T) = Σ_t mean_i(g_i,t): what was not sent is owed."""
    n, steps = 4, 3
    codec = cc.sr4(min_size=100, error_feedback="ef14")
    state = _state(codec, n)
    fn = _fn(codec, n, state)
    rng = np.random.default_rng(1)
    out, mean = np.zeros(SHAPES["w"]), np.zeros(SHAPES["w"])
    for t in range(steps):
        g = _grads(n, rng)
        o, state = fn(g, state, jnp.int32(t))
        out += np.asarray(o["w"], np.float64)
        mean += g["w"].astype(np.float64).mean(axis=0)
    debt = np.asarray(state.worker.value["ef"]["w"], np.float64).mean(axis=0)
    tol = 5 * steps * np.finfo(np.float32).eps * max(np.abs(debt).max(), np.abs(out).max())
    np.testing.assert_allclose(out + debt, mean, atol=tol, rtol=0)
    assert np.abs(out - mean).max() > 1e-3


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class _Folded(cc.StochasticRound4):
    state_merge: ClassVar[str] = "fold"


@pytest.mark.parametrize("make", [cc.sr4, _Folded], ids=["mean", "fold"])
def test_rescale_8_4_8_keeps_its_state(make):
    """Its error-feedback debt survives 8 -> 4 -> 8 replicas under its declared merge rule."""
    codec = make(min_size=100, error_feedback="ef14")
    state = _state(codec, 8)
    _, state = _fn(codec, 8, state)(_grads(8, np.random.default_rng(2)), state, jnp.int32(0))
    assert state.worker.merge == codec.state_merge
    ef = np.asarray(state.worker.value["ef"]["w"], np.float64)
    at4 = adaptjax.sync.merge_replicas(jax.tree.map(np.asarray, state), 4)
    back = adaptjax.sync.merge_replicas(at4, 8)
    for s, m in ((at4, 4), (back, 8)):
        got = np.asarray(s.worker.value["ef"]["w"], np.float64)
        assert got.shape == (m, *SHAPES["w"])
        np.testing.assert_allclose(got.mean(axis=0), ef.mean(axis=0), atol=1e-6)  # the debt
    if codec.state_merge == "fold":  # 8 -> 4 -> 8 keeps pairs' means, replica by replica
        pairs = (ef[:4] + ef[4:]) / 2
        np.testing.assert_allclose(np.asarray(back.worker.value["ef"]["w"]),
                                   np.concatenate([pairs, pairs]), atol=1e-6)
    # and the merged state syncs at 4 replicas
    out, _ = _fn(codec, 4, at4)(_grads(4, np.random.default_rng(3)), at4, jnp.int32(1))
    assert np.all(np.isfinite(out["w"]))


@pytest.mark.parametrize("transport", ["owner", "allgather"])
def test_wire_bytes_equal_its_formula(transport):
    n = 8
    codec = cc.sr4(min_size=100)
    codec = dataclasses.replace(codec, transport=transport)
    state = _state(codec, n)
    g = {k: jax.ShapeDtypeStruct((n, *s), jnp.float32) for k, s in SHAPES.items()}
    report = adaptjax.wire_bytes(_fn(codec, n, state), g, state, jnp.int32(0))
    encoded = math.prod(SHAPES["w"]) // 64 * (64 // 2 + 4)  # 4-bit codes + a float32 scale
    wire = 2 * (n - 1) / n * encoded if transport == "owner" else (n - 1) * encoded
    small = 2 * (n - 1) / n * 4 * 10  # the float32 psum of b
    assert report.total == pytest.approx(wire + small, rel=1e-12)
    plan = ajc.plan({k: jnp.zeros(s) for k, s in SHAPES.items()}, codec, n, show=False)
    assert plan.rows[1].method == "sr4" and plan.rows[1].bytes == pytest.approx(wire)


# ------------------------------------------------------------------ bad codecs
def _trace(codec):
    """Traces one sync at 2 replicas (nothing compiles; errors carry jax's note, not in str)."""
    params = {"w": jnp.zeros((64, 32))}
    state = codec.init(params)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    f = jax.shard_map(lambda g: codec.sync(g, state)[0], mesh=mesh, in_specs=P(),
                      out_specs=P(), check_vma=False)
    return jax.make_jaxpr(f)(params)


def _one_line(excinfo):
    assert "\n" not in str(excinfo.value), str(excinfo.value)


def _variant(**methods):
    return dataclasses.dataclass(frozen=True, kw_only=True, repr=False)(
        type("Bad", (cc.StochasticRound4,), methods))


def test_a_decode_of_the_wrong_shape_is_one_line_at_trace_time():
    short = lambda self, p: cc.StochasticRound4.decode_blocks(self, p)[..., :8]  # noqa: E731
    bad = _variant(decode_blocks=short)
    with pytest.raises(ValueError, match=r"^Bad\.decode_blocks returned float32\[2, \d+, 8\]; "
                                         r"return float32 values of the blocks, shape "
                                         r"\[2, \d+, 64\]") as e:
        _trace(bad(block=64, min_size=1))
    _one_line(e)


@pytest.mark.parametrize("dtype, why", [
    (jnp.bool_, "which a collective cannot carry as bits"),
    (jnp.complex64, "which a collective cannot carry as bits"),
    (np.float64, "which a collective cannot carry as bits"),
])
def test_a_payload_dtype_a_collective_cannot_carry_is_one_line(dtype, why):
    bad = _variant(payload=lambda self: {"codes": (dtype, self.block // 2),
                                         "scales": (jnp.float32, 1)})
    with pytest.raises(ValueError, match=rf"^Bad\.payload\(\)\['codes'\] has dtype \w+, {why}: "
                                         r"use a 1-, 2- or 4-byte number type") as e:
        bad()
    _one_line(e)


def test_a_payload_entry_of_odd_bytes_is_one_line():
    bad = _variant(payload=lambda self: {"codes": (jnp.uint8, self.block // 2),
                                         "scales": (jnp.uint8, 1)})
    with pytest.raises(ValueError, match=r"^Bad\.payload\(\)\['scales'\] is 1 bytes per block; "
                                         r"the collectives carry 32-bit words") as e:
        bad()
    _one_line(e)


def test_an_encode_that_breaks_its_payload_is_one_line_at_trace_time():
    def as_bool(self, x, blocks):
        p = cc.StochasticRound4.encode_blocks(self, x, blocks)
        return {**p, "codes": p["codes"] > 0}

    with pytest.raises(ValueError, match=r"^Bad\.encode_blocks returned 'codes' as "
                                         r"bool\[2, \d+, 32\]; its payload\(\) declares 32 uint8 "
                                         r"per block, so uint8\[2, \d+, 32\]") as e:
        _trace(_variant(encode_blocks=as_bool)(block=64, min_size=1))
    _one_line(e)
    missing = _variant(encode_blocks=lambda self, x, b: {"codes": jnp.zeros(x.shape, jnp.uint8)})
    with pytest.raises(ValueError, match=r"^Bad\.encode_blocks returned \['codes'\]; return a "
                                         r"dict with the entries of its payload\(\): "
                                         r"\['codes', 'scales'\]"):
        _trace(missing(block=64, min_size=1))
