"""How replicas synchronise: the strategy protocol and what every strategy shares.

A *synchronisation strategy* decides what crosses the wire each step and how
the replicas' models relate to each other. Every strategy is three optax
transformations, chained around the user's optimizer by :func:`sync_chain`:

* ``pre``: before the optimizer, on this replica's gradient. S-SGD averages it
  here (:func:`adaptjax.sync_gradients`); strategies with local models pass it
  through.
* ``optimizer``: the user's optimizer. With local models its moments differ
  between replicas, so its state is wrapped in :class:`adaptjax.PerReplica`
  (:func:`per_replica_optimizer`); injected hyperparameters stay replicated,
  so ``SetHyperparams`` works under every strategy.
* ``post``: after the optimizer, on this replica's update. It holds the
  replica's local model (``PerReplica``, merge rule ``"fold"``: averaged on a
  shrink, copied on a grow), applies the update to it, synchronises models as
  the strategy says, and returns the update of the *global* parameters.

The global parameters (``TrainState.params``) are the model as of the latest
synchronisation: the average after every step under SMA, the outer model under
local SGD and DiLoCo, the model the run entered gossip with under gossip (no
step computes a global average there). :func:`consensus_params` gives the
model to evaluate or save: the mean of the local models.

Gradients are taken at the local model: :func:`local_params` finds it in the
optimizer state (the step builder does this; a user's own ``shard_map`` step
does the same and passes ``local_params=`` to ``tx.update``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adaptjax._per_replica import PerReplica
from adaptjax._walk import find_held

#: The merge rule of local models and their optimizer state on a rescale.
LOCAL_MERGE = "fold"


def _is_model_sync(node) -> bool:
    return bool(getattr(node, "_model_sync", False))


def find_model_sync(opt_state):
    """The first strategy state holding local models in ``opt_state``, or ``None``."""
    for node in jax.tree.leaves(opt_state, is_leaf=_is_model_sync):
        if _is_model_sync(node):
            return node
    return None


def local_params(params, opt_state):
    """The parameters this replica differentiates at: its local model, or ``params``.

    Call inside ``shard_map`` on the *local view* of the optimizer state
    (:func:`adaptjax.to_local`). Under S-SGD (no local model) it returns
    ``params``.

    Args:
      params: the global parameters.
      opt_state: the optimizer state of a chain built by :func:`sync_chain`.

    Returns:
      A pytree shaped like ``params``.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> tx = adaptjax.sync_chain(optax.sgd(0.1), adaptjax.LocalSGD(H=4))
      >>> p = {"w": jnp.ones(2)}
      >>> adaptjax.local_params(p, tx.init(p))["w"].tolist()
      [1.0, 1.0]
    """
    node = find_model_sync(opt_state)
    return params if node is None else node.local.value


def consensus_params(params, opt_state):
    """Host side: the mean of the replicas' local models (``params`` when there are none).

    Takes the *global view* (what :func:`adaptjax.init_state` and the step
    return: local models stacked over a leading replica axis). Gossip never
    forms this average during training; evaluate and save this.

    Args:
      params: the global parameters.
      opt_state: the global-view optimizer state.

    Returns:
      A pytree shaped like ``params``.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> tx = adaptjax.sync_chain(optax.sgd(0.1), adaptjax.Gossip())
      >>> state = adaptjax.init_state({"w": jnp.ones(2)}, tx, adaptjax.make_mesh(4))
      >>> adaptjax.consensus_params(state.params, state.opt_state)["w"].tolist()
      [1.0, 1.0]
    """
    node = find_model_sync(opt_state)
    if node is None:
        return params
    return jax.tree.map(
        lambda p, x: jnp.mean(x, axis=0, dtype=jnp.float32).astype(p.dtype),
        params,
        node.local.value,
    )


def _mark(state):
    if hasattr(state, "hyperparams") and hasattr(state, "inner_state"):  # inject_hyperparams
        return state._replace(inner_state=PerReplica(state.inner_state, LOCAL_MERGE))
    return PerReplica(state, LOCAL_MERGE)


def _unmark(state):
    if isinstance(state, PerReplica):
        return state.value
    return state._replace(inner_state=state.inner_state.value)


def per_replica_optimizer(optimizer: optax.GradientTransformation):
    """Runs ``optimizer`` on each replica's own model, its moments per replica.

    The state is wrapped in :class:`adaptjax.PerReplica` (merge rule
    ``"fold"``); for ``optax.inject_hyperparams`` only the inner state is, so
    the hyperparameters stay replicated and settable. ``update`` takes the
    replica's model as ``local_params=`` (weight decay needs it); without it,
    ``params``.

    Args:
      optimizer: any optax transformation.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> tx = adaptjax.per_replica_optimizer(optax.adam(0.1))
      >>> adaptjax.has_per_replica(tx.init({"w": jnp.zeros(2)}))
      True
    """
    optimizer = optax.with_extra_args_support(optimizer)

    def init_fn(params):
        return _mark(optimizer.init(params))

    def update_fn(updates, state, params=None, *, local_params=None, **extra):
        at = params if local_params is None else local_params
        updates, state = optimizer.update(updates, _unmark(state), at, **extra)
        return updates, _mark(state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def pass_gradients() -> optax.GradientTransformationExtraArgs:
    """The ``pre`` step of strategies with local models: the replica's own gradient."""
    return optax.with_extra_args_support(optax.identity())


def check_axis_params(params, what: str) -> None:
    if params is None:
        raise ValueError(f"{what} needs params (the global parameters) in update(...)")


@dataclasses.dataclass(frozen=True)
class SyncStrategy:
    """Base of the synchronisation strategies (:class:`SSGD`, :class:`ModelAveraging`,
    :class:`LocalSGD`, :class:`DiLoCo`, :class:`Gossip`).

    A strategy is a small frozen value: it compares and hashes by its fields,
    its ``repr`` is its key in :class:`adaptjax.RunConfig` (so compiled steps
    are cached per strategy), and it builds the three transformations
    :func:`sync_chain` puts around the optimizer.

    **The noise scale under each strategy.** Gradient monitors need this
    replica's gradient *and the averaged one* at the same point. S-SGD forms
    the average every step and estimates the noise scale as
    :func:`adaptjax.sync_gradients` says. SMA, local SGD, DiLoCo and gossip
    never average gradients (that is what they save), and their replicas'
    gradients are taken at different local models, so their monitors are off:
    ``noise_scale``, ``grad_snr`` and ``grad_norm`` are absent from the step's
    metrics while they run, and monitors start afresh when a run switches
    back to S-SGD. A policy that switches on the noise scale should therefore
    decide *while* S-SGD runs (e.g. S-SGD -> DiLoCo once it is small enough).

    Subclasses set ``local_models`` and ``accepts_codec`` and implement
    ``post`` and ``wire_formula``.

    Example:
      >>> import adaptjax
      >>> s = adaptjax.DiLoCo(H=64)
      >>> isinstance(s, adaptjax.SyncStrategy), s.local_models, s == adaptjax.DiLoCo(H=64)
      (True, True, True)
      >>> adaptjax.Gossip().check(n_replicas=1)
      Traceback (most recent call last):
      ...
      ValueError: gossip needs at least 2 replicas, got 1; use more devices or another strategy (e.g. adaptjax.SSGD())
    """  # noqa: E501

    local_models: ClassVar[bool] = True
    accepts_codec: ClassVar[bool] = True

    def check(self, n_replicas: int, codec=None) -> None:
        """Raises a one-line ``ValueError`` if this strategy cannot run so."""
        if codec is not None and not self.accepts_codec:
            raise ValueError(
                f"{self!r} cannot carry a codec (it averages parameters, which a lossy codec "
                "would corrupt with nothing to correct it); use codec=None, or SSGD, "
                "LocalSGD or DiLoCo with a codec"
            )

    def pre(self, axis_name="data", *, codec=None, monitors=(), **sync_kwargs):
        """The transformation before the optimizer (on this replica's gradient)."""
        del axis_name, codec, monitors, sync_kwargs
        return pass_gradients()

    def optimizer(self, optimizer: optax.GradientTransformation):
        """The optimizer as this strategy runs it (per replica with local models)."""
        return per_replica_optimizer(optimizer) if self.local_models else optimizer

    def post(self, axis_name="data", *, codec=None):
        """The transformation after the optimizer (model synchronisation), or ``None``."""
        raise NotImplementedError

    def wire_formula(self, param_bytes: float, n_replicas: int) -> float:
        """Bytes each device sends per step (amortised), for ``param_bytes`` of parameters.

        Ring all-reduce sends ``2 (N-1)/N`` of its buffer per device; a
        ``ppermute`` to one neighbour sends the buffer once.
        """
        raise NotImplementedError

    def amortised_bytes(self, report) -> float:
        """Bytes per device per step from a :class:`adaptjax.WireReport` of one step."""
        return report.total


def all_reduce_bytes(param_bytes: float, n: int) -> float:
    return 2.0 * (n - 1) / n * param_bytes if n > 1 else 0.0


def sync_chain(
    optimizer: optax.GradientTransformation,
    strategy: SyncStrategy | str | None = None,
    axis_name: str | tuple[str, ...] = "data",
    *,
    codec=None,
    monitors=(),
    **sync_kwargs,
) -> optax.GradientTransformationExtraArgs:
    """``optimizer`` synchronised by ``strategy``: ``chain(pre, optimizer, post)``.

    Use it in a ``shard_map`` step with ``axis_name`` bound (or through
    :func:`adaptjax.data_parallel_step`). Differentiate at
    ``adaptjax.local_params(params, opt_state)`` and pass it as
    ``local_params=`` to ``update``; apply the returned updates to the global
    ``params`` as usual.

    Args:
      optimizer: the (inner) optimizer, e.g. ``optax.adamw(1e-3)``.
      strategy: a :class:`SyncStrategy`, one of the names ``"ssgd"``,
        ``"sma"``, ``"local_sgd"``, ``"diloco"``, ``"gossip"`` (their
        defaults), or ``None`` (S-SGD).
      axis_name: the data-parallel axis.
      codec: a :class:`adaptjax.GradientCodec`: compresses the gradients
        (S-SGD) or the outer delta (local SGD, DiLoCo).
      monitors: gradient monitors (S-SGD only; see :class:`SyncStrategy`).
      **sync_kwargs: further arguments of :func:`adaptjax.sync_gradients` (S-SGD).

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, adaptjax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = adaptjax.make_mesh(4)
      >>> tx = adaptjax.sync_chain(optax.sgd(0.5), adaptjax.ModelAveraging(alpha=1.0))
      >>> state = adaptjax.init_state({"w": jnp.zeros(())}, tx, mesh)
      >>> specs = adaptjax.state_partition_specs(state.opt_state)
      >>> def step(params, opt_state, x):       # x: this replica's data point
      ...     opt_state = adaptjax.to_local(opt_state)
      ...     at = adaptjax.local_params(params, opt_state)
      ...     g = jax.grad(lambda p: jnp.mean((p["w"] - x) ** 2))(at)
      ...     u, opt_state = tx.update(g, opt_state, params, local_params=at)
      ...     return optax.apply_updates(params, u), adaptjax.to_global(opt_state)
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
    from adaptjax._chain import chain  # _chain imports _sync, which imports this module

    return chain(*parts)


def _defaults() -> dict:
    from adaptjax._diloco import DiLoCo
    from adaptjax._gossip import Gossip
    from adaptjax._local_sgd import LocalSGD
    from adaptjax._model_averaging import ModelAveraging
    from adaptjax._ssgd import SSGD

    return {
        "ssgd": SSGD(),
        "sma": ModelAveraging(),
        "local_sgd": LocalSGD(),
        "diloco": DiLoCo(),
        "gossip": Gossip(),
    }


def resolve_sync(strategy) -> SyncStrategy:
    """A :class:`SyncStrategy` from a strategy, a name, or ``None`` (S-SGD).

    Example:
      >>> from adaptjax._sync_strategy import resolve_sync
      >>> resolve_sync("diloco")
      DiLoCo(H=32, outer_lr=0.7, outer_momentum=0.9, nesterov=True)
      >>> resolve_sync("allreduce")
      Traceback (most recent call last):
      ...
      ValueError: unknown sync strategy 'allreduce'; use one of 'ssgd', 'sma', 'local_sgd', 'diloco', 'gossip' or an adaptjax.SyncStrategy such as adaptjax.DiLoCo(H=32)
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
        f"unknown sync strategy {strategy!r}; use one of {names} or an adaptjax.SyncStrategy "
        "such as adaptjax.DiLoCo(H=32)"
    )


def sync_key(strategy) -> str | None:
    """The strategy's key in :class:`adaptjax.RunConfig`: ``None`` for S-SGD, else its repr.

    Example:
      >>> import adaptjax
      >>> adaptjax.sync_key(None), adaptjax.sync_key(adaptjax.SSGD())
      (None, None)
      >>> adaptjax.sync_key(adaptjax.LocalSGD(H=8))
      'LocalSGD(H=8)'
    """
    strategy = resolve_sync(strategy)
    return None if not strategy.local_models else repr(strategy)


def rebuild_state(state, new_tx, mesh, *, carry_sync: bool):
    """Host side: the train state under ``new_tx`` (another strategy or codec), nothing lost.

    The new global parameters are :func:`consensus_params` of the old state;
    the optimizer state (``opt_state["optimizer"]``) carries over, averaged
    over replicas when the new strategy keeps it replicated and copied to
    every replica when it keeps it per replica; local models start at the new
    global parameters. With ``carry_sync`` (S-SGD to S-SGD) the sync's count,
    monitor states and metrics carry over too; the codec's state and a DiLoCo
    outer momentum start afresh. ``new_tx`` is the controller's named chain
    (``"sync"``, ``"optimizer"``, ...) or a :func:`sync_chain` (a tuple).
    """
    from adaptjax._per_replica import stack_replicas
    from adaptjax._state import init_state, train_state_shardings

    n = int(np.prod(mesh.devices.shape))
    old = jax.device_get(state)
    params = jax.device_get(consensus_params(old.params, old.opt_state))
    fresh = jax.device_get(init_state(params, new_tx, mesh))
    named = isinstance(fresh.opt_state, dict)
    opt_key, sync_slot = ("optimizer", "sync") if named else (1, 0)
    opt_state = dict(fresh.opt_state) if named else list(fresh.opt_state)
    old_opt = old.opt_state[opt_key]
    new_opt = fresh.opt_state[opt_key]
    if _is_marked(old_opt) and _is_marked(new_opt):
        opt_state[opt_key] = old_opt  # per replica before and after: kept as it is
    else:
        replicated = jax.tree.map(
            lambda node: jax.tree.map(_mean0, node.value) if isinstance(node, PerReplica) else node,
            old_opt,
            is_leaf=lambda x: isinstance(x, PerReplica),
        )
        if _is_marked(new_opt):
            replicated = jax.device_get(stack_replicas(_mark(replicated), n))
        opt_state[opt_key] = replicated
    if carry_sync:
        sync = fresh.opt_state[sync_slot]
        opt_state[sync_slot] = sync._replace(
            count=old.opt_state[sync_slot].count,
            monitor_states=old.opt_state[sync_slot].monitor_states,
            metrics=old.opt_state[sync_slot].metrics,
        )
    new = dataclasses.replace(
        fresh,
        step=old.step,
        nonfinite_count=old.nonfinite_count,
        model_state=old.model_state,
        graphdef=old.graphdef,
        opt_state=type(fresh.opt_state)(opt_state) if named else tuple(opt_state),
    )
    new = jax.tree.map(np.array, new)
    return jax.device_put(new, train_state_shardings(new, mesh))


def _is_marked(opt_state) -> bool:
    return isinstance(opt_state, PerReplica) or isinstance(
        getattr(opt_state, "inner_state", None), PerReplica
    )


def _mean0(x):
    x = np.asarray(x)
    return x.mean(axis=0, dtype=np.float64).astype(x.dtype)


def register_strategies(obj, cache) -> None:
    """Registers in ``cache`` (``add_sync``) every strategy ``obj`` holds, and the defaults.

    Policies hold strategies as opaque values (``SwitchSync(to=...)``,
    ``SetSync(...)``); a resumed run must know the one its checkpoint names.
    """
    for strategy in _defaults().values():
        cache.add_sync(strategy)
    for strategy in find_held(obj, lambda o: isinstance(o, SyncStrategy)):
        cache.add_sync(strategy)
