"""The samples a job fed: one line per batch in ``RUN_DIR/fed.jsonl``, read back as one stream.

:func:`record` makes a dataset write, at every ``next_batch``, its cursor after
the batch and the indices of the elements the batch holds (its ``"idx"`` leaf;
in a batch of packed rows, the index of each element packed into them). A run
resumed after a kill feeds the batches after its checkpoint again, at the same
cursors: :func:`stream` keeps one line per cursor and says whether every line
of a cursor named the same elements (a resume that fed others there would not).
``tests/distributed_job.py`` writes the same file per process.
"""

from __future__ import annotations

import json
import os

import numpy as np

FED = "fed.jsonl"


def element_indices(batch) -> list[int]:
    """The ``"idx"`` of every element in ``batch``, in order.

    A batch of rows packed by grain (``FirstFitPackIterDataset``) holds each
    element's index once per token, with ``idx_segment_ids`` (0: padding) and
    ``idx_positions`` (0: an element's first token): one index per element.
    """
    idx = np.asarray(batch["idx"])
    if "idx_segment_ids" in batch:
        segment = np.asarray(batch["idx_segment_ids"])
        idx = idx[(segment > 0) & (np.asarray(batch["idx_positions"]) == 0)]
    return idx.ravel().tolist()


def record(data, run_dir):
    """``data``, its ``next_batch`` now also appending the batch to ``run_dir/fed.jsonl``.

    The method is replaced on the instance, so the dataset keeps its type (and
    the checks the controller makes of it). Lines are flushed as written: a
    ``kill -9`` between two steps loses none.
    """
    os.makedirs(run_dir, exist_ok=True)
    fed = open(os.path.join(run_dir, FED), "a", buffering=1)  # open for the job's life
    read = data.next_batch

    def next_batch(batch_size):
        batch = read(batch_size)
        fed.write(json.dumps({"cursor": data.cursor, "idx": element_indices(batch)}) + "\n")
        return batch

    data.next_batch = next_batch
    return data


def stream(run_dir) -> tuple[list[int], bool]:
    """``(indices, agreed)``: the elements fed, in stream order, one line per cursor, and
    whether the lines written at the same cursor (by resumed runs) all agreed."""
    by_cursor: dict[int, list[int]] = {}
    agreed = True
    with open(os.path.join(run_dir, FED)) as f:
        for line in f:
            row = json.loads(line)
            seen = by_cursor.setdefault(row["cursor"], row["idx"])
            agreed = agreed and seen == row["idx"]
    return [i for c in sorted(by_cursor) for i in by_cursor[c]], agreed
