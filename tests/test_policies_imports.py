"""adaptjax.policies imports nothing but the standard library and numpy (never jax)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

POLICIES = Path(__file__).resolve().parents[1] / "policies"

# Loads the package as `adaptjax.policies` under a bare stand-in for the `adaptjax`
# package, so only what policies/ itself imports is loaded (adaptjax's own __init__
# may import jax; that is the core's business, not the policies').
_PROBE = r"""
import importlib.util, sys, types
import numpy  # allowed; imported first so its own helper modules count as baseline
before = set(sys.modules)
parent = types.ModuleType("adaptjax")
parent.__path__ = []
sys.modules["adaptjax"] = parent
spec = importlib.util.spec_from_file_location(
    "adaptjax.policies", sys.argv[1] + "/__init__.py", submodule_search_locations=[sys.argv[1]]
)
module = importlib.util.module_from_spec(spec)
sys.modules["adaptjax.policies"] = module
spec.loader.exec_module(module)
module.AdaptiveBatchSize(256)  # and the package works
new = sorted(set(sys.modules) - before)
allowed = set(sys.stdlib_module_names) | {"numpy", "adaptjax"}
bad = [m for m in new if m.split(".")[0] not in allowed]
print("jax" in sys.modules, bad)
"""


def test_import_loads_no_jax_and_nothing_outside_stdlib_and_numpy():
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, str(POLICIES)], capture_output=True, text=True, timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False []"


def _imported_names(path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: use absolute imports (adaptjax.policies....)"
            yield node.module


@pytest.mark.parametrize("path", sorted(POLICIES.glob("*.py")), ids=lambda p: p.name)
def test_every_import_is_stdlib_numpy_or_policies(path):
    for name in _imported_names(path):
        top = name.split(".")[0]
        ok = (
            top in sys.stdlib_module_names
            or top == "numpy"
            or name == "adaptjax.policies"
            or name.startswith("adaptjax.policies.")
        )
        assert ok, f"{path.name} imports {name}"


def test_top_level_policies_import_is_refused():
    result = subprocess.run(
        [sys.executable, "-c", "import policies"], cwd=POLICIES.parent, capture_output=True,
        text=True, timeout=60, check=False,
    )
    assert "import this package as `adaptjax.policies`" in result.stderr
