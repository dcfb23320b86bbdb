"""Mesh shapes a job could run on, and the bytes of state each device would hold there.

``adaptjax plan`` ranks the factorisations of a device count into a run's mesh
axes (:func:`mesh_shapes`: the ``"data"`` size must divide the batch) by
predicted step time, next to what each device would hold of the parameters
and optimizer state (:func:`state_bytes_per_device`, computed from the
shapes alone: nothing is allocated and no device is needed, so a plan can
ask about a mesh larger than this machine's).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AbstractMesh

from adaptjax._per_replica import stack_replicas
from adaptjax._state import TrainState, split_model, train_state_specs


def mesh_shapes(devices: int, axes: Sequence[str], batch_size: int,
                microbatches: int = 1) -> list[dict[str, int]]:
    """Every ``{axis: size}`` over ``axes`` (in order) whose sizes multiply to ``devices``
    and whose ``"data"`` size divides ``batch_size`` into ``microbatches`` equal parts.

    Example:
      >>> from adaptjax.costs._meshes import mesh_shapes
      >>> [tuple(s.values()) for s in mesh_shapes(8, ("data", "fsdp"), 64)]
      [(1, 8), (2, 4), (4, 2), (8, 1)]
      >>> [tuple(s.values()) for s in mesh_shapes(8, ("data", "fsdp"), 12)]
      [(1, 8), (2, 4), (4, 2)]
    """
    if "data" not in axes:
        raise ValueError(f"mesh axes {tuple(axes)} have no 'data' axis; add it")
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    out = []
    for sizes in itertools.product(divisors, repeat=len(axes)):
        shape = dict(zip(axes, sizes, strict=True))
        if math.prod(sizes) == devices and batch_size % (shape["data"] * microbatches) == 0:
            out.append(shape)
    return out


def _split(spec, shape: Mapping[str, int]) -> list[int]:
    """How many ways each dimension is split by ``spec`` on a mesh of ``shape``."""
    out = []
    for entry in spec:
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        out.append(math.prod(int(shape[a]) for a in names))
    return out


def state_bytes_per_device(
    model: Any,
    tx: optax.GradientTransformation,
    mesh_shape: Mapping[str, int],
    *,
    sharding: Any = None,
) -> int:
    """Bytes of parameters and optimizer state on each device of a ``mesh_shape`` mesh.

    The state :func:`adaptjax.init_state` would build for ``model`` and ``tx``
    there (``sharding`` as in :func:`adaptjax.param_specs`), counted from its
    shapes and partition specs: per-replica leaves hold one replica's copy
    per device, sharded leaves their shard.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from adaptjax.costs import state_bytes_per_device
      >>> params = {"w": jnp.zeros((64, 128))}  # 32 KiB, Adam's two moments, its int32 count
      >>> state_bytes_per_device(params, optax.adam(0.1), {"data": 8})
      98308
      >>> state_bytes_per_device(params, optax.adam(0.1), {"data": 2, "fsdp": 4})
      24580
    """
    shape = dict(mesh_shape)
    mesh = AbstractMesh(tuple(shape.values()), tuple(shape))
    _, params, _ = split_model(model)
    n = int(shape["data"])
    state = jax.eval_shape(
        lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p,
                             opt_state=stack_replicas(tx.init(p), n),
                             nonfinite_count=jnp.zeros((), jnp.int32)),
        params,
    )
    specs = train_state_specs(state, mesh=mesh, sharding=sharding)
    total = 0
    for part in ("params", "opt_state"):
        leaves = jax.tree.leaves(getattr(state, part))
        parts = jax.tree.leaves(getattr(specs, part), is_leaf=lambda x: isinstance(x, jax.P))
        for x, spec in zip(leaves, parts, strict=True):
            split = _split(spec, shape) + [1] * (len(x.shape) - len(spec))
            local = math.prod(d // s for d, s in zip(x.shape, split, strict=True))
            total += local * np.dtype(x.dtype).itemsize
    return int(total)
