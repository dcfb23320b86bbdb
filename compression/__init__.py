"""Gradient codecs and compressed collectives (imported as ``adaptjax.compression``).

Every codec works as ``codec=`` of :func:`adaptjax.sync_gradients` and as an
optax transformation of its own, inside ``shard_map`` with the data axis bound:

>>> import optax, adaptjax
>>> from adaptjax import compression as ajc
>>> tx = optax.chain(adaptjax.sync_gradients("data", codec=ajc.onebit()), optax.sgd(0.1))
>>> tx = optax.chain(ajc.topk(0.01, axis_name="data"), optax.sgd(0.1))

Codecs and the collective that moves each one's compressed form (bytes per
device per step for ``d`` float32 elements on ``N`` replicas):

==========================  ==========================================  =====================
codec                       collective                                  bytes per device
==========================  ==========================================  =====================
:func:`bf16`, :func:`fp16`  owner-compute, 16-bit patterns as integers  ``4d(N−1)/N``
:func:`onebit`              owner-compute, signs packed 32 per word     ``≈2(d/8)(N−1)/N``
:func:`terngrad`            owner-compute, 2-bit codes                  ``≈2(d/4)(N−1)/N``
:func:`qsgd`                owner-compute, ``ceil(log2(2s+1))`` bits    ``≈2(d·b/8)(N−1)/N``
:func:`natural`             owner-compute, 8-bit codes                  ``≈2d(N−1)/N``
:func:`topk`, :func:`dgc`   (value, index) pairs routed to owners       ``≈24k(N−1)/N``
:func:`randomk`             psum of ``k`` values (shared coordinates)   ``8k(N−1)/N``
:func:`powersgd`            psum of ``P``, then of ``Q``                ``8r·(n+m)(N−1)/N``
==========================  ==========================================  =====================

Owner-compute: an all-to-all hands replica ``j`` every replica's encoded chunk
``j``; it decodes and averages them, re-encodes them (with error feedback,
``N`` times its re-encoding error joins its own residual), and an all-gather
returns every encoded chunk to everyone, so the bytes per device stay nearly
constant in ``N`` (owner-compute codecs add one
float32 scale per ``block`` elements). With ``fast_axis`` on a 2-D mesh the fast
axis carries bf16 and only the slow axes carry the compressed payload.

Per leaf (see :func:`plan`), leaves under ``min_size`` go in one float32 psum
(when all of them do, the codec compresses nothing and warns once, when its
first step is traced), and leaves a codec cannot compress or would send more
bytes for than a bf16 psum go as bf16 (owner-compute). Error feedback (``"ef14"``, ``"ef21"``) keeps
its buffers in the optax state as :class:`adaptjax.PerReplica` (merge rule
``"mean"``), so they are checkpointed and a rescale keeps the debt owed to the
averaged gradient.

:func:`onebit_adam` is 1-bit Adam (Tang et al. 2021): a dense ``optax.adam``
warm-up, then a frozen second moment and the replicas' momenta averaged
through :func:`onebit`; it takes per-replica gradients and syncs them itself.

With monitors, :func:`adaptjax.sync_gradients` runs the codec on every step
and lets each replica send its exact gradient at 1% of shared random
coordinates (``codec_sample``) in the monitors' small all-reduce, so the
noise scale is estimated from the exact averaged gradient, not the compressed one.
"""

if __name__ != "adaptjax.compression":  # pragma: no cover - guards against shadowing
    raise ImportError(
        "import this package as `adaptjax.compression`, not as a top-level `compression`"
    )

from typing import TYPE_CHECKING

from adaptjax._lazy import attach

# Public name -> the private module that defines it (a test checks this table,
# __all__ and the TYPE_CHECKING imports agree).
_NAMES = {
    "Codec": "adaptjax.compression._base",
    "BlockCodec": "adaptjax.compression._quantizers",
    "Blocks": "adaptjax.compression._blocks",
    "factory": "adaptjax.compression._base",
    "pack_bits": "adaptjax.compression._bits",
    "unpack_bits": "adaptjax.compression._bits",
    "plan": "adaptjax.compression._plan",
    "bf16": "adaptjax.compression._quantizers",
    "fp16": "adaptjax.compression._quantizers",
    "natural": "adaptjax.compression._quantizers",
    "onebit": "adaptjax.compression._quantizers",
    "qsgd": "adaptjax.compression._quantizers",
    "terngrad": "adaptjax.compression._quantizers",
    "dgc": "adaptjax.compression._sparse",
    "randomk": "adaptjax.compression._sparse",
    "topk": "adaptjax.compression._sparse",
    "powersgd": "adaptjax.compression._powersgd",
    "onebit_adam": "adaptjax.compression._onebit_adam",
    "native_topk_available": "adaptjax.compression._topk_native",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time names load lazily
    from adaptjax.compression._base import Codec, factory
    from adaptjax.compression._bits import pack_bits, unpack_bits
    from adaptjax.compression._blocks import Blocks
    from adaptjax.compression._onebit_adam import onebit_adam
    from adaptjax.compression._plan import plan
    from adaptjax.compression._powersgd import powersgd
    from adaptjax.compression._quantizers import (
        BlockCodec,
        bf16,
        fp16,
        natural,
        onebit,
        qsgd,
        terngrad,
    )
    from adaptjax.compression._sparse import dgc, randomk, topk
    from adaptjax.compression._topk_native import native_topk_available

__all__ = [
    "Codec",
    "BlockCodec",
    "Blocks",
    "factory",
    "pack_bits",
    "unpack_bits",
    "plan",
    "bf16",
    "fp16",
    "natural",
    "onebit",
    "qsgd",
    "terngrad",
    "dgc",
    "randomk",
    "topk",
    "powersgd",
    "onebit_adam",
    "native_topk_available",
]

__getattr__, __dir__ = attach(__name__, _NAMES)
