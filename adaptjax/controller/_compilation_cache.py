"""JAX's persistent compilation cache, on by default for controller runs."""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/adaptjax/jax-compilation-cache`` (``~/.cache/...`` without XDG)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "adaptjax", "jax-compilation-cache")


def enable_compilation_cache(where: str | os.PathLike | None = "auto") -> str | None:
    """Turns on JAX's persistent compilation cache; returns the directory in use.

    A resumed or relaunched run then loads every step it compiled before from
    disk instead of compiling it again.

    Args:
      where: ``"auto"``: keep JAX's own ``jax_compilation_cache_dir`` if one is
        set, else use :func:`default_cache_dir`; a path: use it; ``None``:
        leave JAX as it is.

    Returns:
      The cache directory JAX uses now (``None`` when it has none).

    Example:
      >>> import jax
      >>> from adaptjax.controller._compilation_cache import enable_compilation_cache
      >>> enable_compilation_cache(None) == (jax.config.jax_compilation_cache_dir or None)
      True
    """
    if where is None:
        return _configured_dir() or None
    if where == "auto" and _configured_dir():
        return _configured_dir()  # the user's own setting wins
    path = default_cache_dir() if where == "auto" else os.fspath(where)
    if path != _configured_dir():
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
        # JAX decides once per process whether the cache is used, at the first compile;
        # a compile before this call (model initialisation, say) would have turned it off.
        compilation_cache.reset_cache()
    return path


def _configured_dir() -> str | None:
    """``jax.config.jax_compilation_cache_dir``: the cache jax uses now (``None``/"" for none)."""
    # jax.config's options are read through __getattr__; its stubs declare none of them
    return jax.config.jax_compilation_cache_dir  # pyright: ignore[reportAttributeAccessIssue]
