"""Device meshes: the data-parallel mesh and its checks."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh


def _axis_names(axis_name) -> tuple[str, ...]:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def check_mesh(mesh, axis_name="data") -> int:
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


def make_mesh(devices: int | None = None, *, axis_name: str = "data", device_list=None) -> Mesh:
    """A 1-D data-parallel mesh on the first ``devices`` devices.

    Args:
      devices: how many devices (default: all).
      axis_name: the axis name.
      device_list: pick from these devices instead of ``jax.devices()``.

    Returns:
      A ``jax.sharding.Mesh`` with one axis.

    Example:
      >>> import adaptjax
      >>> dict(adaptjax.make_mesh(4).shape)
      {'data': 4}
    """
    available = list(device_list if device_list is not None else jax.devices())
    n = len(available) if devices is None else int(devices)
    if n < 1:
        raise ValueError(f"devices must be >= 1, got {n}")
    if n > len(available):
        raise ValueError(
            f"asked for {n} devices but only {len(available)} exist; use devices <= "
            f"{len(available)} (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count)"
        )
    return Mesh(np.array(available[:n]), (axis_name,))
