"""Gossip: each step every replica averages its model with one peer (``ppermute``)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from adaptjax._codec import GradientCodec
from adaptjax._per_replica import PerReplica
from adaptjax._tree import axis_size
from adaptjax.sync._strategy import LOCAL_MERGE, SyncStrategy

TOPOLOGIES = ("ring", "exponential")


class GossipState(NamedTuple):
    """State of :func:`gossip`: the step count and this replica's model (``PerReplica``)."""

    count: jax.Array
    local: PerReplica
    _model_sync = True


def peer_offsets(n: int, topology: str) -> tuple[int, ...]:
    """The shifts a replica receives from, one per step in turn.

    ``"ring"``: always 1. ``"exponential"``: ``1, 2, 4, ... < n``, rotating
    (SGP's time-varying exponential graph).

    Example:
      >>> from adaptjax.sync._gossip import peer_offsets
      >>> peer_offsets(8, "ring"), peer_offsets(16, "exponential")
      ((1,), (1, 2, 4, 8))
    """
    if topology == "ring":
        return (1,)
    offsets, s = [], 1
    while s < n:
        offsets.append(s)
        s *= 2
    return tuple(offsets) or (1,)


def _check_topology(topology) -> str:
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown gossip topology {topology!r}; use one of {TOPOLOGIES}")
    return topology


def gossip(
    axis_name: str | tuple[str, ...] = "data", *, topology: str = "ring"
) -> optax.GradientTransformationExtraArgs:
    """Gossip averaging as the ``post`` step of a chain: no global collective.

    Each replica applies its optimizer's update to its own model, then
    averages with the model of the replica ``s`` places before it on the ring
    (one ``ppermute`` of the parameters)::

        x̃_i = x_i + u_i,    x_i <- (x̃_i + x̃_{i-s}) / 2

    ``s = 1`` (``"ring"``) or ``s = 2^(t mod log2 N)`` (``"exponential"``,
    rotating). The mixing matrix is doubly stochastic, so the mean of the
    models is exactly the mean after the local steps. No step forms that
    mean: the global update is zero and the global parameters stay as they
    were when the run entered gossip; evaluate
    :func:`adaptjax.sync.consensus_params`.

    Args:
      axis_name: the data-parallel axis (one axis).
      topology: ``"ring"`` or ``"exponential"``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a ``GossipState``.

    References:
      Assran et al., "Stochastic gradient push for distributed deep
      learning", ICML 2019. Lian et al., "Can decentralized algorithms
      outperform centralized algorithms?", NeurIPS 2017.

    Example:
      >>> import optax, adaptjax
      >>> tx = optax.chain(adaptjax.sync.per_replica_optimizer(optax.sgd(0.1)),
      ...                  adaptjax.sync.gossip("data", topology="exponential"))
    """
    topology = _check_topology(topology)

    def init_fn(params):
        return GossipState(jnp.zeros((), jnp.int32), PerReplica(params, LOCAL_MERGE))

    def update_fn(updates, state, params=None, **extra):
        del extra
        n = axis_size(axis_name)
        x = jax.tree.map(lambda xi, u: xi + u.astype(xi.dtype), state.local.value, updates)
        offsets = peer_offsets(n, topology)

        def exchange(s):
            perm = [(j, (j + s) % n) for j in range(n)]
            return lambda t: jax.lax.ppermute(t, axis_name, perm)

        if n == 1:
            received = x
        elif len(offsets) == 1:
            received = exchange(offsets[0])(x)
        else:
            index = state.count % len(offsets)
            received = jax.lax.switch(index, [exchange(s) for s in offsets], x)
        new_local = jax.tree.map(lambda a, b: (a + b) / 2, x, received)
        zeros = jax.tree.map(jnp.zeros_like, params if params is not None else updates)
        return zeros, GossipState(state.count + 1, PerReplica(new_local, LOCAL_MERGE))

    # optax's OptState alias (arrays, iterables, mappings) has no room for a custom
    # pytree node such as PerReplica, which this state holds
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


@dataclasses.dataclass(frozen=True)
class Gossip(SyncStrategy):
    """Gossip averaging with one peer per step (see :func:`gossip`).

    Needs at least 2 replicas; cannot carry a codec.

    **Noise scale:** not estimated (gradients are never averaged; monitors
    are off, see :class:`adaptjax.sync.SyncStrategy`).

    Bytes per device per step: ``P`` (one ``ppermute`` of the parameters).

    Attributes:
      topology: ``"ring"`` or ``"exponential"``.

    Example:
      >>> import adaptjax
      >>> adaptjax.sync.Gossip("exponential").wire_formula(4000, 16)
      4000.0
    """

    topology: str = "ring"
    accepts_codec = False

    def __post_init__(self) -> None:
        _check_topology(self.topology)

    def check(self, n_replicas: int, codec: object = None) -> None:
        if n_replicas < 2:
            raise ValueError(
                f"gossip needs at least 2 replicas, got {n_replicas}; use more devices or "
                "another strategy (e.g. adaptjax.sync.SSGD())"
            )
        super().check(n_replicas, codec)

    def post(
        self, axis_name: str | tuple[str, ...] = "data", *, codec: GradientCodec | None = None
    ) -> optax.GradientTransformationExtraArgs | None:
        self.check(2, codec)
        return gossip(axis_name, topology=self.topology)

    def wire_formula(self, param_bytes: float, n_replicas: int) -> float:
        return float(param_bytes) if n_replicas > 1 else 0.0
