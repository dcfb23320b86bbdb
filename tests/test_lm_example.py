"""examples/lm.py at a tiny size, end to end through the controller.

The run must go through every policy the example wires (ElasticScale's 8 -> 4
-> 8 rescales are on a schedule, so they happen whatever the metrics), leave a
run directory adaptjax can read, and print the bits per byte last: the
validation loss in nats over ln 2.
"""

import contextlib
import io
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))


def _corpus(tmp_path):
    data = tmp_path / "text"
    data.mkdir()
    for i in range(24):
        (data / f"f{i}.txt").write_text(f"line {i}: the quick brown fox jumps over it\n" * 40)
    return data


def _run_lm(*args):
    """``lm.main(args)``'s result and the lines it printed."""
    import lm

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = lm.main(list(args))
    return result, out.getvalue().splitlines()


@pytest.mark.slow
def test_tiny_lm_trains_through_the_controller(tmp_path):
    run_dir = tmp_path / "run"
    result, text = _run_lm(
        "--size", "tiny", "--steps", "20", "--data", str(_corpus(tmp_path)),
        "--run-dir", str(run_dir), "--no-progress", "--policy-every", "5", "--val-windows", "16",
    )
    last = text[-1]
    assert last == f"validation bits per byte: {result['bpb']:.4f}"
    assert result["bpb"] == pytest.approx(result["loss"] / math.log(2))
    assert result["loss"] < math.log(256)  # better than a uniform guess over bytes
    events = [json.loads(line) for line in open(run_dir / "events.jsonl")]
    rescales = [(e["devices_from"], e["devices_to"]) for e in events if e["kind"] == "rescale"]
    assert rescales == [(8, 4), (4, 8)]
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert rows[-1]["step"] == 20 and all("learning_rate" in r for r in rows)


def test_missing_sources_exit_names_the_data_flag(tmp_path):
    import lm

    with pytest.raises(SystemExit, match="--data") as info:
        lm.main(["--data", str(tmp_path / "nothing"), "--run-dir", str(tmp_path / "r")])
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_tiny_lm_on_sharded_meshes_prints_bytes_per_device(tmp_path):
    data = _corpus(tmp_path)
    results, lines = [], []
    meshes = ("data=2,fsdp=4", "data=2,fsdp=2,model=2")
    for i, mesh in enumerate(meshes):
        result, text = _run_lm(
            "--size", "tiny", "--steps", "2", "--data", str(data), "--mesh", mesh,
            "--val-windows", "8", "--layers", "1", "--width", "64",
            "--run-dir", str(tmp_path / f"run{i}"),  # not ./runs/lm, which lm.py deletes first
        )
        results.append(result)
        lines.append(text)
    # width 64: embedding, qkv, proj, up, down and head kernels have >= 4096
    # elements and are split 4 ways (over fsdp, or fsdp x model); the rest is whole
    # (with "model", the MLP's first bias is split over it too: 128 elements fewer)
    split = 256 * 64 + 64 * 192 + 64 * 64 + 2 * 64 * 256 + 64 * 256
    for mesh, text in zip(meshes, lines, strict=True):
        (total,) = [int(r.rsplit(" ", 1)[1]) for r in text if r.startswith("model:")]
        (row,) = [r for r in text if "params+optimizer bytes per device:" in r]
        per_device = int(row.rsplit(":", 1)[1])
        # float32 params and Adam's two moments; then the counters and the
        # monitors' scalars (a few hundred bytes)
        expected = 3 * 4 * (split // 4 + total - split - (128 if "model" in mesh else 0))
        assert expected <= per_device <= expected + 256
    # the same global batch, replicas and dropout masks: the same model
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=1e-4)


@pytest.mark.slow
def test_the_sharded_lm_rescales_its_data_axis_and_back(tmp_path):
    # examples/lm.py --mesh through the controller: its ElasticScale moves it between shapes
    run_dir = tmp_path / "run"
    result, text = _run_lm(
        "--size", "tiny", "--steps", "20", "--data", str(_corpus(tmp_path)),
        "--mesh", "data=2,fsdp=4", "--run-dir", str(run_dir), "--no-progress",
        "--policy-every", "5", "--val-windows", "16", "--width", "64",
    )
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


def test_the_grain_loader_serves_every_window_once_an_epoch():
    import grain  # noqa: F401  (the [dev] extra installs it)
    import lm
    import numpy as np

    windows = np.arange(40, dtype=np.uint8).reshape(10, 4)  # window i starts with byte 4 * i
    data = lm.train_data(windows, "grain", seed=0)
    firsts = [data.next_batch(b)["tokens"][:, 0] for b in (4, 2, 4)]  # the batch size changes
    data.close()
    assert sorted(np.concatenate(firsts).tolist()) == list(range(0, 40, 4))
    array = lm.train_data(windows, "array", seed=0).next_batch(10)["tokens"]
    assert sorted(array[:, 0].tolist()) == list(range(0, 40, 4))


def test_the_lm_splits_over_replicas_by_source_file(tmp_path):
    # 24 files of 1,720 or 1,760 bytes (+ 2 separator bytes): each train window's label is
    # the file it starts in, so a small alpha gives each replica whole files, infinity every file's
    # windows spread evenly (issue 49: the LM split by source file)
    import math

    import lm_data
    import numpy as np

    import adaptjax.sync

    train, _, info = lm_data.load_corpus(_corpus(tmp_path), context=32, val_fraction=0.2)
    sources = info["train_sources"]
    assert len(sources) == len(train) and sources[0] == 0
    assert np.all(np.diff(sources) >= 0) and sources[-1] == info["train_files"] - 1
    per_file = np.bincount(sources)
    sizes = [len(f"line {i}: the quick brown fox jumps over it\n" * 40) + 2 for i in (0, 10)]
    assert per_file.min() >= sizes[0] // 32 - 1 and per_file.max() <= -(-sizes[1] // 32)
    def shares(alpha):  # windows of each file (columns) on each replica (rows)
        shards = adaptjax.sync.dirichlet_split(sources, 4, alpha, seed=0)
        assert sorted(np.concatenate(shards).tolist()) == list(range(len(train)))
        return np.stack([np.bincount(sources[s], minlength=len(per_file)) for s in shards])

    # alpha = inf: every file's windows split evenly (counts within one of each other)
    even = shares(math.inf)
    assert np.array_equal(even.max(axis=0), -(-per_file // 4)) and even.min() >= per_file.min() // 4
    # alpha = 0.01: a file's windows almost all on one replica
    assert np.mean(shares(0.01).max(axis=0) / per_file) >= 0.95
