"""The run's mesh: its shape in a :class:`RunConfig`, where a ``Rescale`` moves it, what it holds.

A configuration's mesh is the 1-D ``("data",)`` mesh of ``devices`` replicas,
or the named axes of :attr:`RunConfig.mesh_shape` (``"data"`` of size
``devices``, then ``"fsdp"`` and ``"model"`` where the user put them). This
module turns the controller's ``devices``/``mesh_shape`` arguments and a
``Rescale``'s into a configuration's shape, checks that the model's
shardings fit a shape before anything compiles (:func:`check_shardings`), and
builds the mesh on the devices the job's processes give
(:func:`build_mesh`): ``device_count / P`` devices of each of the ``P``
processes, in process order, so that each process holds whole rows of the
mesh (its devices on every axis) and the data replicas' rows of the batch it
feeds are contiguous.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AbstractMesh

from adaptjax._mesh import make_mesh, param_specs
from adaptjax._run_config import RunConfig, mesh_key, shape_dict
from adaptjax._state import split_model
from adaptjax.launch._distributed import max_processes, mesh_devices


def start_shape(devices, mesh_shape) -> tuple[int, tuple | None]:
    """``(replicas, RunConfig.mesh_shape)`` from the controller's ``devices`` and ``mesh_shape``.

    With ``mesh_shape`` (``{"data": 2, "fsdp": 4}``), ``devices`` may be left
    out (``None``); given, it must be the ``"data"`` size. Bad shapes raise a
    one-line ``ValueError`` naming the fix.

    Example:
      >>> from adaptjax._config_meshes import start_shape
      >>> start_shape(8, None), start_shape(None, {"data": 2, "fsdp": 4})
      ((8, None), (2, (('data', 2), ('fsdp', 4))))
    """
    if mesh_shape is None:
        if devices is None:
            raise ValueError(
                "give devices= (replicas on a 1-D mesh) or mesh_shape= (e.g. {'data': 2, "
                "'fsdp': 4})"
            )
        return devices, None
    replicas = shape_dict(mesh_shape)["data"]
    return replicas, mesh_key(mesh_shape, replicas if devices is None else devices)


def build_mesh(config: RunConfig):
    """``config``'s mesh on the devices :func:`adaptjax.launch._distributed.mesh_devices` picks."""
    devices = mesh_devices(config.device_count)
    if config.mesh_shape is None:
        return make_mesh(config.devices, device_list=devices)
    return make_mesh(config.axes, device_list=devices)


def abstract_mesh(config: RunConfig) -> AbstractMesh:
    """``config``'s mesh without devices (for checks before anything is placed)."""
    axes = config.axes
    return AbstractMesh(tuple(axes.values()), tuple(axes))


def check_shardings(model, config: RunConfig, sharding, *, what: str = "") -> None:
    """Raises a one-line ``ValueError`` unless every parameter's spec fits ``config``'s mesh.

    ``sharding`` is the run's rule (see :func:`adaptjax.param_specs`); the
    error names the leaf and the dimension (and starts with ``what``, e.g.
    ``"Rescale to {'data': 1, 'fsdp': 8}: "``). Nothing is compiled or placed.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from adaptjax import RunConfig
      >>> from adaptjax._config_meshes import check_shardings
      >>> config = RunConfig(1, 8, mesh_shape={"data": 1, "fsdp": 8})
      >>> check_shardings({"w": jnp.zeros((12, 4))}, config, {"w": jax.P("fsdp")})
      Traceback (most recent call last):
      ...
      ValueError: parameter ['w'] of shape (12, 4) cannot be split over ('fsdp',) (size 8) along dimension 0 (12); use a mesh whose fsdp size divides 12 or replicate that dimension
    """  # noqa: E501
    if config.mesh_shape is None:
        return
    params = split_model(model)[1]
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    try:
        param_specs(structs, abstract_mesh(config), sharding=sharding)
    except ValueError as e:
        raise ValueError(f"{what}{e}") from None


def rescale_target(action, config: RunConfig) -> tuple[int, tuple | None]:
    """``(replicas, mesh_shape)`` a ``Rescale`` asks for, from ``config``.

    ``Rescale(devices=n)`` resizes the ``"data"`` axis and keeps the others;
    ``Rescale(mesh_shape={"data": d, "fsdp": f})`` names the new mesh (a
    mapping of ``"data"`` alone is the 1-D mesh); ``Rescale(mesh_shape=(d,
    f))`` gives the sizes of the run's own axes, in order.

    Example:
      >>> from adaptjax import RunConfig, policies as ajp
      >>> from adaptjax._config_meshes import rescale_target
      >>> config = RunConfig(2, 64, mesh_shape={"data": 2, "fsdp": 4})
      >>> rescale_target(ajp.Rescale(devices=1), config)
      (1, (('data', 1), ('fsdp', 4)))
      >>> rescale_target(ajp.Rescale(mesh_shape=(4, 2)), config)
      (4, (('data', 4), ('fsdp', 2)))
      >>> rescale_target(ajp.Rescale(mesh_shape={"data": 8}), config)
      (8, None)
    """
    if action.devices is not None:
        n = int(action.devices)
        if config.mesh_shape is None:
            return n, None
        return n, tuple((a, n if a == "data" else size) for a, size in config.mesh_shape)
    shape = action.mesh_shape
    if not isinstance(shape, Mapping):
        names = tuple(config.axes)
        if len(shape) != len(names):
            raise ValueError(
                f"Rescale(mesh_shape={tuple(shape)}) gives {len(shape)} sizes for the run's mesh "
                f"axes {names}; name the axes, e.g. Rescale(mesh_shape="
                f"{dict(zip(('data', 'fsdp', 'model'), shape, strict=False))})"
            )
        shape = dict(zip(names, shape, strict=True))
    return shape_dict(shape)["data"], mesh_key(shape)


def describe(config: RunConfig) -> str:
    """How ``config``'s mesh reads in a message: ``8 devices`` or ``{'data': 2, 'fsdp': 4}``."""
    return f"{config.devices} devices" if config.mesh_shape is None else str(config.axes)


def model_size(config: RunConfig) -> int:
    """The devices of one replica: the product of the model axes' sizes (1 on a 1-D mesh)."""
    return math.prod(n for a, n in config.axes.items() if a != "data")


def job_devices() -> int:
    """The devices this job may have: all of them now, or under a launcher that may start
    more processes, theirs too."""
    return max(len(jax.devices()), jax.local_device_count() * max_processes())


def mesh_context(config: RunConfig, max_devices: int, device_limit: int) -> dict:
    """``max_devices`` and ``mesh_shape`` of the :class:`adaptjax.policies.Context` at ``config``.

    On a sharded mesh a policy's replica count keeps the model axes, so the
    most replicas it may ask for is what the job's devices hold at this
    model size (and at most ``max_devices``).

    Example:
      >>> from adaptjax import RunConfig
      >>> from adaptjax._config_meshes import mesh_context
      >>> mesh_context(RunConfig(2, 64, mesh_shape={"data": 2, "fsdp": 4}), 8, 8)
      {'max_devices': 2, 'mesh_shape': {'data': 2, 'fsdp': 4}}
      >>> mesh_context(RunConfig(4, 64), 8, 8)
      {'max_devices': 8, 'mesh_shape': None}
    """
    if config.mesh_shape is None:
        return {"max_devices": max_devices, "mesh_shape": None}
    most = max(min(max_devices, device_limit // model_size(config)), config.devices)
    return {"max_devices": most, "mesh_shape": config.axes}
