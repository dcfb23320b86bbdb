"""README code that claims to run, runs as written."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _first_python_block(section_title: str) -> str:
    text = README.read_text()
    section = text[text.index(section_title) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_section_1_runs_as_written_and_reports_monitors_and_wire_bytes():
    code = _first_python_block("## 1. Compose an optax chain inside your own step")
    out = io.StringIO()
    namespace = {"__name__": "readme"}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md §1", "exec"), namespace)
    metrics_line, bytes_line = out.getvalue().strip().splitlines()
    assert "'noise_scale'" in metrics_line and "'grad_snr'" in metrics_line
    # one all-reduce of the 4 f32 gradient entries plus the monitors' scalars:
    # a ring all-reduce sends 2 (n-1)/n of its operand per device, so > 0
    assert float(bytes_line) > 0
    assert int(namespace["opt_state"][0].count) == 3  # three steps ran
