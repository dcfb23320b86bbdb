"""A marker for state that differs between data-parallel replicas.

Most optimizer state is replicated: every replica holds the same moments. Some
state is not — error-feedback residuals, local models, a replica's own random
stream. adaptjax marks such a subtree by wrapping it in :class:`PerReplica`, so
shardings are *derived from the tree* instead of guessed.

Two views of the same state:

* **local view** (what a transformation's ``init``/``update`` see, inside
    ``shard_map``): each per-replica leaf has its own shape, e.g. ``(d,)``.
* **global view** (what lives on the mesh, what Orbax saves): each per-replica
    leaf is stacked to ``(n_replicas, d)`` and sharded ``P("data")``; every other
    leaf is replicated ``P()``.

:func:`to_local` and :func:`to_global` convert inside ``shard_map``;
:func:`stack_replicas` builds the global view from a local one on the host; and
``merge_replicas`` is the hook a rescale from ``n`` to ``m`` replicas calls.
Its rule is carried by the marker (``merge=``):

* ``"mean"`` (default): every new replica gets the mean over the old replicas.
    The *average* over replicas is preserved exactly, which is what matters for
    error-feedback debt: the synchronised update is the mean of the replicas'
    sent values, so the debt still owed to the averaged gradient,
    ``mean_i(e_i)``, is the same before and after the rescale.
* ``"sum"``: new replica 0 receives the sum over old replicas, others zeros
    (preserves the total).
* ``"first"``: every new replica gets old replica 0 (for local models that
    are kept in sync).
* ``"fold"``: for state that *is* per replica (local models, their
    optimizer moments): on a shrink, new replica ``j`` averages the old
    replicas ``i`` with ``i % m == j``; on a grow, new replica ``j`` copies old
    replica ``j % n``. When one count divides the other the mean over replicas
    is preserved exactly (``8 -> 4 -> 8`` keeps it), and the replicas keep as
    much of their spread as the new count can hold.
* ``"zeros"``: reset.
* a callable ``rule(old: np.ndarray[n, ...], m: int) -> np.ndarray[m, ...]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MergeRule = str | Callable[[np.ndarray, int], np.ndarray]
_RULES = ("mean", "sum", "first", "fold", "zeros")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PerReplica:
    """Wraps a subtree whose leaves differ between replicas.

    Attributes:
        value: the wrapped pytree.
        merge: how ``merge_replicas`` maps ``n`` replicas to ``m`` (see module
            docstring): ``"mean"``, ``"sum"``, ``"first"``, ``"fold"``, ``"zeros"`` or a
            callable.

    Example:
        >>> import jax.numpy as jnp
        >>> import adaptjax
        >>> r = adaptjax.PerReplica(jnp.zeros(3))
        >>> state_partition_specs({"ef": r, "count": jnp.int32(0)})
        {'count': P(), 'ef': PerReplica(value=P('data',), merge='mean')}
    """

    value: Any
    merge: MergeRule = "mean"

    def __post_init__(self):
        if isinstance(self.merge, str) and self.merge not in _RULES:
            raise ValueError(
                f"PerReplica merge={self.merge!r} is unknown; use one of {_RULES} or a callable"
            )

    def tree_flatten(self) -> tuple[tuple[Any], MergeRule]:
        """``((value,), merge)``: the wrapped tree is the child, the rule is static."""
        return (self.value,), self.merge

    @classmethod
    def tree_unflatten(cls, merge: MergeRule, children: Sequence[Any]) -> PerReplica:
        """The inverse of :meth:`tree_flatten` (no check: jax passes back what it took)."""
        obj = object.__new__(cls)
        object.__setattr__(obj, "value", children[0])
        object.__setattr__(obj, "merge", merge)
        return obj


def _is_marker(x) -> bool:
    return isinstance(x, PerReplica)


def _map_marked(fn_replica, fn_other, tree):
    def visit(node):
        if _is_marker(node):
            return PerReplica(jax.tree.map(fn_replica, node.value), node.merge)
        return jax.tree.map(fn_other, node)

    return jax.tree.map(visit, tree, is_leaf=_is_marker)


def has_per_replica(tree: Any) -> bool:
    """Whether ``tree`` holds any :class:`PerReplica` subtree.

    Example:
        >>> import adaptjax
        >>> has_per_replica({"a": 1.0, "b": adaptjax.PerReplica(2.0)})
        True
    """
    return any(_is_marker(x) for x in jax.tree.leaves(tree, is_leaf=_is_marker))


def _map_marked_with_path(fn_replica, fn_other, tree):
    """:func:`_map_marked` whose functions also receive each leaf's key path."""

    def visit(path, node):
        if _is_marker(node):
            inner = jax.tree_util.tree_map_with_path(
                lambda p, x: fn_replica((*path, *p), x), node.value
            )
            return PerReplica(inner, node.merge)
        return fn_other(path, node)

    return jax.tree_util.tree_map_with_path(visit, tree, is_leaf=_is_marker)


def _spec_index(params, param_specs) -> dict:
    """``{key path: (shape, spec)}`` of every parameter leaf."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, P))
    return {
        tuple(path): (tuple(np.shape(x)), spec) for (path, x), spec in zip(flat, specs, strict=True)
    }


def _spec_like_param(index: dict, path, shape) -> P:
    """The spec of the parameter whose key path ends ``path`` and whose shape is ``shape``.

    Optimizer state mirrors the parameters (``mu['layer']['kernel']`` for
    ``['layer']['kernel']``): the longest key-path suffix naming a parameter of
    the same shape gives the spec. A leaf that matches none (a step count, a
    codec's factors) is replicated.
    """
    path, shape = tuple(path), tuple(shape)
    for k in range(len(path), -1, -1):
        hit = index.get(path[len(path) - k :])
        if hit is not None and hit[0] == shape:
            return hit[1]
    return P()


def state_partition_specs(
    tree: Any,
    axis_name: str | tuple[str, ...] = "data",
    *,
    params: Any = None,
    param_specs: Any = None,
) -> Any:
    """Partition specs for a state tree: ``P(axis_name)`` under markers, else ``P()``.

    With ``params`` and their ``param_specs`` (a sharded mesh, see
    :func:`adaptjax.param_specs`), a leaf shaped like a parameter and named
    like it (its key path ends with the parameter's) is sharded like it:
    Adam's moments like their parameter, a per-replica leaf as
    ``P(axis_name, *its parameter's spec)`` (one copy per replica, each
    sharded like the parameter).

    Example:
        >>> import adaptjax
        >>> specs = state_partition_specs({"m": 0.0, "e": adaptjax.PerReplica(0.0)})
        >>> specs["m"], specs["e"].value
        (P(), P('data',))
    """
    if param_specs is None:
        return _map_marked(lambda _: P(axis_name), lambda _: P(), tree)
    index = _spec_index(params, param_specs)
    return _map_marked_with_path(
        lambda path, x: P(axis_name, *_spec_like_param(index, path, np.shape(x)[1:])),
        lambda path, x: _spec_like_param(index, path, np.shape(x)),
        tree,
    )


def state_shardings(
    tree: Any,
    mesh: Mesh,
    axis_name: str | tuple[str, ...] = "data",
    *,
    params: Any = None,
    param_specs: Any = None,
) -> Any:
    """``NamedSharding``s on ``mesh`` for a state tree (see :func:`state_partition_specs`).

    Example:
        >>> import adaptjax
        >>> mesh = adaptjax.make_mesh(2)
        >>> state_shardings(adaptjax.PerReplica(0.0), mesh).value.spec
        P('data',)
    """
    specs = state_partition_specs(tree, axis_name, params=params, param_specs=param_specs)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def to_local(tree: Any) -> Any:
    """Inside ``shard_map``: drops the leading replica axis (size 1) of marked leaves.

    Example:
        >>> import jax.numpy as jnp, adaptjax
        >>> adaptjax.sync.to_local(adaptjax.PerReplica(jnp.zeros((1, 3)))).value.shape
        (3,)
    """
    return _map_marked(lambda x: x[0], lambda x: x, tree)


def to_global(tree: Any) -> Any:
    """Inside ``shard_map``: adds a leading replica axis of size 1 to marked leaves.

    Example:
        >>> import jax.numpy as jnp, adaptjax
        >>> adaptjax.sync.to_global(adaptjax.PerReplica(jnp.zeros(3))).value.shape
        (1, 3)
    """
    return _map_marked(lambda x: x[None], lambda x: x, tree)


def stack_replicas(tree: Any, n_replicas: int) -> Any:
    """Host-side: broadcast each marked leaf of a local-view tree to ``(n, ...)``.

    Example:
        >>> import jax.numpy as jnp, adaptjax
        >>> stack_replicas(adaptjax.PerReplica(jnp.zeros(3)), 8).value.shape
        (8, 3)
    """
    return _map_marked(
        lambda x: jnp.broadcast_to(x[None], (n_replicas, *jnp.shape(x))), lambda x: x, tree
    )


def _merge_leaf(rule: MergeRule, old: np.ndarray, m: int) -> np.ndarray:
    n = old.shape[0]
    if callable(rule):
        new = np.asarray(rule(old, m))
    elif rule == "mean":
        new = np.broadcast_to(
            old.mean(axis=0, dtype=np.float64).astype(old.dtype), (m, *old.shape[1:])
        )
    elif rule == "sum":
        new = np.zeros((m, *old.shape[1:]), old.dtype)
        new[0] = old.sum(axis=0, dtype=np.float64).astype(old.dtype)
    elif rule == "first":
        new = np.broadcast_to(old[0], (m, *old.shape[1:]))
    elif rule == "fold":
        if m >= n:
            new = old[np.arange(m) % n]
        else:
            groups = np.arange(n) % m
            new = np.stack(
                [old[groups == j].mean(axis=0, dtype=np.float64) for j in range(m)]
            ).astype(old.dtype)
    else:  # zeros
        new = np.zeros((m, *old.shape[1:]), old.dtype)
    if new.shape != (m, *old.shape[1:]):
        raise ValueError(
            f"merge rule returned shape {new.shape} for {n}->{m} replicas; "
            f"it must return {(m, *old.shape[1:])}"
        )
    return np.ascontiguousarray(new)


def merge_replicas(tree: Any, new_n_replicas: int) -> Any:
    """Maps the global view of a state tree from ``n`` to ``new_n_replicas`` replicas.

    Replicated leaves are returned unchanged; each marked leaf of shape
    ``(n, ...)`` becomes ``(new_n_replicas, ...)`` under its marker's rule. The
    result is host (numpy) data: place it with ``jax.device_put(tree,
    state_shardings(tree, new_mesh))``.

    Args:
        tree: a global-view state tree (arrays on any devices, or numpy).
        new_n_replicas: the replica count after the rescale.

    Returns:
        The state tree for ``new_n_replicas`` replicas.

    Example:
        >>> import numpy as np
        >>> import adaptjax
        >>> old = {"ef": adaptjax.PerReplica(np.array([[1.0], [3.0]]))}
        >>> adaptjax.sync.merge_replicas(old, 4)["ef"].value[:, 0].tolist()
        [2.0, 2.0, 2.0, 2.0]
    """
    if new_n_replicas < 1:
        raise ValueError(f"new_n_replicas must be >= 1, got {new_n_replicas}")

    def visit(node):
        if _is_marker(node):
            return PerReplica(
                jax.tree.map(
                    lambda x: _merge_leaf(node.merge, np.asarray(x), new_n_replicas), node.value
                ),
                node.merge,
            )
        return node

    return jax.tree.map(visit, tree, is_leaf=_is_marker)
