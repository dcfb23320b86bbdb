"""Byte-level text data for examples/lm.py: files, a split by file, fixed windows.

Text is read as raw bytes (token = byte value, 0..255: no tokenizer, nothing to
download). The default corpus is the ``.py`` sources of the standard library
this Python ships (``sysconfig.get_paths()["stdlib"]``); any folder of text
files can take its place. Files are assigned to train or validation by a hash of
their path relative to the folder, so the split is the same on every machine
and run, whatever order the file system lists them in, and no file is in both.

Example:
  >>> import tempfile, pathlib
  >>> d = pathlib.Path(tempfile.mkdtemp())
  >>> for i in range(20):
  ...     _ = (d / f"f{i}.txt").write_text("hello world " * 30)
  >>> train, val = split_files(list_text_files(d), d, val_fraction=0.2)
  >>> sorted(set(train) & set(val)), len(train) + len(val)
  ([], 20)
  >>> decode(encode("héllo")) == "héllo"
  True
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sysconfig

import numpy as np

VOCAB = 256  # one token per byte value

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"}


def stdlib_dir() -> pathlib.Path:
    """The folder of this Python's standard library sources."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def list_text_files(root: str | os.PathLike, suffixes: tuple[str, ...] | None = None):
    """The files under ``root`` (sorted), skipping installed packages and test suites.

    Args:
      root: a folder.
      suffixes: keep only files ending in one of these (``None``: every file).

    Returns:
      A sorted list of paths.
    """
    root = pathlib.Path(root)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in filenames:
            if name.startswith("."):
                continue
            if suffixes is None or name.endswith(suffixes):
                files.append(pathlib.Path(dirpath) / name)
    return sorted(files)


def path_hash(relative_path: str) -> float:
    """The first 8 bytes of the SHA-256 of a relative path (``/``-separated), in [0, 1)."""
    digest = hashlib.sha256(relative_path.replace(os.sep, "/").encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_validation(relative_path: str, val_fraction: float) -> bool:
    """Whether a file (by its path relative to the corpus root) belongs to validation.

    :func:`path_hash` below ``val_fraction`` means validation: a pure function
    of the path's text, so the split does not depend on listing order or machine.

    Example:
      >>> is_validation("a/b.py", 0.0), is_validation("a/b.py", 1.0)
      (False, True)
    """
    return path_hash(relative_path) < val_fraction


def split_files(files, root: str | os.PathLike, val_fraction: float = 0.1):
    """Splits ``files`` into (train, validation) by :func:`is_validation` of their paths."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    train, val = [], []
    for f in files:
        rel = os.path.relpath(f, root)
        (val if is_validation(rel, val_fraction) else train).append(f)
    return train, val


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as uint8 tokens."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens) -> str:
    """Tokens back to text (invalid UTF-8 sequences become U+FFFD)."""
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def read_bytes(files, max_bytes: int | None = None, separator: bytes = b"\n\n") -> np.ndarray:
    """The files' bytes concatenated (with ``separator`` between files), at most ``max_bytes``."""
    return _read(files, max_bytes, separator)[0]


def _read(files, max_bytes: int | None, separator: bytes) -> tuple[np.ndarray, np.ndarray]:
    """``read_bytes``' stream and, for each file read, the offset where its bytes start."""
    chunks, starts, total = [], [], 0
    for f in files:
        data = pathlib.Path(f).read_bytes() + separator
        if max_bytes is not None and total + len(data) > max_bytes:
            data = data[: max_bytes - total]
        chunks.append(data)
        starts.append(total)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    stream = np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()
    return stream, np.asarray(starts, dtype=np.int64)


def window_sources(starts: np.ndarray, rows: int, context: int,
                   stride: int | None = None) -> np.ndarray:
    """The file each of ``rows`` windows starts in (an index into the files read).

    ``starts`` are the files' offsets in the stream (``_read``); window ``i``
    starts at byte ``i * stride``. These are the labels of the LM's split by
    source file (``adaptjax.sync``'s Dirichlet split over replicas).

    Example:
      >>> window_sources(np.array([0, 5, 7]), rows=4, context=3).tolist()
      [0, 0, 1, 2]
    """
    first_byte = np.arange(rows, dtype=np.int64) * (stride or context)
    return np.searchsorted(starts, first_byte, side="right") - 1


def windows(tokens: np.ndarray, context: int, stride: int | None = None) -> np.ndarray:
    """Cuts a token stream into rows of ``context + 1`` bytes (input and shifted target).

    Args:
      tokens: a 1-D uint8 array.
      context: the model's context length.
      stride: the start offset between rows (default ``context``: each byte
        is predicted once).

    Returns:
      An array ``[rows, context + 1]`` of uint8.

    Example:
      >>> windows(np.arange(10, dtype=np.uint8), context=3).tolist()
      [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    """
    stride = stride or context
    rows = (len(tokens) - context - 1) // stride + 1
    if rows < 1:
        raise ValueError(
            f"{len(tokens)} bytes are fewer than one window of {context + 1}; "
            "give more text or a smaller context"
        )
    index = np.arange(rows)[:, None] * stride + np.arange(context + 1)[None, :]
    return tokens[index]


def evenly_spaced(rows: np.ndarray, n: int) -> np.ndarray:
    """``n`` rows spread evenly over ``rows`` (all of them if there are fewer).

    A validation subset drawn across every validation file, not the first one's.

    Example:
      >>> evenly_spaced(np.arange(10), 3).tolist()
      [0, 3, 6]
    """
    if n >= len(rows):
        return rows
    return rows[np.arange(n) * (len(rows) // n)]


def load_corpus(
    data_dir: str | os.PathLike | None = None,
    *,
    context: int = 128,
    val_fraction: float = 0.1,
    max_train_bytes: int | None = 4_000_000,
    max_val_bytes: int | None = 200_000,
):
    """Train and validation windows of a folder of text (default: the stdlib's ``.py`` files).

    Args:
      data_dir: a folder of text files; ``None`` uses the standard library's
        ``.py`` sources.
      context: the context length (rows have ``context + 1`` bytes).
      val_fraction: the fraction of files (by path hash) held out for validation.
      max_train_bytes: read at most this many training bytes (``None``: all).
      max_val_bytes: read at most this many validation bytes (``None``: all).

    Returns:
      ``(train_windows, val_windows, info)`` with ``info`` a dict describing the corpus;
      ``info["train_sources"]`` is the training file each train window starts in.

    Raises:
      ValueError: in one line naming ``--data`` when no source files are found.
    """
    if data_dir is None:
        root, suffixes = stdlib_dir(), (".py",)
        files = list_text_files(root, suffixes) if root.is_dir() else []
        if not files:
            raise ValueError(
                f"no .py sources in this Python's standard library ({root}); some "
                "distributions strip them: pass --data DIR with a folder of text files"
            )
    else:
        root, suffixes = pathlib.Path(data_dir), None
        files = list_text_files(root) if root.is_dir() else []
        if not files:
            raise ValueError(f"--data {data_dir}: no text files found there; pass a folder of text")
    train_files, val_files = split_files(files, root, val_fraction)
    # Read in hash order, so a byte cap takes a mix of the whole tree, not its first folders.
    mixed = lambda f: path_hash(os.path.relpath(f, root))  # noqa: E731
    train_files, val_files = sorted(train_files, key=mixed), sorted(val_files, key=mixed)
    if not train_files or not val_files:
        raise ValueError(
            f"{root} has {len(files)} file(s), too few to split into train and validation by "
            "file; pass --data DIR with more files"
        )
    train, train_starts = _read(train_files, max_train_bytes, b"\n\n")
    val = read_bytes(val_files, max_val_bytes)
    train_windows = windows(train, context)
    info = {
        "root": str(root),
        "files": len(files),
        "train_files": len(train_files),
        "val_files": len(val_files),
        "train_bytes": int(train.size),
        "val_bytes": int(val.size),
        # the training file each train window starts in: the LM's split by source file
        "train_sources": window_sources(train_starts, len(train_windows), context),
    }
    return train_windows, windows(val, context), info
