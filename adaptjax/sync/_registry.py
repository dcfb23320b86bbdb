"""The five built-in strategies by name, and the chain a strategy builds around an optimizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optax

from adaptjax._chain import chain
from adaptjax._codec import GradientCodec
from adaptjax._walk import find_held
from adaptjax.sync._diloco import DiLoCo
from adaptjax.sync._gossip import Gossip
from adaptjax.sync._local_sgd import LocalSGD
from adaptjax.sync._model_averaging import ModelAveraging
from adaptjax.sync._ssgd import SSGD
from adaptjax.sync._strategy import SyncStrategy


def sync_chain(
    optimizer: optax.GradientTransformation,
    strategy: SyncStrategy | str | None = None,
    axis_name: str | tuple[str, ...] = "data",
    *,
    codec: GradientCodec | None = None,
    monitors: Sequence[Any] = (),
    **sync_kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
    """``optimizer`` synchronised by ``strategy``: ``chain(pre, optimizer, post)``.

    Use it in a ``shard_map`` step with ``axis_name`` bound (or through
    :func:`adaptjax.data_parallel_step`). Differentiate at
    ``adaptjax.sync.local_params(params, opt_state)`` and pass it as
    ``local_params=`` to ``update``; apply the returned updates to the global
    ``params`` as usual.

    Args:
      optimizer: the (inner) optimizer, e.g. ``optax.adamw(1e-3)``.
      strategy: a :class:`SyncStrategy`, one of the names ``"ssgd"``,
        ``"sma"``, ``"local_sgd"``, ``"diloco"``, ``"gossip"`` (their
        defaults), or ``None`` (S-SGD).
      axis_name: the data-parallel axis.
      codec: a codec (:class:`adaptjax.compression.Codec`): compresses the gradients
        (S-SGD) or the outer delta (local SGD, DiLoCo).
      monitors: gradient monitors (S-SGD only; see :class:`SyncStrategy`).
      **sync_kwargs: further arguments of :func:`adaptjax.sync_gradients` (S-SGD).

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, adaptjax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = adaptjax.make_mesh(4)
      >>> tx = adaptjax.sync.sync_chain(optax.sgd(0.5), adaptjax.sync.ModelAveraging(alpha=1.0))
      >>> state = adaptjax.init_state({"w": jnp.zeros(())}, tx, mesh)
      >>> from adaptjax._per_replica import state_partition_specs
      >>> specs = state_partition_specs(state.opt_state)
      >>> def step(params, opt_state, x):       # x: this replica's data point
      ...     opt_state = adaptjax.sync.to_local(opt_state)
      ...     at = adaptjax.sync.local_params(params, opt_state)
      ...     g = jax.grad(lambda p: jnp.mean((p["w"] - x) ** 2))(at)
      ...     u, opt_state = tx.update(g, opt_state, params, local_params=at)
      ...     return optax.apply_updates(params, u), adaptjax.sync.to_global(opt_state)
      >>> f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
      ...                           out_specs=(P(), specs), check_vma=False))
      >>> params, _ = f(state.params, state.opt_state, jnp.arange(4.0))
      >>> float(params["w"])   # the average of the four local SGD steps
      1.5
    """
    strategy = resolve_sync(strategy)
    strategy.check(2, codec)  # the replica count is checked where it is known
    pre = strategy.pre(axis_name, codec=codec, monitors=monitors, **sync_kwargs)
    post = strategy.post(axis_name, codec=codec)
    parts = [pre, strategy.optimizer(optimizer)] + ([post] if post is not None else [])
    return chain(*parts)


def _defaults() -> dict:

    return {
        "ssgd": SSGD(),
        "sma": ModelAveraging(),
        "local_sgd": LocalSGD(),
        "diloco": DiLoCo(),
        "gossip": Gossip(),
    }


def resolve_sync(strategy: object) -> SyncStrategy:
    """A :class:`SyncStrategy` from a strategy, a name, or ``None`` (S-SGD).

    Example:
      >>> from adaptjax.sync._registry import resolve_sync
      >>> resolve_sync("diloco")
      DiLoCo(H=32, outer_lr=0.7, outer_momentum=0.9, nesterov=True)
      >>> resolve_sync("allreduce")
      Traceback (most recent call last):
      ...
      ValueError: unknown sync strategy 'allreduce'; use one of 'ssgd', 'sma', 'local_sgd', 'diloco', 'gossip' or an adaptjax.sync.SyncStrategy such as adaptjax.sync.DiLoCo(H=32)
    """  # noqa: E501
    defaults = _defaults()
    if strategy is None:
        return defaults["ssgd"]
    if isinstance(strategy, SyncStrategy):
        return strategy
    if isinstance(strategy, str) and strategy in defaults:
        return defaults[strategy]
    names = ", ".join(repr(k) for k in defaults)
    raise ValueError(
        f"unknown sync strategy {strategy!r}; use one of {names} or an adaptjax.sync.SyncStrategy "
        "such as adaptjax.sync.DiLoCo(H=32)"
    )


def sync_key(strategy: object) -> str | None:
    """The strategy's key in :class:`adaptjax.RunConfig`: ``None`` for S-SGD, else its repr.

    Example:
      >>> import adaptjax
      >>> sync_key(None), sync_key(adaptjax.sync.SSGD())
      (None, None)
      >>> sync_key(adaptjax.sync.LocalSGD(H=8))
      'LocalSGD(H=8)'
    """
    strategy = resolve_sync(strategy)
    return None if not strategy.local_models else repr(strategy)


def register_strategies(obj, cache) -> None:
    """Registers in ``cache`` (``add_sync``) every strategy ``obj`` holds, and the defaults.

    Policies hold strategies as opaque values (``SwitchSync(to=...)``,
    ``SetSync(...)``); a resumed run must know the one its checkpoint names.
    """
    for strategy in _defaults().values():
        cache.add_sync(strategy)
    for strategy in find_held(obj, lambda o: isinstance(o, SyncStrategy)):
        cache.add_sync(strategy)
