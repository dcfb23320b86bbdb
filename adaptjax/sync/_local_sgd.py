"""Local SGD: replicas take ``H`` steps alone, then an outer step on the averaged deltas."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from adaptjax._codec import GradientCodec
from adaptjax._metric_vector import Metrics
from adaptjax._per_replica import PerReplica
from adaptjax._sync import codec_sync
from adaptjax._tree import all_gather_replicas, pmean_replicas, tree_sq_norm
from adaptjax.sync._replicas import (
    MEASURED,
    accumulate,
    at_sync,
    check_label_histogram,
    init_knobs,
    measured_head,
    step_factor,
    summary_metrics,
)
from adaptjax.sync._strategy import (
    LOCAL_MERGE,
    SyncStrategy,
    all_reduce_bytes,
    check_axis_params,
)

if TYPE_CHECKING:
    from adaptjax._wire import WireReport


class LocalSGDState(NamedTuple):
    """State of :func:`local_sgd`.

    Attributes:
      count: int32 inner steps so far.
      local: this replica's model (``PerReplica``).
      outer_state: the outer optimizer's state (replicated).
      codec_state: the codec's state (``()`` without a codec).
      knobs: this replica's inner learning-rate factor and local steps per
        round (0: all ``H``), one float32 vector (``PerReplica``; see
        ``adaptjax.sync.set_replica_lr``, ``adaptjax.sync.set_replica_local_steps``).
      measured: this replica's heterogeneity measurements and the round's
        sums, one float32 vector (``PerReplica``; see ``adaptjax.sync.replica_metrics``).
      metrics: their mean and max over replicas at the latest sync (replicated,
        an :class:`adaptjax.Metrics`: one leaf).
    """

    count: jax.Array
    local: PerReplica
    outer_state: Any
    codec_state: Any
    knobs: PerReplica
    measured: PerReplica
    metrics: Metrics
    _model_sync = True


def check_period(H) -> int:
    if isinstance(H, bool) or not isinstance(H, int) or H < 1:
        raise ValueError(f"H (inner steps between outer syncs) must be an int >= 1, got {H!r}")
    return int(H)


def local_sgd(
    H: int = 8,
    axis_name: str | tuple[str, ...] = "data",
    *,
    outer: optax.GradientTransformation | None = None,
    codec: GradientCodec | None = None,
    label_histogram: tuple[float, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Periodic averaging as the ``post`` step of a chain (local SGD; DiLoCo with ``outer``).

    Each replica applies its optimizer's update to its own model. Every
    ``H``-th step (steps ``H-1, 2H-1, ...`` counted from 0) the replicas
    average their *deltas* from the global parameters ``θ`` (one all-reduce,
    or the codec's collective) and the outer optimizer steps on that
    pseudo-gradient; every replica restarts from the result::

        Δ = mean_i (θ - x_i),   θ <- θ + outer.update(Δ),   x_i <- θ

    Replica ``i`` adds ``lr_factor_i`` times its update to its model, on the
    first ``local_steps_i`` inner steps of each round (per-replica knobs in
    the state, set with ``adaptjax.sync.set_replica_lr`` and
    ``adaptjax.sync.set_replica_local_steps`` without recompiling). At
    each sync every replica measures, from the deltas the sync already has
    (no collective beyond one all-gather of three scalars per replica), its
    gradient dissimilarity ``‖Δ_i − Δ‖² / ‖Δ‖²``, its mean loss over the
    round (``replica_loss=`` passed to ``update``) and ``KL(p_i ‖ q)`` of its
    round's labels (``labels=``) against ``label_histogram``; see
    ``adaptjax.sync.replica_metrics``.

    Without ``outer`` the outer step is ``sgd(1.0)``: ``θ <- mean_i x_i``
    (local SGD). Between outer steps the global update is zero. The sync
    runs inside ``lax.cond``, so :func:`adaptjax.wire_bytes` finds it in one
    branch; ``LocalSGD.amortised_bytes`` weighs that branch by ``1/H``.

    Args:
      H: inner steps per outer step, >= 1.
      axis_name: the data-parallel axis.
      outer: the outer optimizer (``None``: ``optax.sgd(1.0)``).
      codec: a codec (:class:`adaptjax.compression.Codec`) to compress the deltas.
      label_histogram: the global label distribution ``q`` (``K`` positive
        numbers, normalised here) for ``label_divergence``; ``None``: not measured.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      ``LocalSGDState``; ``update(updates, state, params, *,
      replica_loss=None, labels=None)`` needs the global ``params``;
      ``replica_loss`` is this replica's loss, ``labels`` its batch's integer
      labels.

    References:
      Stich, "Local SGD converges fast and communicates little", ICLR 2019.
      Lin et al., "Don't use large mini-batches, use local SGD", ICLR 2020.

    Example:
      >>> import optax, adaptjax
      >>> tx = optax.chain(adaptjax.sync.per_replica_optimizer(optax.sgd(0.1)),
      ...                  adaptjax.sync.local_sgd(H=8))
    """
    H = check_period(H)
    outer = optax.sgd(1.0) if outer is None else outer
    q = check_label_histogram(label_histogram)
    if codec is not None and not isinstance(codec, GradientCodec):
        raise ValueError(
            f"codec {codec!r} does not follow adaptjax.compression.Codec's protocol "
            "(needs init and sync); "
            "build one with adaptjax.compression"
        )

    def init_fn(params):
        knobs, measured = init_knobs(0 if q is None else len(q))
        return LocalSGDState(
            count=jnp.zeros((), jnp.int32),
            local=PerReplica(params, LOCAL_MERGE),
            outer_state=outer.init(params),
            codec_state=codec.init(params) if codec is not None else (),
            knobs=knobs,
            measured=measured,
            metrics=summary_metrics(jnp.zeros((1, len(MEASURED)), jnp.float32)),
        )

    def update_fn(updates, state, params=None, *, replica_loss=None, labels=None, **extra):
        layout = extra.get("shard_layout")  # on a sharded mesh: the codec runs per shard
        check_axis_params(params, "local_sgd")
        factor = step_factor(state.knobs.value, state.count, H)
        x = jax.tree.map(
            lambda xi, u: xi + (factor * u.astype(jnp.float32)).astype(xi.dtype),
            state.local.value,
            updates,
        )
        measured = accumulate(state.measured.value, replica_loss, labels)
        sq_norm = tree_sq_norm if layout is None else layout.sq_norm

        def outer_step(operands):
            x, outer_state, codec_state, measured, metrics = operands
            delta = jax.tree.map(lambda p, xi: p - xi, params, x)
            if codec is None:
                mean_delta = pmean_replicas(delta, axis_name)
            else:
                mean_delta, codec_state = codec_sync(
                    codec, delta, codec_state, axis_name=axis_name, step=state.count // H,
                    layout=layout,
                )
            spread = jax.tree.map(lambda d, m: d - m.astype(d.dtype), delta, mean_delta)
            measured = at_sync(measured, sq_norm(spread), sq_norm(mean_delta), q)
            metrics = summary_metrics(all_gather_replicas(measured_head(measured), axis_name))
            step, outer_state = outer.update(mean_delta, outer_state, params)
            step = jax.tree.map(lambda s, p: s.astype(p.dtype), step, params)
            new = jax.tree.map(jnp.add, params, step)
            return step, new, outer_state, codec_state, measured, metrics

        def inner_step(operands):
            x, outer_state, codec_state, measured, metrics = operands
            zeros = jax.tree.map(jnp.zeros_like, params)
            return zeros, x, outer_state, codec_state, measured, metrics

        operands = (x, state.outer_state, state.codec_state, measured, state.metrics)
        if H == 1:
            result = outer_step(operands)
        else:
            result = jax.lax.cond((state.count + 1) % H == 0, outer_step, inner_step, operands)
        step, new_local, outer_state, codec_state, measured, metrics = result
        return step, state._replace(
            count=state.count + 1,
            local=PerReplica(new_local, LOCAL_MERGE),
            outer_state=outer_state,
            codec_state=codec_state,
            measured=PerReplica(measured, state.measured.merge),
            metrics=metrics,
        )

    # optax's OptState alias (arrays, iterables, mappings) has no room for a custom
    # pytree node such as PerReplica, which this state holds
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def freeze_histogram(strategy) -> None:
    """Checks ``strategy.label_histogram`` and stores it as a tuple (hashable, a cache key)."""
    q = check_label_histogram(strategy.label_histogram)
    if q is not None:
        frozen = tuple(float(v) for v in strategy.label_histogram)
        object.__setattr__(strategy, "label_histogram", frozen)


def with_histogram(head: str, strategy) -> str:
    """``head`` closed into a repr, with the label histogram only when one is set."""
    if strategy.label_histogram is None:
        return head + ")"
    return f"{head}, label_histogram={strategy.label_histogram!r})"


def outer_sync_bytes(param_bytes: float, n: int) -> float:
    """Bytes each device sends per outer sync: the deltas' all-reduce and the measurements'
    all-gather (``4 * len(MEASURED)`` bytes per replica, ``(n-1)`` of them sent in a ring)."""
    return all_reduce_bytes(param_bytes, n) + (n - 1) * 4 * len(MEASURED)


def amortise(report, H: int) -> float:
    """Bytes per step of a program whose sync branch runs once every ``H`` calls."""
    if H == 1 or not report.conditionals:
        return report.total
    names = [name for name, _ in report.conditionals]
    # the sync's conditional is the one whose taken branch sends the most
    name = max(names, key=lambda c: max(report.branch_totals(c)))
    skip, sync = report.branch_totals(name)[:2]
    return skip + (sync - skip) / H


@dataclasses.dataclass(frozen=True)
class LocalSGD(SyncStrategy):
    """Local SGD: ``H`` steps alone, then the replicas' models are averaged (see :func:`local_sgd`).

    The optimizer's state is per replica (``PerReplica``, merged ``"fold"``).
    A codec compresses the deltas of the outer sync.

    **Noise scale:** not estimated (gradients are never averaged; monitors
    are off, see :class:`adaptjax.sync.SyncStrategy`).

    Bytes per device per step, amortised: ``(2 (N-1)/N * P + 12 (N-1)) / H``
    (the deltas' all-reduce and the replicas' three measurements' all-gather).

    Attributes:
      H: inner steps per sync, >= 1.
      label_histogram: the global label distribution for the replicas'
        ``label_divergence`` (see :func:`local_sgd`), or ``None``.

    Example:
      >>> import adaptjax
      >>> adaptjax.sync.LocalSGD(H=32).wire_formula(4000, 8)
      221.375
    """

    H: int = 8
    label_histogram: tuple[float, ...] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_period(self.H)
        freeze_histogram(self)

    def __repr__(self) -> str:
        return with_histogram(f"LocalSGD(H={self.H!r}", self)

    def post(
        self, axis_name: str | tuple[str, ...] = "data", *, codec: GradientCodec | None = None
    ) -> optax.GradientTransformationExtraArgs | None:
        return local_sgd(self.H, axis_name, codec=codec, label_histogram=self.label_histogram)

    def wire_formula(self, param_bytes: float, n_replicas: int) -> float:
        return outer_sync_bytes(param_bytes, n_replicas) / self.H

    def amortised_bytes(self, report: WireReport) -> float:
        return amortise(report, self.H)
