"""The README and the guide say what is true: their code runs as written, the
names they use exist, and the commands they give are the ones CI runs."""

import contextlib
import doctest
import importlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide"
PAGES = sorted([README, ROOT / "docs" / "index.md", ROOT / "docs" / "benchmarks.md",
                *GUIDE.glob("*.md")])
CI = (ROOT / ".ci" / "run").read_text()


def _section(path: Path, title: str) -> str:
    text = path.read_text()
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end >= 0 else len(text)]


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def _exec(code: str, name: str) -> tuple[str, dict]:
    out = io.StringIO()
    namespace = {"__name__": "readme"}
    with contextlib.redirect_stdout(out):
        exec(compile(code, name, "exec"), namespace)
    return out.getvalue(), namespace


def test_readme_example_runs_as_written_and_measures_the_noise_scale():
    code = _python_blocks(_section(README, "## An example"))[0]
    assert len(code.strip().splitlines()) <= 20
    printed, ns = _exec(code, "README.md, An example")
    assert "'noise_scale'" in printed and "'loss'" in printed
    m = {k: float(v) for k, v in ns["metrics"].items()}
    assert int(ns["state"].step) == 10
    # Far from the solution (w* = 1..4, ‖G‖² ≈ 4‖w*‖² at w = 0) the gradient is
    # significant, so the reading is valid, and the noise scale is its definition,
    # tr Σ / ‖G‖², of the two parts reported beside it.
    assert m["noise_scale_valid"] == 1.0
    assert m["noise_scale"] == pytest.approx(m["grad_variance"] / m["grad_sqnorm"], rel=1e-4)


def test_quickstart_gives_the_main_job_and_the_test_commands_ci_runs():
    quickstart = _section(README, "## Quickstart")
    assert 'pip install -e ".[examples]" && python examples/digits.py' in quickstart
    assert 'pip install -e ".[dev]"' in quickstart
    fast = 'python -m pytest -q -n 2 --dist loadfile -m "not slow"'
    full = re.search(r"^python -m pytest .*$", CI, re.M).group(0)  # CI's test command
    assert fast in quickstart and f"\n{full}  " in quickstart
    # the notes a reader needs when a run hangs or fails (tests/conftest.py points here)
    assert "pytest-timeout" in quickstart and "PJRT_NPROC" in quickstart


def test_readme_gives_the_docs_build_command_ci_runs():
    command = "python -m sphinx -W --keep-going -b html docs docs/_build/html"
    assert f'pip install -e ".[docs]" && {command}' in README.read_text()
    assert "python -m sphinx -W --keep-going -q -b html docs docs/_build/html" in CI


def test_readme_links_every_guide_page_and_every_link_resolves():
    links = re.findall(r"\]\((docs/[^)#]+)", README.read_text())
    assert all((ROOT / link).is_file() for link in links), links
    assert {f"docs/guide/{p.name}" for p in GUIDE.glob("*.md")} <= set(links)
    assert "docs/benchmarks.md" in links


def test_optax_chain_page_runs_as_written_and_reports_monitors_and_wire_bytes():
    code = _python_blocks((GUIDE / "optax-chain.md").read_text())[0]
    printed, ns = _exec(code, "docs/guide/optax-chain.md")
    metrics_line, bytes_line = printed.strip().splitlines()
    assert "'noise_scale'" in metrics_line and "'grad_snr'" in metrics_line
    # one all-reduce of the 4 f32 gradient entries plus the monitors' scalars:
    # a ring all-reduce sends 2 (n-1)/n of its operand per device, so > 0
    assert float(bytes_line) > 0
    assert int(ns["opt_state"][0].count) == 3  # three steps ran


@pytest.mark.parametrize("page", sorted(p.name for p in GUIDE.glob("*.md")))
def test_guide_examples_run_as_written(page):
    """The ``>>>`` examples of a guide page, in order, sharing the page's names."""
    path = GUIDE / page
    blocks = [b for b in _python_blocks(path.read_text()) if ">>>" in b]
    # these pages' examples are scripts (the test above, tests/test_port_guide.py)
    if page not in ("optax-chain.md", "port.md"):
        assert blocks, f"{page} has no runnable example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    globs: dict = {"__name__": page}
    parser = doctest.DocTestParser()
    for i, block in enumerate(blocks):
        test = parser.get_doctest(block, globs, f"{page}[{i}]", str(path), 0)
        runner.run(test, clear_globs=False)
        globs = test.globs  # the next block sees this one's names
    assert runner.tries >= len(blocks)
    assert runner.failures == 0, f"{runner.failures} failing example(s) in docs/guide/{page}"


_FILES = re.compile(r"\.(md|rst|json|jsonl|py|png)$")  # costs.json, costs.md: files, not names
_ALIASES = {"adaptjax": "adaptjax", "ajc": "adaptjax.compression",
            "ajp": "adaptjax.policies", "costs": "adaptjax.costs"}


def test_every_adaptjax_name_the_docs_use_exists():
    for package in set(_ALIASES.values()):
        importlib.import_module(package)
    missing = []
    for path in PAGES:
        for alias, dotted in re.findall(r"(?<![\w/.-])(adaptjax|ajc|ajp|costs)((?:\.\w+)+)",
                                        path.read_text()):
            if _FILES.search(dotted):
                continue
            obj = importlib.import_module(_ALIASES[alias])
            for part in dotted.lstrip(".").split("."):
                if not hasattr(obj, part):
                    missing.append(f"{path.relative_to(ROOT)}: {alias}{dotted}")
                    break
                obj = getattr(obj, part)
    assert missing == []
