"""examples/lm.py --mesh through the controller: its policies move it between mesh shapes."""

import contextlib
import io
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))


@pytest.mark.slow
def test_the_sharded_lm_rescales_its_data_axis_and_back(tmp_path):
    import lm

    data = tmp_path / "text"
    data.mkdir()
    for i in range(24):
        (data / f"f{i}.txt").write_text(f"line {i}: the quick brown fox jumps over it\n" * 40)
    run_dir = tmp_path / "run"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = lm.main([
            "--size", "tiny", "--steps", "20", "--data", str(data), "--mesh", "data=2,fsdp=4",
            "--run-dir", str(run_dir), "--no-progress", "--policy-every", "5",
            "--val-windows", "16", "--width", "64",
        ])
    text = out.getvalue().splitlines()
    (row,) = [r for r in text if "params+optimizer bytes per device:" in r]
    assert row.startswith("mesh: {'data': 2, 'fsdp': 4}")
    assert text[-1] == f"validation bits per byte: {result['bpb']:.4f}"
    assert result["loss"] < math.log(256)  # better than a uniform guess over bytes
    events = [json.loads(line) for line in open(run_dir / "events.jsonl")]
    moves = [(e["mesh_from"], e["mesh_to"]) for e in events if e["kind"] == "rescale"]
    two, one = {"data": 2, "fsdp": 4}, {"data": 1, "fsdp": 4}
    assert moves == [(two, one), (one, two)]
    assert [r["step"] for r in map(json.loads, open(run_dir / "metrics.jsonl"))] == list(
        range(1, 21))
