"""The package's shape (issue 44 item 5): a small public face, parts that do not tangle.

Counted and parsed from the source, so the checks hold whatever is installed.
"""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FACES = ("adaptjax", "adaptjax.policies", "adaptjax.costs", "adaptjax.compression")


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imported_modules(tree: ast.Module, package: str) -> set[str]:
    """Every module ``tree`` imports (relative imports resolved against ``package``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def test_the_four_public_faces_export_at_most_120_names():
    counts = {face: len(importlib.import_module(face).__all__) for face in FACES}
    assert sum(counts.values()) <= 120, counts


def test_sync_strategies_live_under_adaptjax_sync_only():
    import adaptjax
    import adaptjax.sync

    for name in ("LocalSGD", "DiLoCo", "Gossip", "ModelAveraging", "SSGD", "SyncStrategy"):
        assert name in adaptjax.sync.__all__
        assert not hasattr(adaptjax, name), name


def test_no_module_level_weak_containers_in_the_controller():
    for path in sorted((ROOT / "adaptjax" / "controller").glob("*.py")):
        for node in _parse(path).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", None)
                         for n in ast.walk(node.value)}
                assert not names & {"WeakKeyDictionary", "WeakSet"}, f"{path.name}:{node.lineno}"


@pytest.mark.parametrize(("src", "other"), [("costs", "controller"), ("controller", "costs")])
def test_costs_and_controller_import_nothing_of_each_other(src, other):
    for path in sorted((ROOT / "adaptjax" / src).glob("*.py")):
        package = f"adaptjax.{src}"
        imported = _imported_modules(_parse(path), package)
        bad = sorted(m for m in imported if m.startswith(f"adaptjax.{other}"))
        assert not bad, f"adaptjax/{src}/{path.name} imports {bad}"


def test_controller_init_takes_at_most_six_parameters():
    tree = _parse(ROOT / "adaptjax" / "controller" / "_controller.py")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Controller")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    a = init.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs] + [x for x in (a.vararg, a.kwarg) if x]
    assert len(params) - 1 <= 6, [p.arg for p in params]
