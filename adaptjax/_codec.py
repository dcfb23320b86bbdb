"""The protocol a gradient codec follows to plug into :func:`adaptjax.sync_gradients`.

The core never imports ``adaptjax.compression``: a codec reaches the sync
transformation as any object with these two methods. Codecs own their whole
collective (compress, move the compressed form, decompress, average), because
the right collective depends on the codec (psum for linear codecs, all-gather
for sparse payloads, all-to-all + all-gather for quantisers).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax


@runtime_checkable
class GradientCodec(Protocol):
    """A compressed all-reduce-mean over a mesh axis.

    ``init`` builds the codec state in the *local view* (one replica's state;
    wrap state that differs between replicas, such as error-feedback residuals,
    in :class:`adaptjax.PerReplica`). ``sync`` runs inside ``shard_map`` with
    ``axis_name`` bound, takes this replica's gradients and returns the mean over
    the axis as every replica sees it (identical on all replicas), plus the new
    state. ``step`` is the int32 step counter (for warm-ups and keys).

    The controller keys a codec by its ``repr`` (``codec_key``:
    compiled steps, run configurations, checkpoints), so the ``repr`` must be
    stable across processes and differ between codecs that compute differently;
    the codecs of :mod:`adaptjax.compression` print the factory call that builds
    them (``onebit(block=256)``).

    ``sync`` sees the whole gradient, but nothing obliges it to wait for all of
    it: a codec that splits the leaves into groups, each encoded, sent and
    decoded from its own leaves only (``bucket_bytes`` of the codecs of
    :mod:`adaptjax.compression`), lets XLA start the first group's collective
    while the backward pass still computes the others. To write a codec,
    subclass ``adaptjax.compression.BlockCodec`` (a payload of fixed size per
    block) or ``adaptjax.compression.Codec`` (the guide page "Writing a codec").

    Optionally, ``pairing_warning(optimizer_state)`` returns ``None`` or one
    line saying that this codec is known to train worse than dense sync with
    the optimizer whose init state it is given, and what to use instead;
    the codec's :func:`adaptjax.sync_gradients` link asks it when
    :func:`adaptjax.data_parallel_step` first traces the step (so under the
    controller too), and warns with the line.
    """

    def init(self, params: Any) -> Any: ...

    def sync(
        self, grads: Any, state: Any, *, axis_name: str | tuple[str, ...], step: jax.Array
    ) -> tuple[Any, Any]: ...


#: The mark of an optimizer that all-reduces the gradients itself: a true class attribute
#: of a node in its state (``adaptjax.compression.OnebitAdamState``).
SYNCS_GRADIENTS = "_syncs_gradients"


def _marked(node: Any) -> bool:
    return bool(getattr(node, SYNCS_GRADIENTS, False))


def syncs_itself(optimizer: Any, params: Any) -> bool:
    """Whether ``optimizer`` syncs the gradients itself (e.g. ``compression.onebit_adam``).

    Such an optimizer takes each replica's own gradient and runs its own
    collectives, so the controller's chain must not average the gradients
    before it. It says so in its state: a node whose class has a true
    ``_syncs_gradients`` (:data:`SYNCS_GRADIENTS`). The state is where the mark
    survives every wrapper: ``optax.inject_hyperparams`` builds the
    transformation again inside its own ``init``/``update`` and ``optax.chain``
    keeps only functions, so nothing of the transformation object says what is
    inside, but both keep the inner state as a node of theirs. Read from
    ``jax.eval_shape(optimizer.init, params)``: the state's structure, nothing
    computed or placed. ``False`` for an optimizer whose ``init`` cannot be
    traced so (its first real ``init`` then raises as it would).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from adaptjax import compression as ajc
      >>> from adaptjax._codec import syncs_itself
      >>> p = {"w": jnp.zeros(4)}
      >>> syncs_itself(optax.adam(1e-3), p)
      False
      >>> tx = optax.inject_hyperparams(ajc.onebit_adam, hyperparam_dtype=jnp.float32)(1e-3)
      >>> syncs_itself(optax.chain(optax.clip(1.0), tx), p)
      True
    """
    try:
        state = jax.eval_shape(optimizer.init, params)
    except Exception:  # noqa: BLE001 - left for the real init to raise, with its own message
        return False
    return any(_marked(n) for n in jax.tree.leaves(state, is_leaf=_marked))
