"""Communication knobs chosen by predicted time: the dense lane's collective, bucket sizes.

Both are decisions of the α–β model alone (:class:`~adaptjax.costs.StepTimeModel`
links), so they can be asked before anything is compiled:

* :func:`choose_dense_lane`: one all-reduce of ``m`` bytes, or a
  reduce-scatter followed by an all-gather (each ``(N-1)/N·m`` bytes, ``N-1``
  message steps) — equal bytes, different α and β per kind, so the calibrated
  links decide (on XLA:CPU across processes the pair measured about twice as
  slow as one all-reduce).
* :func:`choose_bucket_bytes`: leaves fused into buckets of at most ``B``
  bytes (a larger leaf split into ``ceil(s/B)`` pieces, ``buckets``):
  fewer buckets pay fewer latencies; smaller buckets let all but the last
  hide behind ``overlap_compute`` seconds of backward pass. With
  ``kind="owner-compute"`` each bucket is a quantizer's exchange (an
  all-to-all and an all-gather, or one all-gather at 2 replicas).

Both knobs are real: :func:`adaptjax.sync_gradients` takes
``dense_lane="reduce-scatter+all-gather"``, and the quantizer codecs of
:mod:`adaptjax.compression` take ``bucket_bytes`` (their bucketing is
``buckets``'). A :class:`~adaptjax.costs.Planner` attached to a
controller turns them: each configuration's step is built with the lane or
bucket size these functions predict fastest at its device count, on the
calibrated links (:meth:`~adaptjax.costs.Planner.schedule`). Under the α–β
model alone, without overlap, one bucket is never slower than several (each
extra bucket pays its latency again), so buckets are chosen only where the
model has fitted overlap between communication and computation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from adaptjax._wire import KINDS, _ring_bytes
from adaptjax.costs._model import StepTimeModel

#: The exchange of one quantizer bucket (:mod:`adaptjax.compression`'s owner-compute).
OWNER_COMPUTE = "owner-compute"


def exchange_time(model: StepTimeModel, kind: str, devices: int, message_bytes: float,
                  operands: int = 1) -> float:
    """Predicted seconds of one ``kind`` collective (or owner-compute exchange) of a message.

    ``message_bytes`` is the collective's per-device operand for the reducing
    kinds and all-to-all (the whole message), as for all-reduce; for
    ``"owner-compute"`` it is one replica's encoded bucket ``E``: an
    all-to-all of ``E`` then an all-gather of each owner's ``E/N``, or at 2
    replicas one all-gather of ``E`` (the same bytes in one collective; see
    ``adaptjax.compression``'s ``choose_transport``).

    Example:
      >>> from adaptjax.costs import LinkModel, StepTimeModel
      >>> from adaptjax.costs._schedule import exchange_time
      >>> model = StepTimeModel({"*": LinkModel(0.0, 1e-9)})
      >>> exchange_time(model, "owner-compute", 4, 4e6) == 2 * 3 / 4 * 4e6 * 1e-9
      True
    """
    n = devices
    if kind == OWNER_COMPUTE:
        if n == 2:
            return exchange_time(model, "all-gather", n, message_bytes)
        return (exchange_time(model, "all-to-all", n, message_bytes)
                + exchange_time(model, "all-gather", n, message_bytes / n))
    if kind not in KINDS:
        raise ValueError(
            f"unknown collective kind {kind!r}: use one of {', '.join(KINDS)} or {OWNER_COMPUTE!r}"
        )
    return model.link(kind).time(kind, n, _ring_bytes(kind, n, message_bytes), operands)


def choose_dense_lane(
    model: StepTimeModel, message_bytes: float, devices: int, *, leaves: int = 1,
    scalar_bytes: float = 0.0,
) -> tuple[str, dict[str, float]]:
    """The faster way to average ``message_bytes`` over ``devices`` replicas.

    The all-reduce lane is one tuple all-reduce of ``leaves`` operands (XLA's
    combiner joins the per-leaf psums), plus one more operand for the
    monitors' scalars when ``scalar_bytes`` > 0; each further operand pays
    the link's ``alpha_operand``. The other lane sends one flat buffer, and the
    scalars in their own small all-reduce.

    Returns:
      ``(choice, {choice: predicted seconds, ...})`` with choices
      ``"all-reduce"`` and ``"reduce-scatter+all-gather"``.

    Example:
      >>> from adaptjax.costs import LinkModel, StepTimeModel, choose_dense_lane
      >>> model = StepTimeModel({"all-reduce": LinkModel(1e-5, 2e-9),
      ...                        "reduce-scatter": LinkModel(1e-5, 1e-9),
      ...                        "all-gather": LinkModel(1e-5, 1e-9)})
      >>> choose_dense_lane(model, 4e6, 8)[0]
      'reduce-scatter+all-gather'
      >>> gloo = LinkModel(1e-3, 1e-8, alpha_operand=1e-3)  # a latency per operand
      >>> model = StepTimeModel({"all-reduce": gloo, "reduce-scatter": LinkModel(1e-3, 1e-8),
      ...                        "all-gather": LinkModel(1e-3, 1e-8)})
      >>> choose_dense_lane(model, 3.4e5, 2)[0], choose_dense_lane(model, 3.4e5, 2, leaves=6)[0]
      ('all-reduce', 'reduce-scatter+all-gather')
    """
    n, scalars = devices, 1 if scalar_bytes > 0 else 0
    ar = exchange_time(model, "all-reduce", n, message_bytes + scalar_bytes,
                       operands=max(int(leaves), 1) + scalars)
    # each replica ends with 1/n of the sum, then gathers the n shards
    pair = (exchange_time(model, "reduce-scatter", n, message_bytes)
            + exchange_time(model, "all-gather", n, message_bytes / n))
    if scalars:
        pair += exchange_time(model, "all-reduce", n, scalar_bytes)
    times = {"all-reduce": ar, "reduce-scatter+all-gather": pair}
    return min(times, key=lambda k: (times[k], k != "all-reduce")), times


def buckets(leaf_bytes: Sequence[float], bucket_bytes: float, *,
            split: bool = True) -> list[float]:
    """Leaves (in order) fused into buckets of at most ``bucket_bytes``; big leaves split.

    With ``split=False`` a leaf larger than a bucket is a bucket of its own, as
    a codec's buckets are (``adaptjax.compression``: leaves are never split).

    Example:
      >>> from adaptjax.costs._schedule import buckets
      >>> buckets([10, 10, 50, 5], 20), buckets([10, 10, 50, 5], 20, split=False)
      ([20.0, 20.0, 20.0, 10.0, 5.0], [20.0, 50.0, 5.0])
    """
    if not bucket_bytes > 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    out: list[float] = []
    fill = 0.0
    for size in leaf_bytes:
        if size > bucket_bytes and not split:
            if fill:
                out.append(fill)
                fill = 0.0
            out.append(float(size))
        elif size > bucket_bytes:
            if fill:
                out.append(fill)
                fill = 0.0
            pieces = math.ceil(size / bucket_bytes)
            out += [bucket_bytes] * (pieces - 1) + [size - bucket_bytes * (pieces - 1)]
        elif fill + size > bucket_bytes:
            out.append(fill)
            fill = size
        else:
            fill += size
    if fill:
        out.append(fill)
    return [float(b) for b in out]


def choose_bucket_bytes(
    model: StepTimeModel,
    leaf_bytes: Sequence[float],
    devices: int,
    *,
    kind: str = "all-reduce",
    candidates: Sequence[float] = tuple(2.0**k for k in range(12, 29)),
    overlap_compute: float = 0.0,
    wire_fraction: float = 1.0,
    split: bool = True,
) -> tuple[float, dict[float, float]]:
    """The bucket size with the least predicted exposed communication.

    Exposed time of buckets ``b₁..b_k`` (each a collective of ``kind``, or an
    ``"owner-compute"`` exchange, of ``wire_fraction·bᵢ`` bytes — a codec's
    encoded share of a float32 bucket, e.g. ``bits / 32``):
    ``Σ t(bᵢ) − min(Σ t(bᵢ) − t(b_k), overlap_compute)`` — all but the last
    bucket can run while ``overlap_compute`` seconds of backward pass remain.
    ``leaf_bytes`` in the order the buckets are sent; ``split``: as in
    ``buckets``.

    Returns:
      ``(best bucket bytes, {bucket bytes: predicted seconds})``; ties go to
      the larger bucket.

    Example:
      >>> from adaptjax.costs import LinkModel, StepTimeModel, choose_bucket_bytes
      >>> model = StepTimeModel({"all-reduce": LinkModel(1e-4, 1e-9)})
      >>> choose_bucket_bytes(model, [4e6] * 8, 8, candidates=(1e6, 4e6, 32e6))[0]  # latency
      32000000.0
      >>> choose_bucket_bytes(model, [4e6] * 8, 8, candidates=(1e6, 4e6, 32e6),
      ...                     overlap_compute=1.0)[0]  # hidden behind the backward pass
      1000000.0
    """
    if not 0.0 < wire_fraction:
        raise ValueError(f"wire_fraction must be > 0, got {wire_fraction}")
    times = {}
    for size in candidates:
        parts = [exchange_time(model, kind, devices, wire_fraction * b)
                 for b in buckets(leaf_bytes, size, split=split)]
        total = math.fsum(parts)
        hidden = min(total - (parts[-1] if parts else 0.0), overlap_compute)
        times[float(size)] = total - hidden
    best = min(times, key=lambda b: (times[b], -b))
    return best, times
