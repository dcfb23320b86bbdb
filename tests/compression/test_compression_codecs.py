"""Codec protocol: bit packing, encode/decode, payload sizes, flags, unbiasedness."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adaptjax import compression as ajc


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack_round_trips_exactly(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2**bits, size=(3, 32 * 37)).astype(np.uint8)
    packed = ajc.pack_bits(jnp.asarray(codes), bits)
    assert packed.dtype == jnp.uint8
    assert packed.shape == (3, 4 * 37 * bits)  # exactly bits/8 bytes per code
    np.testing.assert_array_equal(np.asarray(ajc.unpack_bits(packed, bits)), codes)


def test_pack_layout():
    # 2 bits divide 32: 16 consecutive codes per little-endian uint32, code e at bit 2e
    codes = np.zeros(32, np.uint8)
    codes[[0, 1, 17]] = [3, 1, 2]
    words = [3 + (1 << 2), 2 << 2]
    want = [b for w in words for b in int(w).to_bytes(4, "little")]
    assert ajc.pack_bits(jnp.asarray(codes), 2).tolist() == want
    # 3 bits do not: 32 codes become 3 words, word j holding bit j of code e at bit e
    codes = np.zeros(32, np.uint8)
    codes[[0, 5]] = [5, 2]  # 0b101 and 0b010
    words = [1, 1 << 5, 1]
    want = [b for w in words for b in int(w).to_bytes(4, "little")]
    assert ajc.pack_bits(jnp.asarray(codes), 3).tolist() == want


def test_pack_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible by 32"):
        ajc.pack_bits(jnp.zeros(40, jnp.uint8), 1)
    with pytest.raises(ValueError, match=r"bits must be an integer in \[1, 8\]"):
        ajc.pack_bits(jnp.zeros(8, jnp.uint8), 9)


def _round_trip(codec, x, seed=0):
    """decode(encode(x)) under jit (eager dispatch of every small op is slow)."""
    return jax.jit(lambda v: codec.decode(codec.encode(v, seed=seed), v.shape, seed=seed))(x)


QUANTIZERS = {
    "onebit": ajc.onebit(),
    "terngrad": ajc.terngrad(),
    "qsgd": ajc.qsgd(7),
    "qsgd1": ajc.qsgd(1),
    "natural": ajc.natural(),
    "bf16": ajc.bf16(),
    "fp16": ajc.fp16(),
}


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_quantizer_payload_size_is_fixed_and_formula(name):
    codec = QUANTIZERS[name]
    code_bits = {"bf16": 16, "fp16": 16, "onebit": 1, "terngrad": 2, "qsgd": 4, "qsgd1": 2,
                 "natural": 8}[name]
    scaled = name not in ("bf16", "fp16")
    assert codec.bits == code_bits + (32 / codec.block if scaled else 0)
    for size in (1, 100, 1000, 4096):
        x = jax.ShapeDtypeStruct((size,), jnp.float32)
        p = jax.eval_shape(lambda v, c=codec: c.encode(v), x)
        nb = math.ceil(size / codec.block)
        # the codes of every block, packed: exactly code_bits per element
        assert p["codes"].size * p["codes"].dtype.itemsize * 8 == nb * codec.block * code_bits
        if scaled:
            assert p["scales"].shape == (nb,) and p["scales"].dtype == jnp.float32
        else:
            assert set(p) == {"codes"}


def test_bf16_and_fp16_round_trip_to_the_cast():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 7)).astype(np.float32))
    for codec, dt in ((ajc.bf16(), jnp.bfloat16), (ajc.fp16(), jnp.float16)):
        y = _round_trip(codec, x)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x.astype(dt).astype(jnp.float32)))


def test_fp16_saturates_instead_of_overflowing():
    y = _round_trip(ajc.fp16(), jnp.array([1e6, -1e6]))
    assert y.tolist() == [65504.0, -65504.0]


def test_onebit_decodes_sign_times_block_mean_abs():
    codec = ajc.onebit(block=32)
    x = jnp.asarray(np.random.default_rng(8).normal(size=40).astype(np.float32))
    y = _round_trip(codec, x)
    s1 = float(jnp.mean(jnp.abs(x[:32])))
    s2 = float(jnp.mean(jnp.abs(x[32:])))  # the last partial block: its 8 real entries
    want = np.sign(np.asarray(x)) * np.array([s1] * 32 + [s2] * 8)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6)


def test_onebit_partial_block_scale_is_the_mean_over_its_real_entries():
    # 700 = 512 + 188: the last block's scale is mean |x| over 188 entries, not 512
    x = np.random.default_rng(3).normal(size=700).astype(np.float32)
    y = np.asarray(_round_trip(ajc.onebit(), jnp.asarray(x)))
    np.testing.assert_allclose(np.abs(y[512:]), np.abs(x[512:]).mean(), rtol=1e-6)
    np.testing.assert_allclose(np.abs(y[:512]), np.abs(x[:512]).mean(), rtol=1e-6)


def test_onebit_zeros_do_not_decode_to_a_growing_bias():
    # a 1-bit code has no zero: exact zeros alternate +s, -s, so a run of 2j zeros sums to 0
    x = np.zeros(64, np.float32)
    x[:2] = [4.0, -2.0]  # s = 6/64 in each block... one block of 64
    y = np.asarray(_round_trip(ajc.onebit(block=64), jnp.asarray(x)))
    s = 6.0 / 64
    np.testing.assert_allclose(y[:2], [s, -s], rtol=1e-6)
    np.testing.assert_allclose(np.abs(y[2:]), s, rtol=1e-6)
    assert abs(float(y[2:].sum())) < 1e-6  # 62 zeros: 31 at +s, 31 at -s
    assert np.asarray(_round_trip(ajc.onebit(block=64), jnp.zeros(64))).tolist() == [0.0] * 64


def test_onebit_sync_scales_partial_blocks_by_their_real_entries():
    # every replica sends the same x: the owner re-encodes decode(encode(x)) to itself,
    # so the synced mean is the round trip of x, partial blocks included (700 = 512 + 188)
    codec = ajc.onebit(min_size=64, error_feedback=None)
    n = 2
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))
    x = np.random.default_rng(4).normal(size=700).astype(np.float32)
    state = codec.init({"w": jnp.zeros(700)})
    f = jax.shard_map(
        lambda g: codec.sync({"w": g[0]}, state)[0]["w"],
        mesh=mesh,
        in_specs=jax.sharding.PartitionSpec("data"),
        out_specs=jax.sharding.PartitionSpec(),
        check_vma=False,
    )
    y = np.asarray(jax.jit(f)(jnp.asarray(np.stack([x] * n))))
    np.testing.assert_allclose(y, np.asarray(_round_trip(codec, jnp.asarray(x))), rtol=1e-6)
    np.testing.assert_allclose(np.abs(y[512:]), np.abs(x[512:]).mean(), rtol=1e-6)


def test_terngrad_values_are_ternary_times_block_max():
    codec = ajc.terngrad(block=32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=96).astype(np.float32))
    y = np.asarray(_round_trip(codec, x, seed=3)).reshape(3, 32)
    smax = np.abs(np.asarray(x)).reshape(3, 32).max(axis=1, keepdims=True)
    assert np.all(np.isclose(np.abs(y), 0) | np.isclose(np.abs(y), smax))
    nz = y != 0
    assert np.all(np.sign(y[nz]) == np.sign(np.asarray(x).reshape(3, 32)[nz]))


def test_qsgd_values_are_levels_of_the_block_norm():
    s = 3
    codec = ajc.qsgd(s, block=32)
    x = jnp.asarray(np.random.default_rng(2).normal(size=64).astype(np.float32))
    y = np.asarray(_round_trip(codec, x, seed=5)).reshape(2, 32)
    norm = np.linalg.norm(np.asarray(x).reshape(2, 32), axis=1, keepdims=True)
    lv = y / norm * s
    np.testing.assert_allclose(lv, np.round(lv), atol=1e-5)
    assert np.all(np.abs(lv) <= s + 1e-5)


def test_natural_values_are_signed_powers_of_two_bracketing_x():
    codec = ajc.natural(block=64)
    x = np.random.default_rng(3).normal(size=64).astype(np.float32)
    y = np.asarray(_round_trip(codec, jnp.asarray(x), seed=1))
    m, _ = np.frexp(np.abs(y))
    assert np.all(m == 0.5)  # |y| is a power of two
    assert np.all(np.sign(y) == np.sign(x))
    lo = 2.0 ** np.floor(np.log2(np.abs(x)))
    assert np.all((np.abs(y) == lo) | (np.abs(y) == 2 * lo))


def test_topk_keeps_the_largest_magnitudes():
    x = jnp.asarray(np.random.default_rng(4).normal(size=(10, 30)).astype(np.float32))
    codec = ajc.topk(0.1)
    y = np.asarray(_round_trip(codec, x))
    k = math.ceil(0.1 * 300)
    thr = np.sort(np.abs(np.asarray(x)).ravel())[-k]
    np.testing.assert_array_equal(y, np.where(np.abs(np.asarray(x)) >= thr, np.asarray(x), 0))


@pytest.mark.parametrize("variant", ["sampled", "approx"])
def test_topk_variants_send_k_large_entries(variant):
    x = jnp.asarray(np.random.default_rng(5).normal(size=20000).astype(np.float32))
    codec = ajc.topk(0.01, variant=variant)
    p = jax.jit(lambda v: codec.encode(v, seed=1))(x)
    assert p["values"].shape == (200,)
    y = np.asarray(jax.jit(lambda q: codec.decode(q, x.shape))(p))
    sent = np.abs(y[y != 0])
    # a sampled threshold is only an estimate of the 99th percentile of |x|
    assert sent.size >= 150
    assert sent.min() >= np.quantile(np.abs(np.asarray(x)), 0.97)


def test_powersgd_encode_is_exact_on_low_rank_matrices():
    rng = np.random.default_rng(6)
    x = jnp.asarray((rng.normal(size=(20, 2)) @ rng.normal(size=(2, 12))).astype(np.float32))
    codec = ajc.powersgd(2)
    p = codec.encode(x)
    assert p["p"].shape == (20, 2) and p["q"].shape == (12, 2)
    np.testing.assert_allclose(np.asarray(codec.decode(p, x.shape)), np.asarray(x), atol=1e-4)


def test_flags():
    assert ajc.randomk(0.1).linear and ajc.randomk(0.1).randomness == "shared"
    assert ajc.powersgd(2).linear
    assert not ajc.topk(0.1).linear and ajc.topk(0.1).randomness == "none"
    for name in ("terngrad", "qsgd", "natural"):
        assert QUANTIZERS[name].randomness == "per_replica"
    assert ajc.onebit(block=512).bits == 1 + 32 / 512
    assert ajc.terngrad(block=256).bits == 2 + 32 / 256
    assert ajc.qsgd(7).bits == 4 + 32 / 512
    assert ajc.bf16().bits == 16
    assert ajc.topk(0.01).bits == pytest.approx(0.64)


def test_codecs_are_hashable_values():
    assert ajc.topk(0.01) == ajc.topk(0.01)
    assert hash(ajc.onebit()) == hash(ajc.onebit())
    assert ajc.topk(0.01) != ajc.topk(0.02)


# ---------------------------------------------------------------------- unbiasedness

SEEDS = 4000


def _mean_over_seeds(codec, x):
    seeds = jnp.arange(SEEDS, dtype=jnp.uint32)
    ys = jax.jit(jax.vmap(lambda s: codec.decode(codec.encode(x, seed=s), x.shape, seed=s)))(
        seeds
    )
    ys = np.asarray(ys, np.float64)
    return ys.mean(axis=0), ys.std(axis=0, ddof=1)


@pytest.mark.parametrize(
    "codec",
    [ajc.randomk(0.25), ajc.qsgd(1, block=64), ajc.qsgd(7, block=64), ajc.terngrad(block=64),
     ajc.natural(block=64)],
    ids=["randomk", "qsgd1", "qsgd7", "terngrad", "natural"],
)
def test_stochastic_codecs_are_unbiased(codec):
    """E[decode(encode(x))] = x: the mean over seeds lies within 3 standard errors."""
    x = jnp.asarray(np.random.default_rng(7).normal(size=64).astype(np.float32))
    mean, std = _mean_over_seeds(codec, x)
    se = std / math.sqrt(SEEDS)
    xs = np.asarray(x, np.float64)
    # one scalar statistic at 3 sigma: the summed error over the elements
    total_se = math.sqrt(float(np.sum(std**2)) / SEEDS)
    assert abs(float(np.sum(mean - xs))) <= 3 * total_se
    # and every element at 5 sigma (64 elements: a 3-sigma miss is expected by chance)
    ok = (np.abs(mean - xs) <= 5 * se) | (std == 0)
    assert ok.all(), np.flatnonzero(~ok)
    # the codec really is random (otherwise the test above is vacuous)
    assert np.mean(std > 0) > 0.5


def test_factories_share_one_convention():
    # the main parameter (ratio, rank, levels) is the one positional argument; the rest are
    # keywords; every factory returns an exported Codec whose error-feedback default its
    # docstring justifies ("default:" beside error_feedback)
    import inspect

    main = {"topk": "ratio", "randomk": "ratio", "dgc": "ratio", "qsgd": "levels",
            "powersgd": "rank"}
    assert "Codec" in ajc.__all__
    for name in ("bf16", "fp16", "onebit", "terngrad", "qsgd", "natural", "topk", "randomk",
                 "dgc", "powersgd"):
        factory = getattr(ajc, name)
        params = list(inspect.signature(factory).parameters.values())
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert positional == ([main[name]] if name in main else []), name
        assert all(p.kind is p.KEYWORD_ONLY for p in params[len(positional):]), name
        assert isinstance(factory(), ajc.Codec), name
        doc = inspect.getdoc(factory)
        if name == "dgc":  # momentum correction is its own feedback
            assert "takes no ``error_feedback``" in " ".join(doc.split())
        else:
            assert "(default" in doc.split("error_feedback:")[1].split("\n")[0], name


# ---------------------------------------------------------------------- the codec's own seed

RANDOM_CODECS = {  # every factory with random draws in encode, by its seed
    "qsgd": lambda seed: ajc.qsgd(7, seed=seed),
    "terngrad": lambda seed: ajc.terngrad(seed=seed),
    "natural": lambda seed: ajc.natural(seed=seed),
    "randomk": lambda seed: ajc.randomk(0.1, seed=seed),
    "topk-sampled": lambda seed: ajc.topk(0.1, variant="sampled", seed=seed),
    "powersgd": lambda seed: ajc.powersgd(2, seed=seed),
}


@pytest.mark.parametrize("name", sorted(RANDOM_CODECS))
def test_the_codecs_own_seed_reaches_encode(name):
    """Issue 45: ``qsgd(7, seed=k).encode(x, seed=s)`` drew the same for every ``k``."""
    x = jnp.asarray(np.random.default_rng(8).normal(size=(64, 64)).astype(np.float32))

    def payload(codec_seed, call_seed=5):
        return [np.asarray(v) for v in jax.tree.leaves(
            jax.jit(lambda v: RANDOM_CODECS[name](codec_seed).encode(v, seed=call_seed))(x))]

    def same(a, b):
        return all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))

    assert same(payload(0), payload(0))  # a codec's draws are a function of its seeds
    assert not same(payload(0), payload(1))  # another codec seed, other draws
    assert not same(payload(0), payload(0, call_seed=6))  # and another call seed


def test_randomk_decodes_at_the_coordinates_its_codec_seed_drew():
    # scale 1 with error feedback: decode(encode(x)) is x on the drawn coordinates, 0 elsewhere
    x = jnp.arange(1.0, 1001.0)
    for codec in (ajc.randomk(0.1, error_feedback="ef14", seed=s) for s in (0, 3)):
        y = np.asarray(_round_trip(codec, x, seed=2))
        kept = np.flatnonzero(y)
        assert kept.size == 100  # one per stratum of 10
        np.testing.assert_array_equal(y[kept], np.asarray(x)[kept])
