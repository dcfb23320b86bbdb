"""The LM example's data pipeline (examples/lm_data.py).

* The train/validation split is by file, a pure function of each file's
  relative path: the same for any listing order, disjoint, and covering every file.
* Byte tokens round-trip: decode(encode(text)) == text for any Unicode text,
  and each window row is a contiguous slice of the stream (row i starts at i * stride).
"""

import os
import pathlib
import random
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
import lm_data  # noqa: E402


def _tree(root: pathlib.Path, n: int = 40) -> list[pathlib.Path]:
    for i in range(n):
        sub = root / f"pkg{i % 4}"
        sub.mkdir(exist_ok=True)
        (sub / f"mod{i}.py").write_text(f"# module {i}\n" + "x = 1\n" * (i + 5))
    return lm_data.list_text_files(root)


def test_split_is_deterministic_disjoint_and_complete(tmp_path):
    files = _tree(tmp_path)
    train, val = lm_data.split_files(files, tmp_path, val_fraction=0.25)
    shuffled = list(files)
    random.Random(1).shuffle(shuffled)
    train2, val2 = lm_data.split_files(shuffled, tmp_path, val_fraction=0.25)
    assert sorted(train) == sorted(train2) and sorted(val) == sorted(val2)
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(files)
    assert train and val
    # The same relative paths under another root split the same way.
    other = tmp_path.parent / (tmp_path.name + "_copy")
    other.mkdir()
    _tree(other)
    train3, _ = lm_data.split_files(lm_data.list_text_files(other), other, val_fraction=0.25)
    assert sorted(os.path.relpath(f, other) for f in train3) == sorted(
        os.path.relpath(f, tmp_path) for f in train
    )


def test_validation_fraction_is_monotone_in_the_threshold(tmp_path):
    files = _tree(tmp_path)
    sizes = [len(lm_data.split_files(files, tmp_path, f)[1]) for f in (0.1, 0.3, 0.6, 0.9)]
    assert sizes == sorted(sizes)
    small = set(lm_data.split_files(files, tmp_path, 0.1)[1])
    assert small <= set(lm_data.split_files(files, tmp_path, 0.6)[1])  # a threshold on one hash


@pytest.mark.parametrize("text", ["def f(x):\n    return x\n", "héllo wörld ✓ 𝄞", ""])
def test_byte_tokens_round_trip(text):
    tokens = lm_data.encode(text)
    assert tokens.dtype == np.uint8 and len(tokens) == len(text.encode("utf-8"))
    assert lm_data.decode(tokens) == text


def test_windows_are_contiguous_slices_of_the_stream():
    stream = lm_data.encode("abcdefghijklmnopqrstuvwxyz" * 3)
    rows = lm_data.windows(stream, context=8)
    assert rows.shape == ((len(stream) - 9) // 8 + 1, 9)
    for i, row in enumerate(rows):
        assert np.array_equal(row, stream[i * 8 : i * 8 + 9])


def test_corpus_round_trips_file_bytes(tmp_path):
    _tree(tmp_path, n=30)
    train, val, info = lm_data.load_corpus(tmp_path, context=16, val_fraction=0.3)
    assert info["train_files"] + info["val_files"] == 30
    text = lm_data.decode(train[0])
    assert "module" in text or "x = 1" in text


def test_no_sources_names_the_data_flag(tmp_path, monkeypatch):
    monkeypatch.setattr(lm_data, "stdlib_dir", lambda: tmp_path / "stripped")
    with pytest.raises(ValueError, match=r"--data DIR") as info:
        lm_data.load_corpus()
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"^--data .*no text files") as info:
        lm_data.load_corpus(tmp_path / "empty")
    assert "\n" not in str(info.value)
