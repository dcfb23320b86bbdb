"""docs/guide/port.md runs as written: every program, original and port, and its diffs are true.

Each ``python`` block of the page whose first line is ``# port: <name>`` is a
whole program, run here on the suite's 8 simulated devices (in a temporary
directory: the controller ports write their run directories there); each ``diff``
block is ``difflib.unified_diff`` of two of them (``--- <from>``/``+++ <to>``),
regenerated and compared, so the page never shows a diff of code it does not
run. ``python tests/test_port_guide.py`` rewrites the diff blocks.
"""

import contextlib
import difflib
import io
import json
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


def _run_dir(path: Path) -> tuple[list[dict], list[dict]]:
    """The ``metrics.jsonl`` rows and ``events.jsonl`` events of a controller's run."""
    return [[json.loads(line) for line in (path / name).read_text().splitlines()]
            for name in ("metrics.jsonl", "events.jsonl")]


def _check_controller_run(rows: list[dict], events: list[dict], batch_size: int) -> None:
    """What the page says of a controller port: 8 -> 4 -> 8 devices, the batch where it was."""
    assert [e["devices_to"] for e in events if e["kind"] == "rescale"] == [4, 8]
    devices = [r["devices"] for r in rows]
    assert [d for i, d in enumerate(devices) if i == 0 or devices[i - 1] != d] == [8, 4, 8]
    assert {r["batch_size"] for r in rows} == {batch_size}  # BatchSizeWarmup held it
    assert max(r["noise_scale"] for r in rows) > 0


PORTS = [(program, f"{program}/{port}") for program in ("mnist", "fit")
         for port in ("loop", "controller")]


def test_the_page_shows_both_programs_with_their_ports():
    assert {name for _, name in PORTS} | {f"{p}/original" for p, _ in PORTS} <= set(PROGRAMS)
    pairs = {(a, b) for a, b, _ in diff_blocks(PAGE.read_text())}
    assert {(f"{program}/original", name) for program, name in PORTS} <= pairs


def test_every_diff_is_the_diff_of_the_programs_it_names():
    for old, new, block in diff_blocks(PAGE.read_text()):
        assert block == diff(PROGRAMS, old, new), f"{old} -> {new}: run python {__file__}"


@pytest.mark.parametrize("name", [n for n in sorted(PROGRAMS) if n.startswith("mnist/")])
def test_the_mnist_programs_train_to_the_tutorials_accuracy(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    printed, ns = _run(PROGRAMS[name])
    accuracy = float(printed.split("test accuracy: ")[1].split()[0])
    assert accuracy >= 0.9, printed  # 200 steps of batch 32 on the digits
    if name == "mnist/loop":
        assert ns["adaptjax"].read_metrics(ns["state"].opt_state)["noise_scale"] > 0
    if name == "mnist/controller":
        rows, events = _run_dir(tmp_path / "runs" / "mnist")
        _check_controller_run(rows, events, batch_size=32)
        # the nnx.MultiMetric made once evaluated on 8, 4 and 8 devices; the last
        # evaluation (step 200) is the final model's, the accuracy printed
        evals = {e["step"]: e["eval_accuracy"] for e in events if e["kind"] == "eval"}
        assert sorted(evals) == [50, 100, 150, 200]
        assert [rows[s - 1]["devices"] for s in sorted(evals)] == [8, 4, 8, 8]
        assert evals[200] == pytest.approx(accuracy, abs=5e-4)


@pytest.mark.parametrize("name", [n for n in sorted(PROGRAMS) if n.startswith("fit/")])
def test_the_fit_programs_learn_the_parity(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    printed, ns = _run(PROGRAMS[name])
    # parity is the last bit: the MLP reaches a small loss (the first is about 1 or more)
    assert float(ns["final_loss"]) < 0.1, printed
    logged = {int(s): float(v) for s, v in re.findall(r"^step (\d+), loss: (\S+)$", printed, re.M)}
    if name != "fit/controller":
        assert sorted(logged) == [0, 250, 500, 750]
    else:  # a hook after every 250th step; it prints that step's loss (it drains first)
        rows, events = _run_dir(tmp_path / "runs" / "fit")
        _check_controller_run(rows, events, batch_size=40)
        assert logged == {s: rows[s - 1]["loss"] for s in (250, 500, 750, 1000)}
        assert ns["final_loss"] == rows[-1]["loss"] and rows[-1]["step"] == 1000


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
