"""Runs the docstring examples of every module of adaptjax and adaptjax.compression.

(adaptjax.policies has its own runner in test_policies_doctests.py.) Modules are
imported by their real names, so the folders packaged as subpackages are never
imported as top-level packages.

An example sees only the names its own module defines (what ``help()`` shows
next to it); everything else (``jnp``, ``np``, ``optax``...) it imports itself,
so a reader can copy it as it stands. Nothing is injected.
"""

import doctest
import importlib
import pkgutil

import pytest

import adaptjax


def _modules():
    names = ["adaptjax"]
    names += [m.name for m in pkgutil.walk_packages(adaptjax.__path__, "adaptjax.")]
    try:
        from adaptjax import compression
    except ImportError:  # pragma: no cover - the package always ships it
        return names
    names.append("adaptjax.compression")
    names += [f"adaptjax.compression.{m.name}" for m in pkgutil.iter_modules(compression.__path__)]
    return sorted(set(names) - {"adaptjax.policies"})


def _own_names(module) -> dict:
    """The names ``module`` defines itself (not the ones it imports)."""
    name = module.__name__
    own = {k: v for k, v in vars(module).items() if getattr(v, "__module__", None) == name}
    return {"__name__": name, **own}


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, globs=_own_names(module), optionflags=doctest.ELLIPSIS, report=True
    )
    assert result.failed == 0, f"{result.failed} failing example(s) in {name}"


def test_every_public_core_name_is_documented_with_an_example():
    missing = []
    for name in adaptjax.__all__:
        obj = getattr(adaptjax, name)
        if callable(obj) and ">>>" not in (getattr(obj, "__doc__", None) or ""):
            missing.append(name)
    # Small state containers document their fields, not an example.
    containers = {"Collective"}
    allowed = {n for n in adaptjax.__all__ if n.endswith("State") or n in containers}
    assert sorted(set(missing) - allowed) == []
