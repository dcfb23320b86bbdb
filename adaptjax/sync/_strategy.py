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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
import optax

from adaptjax._codec import GradientCodec
from adaptjax._per_replica import PerReplica

if TYPE_CHECKING:
    from adaptjax._wire import WireReport

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


def local_params(params: Any, opt_state: Any) -> Any:
    """The parameters this replica differentiates at: its local model, or ``params``.

    Call inside ``shard_map`` on the *local view* of the optimizer state
    (:func:`adaptjax.sync.to_local`). Under S-SGD (no local model) it returns
    ``params``.

    Args:
      params: the global parameters.
      opt_state: the optimizer state of a chain built by :func:`sync_chain`.

    Returns:
      A pytree shaped like ``params``.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> tx = adaptjax.sync.sync_chain(optax.sgd(0.1), adaptjax.sync.LocalSGD(H=4))
      >>> p = {"w": jnp.ones(2)}
      >>> adaptjax.sync.local_params(p, tx.init(p))["w"].tolist()
      [1.0, 1.0]
    """
    node = find_model_sync(opt_state)
    return params if node is None else node.local.value


def consensus_params(params: Any, opt_state: Any) -> Any:
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
      >>> tx = adaptjax.sync.sync_chain(optax.sgd(0.1), adaptjax.sync.Gossip())
      >>> state = adaptjax.init_state({"w": jnp.ones(2)}, tx, adaptjax.make_mesh(4))
      >>> adaptjax.sync.consensus_params(state.params, state.opt_state)["w"].tolist()
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


def per_replica_optimizer(
    optimizer: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
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
      >>> tx = adaptjax.sync.per_replica_optimizer(optax.adam(0.1))
      >>> from adaptjax._per_replica import has_per_replica
      >>> has_per_replica(tx.init({"w": jnp.zeros(2)}))
      True
    """
    optimizer = optax.with_extra_args_support(optimizer)

    def init_fn(params):
        return _mark(optimizer.init(params))

    def update_fn(updates, state, params=None, *, local_params=None, **extra):
        at = params if local_params is None else local_params
        updates, state = optimizer.update(updates, _unmark(state), at, **extra)
        return updates, _mark(state)

    # optax's OptState alias (arrays, iterables, mappings) has no room for a custom
    # pytree node such as PerReplica, which this state holds
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


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
      >>> s = adaptjax.sync.DiLoCo(H=64)
      >>> isinstance(s, adaptjax.sync.SyncStrategy), s.local_models, s == adaptjax.sync.DiLoCo(H=64)
      (True, True, True)
      >>> adaptjax.sync.Gossip().check(n_replicas=1)
      Traceback (most recent call last):
      ...
      ValueError: gossip needs at least 2 replicas, got 1; use more devices or another strategy (e.g. adaptjax.sync.SSGD())
    """  # noqa: E501

    local_models: ClassVar[bool] = True
    accepts_codec: ClassVar[bool] = True

    def check(self, n_replicas: int, codec: object = None) -> None:
        """Raises a one-line ``ValueError`` if this strategy cannot run so.

        ``codec`` is the codec the run would carry (only whether one is given matters).
        """
        if codec is not None and not self.accepts_codec:
            raise ValueError(
                f"{self!r} cannot carry a codec (it averages parameters, which a lossy codec "
                "would corrupt with nothing to correct it); use codec=None, or SSGD, "
                "LocalSGD or DiLoCo with a codec"
            )

    def pre(
        self,
        axis_name: str | tuple[str, ...] = "data",
        *,
        codec: GradientCodec | None = None,
        monitors: Sequence[Any] = (),
        **sync_kwargs: Any,
    ) -> optax.GradientTransformationExtraArgs:
        """The transformation before the optimizer (on this replica's gradient)."""
        del axis_name, codec, monitors, sync_kwargs
        return pass_gradients()

    def optimizer(self, optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
        """The optimizer as this strategy runs it (per replica with local models)."""
        return per_replica_optimizer(optimizer) if self.local_models else optimizer

    def post(
        self, axis_name: str | tuple[str, ...] = "data", *, codec: GradientCodec | None = None
    ) -> optax.GradientTransformationExtraArgs | None:
        """The transformation after the optimizer (model synchronisation), or ``None``."""
        raise NotImplementedError

    def wire_formula(self, param_bytes: float, n_replicas: int) -> float:
        """Bytes each device sends per step (amortised), for ``param_bytes`` of parameters.

        Ring all-reduce sends ``2 (N-1)/N`` of its buffer per device; a
        ``ppermute`` to one neighbour sends the buffer once.
        """
        raise NotImplementedError

    def amortised_bytes(self, report: WireReport) -> float:
        """Bytes per device per step from a ``WireReport`` of one step."""
        return report.total


def all_reduce_bytes(param_bytes: float, n: int) -> float:
    return 2.0 * (n - 1) / n * param_bytes if n > 1 else 0.0
