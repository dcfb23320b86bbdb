"""Runs the docstring examples of every adaptjax.policies module.

(``pytest --doctest-modules policies`` would import the folder as a top-level
``policies``, which the package refuses; so the modules are imported by their
real names here.)
"""

import doctest
import importlib
import pkgutil

import pytest

from adaptjax import policies

MODULES = ["adaptjax.policies"] + [
    f"adaptjax.policies.{info.name}" for info in pkgutil.iter_modules(policies.__path__)
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False, report=True)
    assert result.failed == 0
    assert result.attempted > 0, f"{name} has no runnable example"


def test_every_public_name_has_an_example():
    missing = []
    for name in policies.__all__:
        obj = getattr(policies, name)
        doc = getattr(obj, "__doc__", None) or ""
        if callable(obj) and name not in ("Action",) and ">>>" not in doc:
            missing.append(name)
    assert missing == []
