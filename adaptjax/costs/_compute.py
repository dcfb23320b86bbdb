"""Compute time of one step: a fixed cost plus a cost per sample, fitted on this model.

Per replica with ``b`` samples in ``k`` micro-batches on ``n`` replicas::

    T_compute = fixed + per_microbatch·k + per_sample·b + per_global_sample·n·b
                + per_replica·n + per_replica_microbatch·n·k

On real accelerators each replica computes alone and ``per_global_sample``,
``per_replica`` and ``per_replica_microbatch`` are 0 (Pollux's T(M) = t₀ +
t₁·M per replica). Simulated devices that share one host's cores
(``--xla_force_host_platform_device_count``) run the replicas' work on the
same cores, so the step grows with the global batch ``n·b``, with each
replica's fixed work and with each replica's work per micro-batch: the fit
finds which the measurements show. Coefficients are fitted by
non-negative least squares (none of them can be negative).

References:
  Qiao et al., "Pollux", OSDI 2021 (T(M) = t₀ + t₁·M fitted online).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

FEATURES = ("fixed", "per_microbatch", "per_sample", "per_global_sample", "per_replica",
            "per_replica_microbatch")


def _features(devices: int, per_device_batch: float, microbatches: int) -> list[float]:
    return [1.0, float(microbatches), float(per_device_batch),
            float(devices) * float(per_device_batch), float(devices),
            float(devices) * float(microbatches)]


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares ``argmin_x>=0 |a x - y|`` (scipy's Lawson–Hanson)."""
    from scipy.optimize import nnls as _nnls  # (comes with jax) only when a model is fitted

    scale = np.where(np.abs(a).max(axis=0) > 0, np.abs(a).max(axis=0), 1.0)
    x, _ = _nnls(a / scale, y)
    return x / scale


@dataclasses.dataclass(frozen=True)
class ComputeModel:
    """Seconds of one step's computation (forward, backward, optimizer) per configuration.

    Attributes:
      fixed: seconds per step whatever the batch.
      per_microbatch: seconds per micro-batch (a loop iteration of accumulation).
      per_sample: seconds per sample of one replica's batch.
      per_global_sample: seconds per sample of the global batch (replicas that
        share a host's cores; 0 on real accelerators).
      per_replica: seconds per replica (fixed work of replicas sharing a host's
        cores; 0 on real accelerators).
      per_replica_microbatch: seconds per replica and micro-batch (each
        replica's work per accumulation step on a host's shared cores; 0 on
        real accelerators).

    Example:
      >>> from adaptjax.costs import ComputeModel
      >>> round(ComputeModel(fixed=0.01, per_sample=0.001).time(devices=4, batch_size=64), 9)
      0.026
    """

    fixed: float = 0.0
    per_microbatch: float = 0.0
    per_sample: float = 0.0
    per_global_sample: float = 0.0
    per_replica: float = 0.0
    per_replica_microbatch: float = 0.0

    def __post_init__(self) -> None:
        for name in FEATURES:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"ComputeModel: {name} must be a finite number >= 0, got {value!r}"
                )

    def time(self, *, devices: int, batch_size: int, microbatches: int = 1) -> float:
        """Seconds of computation for a global ``batch_size`` over ``devices`` replicas."""
        if devices < 1 or batch_size < 1 or microbatches < 1:
            raise ValueError(
                f"devices, batch_size and microbatches must be >= 1, got {devices}, "
                f"{batch_size}, {microbatches}"
            )
        coef = [getattr(self, n) for n in FEATURES]
        feats = _features(devices, batch_size / devices, microbatches)
        return math.fsum(c * f for c, f in zip(coef, feats, strict=True))

    def on_own_devices(self) -> ComputeModel:
        """The same costs on replicas that each have their own processor.

        Host-shared work (``per_global_sample``, ``per_replica``,
        ``per_replica_microbatch``) becomes per-replica work: one replica's
        share of it is what a replica computing alone spends.
        """
        return ComputeModel(self.fixed + self.per_replica,
                            self.per_microbatch + self.per_replica_microbatch,
                            self.per_sample + self.per_global_sample, 0.0, 0.0, 0.0)


def fit_compute(
    devices: Sequence[int],
    batch_sizes: Sequence[int],
    microbatches: Sequence[int],
    seconds: Sequence[float],
) -> ComputeModel:
    """Fits a :class:`ComputeModel` to measured compute seconds (non-negative least squares).

    Args:
      devices: replicas of each measurement.
      batch_sizes: the global batch of each.
      microbatches: micro-batches of each.
      seconds: the compute seconds of each (step time minus modelled communication).

    Returns:
      The fitted model.

    Example:
      >>> from adaptjax.costs._compute import fit_compute
      >>> bs = [8, 16, 32, 64, 64]
      >>> secs = [0.02 + 0.003 * b / 2 for b in bs]  # 2 replicas: 3 ms per replica sample
      >>> m = fit_compute([2] * 5, bs, [1] * 5, secs)
      >>> round(m.fixed + m.per_microbatch, 9), round(m.per_sample + 2 * m.per_global_sample, 9)
      (0.02, 0.003)
    """
    n = len(seconds)
    if not (len(devices) == len(batch_sizes) == len(microbatches) == n):
        raise ValueError(
            "fit_compute: devices, batch_sizes, microbatches and seconds need one entry each "
            f"per measurement, got {len(devices)}, {len(batch_sizes)}, {len(microbatches)}, {n}"
        )
    if len({b / d for b, d in zip(batch_sizes, devices, strict=True)}) < 2:
        raise ValueError(
            "fit_compute: needs >= 2 distinct per-replica batch sizes to separate fixed from "
            "per-sample cost; measure a second batch size"
        )
    a = np.array([_features(d, b / d, k) for d, b, k in
                  zip(devices, batch_sizes, microbatches, strict=True)], dtype=np.float64)
    y = np.array(seconds, dtype=np.float64)
    if not np.all(np.isfinite(y)):
        raise ValueError("fit_compute: every time must be finite")
    # Relative error matters (step times span orders of magnitude): weight rows by 1/y.
    w = 1.0 / np.maximum(np.abs(y), 1e-9)
    x = nnls(a * w[:, None], y * w)
    return ComputeModel(*(float(v) for v in x))
