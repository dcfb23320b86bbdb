"""The records of ``tests/distributed_job.py``, importable without starting ``jax.distributed``."""

import numpy as np

D = 8


def make_data(n=256):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, D)).astype(np.float32)
    w = rng.normal(size=(D, 2)).astype(np.float32)
    y = (x @ w + 0.1 * rng.normal(size=(n, 2))).astype(np.float32)
    return {"x": x, "y": y, "idx": np.arange(n, dtype=np.int32)}


def grain_pipeline():
    """The job's records as a ``grain.MapDataset`` shuffled with seed 3 (``--data grain``)."""
    import grain

    data = make_data()
    records = [{k: v[i] for k, v in data.items()} for i in range(len(data["idx"]))]
    return grain.MapDataset.source(records).shuffle(seed=3)
