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


# --- issue 44 item 2: one spec, hooks -----------------------------------------------------
ADAPTJAX = CONTROLLER.parent


def test_the_constructor_takes_code_a_spec_and_hooks():
    import inspect

    import adaptjax

    params = list(inspect.signature(adaptjax.Controller.__init__).parameters)[1:]
    assert params == ["model", "loss_fn", "optimizer", "data", "spec", "hooks"]
    assert len(params) <= 6


def _imports_of(path: pathlib.Path) -> set[str]:
    """The modules ``path`` imports (TYPE_CHECKING blocks included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_the_cost_model_imports_nothing_of_the_controller():
    for path in sorted((ADAPTJAX / "costs").glob("*.py")):
        assert not {m for m in _imports_of(path) if m.startswith("adaptjax.controller")}, path
