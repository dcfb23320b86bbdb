"""A codec prints as the factory call that builds it, and that is its key.

``codec_key`` is the ``repr``: it names compiled steps, run
configurations and checkpoints, so two codecs that differ in any argument must
print differently, and printing must not depend on anything but the arguments.
"""

import dataclasses
import inspect
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from adaptjax.compression._base import Codec, factory
from adaptjax.compression._lanes import leaf_outs
from adaptjax.compression._quantizers import _OneBit, _quantizer
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from adaptjax import compression as ajc
from adaptjax._run_config import codec_key

FACTORIES = [ajc.bf16, ajc.fp16, ajc.onebit, ajc.terngrad, ajc.qsgd, ajc.natural,
             ajc.topk, ajc.randomk, ajc.dgc, ajc.powersgd]

# a value other than the default for every parameter any factory has
OTHER = {
    "ratio": 0.02, "levels": 3, "rank": 2, "block": 256, "error_feedback": "ef21",
    "axis_name": ("data", "fast"), "min_size": 64, "fast_axis": "fast", "seed": 3,
    "bucket_bytes": 4096, "variant": "exact", "alternate": True, "momentum": 0.5,
    "clip_norm": 1.0, "warmup_steps": 10, "warmup_densities": (0.5,), "transport": "owner",
}


def _variants():
    """Each factory's default codec, and one codec per parameter set to another value."""
    out = []
    for make in FACTORIES:
        out.append(make())
        for name, p in inspect.signature(make).parameters.items():
            assert OTHER[name] != p.default
            out.append(make(**{name: OTHER[name]}))
    return out


def test_repr_is_the_call_a_user_types():
    assert repr(ajc.onebit()) == "onebit()"
    assert repr(ajc.onebit(block=256, error_feedback="ef21")) == (
        "onebit(block=256, error_feedback='ef21')")
    assert repr(ajc.topk(0.01)) == repr(ajc.topk()) == "topk(0.01)"
    assert repr(ajc.powersgd(rank=4)) == "powersgd(4)"
    assert repr(ajc.qsgd(3, bucket_bytes=4096)) == "qsgd(3, bucket_bytes=4096)"
    assert repr(ajc.bf16()) == "bf16()" and repr(ajc.fp16(min_size=64)) == "fp16(min_size=64)"
    assert repr(ajc.dgc(0.001, warmup_steps=400)) == "dgc(0.001, warmup_steps=400)"
    # arguments print as they are kept: True means "ef14", a list of axes is a tuple
    assert repr(ajc.bf16(error_feedback=True, axis_name=["a", "b"])) == (
        "bf16(error_feedback='ef14', axis_name=('a', 'b'))")


def test_every_argument_changes_the_key_and_the_repr_builds_the_codec():
    codecs = _variants()
    keys = [codec_key(c) for c in codecs]
    assert keys == [repr(c) for c in codecs]
    assert len(set(keys)) == len(codecs)  # unique per configuration
    namespace = {f.__name__: f for f in FACTORIES}
    for codec in codecs:
        again = eval(repr(codec), namespace)  # noqa: S307 - the repr is a factory call
        assert again == codec and repr(again) == repr(codec)


def test_equal_codecs_have_one_key():
    assert codec_key(ajc.topk(1 / 100)) == codec_key(ajc.topk(0.01))
    assert codec_key(ajc.onebit(error_feedback=True)) == codec_key(ajc.onebit())


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class HalfCodec(Codec):
    """A codec class without a factory (sends each leaf halved, for the repr only)."""

    scale: float = 0.5
    name: ClassVar[str] = "half"

    def leaf_bytes(self, shape, n):
        return 0.0

    def reduce(self, leaves, ctx):
        return leaf_outs([i.x * self.scale for i in leaves])


def test_a_codec_class_without_a_factory_prints_its_class_call():
    assert repr(HalfCodec()) == "HalfCodec()"
    assert repr(HalfCodec(scale=0.25, min_size=8)) == "HalfCodec(min_size=8, scale=0.25)"
    assert eval(repr(HalfCodec(scale=0.25)), {"HalfCodec": HalfCodec}) == HalfCodec(scale=0.25)


def test_a_factory_takes_only_fields_of_its_class():
    def f(*, blocks: int = 1) -> Codec:
        return _OneBit(block=blocks)

    with pytest.raises(TypeError, match=r"parameters \['blocks'\] of f are not fields"):
        factory(_OneBit)(f)


def test_a_quantizer_factory_follows_the_template():
    def loose(*, block: int = 512, axis_name="data", min_size: int = 512, fast_axis=None,
              seed: int = 0, bucket_bytes=None) -> Codec:
        """Args:
          {shared args}
        """
        return _OneBit(**locals())

    with pytest.raises(TypeError, match="loose does not follow the quantizer factory template"):
        _quantizer(_OneBit)(loose)


def test_a_lane_the_table_does_not_have_is_one_line():
    @dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
    class Fp8(HalfCodec):
        def method(self, shape, n):
            return "fp8"

    with pytest.raises(ValueError, match=r"^Fp8.method returned 'fp8' for the leaf at \['w'\]; "
                                         r"return one of \('f32', 'bf16', 'codec'\)$"):
        ajc.plan({"w": jnp.zeros(4)}, Fp8(), 8, show=False)


def test_a_lane_that_loses_a_leaf_is_one_line():
    @dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
    class Lossy(HalfCodec):
        def reduce(self, leaves, ctx):
            return super().reduce(leaves[1:], ctx)

    codec = Lossy(min_size=1)
    grads = {"a": jnp.ones(4), "b": jnp.ones(4)}
    state = codec.init(grads)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    f = jax.shard_map(lambda g: codec.sync(g, state)[0], mesh=mesh, in_specs=P(), out_specs=P())
    with pytest.raises(ValueError, match=r"^the 'codec' lane of Lossy\(min_size=1\) returned 1 "
                                         r"results for 2 leaves; return one LeafOut per leaf"):
        jax.make_jaxpr(f)(grads)
