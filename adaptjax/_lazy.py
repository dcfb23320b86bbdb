"""The facade every public package of adaptjax uses: names load on first use (PEP 562).

``adaptjax``, ``adaptjax.costs``, ``adaptjax.compression`` and
``adaptjax.policies`` each list their public names in one table (name -> the
private module defining it) and call :func:`attach`. Nothing is imported until
a name is used, so ``import adaptjax.policies`` and the ``adaptjax`` command's
read-only subcommands never load jax. Standard library only: the policies
layer, which imports no other part of adaptjax, uses it too.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def attach(
    package: str, names: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``'s module namespace.

    Args:
      package: the package's ``__name__``.
      names: each public name -> the module that defines it.

    Returns:
      The two module-level functions of PEP 562.

    Example:
      >>> getattr_, dir_ = attach("json", {"dumps": "json"})
      >>> getattr_("dumps")({"a": 1})
      '{"a": 1}'
    """

    def __getattr__(name: str) -> object:
        module = names.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
            setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
            return value
        # Unknown names raise AttributeError, so `from adaptjax import compression`
        # falls through to importing the subpackage.
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
