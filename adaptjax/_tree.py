"""Small tree helpers shared by the sync transformation, monitors and codecs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

# Leaves under this many elements are concatenated and reduced together: on
# XLA:CPU each reduction is its own kernel, and one of fewer than 4096 elements
# is three (a multiply, a reduce-window, a reduce), so a model's many biases
# and norm scales would cost more in kernels than in bytes.
_SMALL_LEAF = 4096


def _sq_sum(x: jax.Array) -> jax.Array:
    """``Σx²`` of a flat float32 vector, in one kernel on XLA:CPU (zero-padded to 4096)."""
    if x.shape[0] < _SMALL_LEAF:
        x = jnp.pad(x, (0, _SMALL_LEAF - x.shape[0]))
    return jnp.sum(jnp.square(x))


def _sum_squares(leaves) -> jax.Array:
    """``Σ‖x‖²`` over ``leaves`` in float32: a reduction per large leaf, one for the small."""
    flat = [x.reshape(-1).astype(jnp.float32) for x in leaves]
    small = [x for x in flat if x.shape[0] < _SMALL_LEAF]
    parts = [_sq_sum(x) for x in flat if x.shape[0] >= _SMALL_LEAF]
    if small:
        parts.append(_sq_sum(jnp.concatenate(small)))
    if not parts:
        return jnp.zeros((), jnp.float32)
    return parts[0] if len(parts) == 1 else jnp.sum(jnp.stack(parts))


def tree_sq_norm(tree: Any) -> jax.Array:
    """Sum of squares of every leaf, accumulated in float32.

    Leaves under 4096 elements are concatenated and reduced in one kernel
    (a transformer's biases and norm scales would otherwise cost one or more
    kernels each); larger leaves are reduced one by one.

    Example:
        >>> import jax.numpy as jnp
        >>> from adaptjax._tree import tree_sq_norm
        >>> float(tree_sq_norm({"a": jnp.array([3.0]), "b": jnp.array([4.0])}))
        25.0
    """
    return _sum_squares(jax.tree.leaves(tree))


def tree_vdot(a: Any, b: Any) -> jax.Array:
    """Inner product of two trees of the same structure, in float32.

    Example:
        >>> import jax.numpy as jnp
        >>> from adaptjax._tree import tree_vdot
        >>> float(tree_vdot({"a": jnp.array([1.0, 2.0])}, {"a": jnp.array([3.0, 4.0])}))
        11.0
    """
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return sum(
        (jnp.vdot(x.astype(jnp.float32), y.astype(jnp.float32)) for x, y in pairs),
        jnp.zeros((), jnp.float32),
    )


def check_float_tree(tree, what: str = "gradients") -> None:
    """Raises ``ValueError`` when a leaf is not floating point (at trace time)."""
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise ValueError(
                f"{what} must be floating point, got {jnp.result_type(x)} at "
                f"{jax.tree_util.keystr(path) or 'the root'}; "
                "cast integer parameters to float32"
            )


def axis_size(axis_name) -> int:
    """Size of a bound mesh axis, or of a tuple of axes (their product)."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    size = 1
    for name in names:
        size *= jax.lax.axis_size(name)
    return size


def _trivial_over(axis_name) -> bool:
    """Whether a collective over ``axis_name`` must be left out: the identity XLA cannot compile.

    On a (1, N) mesh (``make_mesh({"data": 1, "fsdp": 8})``) the step is
    manual over a data axis of size 1 beside ``Auto`` axes; XLA's SPMD
    partitioner (jax 0.10.2) rejects an all-reduce over it of an array the
    compiler shards ("Cross-partition allreduce must be in (partial) manual
    partitioning mode"). Over one replica the sum is the value itself.
    """
    if axis_size(axis_name) != 1:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and any(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def psum_replicas(tree, axis_name):
    """``jax.lax.psum`` over the data axis, left out where it is the identity XLA rejects."""
    return tree if _trivial_over(axis_name) else jax.lax.psum(tree, axis_name)


def pmean_replicas(tree, axis_name):
    """``jax.lax.pmean`` over the data axis (see :func:`psum_replicas`)."""
    return tree if _trivial_over(axis_name) else jax.lax.pmean(tree, axis_name)


def all_gather_replicas(x, axis_name):
    """The replicas' ``x`` along its leading axis in replica order (see :func:`psum_replicas`)."""
    return x if _trivial_over(axis_name) else jax.lax.all_gather(x, axis_name, tiled=True)


def tree_sq_norm_sampled(
    tree: Any, index: jax.Array, chunks: int, *, min_size: int = 4096
) -> jax.Array:
    """An unbiased, cheaper estimate of :func:`tree_sq_norm` from one chunk per leaf.

    Each leaf of ``d >= min_size`` elements is cut into ``chunks`` contiguous
    chunks of ``ceil(d / chunks)`` elements; only chunk ``index % chunks`` is
    read, and its sum of squares is multiplied by ``chunks``. Averaged over a
    full rotation of ``index`` every element is counted exactly once, so the
    estimate is unbiased for a uniformly random ``index`` and exact on average
    over any ``chunks`` consecutive indices. Smaller leaves are summed whole.
    It reads about ``1/chunks`` of the memory that :func:`tree_sq_norm` reads.

    Args:
      tree: a pytree of arrays.
      index: int32 scalar (e.g. the step counter).
      chunks: the number of chunks; 1 gives the exact norm.
      min_size: leaves smaller than this are read whole.

    Returns:
      A float32 scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> from adaptjax._tree import tree_sq_norm, tree_sq_norm_sampled
      >>> x = {"w": jnp.arange(8192.0) % 3}
      >>> est = [float(tree_sq_norm_sampled(x, jnp.int32(i), 4)) for i in range(4)]
      >>> sum(est) / 4 == float(tree_sq_norm(x))
      True
    """
    if chunks <= 1:
        return tree_sq_norm(tree)
    i = jnp.asarray(index, jnp.int32) % chunks
    whole, chunked = [], []
    for x in jax.tree.leaves(tree):
        flat = x.reshape(-1).astype(jnp.float32)
        d = flat.shape[0]
        if d < min_size:
            whole.append(flat)
            continue
        c = -(-d // chunks)
        start = i * c
        offset = jnp.minimum(start, d - c)
        part = jax.lax.dynamic_slice(flat, (offset,), (c,))
        # Mask out the elements the clipped last chunk shares with its neighbour.
        pos = offset + jnp.arange(c, dtype=jnp.int32)
        chunked.append(jnp.where(pos >= start, part, 0.0))
    # The chunks are joined and reduced in one kernel, like the small leaves.
    total = _sum_squares(whole)
    if chunked:
        total = total + chunks * _sq_sum(jnp.concatenate(chunked))
    return total


# --------------------------------------------------------------------------------------
# Sharded leaves: norms summed over shards, and per-shard views
# --------------------------------------------------------------------------------------


def _spec_axes(spec) -> tuple[str, ...]:
    out: list[str] = []
    for entry in spec:
        for a in entry if isinstance(entry, tuple) else (entry,):
            if a is not None:
                out.append(a)
    return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class ShardLayout:
    """How one replica's gradient leaves lie over the mesh axes that shard the model.

    On a sharded mesh :func:`adaptjax.data_parallel_step` is manual over the
    data axis only: the gradients a transformation sees are each replica's
    *whole* leaves, laid over ``"fsdp"``/``"model"`` by the compiler. A
    layout lets the sync transformation, the monitors and the codecs work on
    each device's shard instead, with a ``jax.shard_map`` nested over those
    axes (:meth:`local_map`): norms are summed over the shards in one scalar
    all-reduce (:meth:`sq_norm`), and a codec compresses each shard over the
    data axis. The step passes it to ``tx.update`` as the extra argument
    ``shard_layout``; without one, everything runs on the whole leaves
    (correct, the compiler moving what it needs).

    Attributes:
      specs: a ``PartitionSpec`` per parameter leaf (the non-data axes only).
      axes: the mesh axes the specs may name (manual inside :meth:`local_map`).
      mesh: the mesh (used when no mesh is bound by an enclosing ``shard_map``).
      index: ``{key path: (shape, spec)}`` of the parameters, to shard state
        that mirrors them (:meth:`specs_for`).

    Example:
      >>> import jax, jax.numpy as jnp, adaptjax
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = adaptjax.make_mesh({"data": 2, "fsdp": 4})
      >>> g = {"w": jnp.ones((8, 4)), "b": jnp.ones(3)}
      >>> layout = ShardLayout.of(g, mesh, sharding={"w": P("fsdp"), "b": P()})
      >>> on = lambda spec: NamedSharding(mesh, spec)
      >>> g = jax.device_put(g, {"w": on(P("fsdp")), "b": on(P())})
      >>> float(jax.jit(layout.sq_norm)(g))   # 32 + 3, the replicated leaf counted once
      35.0
    """

    specs: Any
    axes: tuple[str, ...]
    mesh: Any
    index: dict

    @classmethod
    def of(
        cls,
        params: Any,
        mesh: Mesh,
        *,
        sharding: Any = None,
        axis_name: str | tuple[str, ...] = "data",
    ) -> ShardLayout:
        """The layout of ``params`` on ``mesh``; ``sharding`` as in :func:`adaptjax.param_specs`."""
        from adaptjax._mesh import model_axes, param_specs  # _mesh imports jax only
        from adaptjax._per_replica import _spec_index

        specs = param_specs(params, mesh, sharding=sharding, axis_name=axis_name)
        return cls(specs, model_axes(mesh, axis_name), mesh, _spec_index(params, specs))

    @property
    def devices(self) -> int:
        """The number of devices one replica spans, the product of the sizes of :attr:`axes`."""
        size = 1
        for a in self.axes:
            size *= int(self.mesh.shape[a])
        return size

    def local_shape(self, shape: Sequence[int], spec: P) -> tuple[int, ...]:
        """The shape of one device's shard of a leaf of ``shape`` laid out by ``spec``."""
        out = list(shape)
        for d, entry in enumerate(spec):
            for a in _spec_axes(P(entry)):
                out[d] //= int(self.mesh.shape[a])
        return tuple(out)

    def specs_for(self, tree: Any) -> Any:
        """A spec per leaf of ``tree``: its parameter's for state that mirrors one, else ``P()``.

        ``tree`` is in the local view (no leading replica axis), e.g. a codec's state.
        """
        from adaptjax._per_replica import _spec_like_param

        return jax.tree_util.tree_map_with_path(
            lambda p, x: _spec_like_param(self.index, p, jnp.shape(x)), tree
        )

    def local_map(
        self, fn: Callable[..., Any], in_specs: Any, out_specs: Any
    ) -> Callable[..., Any]:
        """``fn`` on each device's shards: a ``jax.shard_map`` manual over :attr:`axes`."""
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            mesh = self.mesh
        return jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=frozenset(self.axes),
            check_vma=False,
        )

    def first_of(self, specs: Any) -> list[jax.Array]:
        """Per leaf (inside :meth:`local_map`): whether this device counts it in a sum.

        A leaf sharded over every one of :attr:`axes` is counted everywhere; one
        replicated over some of them only on the device at index 0 of those.
        """
        out = []
        for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)):
            replicated = [a for a in self.axes if a not in _spec_axes(s)]
            out.append(
                jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in replicated]))
                if replicated
                else jnp.bool_(True)
            )
        return out

    def _partial(self, specs, tree, index, chunks: int) -> jax.Array:
        """This device's share of ``Σ‖x‖²`` (inside :meth:`local_map`), each leaf counted once."""
        groups: dict[tuple, list] = {}
        flat_specs = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
        for s, x in zip(flat_specs, jax.tree.leaves(tree), strict=True):
            replicated = tuple(a for a in self.axes if a not in _spec_axes(s))
            groups.setdefault(replicated, []).append(x)
        total = jnp.zeros((), jnp.float32)
        for replicated, leaves in groups.items():
            part = tree_sq_norm_sampled(leaves, index, chunks)
            if replicated:
                first = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in replicated]))
                part = jnp.where(first, part, 0.0)
            total = total + part
        return total

    def sq_partials(self, tree: Any, index: int | jax.Array = 0, chunks: int = 1) -> jax.Array:
        """Every device's share of ``Σ‖x‖²`` as one vector over :attr:`axes` (no collective).

        Add several of them up and call :meth:`total` once (micro-batches).
        """
        specs = self.specs_for(tree)
        fn = lambda t, i: self._partial(specs, t, i, chunks).reshape(1)
        index = jnp.asarray(index, jnp.int32)
        return self.local_map(fn, (specs, P()), P(self.axes))(tree, index)

    def total(self, partials: jax.Array) -> jax.Array:
        """The sum of :meth:`sq_partials` over the devices: one scalar all-reduce."""
        fn = lambda v: jax.lax.psum(v[0], self.axes)
        return self.local_map(fn, P(self.axes), P())(partials)

    def sq_norm(self, tree: Any, index: int | jax.Array = 0, chunks: int = 1) -> jax.Array:
        """``Σ‖x‖²`` of a tree shaped like the parameters, from each device's shards.

        With ``chunks > 1`` each shard is read as :func:`tree_sq_norm_sampled`
        reads a leaf (unbiased, exact over ``chunks`` consecutive ``index``).
        One scalar all-reduce over :attr:`axes`, however many leaves.
        """
        specs = self.specs_for(tree)
        fn = lambda t, i: jax.lax.psum(self._partial(specs, t, i, chunks), self.axes)
        index = jnp.asarray(index, jnp.int32)
        return self.local_map(fn, (specs, P()), P())(tree, index)
