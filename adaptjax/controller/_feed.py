"""The batch of one step: the global batch, or across processes this process's rows of it."""

from __future__ import annotations

import jax

from adaptjax._run_config import RunConfig
from adaptjax.controller._step_cache import StepCache
from adaptjax.launch._distributed import global_batch, mesh_rows


def next_batch(data, config: RunConfig, steps: StepCache):
    """The next global batch of ``config`` from ``data``; each process reads only its rows.

    Across processes the rows (those of the data replicas this process's
    devices hold, :func:`~adaptjax.launch._distributed.mesh_rows`) become one
    global array on ``config``'s mesh
    (datasets with ``next_rows`` read only those rows; others, e.g. an
    :class:`adaptjax.IterableDataset`, read the whole batch and keep them).
    """
    if jax.process_count() == 1:
        return data.next_batch(config.batch_size)
    mesh = steps.mesh(config)
    start, stop = mesh_rows(mesh, config.batch_size)
    if hasattr(data, "next_rows"):
        local = data.next_rows(config.batch_size, start, stop)
    else:
        local = jax.tree.map(lambda x: x[start:stop], data.next_batch(config.batch_size))
    return global_batch(local, mesh, config.batch_size)
