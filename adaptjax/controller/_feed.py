"""The batches of one step: the global batch, or across processes this process's rows of it.

Under ``RunSpec.micro_batch_size`` a step is several calls of one compiled
micro-step (:func:`step_batches`, :func:`run_micro_steps`).
"""

from __future__ import annotations

from typing import Any

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


def step_batches(data, config: RunConfig, steps: StepCache) -> list:
    """The batches of one step of ``config``, in the order they are read.

    One :func:`next_batch` of ``config``'s batch, or with ``micro_batch_size``
    :meth:`StepCache.micro_steps` consecutive micro-batches of
    :meth:`StepCache.compiled`'s batch (``batch_size`` samples in all).
    """
    compiled = steps.compiled(config)
    return [next_batch(data, compiled, steps) for _ in range(steps.micro_steps(config))]


def run_micro_steps(fn, state, batches: list) -> tuple[Any, Any]:
    """``fn`` on ``state`` and each of ``batches`` in turn: ``(state, metrics of the last)``.

    With accumulated micro-steps the optimizer runs on the last one, so its
    metrics are the step's (their loss that of the last micro-batch).
    """
    metrics = None
    for batch in batches:
        state, metrics = fn(state, batch)
    return state, metrics
