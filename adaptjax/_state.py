"""The training state the step builder threads through ``jit``."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from adaptjax._mesh import check_mesh, is_sharded, param_specs
from adaptjax._per_replica import stack_replicas, state_partition_specs
from adaptjax._tree import check_float_tree


class RngKeyData:
    """The ``uint32`` data of a typed PRNG key held in a :class:`TrainState`.

    NNX keeps its RNG streams as typed key arrays (``key<fry>``), which numpy,
    Orbax and ``np.array`` cannot hold; the train state stores their raw data
    (``jax.random.key_data``) with the key implementation as static metadata,
    and turns them back into keys (``jax.random.wrap_key_data``) wherever the
    model is merged.
    """

    __slots__ = ("data", "impl")

    def __init__(self, data, impl: str):
        self.data = data
        self.impl = impl

    def __repr__(self) -> str:
        return f"RngKeyData({self.data!r}, impl={self.impl!r})"


jax.tree_util.register_pytree_with_keys(
    RngKeyData,
    lambda k: (((jax.tree_util.GetAttrKey("data"), k.data),), k.impl),
    lambda impl, children: RngKeyData(next(iter(children)), impl),  # children: (data,)
    lambda k: ((k.data,), k.impl),
)


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_key_data(x) -> bool:
    return isinstance(x, RngKeyData)


def keys_to_data(tree):
    """Replaces every typed PRNG key in ``tree`` by its :class:`RngKeyData`."""

    def to_data(x):
        return RngKeyData(jax.random.key_data(x), str(jax.random.key_impl(x))) if _is_key(x) else x

    return jax.tree.map(to_data, tree)


def data_to_keys(tree):
    """Inverse of :func:`keys_to_data`."""

    def to_key(x):
        return jax.random.wrap_key_data(x.data, impl=x.impl) if _is_key_data(x) else x

    return jax.tree.map(to_key, tree, is_leaf=_is_key_data)


@dataclasses.dataclass
class TrainState:
    """Everything one data-parallel step reads and returns.

    For a flax NNX model, ``params`` holds its ``nnx.Param`` variables and
    ``model_state`` everything else the module carries: BatchNorm statistics
    (``nnx.BatchStat``), the RNG streams of ``nnx.Dropout`` (key and count),
    caches. The step updates them (see :func:`adaptjax.data_parallel_step`)
    and checkpoints save and restore them with the rest of the state.
    ``state.model`` is the trained module (``nnx.merge``).

    Attributes:
      step: int32 step counter.
      params: the parameters (replicated). For a flax NNX model, its
        ``nnx.Param`` state.
      opt_state: the optimizer state; subtrees wrapped in
        :class:`adaptjax.PerReplica` are sharded over the data axis.
      nonfinite_count: int32 number of updates skipped for non-finite values.
      model_state: the NNX model's other variables (replicated; RNG keys as
        their ``uint32`` data), else ``()``.
      graphdef: the NNX graph definition (static), else ``None``.

    Example:
      Move from ``nnx.Optimizer`` (``optimizer.update(model, grads)`` inside
      your own ``nnx.jit``) to adaptjax: the same model and optax
      transformation, with the sync first; the loss takes the module.

      >>> import jax.numpy as jnp, numpy as np, optax, adaptjax
      >>> from flax import nnx
      >>> class Net(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.linear = nnx.Linear(4, 2, rngs=rngs)
      ...         self.norm = nnx.BatchNorm(2, rngs=rngs)
      ...         self.drop = nnx.Dropout(0.5, rngs=rngs)
      ...     def __call__(self, x):
      ...         return self.drop(self.norm(self.linear(x)))
      >>> model = Net(nnx.Rngs(0))
      >>> model.train()  # batch statistics and dropout on, as with nnx.Optimizer
      >>> tx = optax.chain(adaptjax.sync_gradients("data"), optax.adam(1e-2))
      >>> mesh = adaptjax.make_mesh(8)
      >>> loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
      >>> step = adaptjax.data_parallel_step(loss, tx, mesh)
      >>> state = adaptjax.init_state(model, tx, mesh)
      >>> batch = {"x": np.ones((16, 4), np.float32), "y": np.zeros((16, 2), np.float32)}
      >>> state, metrics = step(state, batch)
      >>> trained = state.model  # nnx.merge(graphdef, params, model_state)
      >>> trained.eval()  # running averages, no dropout
      >>> trained(jnp.ones((1, 4))).shape, int(trained.drop.rngs.count[...])
      ((1, 2), 1)
    """

    # Leaves are arrays (int32 scalars for the two counters); train_state_specs,
    # train_state_shardings and abstract_state return TrainStates of specs,
    # shardings and ShapeDtypeStructs, hence Any.
    step: Any
    params: Any
    opt_state: Any
    nonfinite_count: Any
    model_state: Any = ()
    graphdef: Any = None

    @property
    def model(self) -> Any:
        """The model, the NNX module (``nnx.merge``) or, for a pytree model, ``params``."""
        return merge_model(self.graphdef, self.params, self.model_state)


jax.tree_util.register_dataclass(
    TrainState,
    data_fields=["step", "params", "opt_state", "nonfinite_count", "model_state"],
    meta_fields=["graphdef"],
)


def train_state_specs(
    state: TrainState,
    axis_name: str | tuple[str, ...] = "data",
    *,
    mesh: Mesh | AbstractMesh | None = None,
    sharding: Any = None,
) -> TrainState:
    """Partition specs for a :class:`TrainState` (per-replica leaves over ``axis_name``).

    Without ``mesh`` (or on a mesh of data axes only) every leaf is
    replicated but the per-replica ones, ``P(axis_name)``. On a sharded
    mesh (``adaptjax.make_mesh({"data": 2, "fsdp": 4})``) the parameters
    get :func:`adaptjax.param_specs` (``sharding`` as there), the optimizer
    state follows its parameters (Adam's moments sharded like them), and
    per-replica state gets ``P(axis_name, *its parameter's spec)``. The
    step counters and the NNX model's other variables stay replicated.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> state = adaptjax.init_state({"w": jnp.zeros(2)}, optax.sgd(0.1), adaptjax.make_mesh(2))
      >>> adaptjax.train_state_specs(state).params
      {'w': P()}
      >>> mesh = adaptjax.make_mesh({"data": 2, "fsdp": 4})
      >>> tx = optax.adam(0.1)
      >>> state = adaptjax.abstract_state({"w": jnp.zeros((8, 4096))}, tx, mesh)
      >>> specs = adaptjax.train_state_specs(state, mesh=mesh)
      >>> specs.params["w"], specs.opt_state[0].mu["w"], specs.opt_state[0].count
      (P(None, 'fsdp'), P(None, 'fsdp'), P())
    """
    if mesh is None or not is_sharded(mesh, axis_name):
        params = jax.tree.map(lambda _: P(), state.params)
        opt_state = state_partition_specs(state.opt_state, axis_name)
    else:
        params = param_specs(state.params, mesh, sharding=sharding, axis_name=axis_name)
        opt_state = state_partition_specs(
            state.opt_state, axis_name, params=state.params, param_specs=params
        )
    return TrainState(
        step=P(),
        params=params,
        opt_state=opt_state,
        nonfinite_count=P(),
        model_state=jax.tree.map(lambda _: P(), state.model_state),
        graphdef=state.graphdef,
    )


def train_state_shardings(
    state: TrainState,
    mesh: Mesh,
    axis_name: str | tuple[str, ...] = "data",
    *,
    sharding: Any = None,
) -> TrainState:
    """``NamedSharding``s for a :class:`TrainState` on ``mesh`` (see :func:`train_state_specs`).

    Place a restored or merged state on a new mesh with
    ``jax.device_put(state, train_state_shardings(state, new_mesh))``.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> mesh = adaptjax.make_mesh(2)
      >>> state = adaptjax.init_state({"w": jnp.zeros(2)}, optax.sgd(0.1), mesh)
      >>> adaptjax.train_state_shardings(state, mesh).params["w"].mesh.size
      2
    """
    specs = train_state_specs(state, axis_name, mesh=mesh, sharding=sharding)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def split_model(model_or_params):
    """Returns ``(graphdef, params, model_state)``; NNX modules are split on ``nnx.Param``.

    RNG keys in ``model_state`` become :class:`RngKeyData`.
    """
    from flax import nnx  # NNX models only: optax-only users never load flax (~1 s)

    if isinstance(model_or_params, nnx.Module):
        graphdef, params, rest = nnx.split(model_or_params, nnx.Param, ...)
        return graphdef, params, keys_to_data(rest)
    return None, model_or_params, ()


def merge_model(graphdef, params, model_state):
    """Inverse of :func:`split_model`: the NNX module, or the params pytree."""
    if graphdef is None:
        return params
    from flax import nnx  # NNX models only: optax-only users never load flax (~1 s)

    return nnx.merge(graphdef, params, data_to_keys(model_state))


def fold_replica_into_keys(model_state, axis_name):
    """Folds the replica index into every RNG key: each replica draws its own masks.

    Call inside ``shard_map`` with ``axis_name`` bound. The stored keys stay
    as they are; the NNX stream's count, carried in the state, makes every
    step's draws new, so a run restored from a checkpoint draws the same.
    """
    index = None

    def fold(x):
        nonlocal index
        if not _is_key_data(x):
            return x
        if index is None:
            index = jax.lax.axis_index(axis_name)
        key = jax.random.fold_in(jax.random.wrap_key_data(x.data, impl=x.impl), index)
        return RngKeyData(jax.random.key_data(key), x.impl)

    return jax.tree.map(fold, model_state, is_leaf=_is_key_data)


def model_state_after(model, model_state):
    """The NNX ``model``'s non-parameter variables after a call, shaped like ``model_state``.

    RNG keys keep their stored (unfolded) data; everything else (batch
    statistics, RNG counts) is what the call left behind.
    """
    if not jax.tree.leaves(model_state):
        return model_state
    from flax import nnx  # NNX models only: optax-only users never load flax (~1 s)

    _, _, rest = nnx.split(model, nnx.Param, ...)
    return jax.tree.map(
        lambda new, old: old if _is_key_data(old) else new,
        keys_to_data(rest),
        model_state,
        is_leaf=_is_key_data,
    )


def shape_struct(x) -> jax.ShapeDtypeStruct:
    """The ``ShapeDtypeStruct`` of an array or array-like, without copying it to the host.

    The dtype is the one jax gives the array (int64 data is int32 without x64),
    so a program compiled for the struct is the one the array's call runs.
    """
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(dtype))


def init_state(
    model_or_params: Any,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axis_name: str | tuple[str, ...] = "data",
    sharding: Any = None,
) -> TrainState:
    """Builds a :class:`TrainState` placed on ``mesh``.

    On a mesh of data axes only, parameters are replicated; optimizer state
    in :class:`adaptjax.PerReplica` is stacked to one copy per replica and
    sharded over ``axis_name``. On a sharded mesh every leaf is placed as
    :func:`adaptjax.train_state_specs` says: only its shard reaches each
    device.

    Args:
      model_or_params: a pytree of float parameters, or a flax NNX module.
      tx: the optax transformation the step will run.
      mesh: a ``jax.sharding.Mesh`` with ``axis_name``.
      axis_name: the data-parallel axis.
      sharding: how parameters lie on a sharded mesh (see
        :func:`adaptjax.param_specs`); pass the same to
        :func:`adaptjax.data_parallel_step`.

    Returns:
      The placed :class:`TrainState`.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, adaptjax
      >>> mesh = adaptjax.make_mesh(4)
      >>> state = adaptjax.init_state({"w": jnp.zeros(3)}, optax.sgd(0.1), mesh)
      >>> int(state.step), state.params["w"].sharding.spec == jax.P()
      (0, True)
    """
    n = check_mesh(mesh, axis_name)
    graphdef, params, model_state = split_model(model_or_params)
    check_float_tree(params, "parameters")
    opt_state = stack_replicas(tx.init(params), n)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt_state,
        nonfinite_count=jnp.zeros((), jnp.int32),
        model_state=model_state,
        graphdef=graphdef,
    )
    # Host copies first: leaves that share one buffer (a common zeros scalar)
    # must become distinct device buffers, or donating the state fails.
    state = jax.tree.map(lambda x: np.array(x), state)
    return jax.device_put(state, train_state_shardings(state, mesh, axis_name, sharding=sharding))


def abstract_state(
    model_or_params: Any,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axis_name: str | tuple[str, ...] = "data",
    sharding: Any = None,
) -> TrainState:
    """The :class:`TrainState` that :func:`init_state` would build, as ``ShapeDtypeStruct`` leaves.

    Nothing is allocated: use it as the restore target of a checkpoint on a
    new mesh (``RunCheckpoints.restore(target_state=...)``) or to compile a
    step ahead of time. Each leaf carries its ``NamedSharding`` on ``mesh``.

    Args:
      model_or_params: a pytree of float parameters, or a flax NNX module.
      tx: the optax transformation.
      mesh: the target mesh.
      axis_name: the data-parallel axis.
      sharding: as in :func:`init_state`.

    Returns:
      A :class:`TrainState` of ``jax.ShapeDtypeStruct``.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> s = adaptjax.abstract_state({"w": jnp.zeros(3)}, optax.adam(0.1), adaptjax.make_mesh(2))
      >>> s.params["w"].shape, s.params["w"].sharding.spec
      ((3,), P())
    """
    n = check_mesh(mesh, axis_name)
    graphdef, params, model_state = split_model(model_or_params)
    check_float_tree(params, "parameters")
    shapes = jax.eval_shape(
        lambda p: TrainState(
            step=jnp.zeros((), jnp.int32),
            params=p,
            opt_state=stack_replicas(tx.init(p), n),
            nonfinite_count=jnp.zeros((), jnp.int32),
            model_state=(),
        ),
        params,
    )
    shapes = dataclasses.replace(
        shapes, model_state=jax.tree.map(shape_struct, model_state), graphdef=graphdef
    )
    shardings = train_state_shardings(shapes, mesh, axis_name, sharding=sharding)
    return jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings
    )
