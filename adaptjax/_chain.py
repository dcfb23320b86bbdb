"""The controller's ``optax`` chain, kept in links so the step can guard what follows the sync.

Users chain with ``optax.chain``; :func:`adaptjax.sync.sync_chain` and the
controller build their chains here, so that
:func:`adaptjax.data_parallel_step` can send the non-finite guard's two
scalars in the gradients' all-reduce instead of an all-reduce of their own.
"""

from __future__ import annotations

from typing import Any, Self

import optax

from adaptjax._sync import SyncGradients


class SyncChain(optax.GradientTransformationExtraArgs):
    """What :func:`chain` and :func:`named_chain` return.

    The same transformation, with the same state, as the ``optax`` chain of
    its links. When the first link is a :func:`adaptjax.sync_gradients`,
    ``sync`` is that link and ``rest`` the chain of the others;
    :func:`adaptjax.data_parallel_step` then sends the non-finite guard's
    scalars in the gradients' all-reduce and skips only ``rest``. ``sync`` is
    ``None`` otherwise.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> tx = named_chain(("sync", adaptjax.sync_gradients("data")),
      ...                           ("optimizer", optax.sgd(0.1)))
      >>> sync_state, rest = tx.split_state(tx.init({"w": jnp.zeros(2)}))
      >>> type(sync_state).__name__, list(rest)
      ('SyncState', ['optimizer'])
    """

    sync: SyncGradients | None
    rest: optax.GradientTransformation | None
    _names: tuple[str, ...] | None

    def __new__(
        cls,
        init: optax.TransformInitFn,
        update: optax.TransformUpdateExtraArgsFn,
        sync: SyncGradients | None = None,
        rest: optax.GradientTransformation | None = None,
        names: tuple[str, ...] | None = None,
    ) -> Self:
        self = super().__new__(cls, init, update)
        self.sync = sync
        self.rest = rest
        self._names = names  # None for a tuple-state chain
        return self

    def split_state(self, state: Any) -> tuple[Any, Any]:
        """``(sync link's state, the rest's state)`` from this chain's state."""
        if self._names is None:
            return state[0], tuple(state[1:])
        first, *others = self._names
        return state[first], type(state)((k, state[k]) for k in others)

    def join_state(self, sync_state: Any, rest_state: Any) -> Any:
        """The inverse of :meth:`split_state`."""
        if self._names is None:
            return (sync_state, *rest_state)
        return type(rest_state)([(self._names[0], sync_state), *rest_state.items()])


def chain(*transforms: optax.GradientTransformation) -> SyncChain:
    """``optax.chain(*transforms)``, with a non-finite guard that costs no collective.

    Same updates and state as ``optax.chain``. With
    :func:`adaptjax.sync_gradients` first, :func:`adaptjax.data_parallel_step`
    puts its guard's two scalars (the loss and ``‖g‖²``) in the gradients'
    all-reduce and skips only the transformations after the sync. With a plain
    ``optax.chain`` the guard needs a collective of its own before the whole
    update: a barrier (its cost is on the benchmarks page of the docs).

    Args:
      *transforms: optax transformations, applied in order.

    Returns:
      A ``SyncChain``.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> tx = chain(adaptjax.sync_gradients("data"), optax.sgd(0.1))
      >>> state = tx.init({"w": jnp.zeros(3)})   # optax.chain's state: a tuple
      >>> len(state), type(state[0]).__name__
      (2, 'SyncState')
    """
    inner = optax.chain(*transforms)
    if transforms and isinstance(transforms[0], SyncGradients):
        rest = optax.chain(*transforms[1:])
        return SyncChain(inner.init, inner.update, transforms[0], rest)
    return SyncChain(inner.init, inner.update)


def named_chain(*transforms: tuple[str, optax.GradientTransformation]) -> SyncChain:
    """``optax.named_chain(*transforms)``, guarded as :func:`chain` is.

    Args:
      *transforms: ``(name, transformation)`` pairs; the state is a dict by name.

    Returns:
      A ``SyncChain``.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> tx = named_chain(("sync", adaptjax.sync_gradients("data")),
      ...                           ("optimizer", optax.sgd(0.1)))
      >>> sorted(tx.init({"w": jnp.zeros(3)}))
      ['optimizer', 'sync']
    """
    inner = optax.named_chain(*transforms)
    if transforms and isinstance(transforms[0][1], SyncGradients):
        names = tuple(name for name, _ in transforms)
        rest = optax.named_chain(*transforms[1:])
        return SyncChain(inner.init, inner.update, transforms[0][1], rest, names)
    return SyncChain(inner.init, inner.update)


def guarded_sync(tx: object) -> bool:
    """Whether ``tx`` is a ``SyncChain`` whose first link is a sync the guard can ride."""
    return isinstance(tx, SyncChain) and getattr(tx, "sync", None) is not None
