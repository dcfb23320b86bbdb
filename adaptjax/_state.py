"""The training state the step builder threads through ``jit``."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from adaptjax._per_replica import stack_replicas, state_partition_specs
from adaptjax._tree import check_float_tree


@dataclasses.dataclass
class TrainState:
    """Everything one data-parallel step reads and returns.

    Attributes:
      step: int32 step counter.
      params: the parameters (replicated). For a flax NNX model, its
        ``nnx.Param`` state.
      opt_state: the optimizer state; subtrees wrapped in
        :class:`adaptjax.PerReplica` are sharded over the data axis.
      nonfinite_count: int32 number of updates skipped for non-finite values.
      model_state: non-parameter NNX variables (carried unchanged), else ``()``.
      graphdef: the NNX graph definition (static), else ``None``.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    nonfinite_count: jax.Array
    model_state: Any = ()
    graphdef: Any = None


jax.tree_util.register_dataclass(
    TrainState,
    data_fields=["step", "params", "opt_state", "nonfinite_count", "model_state"],
    meta_fields=["graphdef"],
)


def train_state_specs(state: TrainState, axis_name="data") -> TrainState:
    """Partition specs for a :class:`TrainState` (per-replica leaves over ``axis_name``).

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> state = adaptjax.init_state({"w": jnp.zeros(2)}, optax.sgd(0.1), adaptjax.make_mesh(2))
      >>> adaptjax.train_state_specs(state).params
      {'w': P()}
    """
    return TrainState(
        step=P(),
        params=jax.tree.map(lambda _: P(), state.params),
        opt_state=state_partition_specs(state.opt_state, axis_name),
        nonfinite_count=P(),
        model_state=jax.tree.map(lambda _: P(), state.model_state),
        graphdef=state.graphdef,
    )


def train_state_shardings(state: TrainState, mesh, axis_name="data") -> TrainState:
    """``NamedSharding``s for a :class:`TrainState` on ``mesh``.

    Place a restored or merged state on a new mesh with
    ``jax.device_put(state, train_state_shardings(state, new_mesh))``.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> mesh = adaptjax.make_mesh(2)
      >>> state = adaptjax.init_state({"w": jnp.zeros(2)}, optax.sgd(0.1), mesh)
      >>> adaptjax.train_state_shardings(state, mesh).params["w"].mesh.size
      2
    """
    specs = train_state_specs(state, axis_name)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def split_model(model_or_params):
    """Returns ``(graphdef, params, model_state)``; NNX modules are split on ``nnx.Param``."""
    from flax import nnx

    if isinstance(model_or_params, nnx.Module):
        graphdef, params, rest = nnx.split(model_or_params, nnx.Param, ...)
        return graphdef, params, rest
    return None, model_or_params, ()


def merge_model(graphdef, params, model_state):
    """Inverse of :func:`split_model`: the NNX module, or the params pytree."""
    if graphdef is None:
        return params
    from flax import nnx

    return nnx.merge(graphdef, params, model_state)


def shape_struct(x) -> jax.ShapeDtypeStruct:
    """The ``ShapeDtypeStruct`` of an array or array-like, without copying it to the host."""
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return jax.ShapeDtypeStruct(np.shape(x), dtype)


def init_state(model_or_params, tx, mesh, *, axis_name: str | tuple[str, ...] = "data"):
    """Builds a :class:`TrainState` placed on ``mesh``.

    Parameters are replicated; optimizer state in :class:`adaptjax.PerReplica`
    is stacked to one copy per replica and sharded over ``axis_name``.

    Args:
      model_or_params: a pytree of float parameters, or a flax NNX module.
      tx: the optax transformation the step will run.
      mesh: a ``jax.sharding.Mesh`` with ``axis_name``.
      axis_name: the data-parallel axis.

    Returns:
      The placed :class:`TrainState`.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, adaptjax
      >>> mesh = adaptjax.make_mesh(4)
      >>> state = adaptjax.init_state({"w": jnp.zeros(3)}, optax.sgd(0.1), mesh)
      >>> int(state.step), state.params["w"].sharding.spec == jax.P()
      (0, True)
    """
    from adaptjax._step import check_mesh

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
    return jax.device_put(state, train_state_shardings(state, mesh, axis_name))


def abstract_state(model_or_params, tx, mesh, *, axis_name: str | tuple[str, ...] = "data"):
    """The :class:`TrainState` that :func:`init_state` would build, as ``ShapeDtypeStruct``s.

    Nothing is allocated: use it as the restore target of a checkpoint on a
    new mesh (``CheckpointManager.restore(target_state=...)``) or to compile a
    step ahead of time. Each leaf carries its ``NamedSharding`` on ``mesh``.

    Args:
      model_or_params: a pytree of float parameters, or a flax NNX module.
      tx: the optax transformation.
      mesh: the target mesh.
      axis_name: the data-parallel axis.

    Returns:
      A :class:`TrainState` of ``jax.ShapeDtypeStruct``.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> s = adaptjax.abstract_state({"w": jnp.zeros(3)}, optax.adam(0.1), adaptjax.make_mesh(2))
      >>> s.params["w"].shape, s.params["w"].sharding.spec
      ((3,), P())
    """
    from adaptjax._step import check_mesh

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
    shardings = train_state_shardings(shapes, mesh, axis_name)
    return jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings
    )
