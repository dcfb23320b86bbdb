"""adaptjax.policies imports nothing but the standard library and numpy (never jax).

Of adaptjax itself it uses only the facade helper ``adaptjax._lazy`` (standard library only).

Checked on the installed package in a fresh interpreter: ``import adaptjax.policies``
runs adaptjax's own ``__init__`` (lazy, PEP 562), so whatever that would pull in
shows up here.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

POLICIES = Path(__file__).resolve().parents[2] / "policies"

_PROBE = r"""
import json, sys, time
import numpy  # allowed; imported first so its own helper modules count as baseline
before = set(sys.modules)
cpu0 = time.process_time()
import adaptjax.policies as ajp
ajp.AdaptiveBatchSize(256)  # and the package works
cpu = time.process_time() - cpu0
new = sorted(set(sys.modules) - before)
allowed = set(sys.stdlib_module_names) | {"numpy", "adaptjax"}
bad = [m for m in new if m.split(".")[0] not in allowed]
print(json.dumps({"jax": "jax" in sys.modules, "bad": bad, "cpu_s": cpu,
                  "file": ajp.__file__}))
"""


def test_import_loads_no_jax_and_nothing_outside_stdlib_and_numpy(tmp_path):
    # cwd outside the repository: the installed package, not a checkout on sys.path[0]
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout)
    assert probe["jax"] is False and probe["bad"] == []
    assert Path(probe["file"]).parent.name == "policies"
    # CPU seconds, not wall time: the bound holds on a loaded machine too
    assert probe["cpu_s"] < 1.0


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
            or name == "adaptjax._lazy"  # the facade helper: standard library only
        )
        assert ok, f"{path.name} imports {name}"


def test_top_level_policies_import_is_refused():
    result = subprocess.run(
        [sys.executable, "-c", "import policies"], cwd=POLICIES.parent, capture_output=True,
        text=True, timeout=60, check=False,
    )
    assert "import this package as `adaptjax.policies`" in result.stderr
