"""InputCodec: the decode error bounds, the bytes moved, the dataset contract, bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import adaptjax
from adaptjax._input_codec import batch_bytes


def _features(seed=0, n=200):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype(np.float32) * np.array([1, 10, 0.01, 1e4, 0], np.float32)
    x[:, 4] = 3.5  # a constant column
    x[:, 0] += 100.0  # an offset far from zero
    return x


def test_int8_decode_error_is_at_most_half_a_step_per_element():
    """|decode(encode(x)) - x| <= scale / 2 exactly; the float32 decode adds its own rounding:
    (code + 128) * scale is one rounding of a value <= 255 * scale, + offset another, so at
    most ulp(255 * scale) / 2 + ulp(|decoded|) / 2 <= eps32 * (255 * scale + |x| + scale)."""
    x = _features()
    codec = adaptjax.InputCodec("int8").fit(x)
    codes = codec.encode(x)
    assert codes.dtype == np.int8 and codes.shape == x.shape
    decoded = np.asarray(jax.jit(codec.decode)(codes), np.float64)
    eps = float(np.finfo(np.float32).eps)
    bound = codec.scale / 2 + eps * (256 * codec.scale + np.abs(x))
    assert np.all(np.abs(decoded - x) <= bound)
    # the bound is tight: some element lands near half a step away
    assert np.max(np.abs(decoded - x)[:, 1] / (codec.scale[1] / 2)) > 0.9
    assert codec.scale[4] == 0 and np.all(decoded[:, 4] == 3.5)  # constant: exact
    np.testing.assert_array_equal(codes.min(axis=0)[:4], -128)  # the range is used
    np.testing.assert_array_equal(codes.max(axis=0)[:4], 127)


def test_bfloat16_codes_are_round_to_nearest_within_two_to_the_minus_eight():
    x = _features()
    codec = adaptjax.InputCodec("bfloat16").fit(x)
    decoded = np.asarray(codec.decode(codec.encode(x)), np.float64)
    assert np.all(np.abs(decoded - x) <= 2.0**-8 * np.abs(x))
    assert codec.max_error() is None


def test_dataset_keeps_codes_and_decodes_inside_a_shard_map_step():
    x, y = _features(), np.arange(200, dtype=np.int32) % 7
    plain = adaptjax.ArrayDataset({"x": x, "y": y}, seed=1)
    coded = adaptjax.ArrayDataset({"x": x, "y": y}, seed=1, features=adaptjax.InputCodec("int8"))
    assert plain.bytes_per_sample == 5 * 4 + 4 and coded.bytes_per_sample == 5 + 4
    b_plain, b_coded = plain.next_batch(64), coded.next_batch(64)
    assert batch_bytes(b_plain) == 64 * 24 and batch_bytes(b_coded) == 64 * 9
    np.testing.assert_array_equal(b_coded["y"], b_plain["y"])  # the same samples
    assert set(coded.codecs) == {"x"}
    mesh = adaptjax.make_mesh(8)
    decode = jax.jit(jax.shard_map(
        coded.decode, mesh=mesh, in_specs=P("data"), out_specs=P("data")
    ))
    out = decode(b_coded)  # each replica decodes its 8 rows
    assert out["x"].dtype == jnp.float32 and out["y"].dtype == jnp.int32
    error = np.abs(np.asarray(out["x"], np.float64) - b_plain["x"])
    scale = coded.codecs["x"].scale
    assert np.all(error <= scale / 2 + 1e-6 * (256 * scale + np.abs(b_plain["x"])))
    assert plain.decode(b_plain) is b_plain  # no codec: the identity


def test_positional_arrays_and_a_mapping_of_codecs():
    x, z = _features(), _features(1)
    ds = adaptjax.ArrayDataset(x, np.arange(200), z, features={2: adaptjax.InputCodec("bfloat16")})
    a, labels, c = ds.next_batch(10)
    assert a.dtype == np.float32 and c.dtype == jnp.bfloat16 and labels.dtype == np.int64
    a2, labels2, c2 = ds.decode((a, labels, c))
    assert a2 is a and labels2 is labels and c2.dtype == jnp.float32
    assert "features={2: 'bfloat16'}" in repr(ds)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: adaptjax.InputCodec("int4"),
         "InputCodec: unknown dtype 'int4'; use one of 'int8', 'bfloat16'"),
        (lambda: adaptjax.ArrayDataset({"x": np.ones((4, 2)), "y": np.arange(4)},
                                       features={"y": adaptjax.InputCodec("int8")}),
         "y is int64: an input codec quantizes float features, not integer labels or tokens; "
         "leave y out of features="),
        (lambda: adaptjax.ArrayDataset(np.arange(4), features=adaptjax.InputCodec("int8")),
         "features=InputCodec(dtype='int8') found no float array to encode (arrays[0]=int64); "
         "an input codec quantizes float features, not integer labels"),
        (lambda: adaptjax.ArrayDataset({"x": np.ones((4, 2))},
                                       features={"z": adaptjax.InputCodec("int8")}),
         "features names 'z', which is not one of the dataset's arrays ['x']"),
        (lambda: adaptjax.ArrayDataset({"x": np.ones((4, 2))}, features={"x": "int8"}),
         "features['x'] must be an adaptjax.InputCodec, got str"),
        (lambda: adaptjax.ArrayDataset({"x": np.ones((4, 2))}, features="int8"),
         "features must be an adaptjax.InputCodec or a mapping from array names to codecs, "
         "got str"),
        (lambda: adaptjax.ArrayDataset({"x": np.array([[1.0], [np.nan]])},
                                       features=adaptjax.InputCodec("int8")),
         "x holds inf or NaN; an input codec needs finite features"),
        (lambda: adaptjax.InputCodec("int8").fit(np.ones((3, 2))).encode(np.ones((3, 4))),
         "this codec was fitted to samples of shape (2,), got (4,)"),
    ],
)
def test_bad_inputs_one_line(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value) == message
