"""S-SGD: average the gradients every step (the strategy of :func:`adaptjax.sync_gradients`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import optax

from adaptjax._codec import GradientCodec
from adaptjax._sync import sync_gradients
from adaptjax.sync._strategy import SyncStrategy, all_reduce_bytes


@dataclasses.dataclass(frozen=True)
class SSGD(SyncStrategy):
    """Synchronous SGD: one all-reduce of the gradients per step; one replicated model.

    ``pre`` is :func:`adaptjax.sync_gradients` (codecs and monitors work as
    there); the optimizer state is replicated; there is no ``post``. Every
    replica differentiates at the global parameters.

    **Noise scale:** estimated every step from this replica's gradient and the
    averaged one (see :func:`adaptjax.sync_gradients`).

    Bytes per device per step: ``2 (N-1)/N * P`` for ``P`` bytes of gradients
    (a codec lowers it).

    Example:
      >>> import optax, adaptjax
      >>> tx = adaptjax.sync.sync_chain(optax.sgd(0.1), adaptjax.sync.SSGD())
      >>> adaptjax.sync.SSGD().wire_formula(4000, 8)
      7000.0
    """

    local_models: ClassVar[bool] = False
    accepts_codec: ClassVar[bool] = True

    def pre(
        self,
        axis_name: str | tuple[str, ...] = "data",
        *,
        codec: GradientCodec | None = None,
        monitors: Sequence[Any] = (),
        **sync_kwargs: Any,
    ) -> optax.GradientTransformationExtraArgs:
        return sync_gradients(axis_name, codec=codec, monitors=monitors, **sync_kwargs)

    def post(
        self, axis_name: str | tuple[str, ...] = "data", *, codec: GradientCodec | None = None
    ) -> optax.GradientTransformationExtraArgs | None:
        return None

    def wire_formula(self, param_bytes: float, n_replicas: int) -> float:
        return all_reduce_bytes(param_bytes, n_replicas)
