"""The ``adaptjax`` command: read-only subcommands import no jax; help, version, errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adaptjax.cli import _main as _cli


def _run_dir(path: Path) -> Path:
    rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 6)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    a = {"devices": 8, "batch_size": 64, "microbatches": 1, "codec": None}
    b = {"devices": 4, "batch_size": 64, "microbatches": 1, "codec": None}
    events = [
        {"time": 0.0, "kind": "compile", "step": 1, "latency_s": 1.5, "config": a},
        {"time": 1.0, "kind": "compile", "step": 3, "latency_s": 0.25, "config": b},
        {"time": 2.0, "kind": "compile", "step": 4, "latency_s": 0.5, "config": a},
        {"time": 3.0, "kind": "checkpoint", "step": 5, "latency_s": 0.1},
    ]
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


_PROBE = r"""
import json, sys, time
cpu0 = time.process_time()
from adaptjax.cli._main import main
main(sys.argv[1:])
print(json.dumps({"cpu_s": time.process_time() - cpu0,
                  "heavy": sorted(m for m in ("jax", "optax", "orbax", "flax", "matplotlib")
                                  if m in sys.modules)}))
"""


def test_summary_imports_no_jax(tmp_path):
    run = _run_dir(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, "summary", str(run)], cwd=tmp_path, capture_output=True,
        text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    *text, last = result.stdout.strip().splitlines()
    probe = json.loads(last)
    assert probe["heavy"] == []
    assert probe["cpu_s"] < 1.0  # CPU seconds: holds on a loaded machine too
    assert "steps logged: 5" in text


def test_summary_sums_compile_seconds_per_configuration(tmp_path):
    lines = _cli.summary(str(_run_dir(tmp_path))).splitlines()
    assert "compile seconds: 2.25 in 3 compile(s)" in lines  # 1.5 + 0.25 + 0.5
    per_config = [line for line in lines if line.startswith("  ") and " s  x" in line]
    assert len(per_config) == 2
    assert per_config[0].split()[:2] == ["2.00", "s"] and "devices=8" in per_config[0]
    assert per_config[1].split()[:2] == ["0.25", "s"] and "devices=4" in per_config[1]


def test_summary_reads_a_run_whose_last_lines_were_torn_by_a_kill(tmp_path):
    run = _run_dir(tmp_path)
    for name in ("metrics.jsonl", "events.jsonl"):
        with open(run / name, "a") as f:
            f.write('{"step": 6, "lo')  # the writer died mid-line
    lines = _cli.summary(str(run)).splitlines()
    assert "steps logged: 5" in lines and "compile seconds: 2.25 in 3 compile(s)" in lines


def test_console_script_version_and_help_without_markup(tmp_path):
    import adaptjax

    script = Path(sys.executable).with_name("adaptjax")
    if not script.exists():  # pragma: no cover - installed without console scripts
        pytest.skip("the adaptjax console script is not installed next to this python")
    version = subprocess.run(
        [str(script), "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    assert version.stdout.strip() == f"adaptjax {adaptjax.__version__}"
    for args in ([], ["summary"], ["plot"]):
        out = subprocess.run(
            [str(script), *args, "--help"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
        assert out.startswith("usage: adaptjax")
        assert "``" not in out and ":class:" not in out


def test_plot_without_matplotlib_names_the_extra(tmp_path):
    run = _run_dir(tmp_path)
    probe = (
        "import sys; sys.modules['matplotlib'] = None\n"  # import matplotlib -> ImportError
        "from adaptjax.cli._main import main\n"
        f"main(['plot', {str(run)!r}])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 1
    message = result.stderr.strip()
    assert "\n" not in message and "adaptjax[examples]" in message
    assert not os.path.exists(run / "metrics.png")


def test_not_a_run_directory(tmp_path):
    with pytest.raises(SystemExit, match="not a run directory"):
        _cli.main(["summary", str(tmp_path)])
