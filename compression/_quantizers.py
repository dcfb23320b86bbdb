"""Block codecs: the protocol as a codec (:class:`BlockCodec`) and the built-in quantizers.

A :class:`BlockCodec` is a codec of fixed-size blocks written to the protocol
of :mod:`adaptjax.compression._blocks` (``payload``, ``encode_blocks``,
``decode_blocks``, ``unbiased``); the library moves its payload by
owner-compute or one all-gather (:mod:`adaptjax.compression._exchange`),
in buckets, with error feedback, plans and wire bytes. The built-in ones are
that protocol on the math of :mod:`adaptjax.compression._formats`:
``bf16``/``fp16`` (cast), ``onebit`` (sign + scale, 1 bit), ``terngrad``
(stochastic ternary, 2 bits), ``qsgd`` (``s`` stochastic levels,
``ceil(log2(2s+1))`` bits) and ``natural`` (stochastic power-of-two, 8 bits).

Owner-compute: each replica encodes its gradient, an all-to-all delivers the
blocks replica ``j`` owns to replica ``j``, which decodes, averages,
re-encodes, and an all-gather returns every owner's blocks to everyone:
``2·(N−1)/N`` of one encoded gradient per device. With error feedback, the
owner's re-encoding error is folded (times ``N``) into its own worker residual
on the blocks it owns, so the mean of the residuals carries it into the next
step and no server buffer is kept. With ``fast_axis`` set and a tuple
``axis_name`` (a 2-D mesh), the fast axis carries bf16 (reduce-scatter, then
all-gather) and only the slow axes carry the compressed payload, on ``1/F``
of the gradient.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from adaptjax.compression._base import Codec, F, factory
from adaptjax.compression._blocks import (
    BlockFormat,
    Blocks,
    bits_per_element,
    decode_checked,
    encode_checked,
    payload_spec,
)
from adaptjax.compression._exchange import bucket_transport, check_transport, reduce_blocks
from adaptjax.compression._formats import (
    CastBlocks,
    LevelsBlocks,
    NaturalBlocks,
    SignBlocks,
    TernaryBlocks,
)
from adaptjax.compression._lanes import block_leaf_bytes, leaf_outs
from adaptjax.compression._layout import make_layout, prod
from adaptjax.compression._views import BUCKET_MAX


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)  # the factory call (Codec)
class BlockCodec(Codec, BlockFormat):
    """A codec of fixed-size blocks: the protocol a user implements to add a codec.

    A subclass is a frozen dataclass (``repr=False``: its ``repr`` is its
    factory's call, see :func:`factory`) that implements the block-codec
    protocol and nothing else:

    * ``payload(self)``: what one block becomes, ``{name: (dtype, count)}``:
      1-, 2- or 4-byte number types, a multiple of 4 bytes per block each;
    * ``encode_blocks(self, x, blocks)``: ``x`` float32 ``(R, nb, block)``
      (elements past ``blocks.count`` are zero) to ``{name: (R, nb, count)}``;
      ``blocks`` (:class:`Blocks`) draws random numbers per element;
    * ``decode_blocks(self, payload)``: back to float32 ``(R, nb, block)``;
    * ``unbiased``: whether ``E[decode(encode(x))] = x``;
    * optionally ``reconstruct_blocks(self, x, payload)`` (a cheaper decode of
      what this replica sent, given ``x``) and ``state_merge`` (the merge rule
      of its error-feedback buffers on a rescale, ``"mean"`` by default).

    The library packs the payload into 32-bit words (:func:`pack_bits` packs
    codes of fewer bits), moves it by owner-compute or one all-gather per
    bucket, keeps error feedback (``"ef14"``, ``"ef21"``), and derives the
    plan, wire bytes and checkpointed state from it. A payload that does not
    match its ``payload()``, or a decode of the wrong shape, is a one-line
    ValueError at trace time.

    Attributes:
      block: elements per block (a multiple of 32).
      fast_axis: the fast axis of a 2-D mesh for the two-level mode, or None.
      transport: ``None`` (each bucket by predicted time: owner-compute, or
        one all-gather where that is faster, e.g. at 2 replicas), ``"owner"``
        or ``"allgather"``.

    Example:
      >>> import dataclasses, jax.numpy as jnp
      >>> from typing import ClassVar
      >>> from adaptjax import compression as ajc
      >>> @dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
      ... class Halves(ajc.BlockCodec):     # bfloat16 halves of each value, 16 bits
      ...     name: ClassVar[str] = "halves"
      ...     def payload(self):
      ...         return {"h": (jnp.bfloat16, self.block)}
      ...     def encode_blocks(self, x, blocks):
      ...         return {"h": (x / 2).astype(jnp.bfloat16)}
      ...     def decode_blocks(self, payload):
      ...         return payload["h"].astype(jnp.float32) * 2
      >>> codec = Halves(block=32)
      >>> codec, codec.bits, codec.decode(codec.encode(jnp.arange(3.0)), (3,)).tolist()
      (Halves(block=32), 16.0, [0.0, 1.0, 2.0])
    """

    block: int = 512
    fast_axis: str | None = None
    transport: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.block, bool) or int(self.block) != self.block or (
            self.block < 32 or self.block % 32
        ):
            raise ValueError(f"block must be a positive multiple of 32, got {self.block}")
        object.__setattr__(self, "block", int(self.block))
        if self.fast_axis is not None and not (isinstance(self.fast_axis, str) and self.fast_axis):
            raise ValueError(f"fast_axis must be an axis name or None, got {self.fast_axis!r}")
        check_transport(self.transport)
        payload_spec(self)  # its one-line errors before anything is traced

    @property
    def bits(self) -> float:
        """Bits per element on the wire, the payload's (scales included)."""
        return bits_per_element(self)

    def leaf_bytes(self, shape: Sequence[int], n: int, transport: str | None = None) -> float:
        """Bytes per device for one leaf: ``2(N−1)/N·E`` by owner-compute, ``(N−1)·E`` gathered.

        ``E = ceil(d / block) · block_bytes`` is one replica's encoded leaf;
        ``transport`` is that of the leaf's bucket (default: a bucket of this leaf alone).
        """
        transport = transport or self.bucket_transport([prod(shape)], n) or "owner"
        return block_leaf_bytes(self, prod(shape), n, transport)

    def bucket_transport(self, sizes: Sequence[int], n: int) -> str | None:
        """The transport of a bucket of leaves of ``sizes`` elements (None: two-level)."""
        if self.fast_axis is not None:
            return None
        return bucket_transport(self, sizes, n, self.transport)

    def method(self, shape: Sequence[int], n: int) -> str:
        # the bf16 lane where the codec sends more than bf16 (more than 16 bits per element)
        if prod(shape) < self.min_size:
            return "f32"
        return "bf16" if self.bits > 16 else "codec"

    def _check_axes(self, names) -> None:
        if self.fast_axis is not None and self.fast_axis not in names:
            raise ValueError(
                f"fast_axis {self.fast_axis!r} is not in axis_name {names}; pass "
                f"axis_name=(slow, {self.fast_axis!r}) on a 2-D mesh"
            )

    def reduce(self, leaves: Sequence[Any], ctx: Any) -> list[Any]:  # _lanes' private types
        """One bucket by owner-compute, all-gather or the two-level mode (``_exchange``)."""
        # BUCKET_MAX is read when traced, so a caller may set it to 0 (per leaf)
        return leaf_outs(*reduce_blocks(self, leaves, ctx, stages=(0, 1), pack_max=BUCKET_MAX,
                                        transport=self.transport, fast_axis=self.fast_axis))

    # ------------------------------------------------------------- protocol
    def _blocks_of(self, size: int, seed) -> Blocks:
        nb = max(1, -(-size // self.block))
        count = make_layout([size], self.block).block_counts().reshape(1, nb, 1)
        return Blocks.of(self.draw_seed(seed), nb, self.block)._replace(count=jnp.asarray(count))

    def encode(self, x: jax.Array, *, seed: int | jax.Array = 0) -> dict[str, jax.Array]:
        """Encodes one array: its payload entries flattened (``{"codes": ..., "scales": ...}``).

        Example:
          >>> import jax.numpy as jnp
          >>> from adaptjax import compression as ajc
          >>> codec = ajc.onebit(block=32)
          >>> p = codec.encode(jnp.arange(-16.0, 16.0))
          >>> p["codes"].shape, p["scales"].shape     # 32 signs in one uint32, one scale
          ((1,), (1,))
          >>> codec.decode(p, (32,))[jnp.array([0, 31])].tolist()     # ±mean|x|
          [-8.0, 8.0]
        """
        flat = jnp.ravel(jnp.asarray(x)).astype(jnp.float32)
        size = flat.shape[0]
        blocks = self._blocks_of(size, seed)
        nb = blocks.base.shape[1]
        padded = jnp.pad(flat, (0, nb * self.block - size)).reshape(1, nb, self.block)
        return {k: v.reshape(-1) for k, v in encode_checked(self, padded, blocks).items()}

    def decode(
        self, payload: Any, shape: Sequence[int], *, seed: int | jax.Array = 0
    ) -> jax.Array:
        """Decodes :meth:`encode`'s payload to a float32 array of ``shape``."""
        del seed
        size = prod(shape)
        nb = max(1, -(-size // self.block))
        blocks = {e.name: payload[e.name].reshape(1, nb, e.count) for e in payload_spec(self)}
        y = decode_checked(self, blocks, (1, nb, self.block))
        return y.reshape(-1)[:size].reshape(shape)


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class _Cast(CastBlocks, BlockCodec):
    dtype: str = "bfloat16"
    block: int = 32

    @property
    def name(self):  # type: ignore[override]
        return "bf16" if self.dtype == "bfloat16" else "fp16"


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class _OneBit(SignBlocks, BlockCodec):
    name: ClassVar[str] = "onebit"


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class _TernGrad(TernaryBlocks, BlockCodec):
    name: ClassVar[str] = "terngrad"
    randomness: ClassVar[str] = "per_replica"


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class _QSGD(LevelsBlocks, BlockCodec):
    levels: int = 7
    name: ClassVar[str] = "qsgd"
    randomness: ClassVar[str] = "per_replica"

    def __post_init__(self):
        if isinstance(self.levels, bool) or int(self.levels) != self.levels or not (
            1 <= self.levels <= 127
        ):
            raise ValueError(
                f"levels must be an integer in [1, 127], got {self.levels}; e.g. 7 (4 bits)"
            )
        object.__setattr__(self, "levels", int(self.levels))
        super().__post_init__()


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class _Natural(NaturalBlocks, BlockCodec):
    name: ClassVar[str] = "natural"
    randomness: ClassVar[str] = "per_replica"


# The template of the six factories: a signature ending in these parameters, with
# these defaults, an Args section ending in the line "{shared args}", and the body
# `return cls(**locals())` (see _quantizer).
_SHARED = {"axis_name": "data", "min_size": 1024, "fast_axis": None, "seed": 0,
           "bucket_bytes": None, "transport": None}
_SHARED_ARGS = """\
      axis_name: the data-parallel axis (or tuple of axes) of the optax form.
      min_size: leaves with fewer elements go in one float32 psum.
      fast_axis: two-level mode on a 2-D mesh: bf16 over this axis, the codec
        over the others (``axis_name`` must then be a tuple holding it).
      seed: seed of the random numbers (mixed with the step, leaf and replica index).
      bucket_bytes: ``None`` (one exchange per lane) or the most float32 bytes
        of gradient per exchange: leaves in reverse order, fused into buckets
        that can travel during the backward pass (see :class:`Codec`).
      transport: ``None`` (each bucket by predicted time), ``"owner"`` or
        ``"allgather"`` (see :class:`BlockCodec`).
"""


def _quantizer(cls: type[BlockCodec]) -> Callable[[F], F]:
    """A factory of ``cls`` on the quantizers' template (checked), registered by :func:`factory`."""

    def make(fn: F) -> F:
        params = inspect.signature(fn).parameters
        tail = {k: p.default for k, p in list(params.items())[-len(_SHARED):]}
        doc = fn.__doc__ or ""
        if tail != _SHARED or "      {shared args}\n" not in doc:
            raise TypeError(f"{fn.__name__} does not follow the quantizer factory template")
        fn.__doc__ = doc.replace("      {shared args}\n", _SHARED_ARGS)
        factory(cls)(fn)  # registers fn (and returns it as it is)
        return fn

    return make


@_quantizer(_Cast)
def bf16(
    *,
    error_feedback: str | None = None,
    axis_name: str | tuple[str, ...] = "data",
    min_size: int = 1024,
    fast_axis: str | None = None,
    seed: int = 0,
    bucket_bytes: int | None = None,
    transport: str | None = None,
) -> Codec:
    """bfloat16 gradients, moved as uint16 through all-to-all + all-gather.

    Bytes per device: ``4 d (N−1)/N``, like a bf16 psum, but through integer
    collectives, which XLA does not widen (it runs a bf16 all-reduce as float32
    on CPU). With ``error_feedback`` the rounding error is carried over.

    Args:
      error_feedback: ``None`` (default: rounding to bfloat16 errs by at most
        2^-9 of each element, too little to owe), ``"ef14"`` or ``"ef21"``.
      {shared args}

    Returns:
      The codec (a :class:`Codec`).

    Example:
      >>> from adaptjax import compression as ajc
      >>> ajc.bf16().bits
      16.0
    """
    return _Cast(dtype="bfloat16", **locals())


@_quantizer(_Cast)
def fp16(
    *,
    error_feedback: str | None = None,
    axis_name: str | tuple[str, ...] = "data",
    min_size: int = 1024,
    fast_axis: str | None = None,
    seed: int = 0,
    bucket_bytes: int | None = None,
    transport: str | None = None,
) -> Codec:
    """float16 gradients (values beyond ±65504 saturate), moved as uint16.

    Like :func:`bf16` with 3 more mantissa bits and 5 fewer exponent bits;
    prefer :func:`bf16` for unnormalised gradients.

    Args:
      error_feedback: ``None`` (default: rounding to float16 errs by at most
        2^-11 of each element, too little to owe), ``"ef14"`` or ``"ef21"``.
      {shared args}

    Returns:
      The codec.

    Example:
      >>> from adaptjax import compression as ajc
      >>> ajc.fp16().name, ajc.fp16(error_feedback="ef14")
      ('fp16', fp16(error_feedback='ef14'))
    """
    return _Cast(dtype="float16", **locals())


@_quantizer(_OneBit)
def onebit(
    *,
    block: int = 512,
    error_feedback: str | None = "ef14",
    axis_name: str | tuple[str, ...] = "data",
    min_size: int = 1024,
    fast_axis: str | None = None,
    seed: int = 0,
    bucket_bytes: int | None = None,
    transport: str | None = None,
) -> Codec:
    """Sign compression with a scale (EF-signSGD, Seide's 1-bit SGD), 8 per byte.

    Each block of ``block`` elements is sent as its signs (1 bit each, packed 8
    per byte) and ``mean |x|`` of the block (one float32), so an element costs
    ``1 + 32/block`` bits, ``32/(1 + 32/block)`` times less than float32
    (30.1x at ``block=512``). Biased: use error feedback (on by default); the
    owner of each chunk re-encodes the average and folds that error into its
    own residual.

    Args:
      block: elements per scale block (a multiple of 32).
      error_feedback: ``"ef14"`` (default: signs are biased, and without feedback
        sign compression can fail to converge; Karimireddy et al. 2019),
        ``"ef21"`` or ``None``.
      {shared args}

    Returns:
      The codec.

    Example:
      >>> import optax
      >>> from adaptjax import compression as ajc
      >>> tx = optax.chain(ajc.onebit(axis_name="data"), optax.sgd(0.1))
      >>> round(ajc.onebit().bits, 4)
      1.0625

    References:
      Seide et al., "1-bit stochastic gradient descent and its application to
      data-parallel distributed training of speech DNNs", Interspeech 2014.
      Karimireddy et al., "Error feedback fixes SignSGD and other gradient
      compression schemes", ICML 2019.
    """
    return _OneBit(**locals())


@_quantizer(_TernGrad)
def terngrad(
    *,
    block: int = 512,
    error_feedback: str | None = None,
    axis_name: str | tuple[str, ...] = "data",
    min_size: int = 1024,
    fast_axis: str | None = None,
    seed: int = 0,
    bucket_bytes: int | None = None,
    transport: str | None = None,
) -> Codec:
    """TernGrad: ``s·sign(x)·Bernoulli(|x|/s)`` with ``s = max |x|`` per block.

    Unbiased; 2 bits per element (4 per byte) plus one float32 scale per block.
    Randomness is per replica.

    Args:
      block: elements per scale block (a multiple of 32).
      error_feedback: ``None`` (default: stochastic rounding is unbiased, so
        SGD converges without a residual per parameter), ``"ef14"`` or ``"ef21"``.
      {shared args}

    Returns:
      The codec.

    Example:
      >>> from adaptjax import compression as ajc
      >>> ajc.terngrad().randomness
      'per_replica'

    References:
      Wen et al., "TernGrad: Ternary gradients to reduce communication in
      distributed deep learning", NeurIPS 2017.
    """
    return _TernGrad(**locals())


@_quantizer(_QSGD)
def qsgd(
    levels: int = 7,
    *,
    block: int = 512,
    error_feedback: str | None = None,
    axis_name: str | tuple[str, ...] = "data",
    min_size: int = 1024,
    fast_axis: str | None = None,
    seed: int = 0,
    bucket_bytes: int | None = None,
    transport: str | None = None,
) -> Codec:
    """QSGD: ``‖x‖·sign(x_i)·ξ_i/s``, ``ξ_i`` stochastic rounding of ``s|x_i|/‖x‖``.

    The norm is taken per block (QSGD's bucketing). Unbiased. Codes take the
    fewest bits that hold ``2s + 1`` values, ``ceil(log2(2s + 1))`` (4 bits at
    the default ``s = 7``), packed bit-plane style.

    Args:
      levels: ``s``, the number of levels, 1 to 127.
      block: elements per scale block (a multiple of 32).
      error_feedback: ``None`` (default: stochastic rounding is unbiased, so
        SGD converges without a residual per parameter), ``"ef14"`` or ``"ef21"``.
      {shared args}

    Returns:
      The codec.

    Example:
      >>> from adaptjax import compression as ajc
      >>> ajc.qsgd(1).code_bits, ajc.qsgd(7).code_bits, ajc.qsgd(8).code_bits
      (2, 4, 5)

    References:
      Alistarh et al., "QSGD: Communication-efficient SGD via gradient
      quantization and encoding", NeurIPS 2017.
    """
    return _QSGD(**locals())


@_quantizer(_Natural)
def natural(
    *,
    block: int = 512,
    error_feedback: str | None = None,
    axis_name: str | tuple[str, ...] = "data",
    min_size: int = 1024,
    fast_axis: str | None = None,
    seed: int = 0,
    bucket_bytes: int | None = None,
    transport: str | None = None,
) -> Codec:
    """Natural compression: unbiased stochastic rounding to a power of two.

    ``|x| = 2^e (1 + f)`` becomes ``2^e`` with probability ``1 − f``, else
    ``2^(e+1)``; 8 bits per element (the sign and an exponent relative to the
    block's largest) plus one scale per block. Its variance is at most
    ``‖x‖²/8``.

    Args:
      block: elements per scale block (a multiple of 32).
      error_feedback: ``None`` (default: stochastic rounding is unbiased, so
        SGD converges without a residual per parameter), ``"ef14"`` or ``"ef21"``.
      {shared args}

    Returns:
      The codec.

    Example:
      >>> from adaptjax import compression as ajc
      >>> ajc.natural().bits     # 8-bit codes and a float32 scale per 512
      8.0625

    References:
      Horváth et al., "Natural compression for distributed deep learning", 2019.
    """
    return _Natural(**locals())
