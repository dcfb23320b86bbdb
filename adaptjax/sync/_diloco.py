"""DiLoCo: local SGD whose outer step is Nesterov momentum on the averaged deltas."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import optax

from adaptjax._codec import GradientCodec
from adaptjax.sync._local_sgd import (
    amortise,
    check_period,
    freeze_histogram,
    local_sgd,
    outer_sync_bytes,
    with_histogram,
)
from adaptjax.sync._strategy import SyncStrategy

if TYPE_CHECKING:
    from adaptjax._wire import WireReport


def diloco(
    H: int = 32,
    axis_name: str | tuple[str, ...] = "data",
    *,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: bool = True,
    codec: GradientCodec | None = None,
    label_histogram: tuple[float, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """DiLoCo's outer loop as the ``post`` step of a chain.

    :func:`adaptjax.sync.local_sgd` with ``outer = optax.sgd(outer_lr,
    momentum=outer_momentum, nesterov=nesterov)``: every ``H`` steps, with
    ``Δ = mean_i (θ - x_i)`` and momentum ``m`` (zero at first)::

        m <- μ m + Δ,   θ <- θ - lr (Δ + μ m)     (Nesterov; θ - lr m without)

    The paper's inner optimizer is AdamW: chain this after
    ``adaptjax.sync.per_replica_optimizer(optax.adamw(...))`` (what
    :func:`adaptjax.sync.sync_chain` does with ``DiLoCo()``).

    Args:
      H: inner steps per outer step, >= 1.
      axis_name: the data-parallel axis.
      outer_lr: the outer learning rate (0.7 in the paper).
      outer_momentum: the outer momentum (0.9).
      nesterov: Nesterov momentum (the paper's choice).
      codec: a codec (:class:`adaptjax.compression.Codec`) to compress the deltas.
      label_histogram: the global label distribution for the replicas'
        ``label_divergence`` (see :func:`adaptjax.sync.local_sgd`), or ``None``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` (state: ``LocalSGDState``;
      per-replica knobs and measurements as :func:`adaptjax.sync.local_sgd`'s).

    References:
      Douillard et al., "DiLoCo: Distributed low-communication training of
      language models", 2023 (arXiv:2311.08105).

    Example:
      >>> import optax, adaptjax
      >>> tx = optax.chain(adaptjax.sync.per_replica_optimizer(optax.adamw(1e-3)),
      ...                  adaptjax.sync.diloco(H=32))
    """
    _check_outer(outer_lr, outer_momentum)
    outer = optax.sgd(outer_lr, momentum=outer_momentum or None, nesterov=nesterov)
    return local_sgd(H, axis_name, outer=outer, codec=codec, label_histogram=label_histogram)


def _check_outer(outer_lr, outer_momentum) -> None:
    if not isinstance(outer_lr, int | float) or not outer_lr > 0:
        raise ValueError(f"DiLoCo outer_lr must be > 0, got {outer_lr!r}")
    if not isinstance(outer_momentum, int | float) or not 0.0 <= outer_momentum < 1.0:
        raise ValueError(f"DiLoCo outer_momentum must be in [0, 1), got {outer_momentum!r}")


@dataclasses.dataclass(frozen=True)
class DiLoCo(SyncStrategy):
    """DiLoCo: ``H`` inner steps alone, then a Nesterov outer step (see :func:`diloco`).

    The inner optimizer is the one you pass (the controller's ``optimizer``;
    the paper uses ``optax.adamw``), its state per replica. A codec
    compresses the outer delta. The outer momentum starts at zero when a run
    switches into DiLoCo.

    **Noise scale:** not estimated (gradients are never averaged; monitors
    are off, see :class:`adaptjax.sync.SyncStrategy`).

    Bytes per device per step, amortised: ``(2 (N-1)/N * P + 12 (N-1)) / H``
    (the deltas' all-reduce and the replicas' three measurements' all-gather).

    Attributes:
      H: inner steps per outer step, >= 1.
      outer_lr: outer learning rate.
      outer_momentum: outer momentum.
      nesterov: Nesterov momentum.
      label_histogram: the global label distribution for the replicas'
        ``label_divergence``, or ``None``.

    Example:
      >>> import adaptjax
      >>> adaptjax.sync.DiLoCo(H=128).wire_formula(4000, 8)
      55.34375
    """

    H: int = 32
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    label_histogram: tuple[float, ...] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_period(self.H)
        _check_outer(self.outer_lr, self.outer_momentum)
        freeze_histogram(self)

    def __repr__(self) -> str:
        head = (
            f"DiLoCo(H={self.H!r}, outer_lr={self.outer_lr!r}, "
            f"outer_momentum={self.outer_momentum!r}, nesterov={self.nesterov!r}"
        )
        return with_histogram(head, self)

    def post(
        self, axis_name: str | tuple[str, ...] = "data", *, codec: GradientCodec | None = None
    ) -> optax.GradientTransformationExtraArgs | None:
        return diloco(
            self.H,
            axis_name,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            nesterov=self.nesterov,
            codec=codec,
            label_histogram=self.label_histogram,
        )

    def wire_formula(self, param_bytes: float, n_replicas: int) -> float:
        return outer_sync_bytes(param_bytes, n_replicas) / self.H

    def amortised_bytes(self, report: WireReport) -> float:
        return amortise(report, self.H)
