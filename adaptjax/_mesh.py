"""Device meshes with named axes, and how parameters lie on them.

``"data"`` is the replica axis: the batch is split over it and the sync
transformation, the monitors, the codecs and the sync strategies act over it.
The other axes shard the model: ``"fsdp"`` (parameters, gradients and
optimizer state split over it, ZeRO-3 style) and ``"model"`` (tensor
parallelism, from the model's own partition specs). A mesh whose axes are all
data axes (the default, ``make_mesh(n)``) replicates every parameter.

:class:`FSDP` is the default rule for a sharded mesh: each leaf of at least
``min_size`` elements is split over ``"fsdp"`` along its largest dimension
that the axis divides (after the model's own annotations, e.g. flax NNX
``nnx.with_partitioning``, have placed theirs), as MaxText's ``fsdp`` logical
rules and Levanter's FSDP do to the weights; smaller leaves are replicated.
:func:`param_specs` applies a rule, or checks a user's tree of
``PartitionSpec`` objects, with one-line errors that name the leaf.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

#: The axis names :func:`make_mesh` knows: the replica axis and the model's two.
MESH_AXES = ("data", "fsdp", "model")
MODEL_AXIS = "model"


def _axis_names(axis_name: str | tuple[str, ...]) -> tuple[str, ...]:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def check_mesh(mesh: object, axis_name: str | tuple[str, ...] = "data") -> int:
    """Raises a one-line ``ValueError`` unless ``mesh`` has ``axis_name``; returns replicas."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    missing = [a for a in _axis_names(axis_name) if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"mesh axes {mesh.axis_names} have no {missing[0]!r} axis; build it with "
            f"adaptjax.make_mesh(n) or Mesh(devices, ({missing[0]!r},))"
        )
    return int(np.prod([mesh.shape[a] for a in _axis_names(axis_name)]))


def model_axes(
    mesh: Mesh | AbstractMesh, axis_name: str | tuple[str, ...] = "data"
) -> tuple[str, ...]:
    """The mesh axes that shard the model: every axis but the data axes, in mesh order.

    Example:
      >>> import adaptjax
      >>> from adaptjax._mesh import model_axes
      >>> model_axes(adaptjax.make_mesh({"data": 2, "fsdp": 4})), model_axes(adaptjax.make_mesh(8))
      (('fsdp',), ())
    """
    data = _axis_names(axis_name)
    return tuple(a for a in mesh.axis_names if a not in data)


def is_sharded(mesh: Mesh | AbstractMesh, axis_name: str | tuple[str, ...] = "data") -> bool:
    """Whether ``mesh`` has axes besides the data axes (even of size 1): the sharded path."""
    return bool(model_axes(mesh, axis_name))


def _available(device_list) -> list:
    return list(device_list if device_list is not None else jax.devices())


def _check_count(n: int, available: list, given: bool) -> None:
    if n < 1:
        raise ValueError(f"devices must be >= 1, got {n}")
    if n > len(available):
        where = "device_list has" if given else "exist"
        raise ValueError(
            f"asked for {n} devices but only {len(available)} {where}; use devices <= "
            f"{len(available)} (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count)"
        )


def checked_shape(shape: Mapping) -> dict[str, int]:
    """Checks a ``{axis: size}`` mapping (one-line errors); returns it as a dict in order."""
    out: dict[str, int] = {}
    for name, size in shape.items():
        if name not in MESH_AXES:
            raise ValueError(
                f"unknown mesh axis {name!r} in {dict(shape)}; use 'data' (replicas), "
                "'fsdp' (parameter shards) and 'model' (tensor parallelism)"
            )
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
            raise ValueError(f"mesh axis {name!r} must have an int size >= 1, got {size!r}")
        out[name] = int(size)
    if "data" not in out:
        raise ValueError(
            f"mesh shape {out} has no 'data' axis (the replicas); add one, e.g. "
            f"{{'data': 1, **{out}}}"
        )
    return out


def make_mesh(
    devices: int | Mapping[str, int] | None = None,
    *,
    axis_name: str = "data",
    device_list: Sequence[Any] | None = None,  # jax devices
) -> Mesh:
    """A mesh on the first devices: 1-D over ``"data"``, or named axes from a mapping.

    ``make_mesh(8)`` is the 1-D data-parallel mesh (every parameter
    replicated). ``make_mesh({"data": 2, "fsdp": 4})`` has two replicas, each
    sharding the model over 4 devices; ``"model"`` adds tensor parallelism.
    Axes keep the order given (the last varies fastest over the devices, so
    put the axis that moves the most bytes, ``"fsdp"`` or ``"model"``, last:
    on GPUs it then stays inside a node). Every axis is ``Auto``: the
    compiler places what the shardings leave open (see
    :func:`adaptjax.data_parallel_step`).

    Args:
      devices: how many devices (default: all), or ``{axis: size}`` with axes
        among ``"data"`` (required), ``"fsdp"`` and ``"model"``.
      axis_name: the axis name of a 1-D mesh.
      device_list: pick from these devices instead of ``jax.devices()``; a
        mapping's sizes must then multiply to exactly its length.

    Returns:
      A ``jax.sharding.Mesh``.

    Example:
      >>> import adaptjax
      >>> dict(adaptjax.make_mesh(4).shape)
      {'data': 4}
      >>> dict(adaptjax.make_mesh({"data": 2, "fsdp": 2, "model": 2}).shape)
      {'data': 2, 'fsdp': 2, 'model': 2}
    """
    available = _available(device_list)
    if not isinstance(devices, Mapping):
        n = len(available) if devices is None else int(devices)
        _check_count(n, available, device_list is not None)
        return Mesh(np.array(available[:n]), (axis_name,))
    shape = checked_shape(devices)
    n = math.prod(shape.values())
    if device_list is not None and n != len(available):
        raise ValueError(
            f"mesh shape {shape} needs {n} devices but device_list has {len(available)}; "
            f"make the sizes multiply to {len(available)}"
        )
    _check_count(n, available, device_list is not None)
    grid = np.array(available[:n], dtype=object).reshape(tuple(shape.values()))
    return Mesh(grid, tuple(shape))


def mesh_shape(mesh: Mesh | AbstractMesh) -> dict[str, int]:
    """``{axis: size}`` of a mesh, in its axis order."""
    return {name: int(mesh.shape[name]) for name in mesh.axis_names}


# --------------------------------------------------------------------------------------
# Partition specs of the parameters
# --------------------------------------------------------------------------------------


def canonical_spec(spec) -> P:
    """``spec`` with trailing ``None`` entries dropped (``P('fsdp', None) -> P('fsdp')``)."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def spec_axes(spec) -> tuple[str, ...]:
    """The mesh axes a partition spec names, in order."""
    out: list[str] = []
    for entry in spec:
        if entry is None:
            continue
        for a in entry if isinstance(entry, tuple) else (entry,):
            if a is not None and a is not P.UNCONSTRAINED:
                out.append(a)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class FSDP:
    """Shards each large leaf over ``axis`` along its largest dimension the axis divides.

    The default rule of a sharded mesh. A leaf of at least ``min_size``
    elements gets ``axis`` on its largest dimension that is free (not already
    sharded by the model's own annotation) and divisible by the axis's size;
    ties go to the leading dimension. A smaller leaf, or one with no such
    dimension, keeps its annotation (else it is replicated). On a mesh
    without ``axis`` the rule adds nothing. Optimizer state and per-replica
    state follow their parameter (:func:`adaptjax.train_state_specs`).

    On a mesh that also has ``"model"``, a leaf the model's annotations leave
    out of tensor parallelism (embeddings, norms, the head) is sharded over
    ``(axis, "model")`` together where that product divides a dimension
    (``with_model``): replicated over ``"model"`` it would cost every device of
    a tensor-parallel group its whole copy. (It also avoids an XLA SPMD
    partitioner failure on jax 0.10.2: a gather from a table sharded over
    ``"fsdp"`` alone, by indices sharded over ``"fsdp"``, with ``"data"``
    manual and ``"model"`` free, aborts the compile.)

    Attributes:
      axis: the mesh axis to shard over.
      min_size: leaves with fewer elements stay replicated (biases and norm
        scales: a collective per step would cost more than their bytes).
      annotations: start from the model's own annotations (flax NNX
        ``nnx.with_partitioning`` metadata, with its logical axis rules).
      with_model: on a mesh with ``"model"``, shard leaves the model does not
        split over ``"model"`` over ``(axis, "model")``.

    Example:
      >>> import jax, adaptjax
      >>> mesh = adaptjax.make_mesh({"data": 2, "fsdp": 4})
      >>> rule = adaptjax.FSDP(min_size=16)
      >>> rule.spec((12, 32), mesh), rule.spec((6, 6), mesh), rule.spec((4,), mesh)
      (P(None, 'fsdp'), P(), P())
      >>> mesh3 = adaptjax.make_mesh({"data": 2, "fsdp": 2, "model": 2})
      >>> rule.spec((256, 32), mesh3), rule.spec((32, 64), mesh3, jax.P(None, "model"))
      (P(('fsdp', 'model'),), P('fsdp', 'model'))

    References:
      Rajbhandari et al., "ZeRO: Memory optimizations toward training
      trillion parameter models", SC 2020.
    """

    axis: str = "fsdp"
    min_size: int = 4096
    annotations: bool = True
    with_model: bool = True

    def __post_init__(self):
        if (
            isinstance(self.min_size, bool)
            or not isinstance(self.min_size, int)
            or (self.min_size < 0)
        ):
            raise ValueError(f"FSDP min_size must be an int >= 0, got {self.min_size!r}")

    def spec(self, shape: Sequence[int], mesh: Mesh | AbstractMesh, base: P | None = None) -> P:
        """The spec of a leaf of ``shape``: ``base`` plus ``axis`` where the rule puts it."""
        shape = tuple(int(d) for d in shape)
        base = P() if base is None else base
        entries = list(base) + [None] * (len(shape) - len(base))
        used = spec_axes(base)
        if (
            self.axis not in mesh.axis_names
            or self.axis in used
            or math.prod(shape) < max(self.min_size, 1)
        ):
            return canonical_spec(entries)
        choices: list = [self.axis]
        if self.with_model and MODEL_AXIS in mesh.axis_names and MODEL_AXIS not in used:
            choices.insert(0, (self.axis, MODEL_AXIS))
        for axes in choices:
            size = math.prod(int(mesh.shape[a]) for a in spec_axes(P(axes)))
            free = [d for d in range(len(shape)) if entries[d] is None and shape[d] % size == 0]
            if free:
                entries[max(free, key=lambda d: (shape[d], -d))] = axes
                break
        return canonical_spec(entries)


def _is_variable(x) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Variable)


def annotation_specs(params) -> list:
    """The model's own spec of every leaf of ``params`` (leaf order), ``P()`` where none.

    Reads flax NNX variable metadata (``nnx.with_partitioning``, resolved by
    its ``sharding_rules`` and the active logical axis rules) when flax is
    loaded; a plain pytree has no annotations.
    """
    nodes = jax.tree.leaves(params, is_leaf=_is_variable)
    out: list = []
    for node in nodes:
        if _is_variable(node):
            from flax.nnx import spmd  # loaded already: the node is one of its variables

            spec = spmd.get_var_pspec(node)
            spec = spec if isinstance(spec, P) else P()
            out.extend(spec for _ in jax.tree.leaves(node))
        else:
            out.append(P())
    return out


def _leaf_name(path) -> str:
    return jax.tree_util.keystr(path) or "the root"


def check_spec(
    path: Any,
    shape: Sequence[int],
    spec: Any,
    mesh: Mesh | AbstractMesh,
    axis_name: str | tuple[str, ...] = "data",
) -> P:
    """``spec`` checked for a leaf of ``shape`` at ``path``: one-line errors naming the leaf."""
    name = _leaf_name(path)
    if not isinstance(spec, P):
        raise ValueError(f"the sharding of parameter {name} must be a PartitionSpec, got {spec!r}")
    data = _axis_names(axis_name)
    others = model_axes(mesh, axis_name)
    seen: set[str] = set()
    for a in spec_axes(spec):
        if a in data:
            raise ValueError(
                f"partition spec {spec} of parameter {name} names the replica axis {a!r}; "
                f"parameters are replicated over it: shard them over {others or 'no axis'}"
            )
        if a not in mesh.axis_names:
            raise ValueError(
                f"partition spec {spec} of parameter {name} names axis {a!r}, which the mesh "
                f"{mesh_shape(mesh)} lacks; use one of {others} or None"
            )
        if a in seen:
            raise ValueError(f"partition spec {spec} of parameter {name} names {a!r} twice")
        seen.add(a)
    if len(spec) > len(shape):
        raise ValueError(
            f"partition spec {spec} of parameter {name} has {len(spec)} entries for a leaf of "
            f"shape {tuple(shape)}"
        )
    for d, entry in enumerate(spec):
        axes = spec_axes(P(entry))
        size = math.prod(int(mesh.shape[a]) for a in axes)
        if shape[d] % size:
            raise ValueError(
                f"parameter {name} of shape {tuple(shape)} cannot be split over {axes} (size "
                f"{size}) along dimension {d} ({shape[d]}); use a mesh whose "
                f"{'/'.join(axes)} size divides {shape[d]} or replicate that dimension"
            )
    return canonical_spec(spec)


def _broadcast_prefix(prefix, tree) -> list:
    """Each leaf's entry of ``prefix`` (a tree of specs whose structure is a prefix of ``tree``)."""
    try:
        full = jax.tree.map(
            lambda s, sub: jax.tree.map(lambda _: s, sub),
            prefix,
            tree,
            is_leaf=lambda x: isinstance(x, P),
        )
    except ValueError as e:
        why = str(e).splitlines()[0]
        raise ValueError(
            "sharding= must be a PartitionSpec, a tree of them shaped like the parameters "
            f"(or a prefix of it), an adaptjax.FSDP rule or a function (path, leaf) -> P: {why}"
        ) from None
    return jax.tree.leaves(full, is_leaf=lambda x: isinstance(x, P))


def param_specs(
    params: Any,
    mesh: Mesh | AbstractMesh,
    *,
    sharding: Any = None,
    axis_name: str | tuple[str, ...] = "data",
) -> Any:
    """The ``PartitionSpec`` of every parameter leaf on ``mesh`` (non-data axes only).

    On a mesh of data axes only, every leaf is ``P()`` (replicated, as
    always). On a sharded mesh ``sharding`` decides:

    * ``None``: :class:`FSDP` with its defaults (the model's annotations, then
      ``"fsdp"`` on each large leaf when the mesh has that axis);
    * an :class:`FSDP` rule;
    * a ``PartitionSpec`` or a tree of them shaped like ``params`` (or a
      prefix of it), used as given;
    * a function ``(path, leaf) -> PartitionSpec``, or one of three
      parameters, ``(path, leaf, mesh) -> PartitionSpec``: it is given the
      mesh, so one rule serves every mesh a ``Rescale`` moves the run to.

    Every spec is checked: an axis the mesh lacks, the replica axis, or a
    dimension the axes do not divide is a one-line ``ValueError`` naming the
    leaf.

    Args:
      params: the parameters (arrays or ``ShapeDtypeStruct`` leaves; an NNX state).
      mesh: the mesh.
      sharding: see above.
      axis_name: the data axis (or axes).

    Returns:
      A tree shaped like ``params`` with a ``PartitionSpec`` per leaf.

    Example:
      >>> import jax, jax.numpy as jnp, adaptjax
      >>> mesh = adaptjax.make_mesh({"data": 2, "fsdp": 4})
      >>> params = {"w": jnp.zeros((64, 128)), "b": jnp.zeros(128)}
      >>> adaptjax.param_specs(params, mesh)
      {'b': P(), 'w': P(None, 'fsdp')}
      >>> adaptjax.param_specs(params, mesh, sharding={"w": jax.P("model"), "b": jax.P()})
      Traceback (most recent call last):
      ...
      ValueError: partition spec P('model',) of parameter ['w'] names axis 'model', which the mesh {'data': 2, 'fsdp': 4} lacks; use one of ('fsdp',) or None
    """  # noqa: E501
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    if not is_sharded(mesh, axis_name):
        return jax.tree.unflatten(treedef, [P() for _ in flat])
    rule = FSDP() if sharding is None else sharding
    if isinstance(rule, FSDP):
        bases = annotation_specs(params) if rule.annotations else [P()] * len(flat)
        specs = []
        for (path, x), base in zip(flat, bases, strict=True):
            base = check_spec(path, np.shape(x), base, mesh, axis_name)
            specs.append(rule.spec(np.shape(x), mesh, base))
    elif callable(rule) and not isinstance(rule, P):
        mesh_arg = (mesh,) if _takes_mesh(rule) else ()
        specs = [rule(path, x, *mesh_arg) for path, x in flat]
    else:
        specs = _broadcast_prefix(rule, params)
    checked = [
        check_spec(path, np.shape(x), s, mesh, axis_name)
        for (path, x), s in zip(flat, specs, strict=True)
    ]
    return jax.tree.unflatten(treedef, checked)


def _takes_mesh(rule) -> bool:
    """Whether a rule function has a third positional parameter (the mesh)."""
    try:
        params = inspect.signature(rule).parameters.values()
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in params if p.kind in kinds]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)


ShardingRule = FSDP | P | Callable[[Any, Any], P] | Callable[[Any, Any, Any], P] | Any
