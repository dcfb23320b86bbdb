"""Synchronous model averaging (SMA): local steps, parameters averaged every step."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import optax

from adaptjax._codec import GradientCodec
from adaptjax._per_replica import PerReplica
from adaptjax._tree import axis_size, pmean_replicas
from adaptjax.sync._strategy import (
    LOCAL_MERGE,
    SyncStrategy,
    all_reduce_bytes,
    check_axis_params,
)


class ModelAveragingState(NamedTuple):
    """State of :func:`model_averaging`: this replica's model (``PerReplica``)."""

    local: PerReplica
    _model_sync = True


def model_averaging(
    axis_name: str | tuple[str, ...] = "data", *, alpha: float | None = None
) -> optax.GradientTransformationExtraArgs:
    """Synchronous model averaging as the ``post`` step of a chain.

    Each replica applies its own optimizer update to its own model ``x_i``,
    then the models are averaged (one all-reduce of the parameters) and each
    replica is corrected toward the average::

        x̃_i = x_i + u_i,   z = mean_i x̃_i,   x_i <- x̃_i + alpha (z - x̃_i)

    The global parameters become ``z``, the mean of the local models after the
    correction too. ``alpha = 1`` averages fully every step; smaller values
    leave each replica on its own trajectory, pulled toward the average (the
    elastic correction of Crossbow's SMA, whose central model is here the
    replicas' average). With identical data on every replica this is S-SGD.

    Args:
      axis_name: the data-parallel axis.
      alpha: the correction toward the average in ``(0, 1]``; ``None``:
        ``1/N`` (Crossbow's choice; ``1`` on one replica).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      ``ModelAveragingState``; ``update(updates, state, params)`` needs
      the global ``params``.

    References:
      Koliousis et al., "Crossbow: Scaling deep learning with small batch
      sizes on multi-GPU servers", VLDB 2019. Mai et al., "KungFu: Making
      training in distributed machine learning adaptive", OSDI 2020.

    Example:
      >>> import optax, adaptjax
      >>> tx = optax.chain(adaptjax.sync.per_replica_optimizer(optax.sgd(0.1)),
      ...                  adaptjax.sync.model_averaging("data", alpha=0.5))
    """
    if alpha is not None and not 0.0 < float(alpha) <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")

    def init_fn(params):
        return ModelAveragingState(PerReplica(params, LOCAL_MERGE))

    def update_fn(updates, state, params=None, **extra):
        del extra
        check_axis_params(params, "model_averaging")
        n = axis_size(axis_name)
        a = 1.0 / n if alpha is None else float(alpha)
        x = jax.tree.map(lambda xi, u: xi + u.astype(xi.dtype), state.local.value, updates)
        z = pmean_replicas(x, axis_name)
        new_local = jax.tree.map(lambda xi, zi: xi + a * (zi - xi), x, z)
        global_updates = jax.tree.map(lambda zi, p: (zi - p).astype(p.dtype), z, params)
        return global_updates, ModelAveragingState(PerReplica(new_local, LOCAL_MERGE))

    # optax's OptState alias (arrays, iterables, mappings) has no room for a custom
    # pytree node such as PerReplica, which this state holds
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


@dataclasses.dataclass(frozen=True)
class ModelAveraging(SyncStrategy):
    """Synchronous model averaging (SMA): see :func:`model_averaging`.

    Replicas step on their own gradients with their own optimizer state
    (``PerReplica``) and average parameters every step, corrected toward the
    average by ``alpha``. Cannot carry a codec (a lossy codec on parameters
    has nothing to correct its error).

    **Noise scale:** not estimated (gradients are never averaged; monitors
    are off, see :class:`adaptjax.sync.SyncStrategy`).

    Bytes per device per step: ``2 (N-1)/N * P`` for ``P`` bytes of
    parameters, as S-SGD.

    Attributes:
      alpha: the correction toward the average; ``None``: ``1/N``.

    Example:
      >>> import adaptjax
      >>> adaptjax.sync.ModelAveraging(alpha=0.5)
      ModelAveraging(alpha=0.5)
    """

    alpha: float | None = None
    accepts_codec = False

    def __post_init__(self) -> None:
        if self.alpha is not None and not (
            isinstance(self.alpha, int | float) and 0.0 < float(self.alpha) <= 1.0
        ):
            raise ValueError(f"ModelAveraging alpha must be in (0, 1] or None, got {self.alpha!r}")

    def post(
        self, axis_name: str | tuple[str, ...] = "data", *, codec: GradientCodec | None = None
    ) -> optax.GradientTransformationExtraArgs | None:
        self.check(2, codec)
        return model_averaging(axis_name, alpha=self.alpha)

    def wire_formula(self, param_bytes: float, n_replicas: int) -> float:
        return all_reduce_bytes(param_bytes, n_replicas)
