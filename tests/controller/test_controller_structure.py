"""The controller keeps its per-run state in its instances, not in module globals."""

import ast
import pathlib

import pytest

CONTROLLER = pathlib.Path(__file__).resolve().parents[2] / "adaptjax" / "controller"
WEAK = {"WeakKeyDictionary", "WeakSet", "WeakValueDictionary"}


def _module_level_weak_containers(source: str) -> list[int]:
    """Lines of module-level assignments whose value calls a ``weakref`` container."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            for call in ast.walk(node.value):
                name = getattr(getattr(call, "func", None), "attr", None) or getattr(
                    getattr(call, "func", None), "id", None)
                if isinstance(call, ast.Call) and name in WEAK:
                    found.append(node.lineno)
    return found


def test_the_check_finds_a_module_level_weak_container():
    assert _module_level_weak_containers("import weakref\n_x = weakref.WeakSet()\n") == [2]
    assert _module_level_weak_containers("def f():\n    _x = weakref.WeakSet()\n") == []


@pytest.mark.parametrize("path", sorted(p.name for p in CONTROLLER.glob("*.py")))
def test_no_module_level_per_instance_container(path):
    assert _module_level_weak_containers((CONTROLLER / path).read_text()) == []
