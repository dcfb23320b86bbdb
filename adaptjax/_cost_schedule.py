"""Communication knobs chosen by predicted time: the dense lane's collective, bucket sizes.

Both are decisions of the α–β model alone (:class:`~adaptjax.costs.StepTimeModel`
links), so they can be asked before anything is compiled:

* :func:`choose_dense_lane`: one all-reduce of ``m`` bytes, or a
  reduce-scatter followed by an all-gather (each ``(N-1)/N·m`` bytes, ``N-1``
  message steps) — equal bytes, different α and β per kind, so the calibrated
  links decide (on XLA:CPU across processes the pair measured about twice as
  slow as one all-reduce).
* :func:`choose_bucket_bytes`: leaves fused into buckets of at most ``B``
  bytes (a larger leaf split into ``ceil(s/B)`` pieces): fewer buckets pay
  fewer latencies; smaller buckets let all but the last hide behind
  ``overlap_compute`` seconds of backward pass.

These are the model's answers; the codecs' own bucketing (``min_size`` and
the per-leaf plan of :mod:`adaptjax.compression`) is not driven by them yet.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from adaptjax._cost_model import StepTimeModel
from adaptjax._wire import _ring_bytes


def choose_dense_lane(
    model: StepTimeModel, message_bytes: float, devices: int
) -> tuple[str, dict[str, float]]:
    """The faster way to average ``message_bytes`` over ``devices`` replicas.

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
    """
    ar = model.link("all-reduce").time("all-reduce", devices,
                                       _ring_bytes("all-reduce", devices, message_bytes))
    half = _ring_bytes("reduce-scatter", devices, message_bytes)
    pair = (model.link("reduce-scatter").time("reduce-scatter", devices, half)
            + model.link("all-gather").time("all-gather", devices, half))
    times = {"all-reduce": ar, "reduce-scatter+all-gather": pair}
    return min(times, key=lambda k: (times[k], k != "all-reduce")), times


def buckets(leaf_bytes: Sequence[float], bucket_bytes: float) -> list[float]:
    """Leaves (in order) fused into buckets of at most ``bucket_bytes``; big leaves split.

    Example:
      >>> from adaptjax.costs import buckets
      >>> buckets([10, 10, 50, 5], 20)
      [20.0, 20.0, 20.0, 10.0, 5.0]
    """
    if not bucket_bytes > 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    out: list[float] = []
    fill = 0.0
    for size in leaf_bytes:
        if size > bucket_bytes:
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
) -> tuple[float, dict[float, float]]:
    """The bucket size with the least predicted exposed communication.

    Exposed time of buckets ``b₁..b_k`` (each a collective of ``kind``):
    ``Σ t(bᵢ) − min(Σ t(bᵢ) − t(b_k), overlap_compute)`` — all but the last
    bucket can run while ``overlap_compute`` seconds of backward pass remain.

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
    link = model.link(kind)
    times = {}
    for size in candidates:
        parts = [link.time(kind, devices, _ring_bytes(kind, devices, b))
                 for b in buckets(leaf_bytes, size)]
        total = math.fsum(parts)
        hidden = min(total - (parts[-1] if parts else 0.0), overlap_compute)
        times[float(size)] = total - hidden
    best = min(times, key=lambda b: (times[b], -b))
    return best, times
