"""docs/guide/port.md runs as written: every program, original and port, and its diffs are true.

Each ``python`` block of the page whose first line is ``# port: <name>`` is a
whole program, run here on the suite's 8 simulated devices; each ``diff``
block is ``difflib.unified_diff`` of two of them (``--- <from>``/``+++ <to>``),
regenerated and compared, so the page never shows a diff of code it does not
run. ``python tests/test_port_guide.py`` rewrites the diff blocks.
"""

import contextlib
import difflib
import io
import re
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "port.md"


def programs(text: str) -> dict[str, str]:
    """``{name: code}`` of the page's ``# port: <name>`` blocks."""
    blocks = re.findall(r"```python\n# port: (\S+)\n(.*?)```", text, re.S)
    return dict(blocks)


def diff(code: dict[str, str], old: str, new: str) -> str:
    """The unified diff of two programs, one line of context, as the page shows it."""
    lines = difflib.unified_diff(code[old].splitlines(), code[new].splitlines(),
                                 fromfile=old, tofile=new, n=1, lineterm="")
    return "\n".join(lines) + "\n"


def diff_blocks(text: str) -> list[tuple[str, str, str]]:
    """``(from, to, block)`` of every ``diff`` block of the page."""
    return [(a, b, block) for block, a, b in
            re.findall(r"```diff\n(--- (\S+)\n\+\+\+ (\S+)\n.*?)```", text, re.S)]


def changed_lines(block: str) -> int:
    """Lines a diff adds or removes (``diff -u | grep -c '^[+-]'``, headers left out)."""
    return sum(1 for line in block.splitlines()[2:] if line[:1] in "+-")


def _run(code: str) -> tuple[str, dict]:
    out, namespace = io.StringIO(), {"__name__": "port"}
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(PAGE), "exec"), namespace)
    return out.getvalue(), namespace


PROGRAMS = programs(PAGE.read_text())


def test_the_page_shows_both_programs_with_their_ports():
    assert {"mnist/original", "mnist/loop", "fit/original", "fit/loop"} <= set(PROGRAMS)
    pairs = {(a, b) for a, b, _ in diff_blocks(PAGE.read_text())}
    assert {("mnist/original", "mnist/loop"), ("fit/original", "fit/loop")} <= pairs


def test_every_diff_is_the_diff_of_the_programs_it_names():
    for old, new, block in diff_blocks(PAGE.read_text()):
        assert block == diff(PROGRAMS, old, new), f"{old} -> {new}: run python {__file__}"


@pytest.mark.parametrize("name", [n for n in sorted(PROGRAMS) if n.startswith("mnist/")])
def test_the_mnist_programs_train_to_the_tutorials_accuracy(name):
    printed, ns = _run(PROGRAMS[name])
    accuracy = float(printed.split("test accuracy: ")[1].split()[0])
    assert accuracy >= 0.9, printed  # 200 steps of batch 32 on the digits
    if name != "mnist/original":
        assert ns["adaptjax"].read_metrics(ns["state"].opt_state)["noise_scale"] > 0


@pytest.mark.parametrize("name", [n for n in sorted(PROGRAMS) if n.startswith("fit/")])
def test_the_fit_programs_learn_the_parity(name):
    printed, ns = _run(PROGRAMS[name])
    # parity is the last bit: the MLP reaches a small loss (the first is about 1 or more)
    assert float(ns["final_loss"]) < 0.1, printed
    assert "step 0, loss:" in printed


if __name__ == "__main__":  # rewrite the page's diff blocks from its programs
    text = PAGE.read_text()
    for old, new, block in diff_blocks(text):
        text = text.replace(block, diff(PROGRAMS, old, new))
    text = re.sub(r"```diff\nDIFF (\S+) (\S+)\n```",
                  lambda m: "```diff\n" + diff(PROGRAMS, m.group(1), m.group(2)) + "```", text)
    PAGE.write_text(text)
    for old, new, block in diff_blocks(text):
        print(f"{old} -> {new}: {changed_lines(block)} lines changed")
    sys.exit(0)
