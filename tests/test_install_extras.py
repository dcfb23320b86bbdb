"""``pip install -e ".[dev]"`` installs everything the test suite needs, and CI installs just that.

A new user runs the README's two lines (install with the ``dev`` extra, then
pytest); CI must run the same, or CI passes where the user fails (as when
``adaptjax report``'s matplotlib came only with the ``examples`` extra). So:

* every third-party module imported by the tests, by the package (its
  optional imports too: the tests exercise them) and by the examples the
  tests import belongs to a distribution that the package's dependencies plus
  the ``dev`` extra bring in, directly or through their own requirements;
* ``.ci/run`` installs the same extras as the README's test section, and
  nothing else before it runs pytest (docs or type-checking tools are
  installed after the tests, so the tests never see them).
"""

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCAL = {"adaptjax", "compression", "policies"}


def _imports(path: Path) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            tops |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def _needed_modules() -> dict[str, str]:
    """Third-party top-level module -> a file that imports it."""
    files = [p for folder in ("tests", *LOCAL) for p in ROOT.glob(f"{folder}/**/*.py")]
    folders = ("tests", "examples", "benchmarks")
    scripts = {p.stem for d in folders for p in ROOT.glob(f"{d}/**/*.py")}  # local modules
    examples = {p.stem: p for p in ROOT.glob("examples/*.py")}
    from_tests = set().union(*(_imports(f) for f in ROOT.glob("tests/**/*.py")))
    files += [examples[name] for name in from_tests & set(examples)]
    needed = {}
    for path in files:
        for top in _imports(path) - LOCAL - scripts - set(sys.stdlib_module_names):
            needed.setdefault(top, str(path.relative_to(ROOT)))
    return needed


def _closure(requirements: list[str]) -> set[str]:
    """The distributions these requirements install, through their own requirements."""
    seen: set[str] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        wanted = {name, *(f"{name}[{e}]" for e in req.extras)}
        if wanted <= seen:
            continue
        seen |= wanted
        try:
            requires = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for e in ("", *req.extras):
            todo += [(Requirement(r), e) for r in requires]
    return {n for n in seen if "[" not in n}


def test_the_dev_extra_installs_every_module_the_tests_import():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = _closure(project["dependencies"] + project["optional-dependencies"]["dev"])
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for module, where in sorted(_needed_modules().items()):
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        assert dists, f"{module} (imported by {where}) is not installed in this environment"
        if not dists & installed:
            missing[module] = where
    assert not missing, f"add to the dev extra in pyproject.toml (module: imported by): {missing}"


def _extras(text: str, where: str) -> set[str]:
    found = re.findall(r"pip install[^\n]*?-e \"?\.\[([a-z,\- ]+)\]", text)
    assert len(found) == 1, f"{where}: expected one `pip install -e \".[...]\"`, found {found}"
    return {e.strip() for e in found[0].split(",")}


def test_ci_installs_what_the_readme_test_section_says():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    tests = [b for b in blocks if "python -m pytest" in b]
    assert tests, "README.md has no ```bash block with the test command"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest" in ci, ".ci/run does not run the tests"
    before = ci[: ci.index("python -m pytest")]
    installs = [
        line for line in before.splitlines()
        if "pip install" in line and "--upgrade pip" not in line and not line.startswith("#")
    ]
    assert len(installs) == 1, f".ci/run installs more than the README before pytest: {installs}"
    assert _extras(installs[0], ".ci/run") == _extras(tests[0], "README's test section")


def test_ci_type_checks_last_with_the_types_extra_on_a_strict_editable_install():
    # pyright resolves adaptjax.policies and adaptjax.compression only through the link tree
    # of a strict editable install; the docs build and the tests must never see that install.
    ci = (ROOT / ".ci" / "run").read_text()
    lines = [line for line in ci.splitlines() if not line.lstrip().startswith("#")]
    strict = [line for line in lines if "editable_mode=strict" in line]
    assert len(strict) == 1, f".ci/run: expected one strict editable install, found {strict}"
    assert _extras(strict[0], ".ci/run's type-check install") == {"types"}
    checks = [line for line in lines if "-m pyright" in line]
    assert len(checks) == 1, f".ci/run: expected one pyright run, found {checks}"
    order = [ci.index(s) for s in ("python -m pytest", "-m sphinx", strict[0], checks[0])]
    assert order == sorted(order), ".ci/run: the tests, the docs, then the types install and check"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    types = [Requirement(r) for r in pyproject["project"]["optional-dependencies"]["types"]]
    assert [(r.name, r.extras) for r in types] == [("pyright", {"nodejs"})]
    assert str(types[0].specifier).startswith("=="), "pin pyright: its checks change by release"
    config = pyproject["tool"]["pyright"]
    assert (config["typeCheckingMode"], sorted(config["include"])) == (
        "basic", ["adaptjax", "compression", "policies"])
