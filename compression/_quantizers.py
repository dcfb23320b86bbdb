"""Element-wise quantisers moved by the owner-compute pattern.

``bf16``/``fp16`` (cast), ``onebit`` (sign + scale, 1 bit), ``terngrad``
(stochastic ternary, 2 bits), ``qsgd`` (``s`` stochastic levels,
``ceil(log2(2s+1))`` bits) and ``natural`` (stochastic power-of-two, 8 bits).
Each replica encodes its flat gradient, an all-to-all delivers chunk ``j`` of
every replica to replica ``j``, which decodes, averages, re-encodes, and an
all-gather returns every encoded chunk to everyone: ``2·(N−1)/N`` of one encoded
gradient per device. With error feedback, the owner's re-encoding error is
folded (times ``N``) into its own worker residual on the chunk it owns, so the
mean of the residuals carries it into the next step and no server buffer is
kept (a param-sized server buffer cost three full passes per step).
With ``fast_axis`` set and a tuple ``axis_name`` (a 2-D mesh), the fast axis
carries bf16 (reduce-scatter, then all-gather) and only the slow axes carry the
compressed payload, on ``1/F`` of the gradient.

``bucket_bytes`` (off by default: the codec's whole lane is one exchange)
fuses the codec's leaves, in order, into buckets of at most that many bytes
of float32 gradient and splits a larger leaf into pieces of that size
(:func:`bucket_plan`, the bucketing :func:`adaptjax.costs.buckets` models);
each bucket is one owner-compute exchange (one all-to-all and one all-gather,
or one all-gather at 2 replicas) with seeds of its own.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import ClassVar

import jax.numpy as jnp
from adaptjax.compression._base import Codec, F, factory
from adaptjax.compression._bits import mix_seed
from adaptjax.compression._collectives import (
    bound_size,
    choose_transport,
    owner_compute,
    owner_compute_leaves,
)
from adaptjax.compression._formats import (
    Cast,
    Format,
    Levels,
    Natural,
    Sign,
    Ternary,
    qsgd_bits,
)
from adaptjax.compression._lanes import Ctx, LeafIn, LeafOut, leaf_outs
from adaptjax.compression._layout import make_layout, prod

# A lane of at most this many elements is sent as one flat bucket (one encode, traced
# once: compiles faster); above it each leaf is viewed in place (no float32 concatenation,
# which XLA's CPU backend runs at a tenth of copy speed).
BUCKET_MAX = 1 << 20


def bucket_plan(sizes, unit: int) -> list[list[tuple[int, int, int]]]:
    """Leaves of ``sizes`` elements fused, in order, into buckets of at most ``unit``.

    A leaf larger than ``unit`` closes the open bucket and is split into
    pieces of ``unit`` elements (the last one shorter), each its own bucket;
    this is :func:`adaptjax.costs.buckets` on ``4·size`` bytes with
    ``4·unit``-byte buckets.

    Returns:
      One list per bucket of ``(leaf index, start, stop)`` element ranges.

    Example:
      >>> from adaptjax.compression._quantizers import bucket_plan
      >>> bucket_plan([3, 3, 9, 1], 5)
      [[(0, 0, 3)], [(1, 0, 3)], [(2, 0, 5)], [(2, 5, 9)], [(3, 0, 1)]]
    """
    out: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    fill = 0
    for i, d in enumerate(int(x) for x in sizes):
        if d > unit:
            if cur:
                out.append(cur)
                cur, fill = [], 0
            out += [[(i, a, min(d, a + unit))] for a in range(0, d, unit)]
        elif fill + d > unit:
            out.append(cur)
            cur, fill = [(i, 0, d)], d
        else:
            cur.append((i, 0, d))
            fill += d
    if cur:
        out.append(cur)
    return out


def _check_bucket_bytes(value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or (
        value < 4 or int(value) % 4
    ):
        raise ValueError(
            f"bucket_bytes must be None or a positive multiple of 4 (bytes of float32 gradient "
            f"per exchange), got {value!r}; e.g. 4 << 20"
        )
    return int(value)


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)  # the factory call (Codec)
class Quantizer(Codec):
    """An element-wise codec moved by the owner-compute pattern.

    Attributes:
      block: elements per scale block (a multiple of 32).
      fast_axis: the fast axis of a 2-D mesh for the two-level mode, or None.
      bucket_bytes: ``None`` (the codec's lane in one exchange) or the most
        bytes of float32 gradient (4 per element) one exchange carries: leaves
        are fused into buckets of at most this size and a larger leaf is
        split (see :func:`bucket_plan`).
    """

    block: int = 512
    fast_axis: str | None = None
    bucket_bytes: int | None = None

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "bucket_bytes", _check_bucket_bytes(self.bucket_bytes))
        if int(self.block) != self.block or self.block < 32 or self.block % 32:
            raise ValueError(f"block must be a positive multiple of 32, got {self.block}")
        object.__setattr__(self, "block", int(self.block))
        if self.fast_axis is not None and not (isinstance(self.fast_axis, str) and self.fast_axis):
            raise ValueError(f"fast_axis must be an axis name or None, got {self.fast_axis!r}")

    @property
    def fmt(self) -> Format:
        raise NotImplementedError

    @property
    def bits(self) -> float:
        return self.fmt.bits_per_element

    def leaf_bytes(self, shape, n: int) -> float:
        if n <= 1:
            return 0.0
        size = prod(shape)
        scales = -(-size // self.fmt.block) * 4 if self.fmt.has_scale else 0
        return 2.0 * (n - 1) / n * (size * self.fmt.bits / 8 + scales)

    def method(self, shape, n: int) -> str:
        # Never worse than a bf16 psum (bits <= 16): compressible leaves use the codec.
        return "f32" if prod(shape) < self.min_size else "codec"

    def _check_axes(self, names) -> None:
        if self.fast_axis is not None and self.fast_axis not in names:
            raise ValueError(
                f"fast_axis {self.fast_axis!r} is not in axis_name {names}; pass "
                f"axis_name=(slow, {self.fast_axis!r}) on a 2-D mesh"
            )

    def reduce(self, leaves: Sequence[LeafIn], ctx: Ctx) -> list[LeafOut]:
        xs = [i.x for i in leaves]
        shapes = [i.leaf.shape for i in leaves]
        if self.bucket_bytes is None:
            return leaf_outs(*self._exchange(xs, shapes, ctx, ctx.seed_for(0), ctx.seed_for(1)))
        return self._buckets(xs, shapes, ctx)

    def _buckets(self, xs, shapes, ctx: Ctx) -> list[LeafOut]:
        """One exchange per bucket of :func:`bucket_plan`; a split leaf is joined again."""
        plan = bucket_plan([prod(sh) for sh in shapes], self.bucket_bytes // 4)
        pieces: list[list[LeafOut]] = [[] for _ in xs]  # per leaf: the LeafOut of each piece
        for b, segs in enumerate(plan):
            seeds = (ctx.seed_for(0), ctx.seed_for(1))
            if b:  # bucket 0 keeps the unbucketed seeds: one bucket is the default exactly
                seeds = tuple(mix_seed(s, 0xB0C4E7, b) for s in seeds)
            parts, part_shapes = [], []
            for i, a, z in segs:
                whole = (a, z) == (0, prod(shapes[i]))
                parts.append(xs[i] if whole else jnp.ravel(xs[i])[a:z])
                part_shapes.append(shapes[i] if whole else (z - a,))
            got = leaf_outs(*self._exchange(parts, part_shapes, ctx, *seeds))
            for (i, _, _), piece in zip(segs, got, strict=True):
                pieces[i].append(piece)

        def join(i, field):
            got = [getattr(p, field) for p in pieces[i]]
            if got[0] is None or len(got) == 1:
                return got[0]
            return jnp.concatenate([jnp.ravel(g) for g in got]).reshape(shapes[i])

        fields = ("out", "residual", "server")
        outs, res, srv = ([join(i, f) for i in range(len(xs))] for f in fields)
        return leaf_outs(outs, res, srv)

    def _exchange(self, xs, shapes, ctx: Ctx, seed_worker, seed_server):
        """One exchange: the compressed mean of ``xs`` (the whole lane or one bucket).

        Returns ``(outs, residuals or None, server residuals or None)``, lists like ``xs``.
        """
        big = sum(prod(sh) for sh in shapes) > BUCKET_MAX
        if self.fast_axis is None and (big or choose_transport(ctx.n) != "owner"):
            # the leaf-by-leaf path also carries the all-gather transport (2 replicas)
            outs, res = owner_compute_leaves(
                xs,
                self.fmt,
                names=ctx.names,
                n=ctx.n,
                seed_worker=seed_worker,
                seed_server=seed_server,
                residual=ctx.residual,
                fold=ctx.residual,
            )
            return outs, res, None
        # One flat bucket (a small lane, or the two-level mode): the codec's code is
        # traced once for the lane instead of once per leaf (compile time).
        fast = (self.fast_axis,) if self.fast_axis is not None else ()
        slow = tuple(a for a in ctx.names if a not in fast)
        f = bound_size(fast) if fast else 1
        s = ctx.n // f
        lay = make_layout([prod(sh) for sh in shapes], self.fmt.block, f * s)
        out, res, srv = owner_compute(
            lay.flatten(xs),
            self.fmt,
            slow=slow,
            slow_size=s,
            fast=fast,
            fast_size=f,
            seed_worker=seed_worker,
            seed_server=seed_server,
            valid=lay.block_counts(),
            residual=ctx.residual,
            server_mode="fold" if ctx.residual else None,
        )
        outs = lay.unflatten(out, shapes)
        res = lay.unflatten(res, shapes) if res is not None else None
        srv = lay.unflatten(srv, shapes) if srv is not None else None
        return outs, res, srv

    # ------------------------------------------------------------- protocol
    def encode(self, x, *, seed=0):
        """Encodes one array: ``{"codes": uint32 words, "scales": float32 per block}``.

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
        fmt = self.fmt
        nb = max(1, -(-size // fmt.block))
        padded = jnp.pad(flat, (0, nb * fmt.block - size))
        valid = make_layout([size], fmt.block).block_counts().reshape(1, nb)
        words, scales = fmt.encode_words(
            padded.reshape(1, nb, fmt.block), mix_seed(seed), jnp.asarray(valid)
        )
        payload = {"codes": words.reshape(-1)}
        if fmt.has_scale:
            payload["scales"] = scales.reshape(-1)
        return payload

    def decode(self, payload, shape, *, seed=0):
        """Decodes :meth:`encode`'s payload to a float32 array of ``shape``."""
        del seed
        fmt = self.fmt
        size = prod(shape)
        nb = max(1, -(-size // fmt.block))
        scales = payload["scales"].reshape(1, nb) if fmt.has_scale else None
        y = fmt.decode_words(payload["codes"].reshape(1, nb, -1), scales)
        return y.reshape(-1)[:size].reshape(shape)


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class _Cast(Quantizer):
    dtype: str = "bfloat16"
    block: int = 32

    @property
    def name(self):  # type: ignore[override]
        return "bf16" if self.dtype == "bfloat16" else "fp16"

    @property
    def fmt(self) -> Format:
        return Cast(bits=16, block=self.block, has_scale=False, dtype=self.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class _OneBit(Quantizer):
    name: ClassVar[str] = "onebit"

    @property
    def fmt(self) -> Format:
        return Sign(bits=1, block=self.block)


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class _TernGrad(Quantizer):
    name: ClassVar[str] = "terngrad"
    randomness: ClassVar[str] = "per_replica"

    @property
    def fmt(self) -> Format:
        return Ternary(bits=2, block=self.block)


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class _QSGD(Quantizer):
    levels: int = 7
    name: ClassVar[str] = "qsgd"
    randomness: ClassVar[str] = "per_replica"

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.levels, bool) or int(self.levels) != self.levels or not (
            1 <= self.levels <= 127
        ):
            raise ValueError(
                f"levels must be an integer in [1, 127], got {self.levels}; e.g. 7 (4 bits)"
            )
        object.__setattr__(self, "levels", int(self.levels))

    @property
    def fmt(self) -> Format:
        return Levels(
            bits=qsgd_bits(self.levels), block=self.block, levels=self.levels
        )


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class _Natural(Quantizer):
    name: ClassVar[str] = "natural"
    randomness: ClassVar[str] = "per_replica"

    @property
    def fmt(self) -> Format:
        return Natural(bits=8, block=self.block)


# The template of the six factories: a signature ending in these parameters, with
# these defaults, an Args section ending in the line "{shared args}", and the body
# `return cls(**locals())` (see _quantizer).
_SHARED = {"axis_name": "data", "min_size": 1024, "fast_axis": None, "seed": 0,
           "bucket_bytes": None}
_SHARED_ARGS = """\
      axis_name: the data-parallel axis (or tuple of axes) of the optax form.
      min_size: leaves with fewer elements go in one float32 psum.
      fast_axis: two-level mode on a 2-D mesh: bf16 over this axis, the codec
        over the others (``axis_name`` must then be a tuple holding it).
      seed: seed of the random numbers (mixed with the step and replica index).
      bucket_bytes: ``None`` (one exchange for the codec's leaves) or the most
        float32 bytes of gradient per exchange (see :class:`Quantizer`).
"""


def _quantizer(cls: type[Quantizer]) -> Callable[[F], F]:
    """A factory of ``cls`` on the quantizers' template (checked), registered by :func:`factory`."""

    def make(fn: F) -> F:
        params = inspect.signature(fn).parameters
        tail = {k: p.default for k, p in list(params.items())[-len(_SHARED):]}
        if tail != _SHARED or "      {shared args}\n" not in (fn.__doc__ or ""):
            raise TypeError(f"{fn.__name__} does not follow the quantizer factory template")
        fn.__doc__ = fn.__doc__.replace("      {shared args}\n", _SHARED_ARGS)
        return factory(cls)(fn)

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
      >>> ajc.qsgd(1).fmt.bits, ajc.qsgd(7).fmt.bits, ajc.qsgd(8).fmt.bits
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
      >>> ajc.natural().fmt.bits
      8

    References:
      Horváth et al., "Natural compression for distributed deep learning", 2019.
    """
    return _Natural(**locals())
