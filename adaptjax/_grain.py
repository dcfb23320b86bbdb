"""A ``grain.MapDataset`` served as a resumable stream with a sample cursor.

:class:`GrainDataset` gives a user's unbatched, random-access grain pipeline
(``grain.MapDataset.source(...)`` over an ArrayRecord file, a Hugging Face
``datasets.Dataset`` or a NumPy array, with ``.map``, ``.random_map`` and
``.shuffle(seed)``) the guarantees of :class:`adaptjax.ArrayDataset`: its
position is one integer, the number of samples handed out, and whatever the
batch size, the mesh or the process count between two reads, no sample is
skipped or repeated.

The stream is ``dataset.repeat()`` (epochs back to back; grain's
``.shuffle(seed)`` reshuffles each epoch) read at positions ``cursor,
cursor + 1, ...``. Its order is that of ``grain.experimental.ElasticIterator``
over the same dataset: with ``K`` processes, process ``k`` of a global batch
of ``b`` at cursor ``c`` holds positions ``c + k, c + k + K, ...`` (grain's
``ds[c + k::K]``, ``ShardByJaxProcess``), laid out as the ``k``-th block of
``b // K`` rows. The cursor is ``ElasticIterator``'s ``global_next_index``.

Reading is done on host threads: each element on a thread pool, and the next
batches (same size, same rows) are read ahead while the step runs, so
:meth:`GrainDataset.next_batch` only waits for what is not read yet.
"""

from __future__ import annotations

import sys
import weakref
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from adaptjax._data import _check_state, check_count
from adaptjax._grain_pipeline import _chain, _grain, _stack

if TYPE_CHECKING:
    from adaptjax._grain_iter import GrainIterDataset

_GRAIN_KIND = "GrainDataset"


def _check_map_dataset(dataset) -> None:
    """One-line ``ValueError`` unless ``dataset`` is an unbatched, unsharded MapDataset."""
    grain = _grain()
    if isinstance(dataset, (grain.IterDataset, grain.DatasetIterator)):
        raise ValueError(
            f"GrainDataset needs a grain.MapDataset (read by index), got an IterDataset's "
            f"{type(dataset).__name__}; build the pipeline from grain.MapDataset.source(...) with "
            ".map/.random_map/.shuffle and without .to_iter_dataset()"
        )
    if not isinstance(dataset, grain.MapDataset):
        raise ValueError(
            f"GrainDataset needs a grain.MapDataset, got {type(dataset).__name__}; wrap a "
            "sequence as grain.MapDataset.source(...) (or arrays in adaptjax.ArrayDataset)"
        )
    for ds in _chain(dataset):  # by class name: grain's transformation classes are private
        kind = type(ds).__name__
        if kind == "BatchMapDataset":
            raise ValueError(
                "GrainDataset needs an unbatched MapDataset, this one is batched; remove "
                ".batch(...): GrainDataset batches to the controller's batch size itself"
            )
        if kind == "FilterMapDataset":
            raise ValueError(
                "GrainDataset cannot count samples through .filter(...) (it leaves holes in the "
                "index space); filter the records before building the MapDataset"
            )
        if kind == "SliceMapDataset" and getattr(ds, "_step", 1) != 1:
            raise ValueError(
                f"this MapDataset is already sharded ({ds}); pass the unsharded dataset: "
                "GrainDataset reads only this process's rows itself"
            )
    if len(dataset) == 0:
        raise ValueError("the MapDataset is empty; GrainDataset needs at least one element")


class GrainDataset:
    """An unbatched ``grain.MapDataset`` as a resumable stream of batches.

    The stream is ``dataset.repeat()`` (an infinite dataset is read as it is):
    stream position ``p`` is the element ``dataset.repeat()[p]``, so epoch
    ``e`` is positions ``e * n ... (e + 1) * n - 1`` and grain's
    ``.shuffle(seed)`` permutes each epoch anew. The dataset stays unbatched:
    a batch of ``b`` samples at :attr:`cursor` ``c`` is positions ``c ... c +
    b - 1``, stacked leaf by leaf, and :attr:`cursor` moves by ``b``, so the
    batch size, the mesh and the process count may change between two calls
    and every epoch still visits every element once.

    Rows follow ``grain.experimental.ElasticIterator``: with ``K`` processes,
    rows ``k * b // K ... (k + 1) * b // K - 1`` (process ``k``'s block, what
    :meth:`next_rows` reads) are positions ``c + k, c + k + K, ...`` — the
    batch shard ``k`` of an ``ElasticIterator(dataset.repeat(), b,
    ShardOptions(k, K))`` reads — and its ``global_next_index`` is
    :attr:`cursor`, saved with every checkpoint (:meth:`state_dict`).

    Elements are read on ``num_threads`` host threads, and the ``prefetch``
    batches after each one (same size, same rows) are read ahead in the
    background; a call with another size or other rows drops them.

    Args:
      dataset: an unbatched, unsharded ``grain.MapDataset`` without
        ``.filter``; its elements are pytrees of arrays or scalars.
      process_count: the ``K`` of the row layout; ``None`` reads
        ``jax.process_count()`` at each call.
      num_threads: threads reading elements (``1`` reads them one by one).
      prefetch: batches read ahead (``0`` reads each batch when asked).

    Example:
      >>> import grain, adaptjax
      >>> ds = adaptjax.GrainDataset(grain.MapDataset.range(5).map(lambda i: {"x": 10 * i}))
      >>> ds.next_batch(3)["x"].tolist(), ds.next_batch(4)["x"].tolist(), ds.cursor, ds.epoch
      ([0, 10, 20], [30, 40, 0, 10], 7, 1)
      >>> two = adaptjax.GrainDataset(grain.MapDataset.range(10), process_count=2)
      >>> two.next_rows(4, 2, 4).tolist(), two.cursor  # process 1's rows: positions 1, 3
      ([1, 3], 4)
      >>> again = adaptjax.GrainDataset(grain.MapDataset.range(5).map(lambda i: {"x": 10 * i}))
      >>> again.load_state_dict(ds.state_dict())
      >>> again.next_batch(2)["x"].tolist()
      [20, 30]
    """

    def __init__(
        self,
        dataset: Any,
        *,
        process_count: int | None = None,
        num_threads: int = 16,
        prefetch: int = 2,
    ) -> None:
        _check_map_dataset(dataset)
        self._n = len(dataset)
        self._stream = dataset if self._n >= sys.maxsize else dataset.repeat()
        if process_count is not None:
            process_count = check_count(process_count, "process_count", positive=True)
        self._process_count = process_count
        self._prefetch = check_count(prefetch, "prefetch")
        threads = check_count(num_threads, "num_threads", positive=True)
        self._fingerprint = " <- ".join(type(ds).__name__ for ds in _chain(dataset))
        self._cursor = 0
        self._elements = ThreadPoolExecutor(threads, "grain-read") if threads > 1 else None
        self._ahead = ThreadPoolExecutor(1, "grain-prefetch")
        self._queue: deque[tuple[tuple[int, int, int, int], Future]] = deque()
        for pool in (self._elements, self._ahead):
            if pool is not None:
                weakref.finalize(self, pool.shutdown, wait=False, cancel_futures=True)

    @staticmethod
    def from_iter_dataset(dataset: Any, batch_size: int) -> GrainIterDataset:
        """A packed or filtered ``grain.IterDataset``, ``batch_size`` elements a step.

        Such a pipeline has no sample index, so it is read forward and its
        position is grain's iterator state (``get_state()``), saved with every
        checkpoint: a resume continues at the exact element. Every read takes
        ``batch_size`` elements, and the job runs on one process; the
        controller's batch can still change when each step accumulates
        micro-steps of this batch (``RunSpec(micro_batch_size=batch_size)``).

        Args:
          dataset: an unbatched, endless ``grain.IterDataset`` (repeat the
            ``MapDataset`` before ``.to_iter_dataset()``).
          batch_size: elements in every batch (read).
        """
        from adaptjax._grain_iter import GrainIterDataset

        return GrainIterDataset(dataset, batch_size)

    @property
    def cursor(self) -> int:
        """int: samples handed out so far (``ElasticIterator``'s ``global_next_index``)."""
        return self._cursor

    @property
    def num_samples(self) -> int:
        """Elements per epoch, ``len(dataset)``."""
        return self._n

    @property
    def epoch(self) -> int:
        """The epoch the next sample belongs to (``cursor // n``)."""
        return self._cursor // self._n

    @property
    def fingerprint(self) -> str:
        """The pipeline's transformations (guards :meth:`load_state_dict`)."""
        return self._fingerprint

    def positions(
        self, cursor: int, batch_size: int, start: int = 0, stop: int | None = None
    ) -> np.ndarray:
        """Stream positions of rows ``[start, stop)`` of the ``batch_size`` batch at ``cursor``.

        Pure. Row ``k * (b // K) + j`` is position ``cursor + k + j * K`` for
        ``K`` processes (``ElasticIterator``'s shard ``k``); with one process,
        row ``r`` is position ``cursor + r``.
        """
        cursor = check_count(cursor, "cursor")
        b = check_count(batch_size, "batch_size", positive=True)
        stop = b if stop is None else check_count(stop, "stop")
        start = check_count(start, "start")
        if not start < stop <= b:
            raise ValueError(
                f"rows [{start}, {stop}) are not inside a batch of {b}; "
                f"use 0 <= start < stop <= {b}"
            )
        k = self._process_count or jax.process_count()
        per, rest = divmod(b, k)
        if rest:
            raise ValueError(
                f"batch_size {b} does not split over {k} processes; use a multiple of {k}"
            )
        rows = np.arange(start, stop, dtype=np.int64)
        return cursor + rows // per + (rows % per) * k

    def _read(self, positions: np.ndarray) -> Any:
        at = [int(p) for p in positions]
        if self._elements is None:
            elements = [self._stream[p] for p in at]
        else:
            elements = list(self._elements.map(self._stream.__getitem__, at))
        return _stack(elements, positions)

    def batch_at(self, cursor: int, batch_size: int) -> Any:
        """The ``batch_size`` samples at stream position ``cursor`` (pure, not read ahead)."""
        return self._read(self.positions(cursor, batch_size))

    def _take(self, batch_size: int, start: int, stop: int | None) -> Any:
        """Rows ``[start, stop)`` of the next batch, read ahead when asked for as before."""
        positions = self.positions(self._cursor, batch_size, start, stop)
        key = (self._cursor, int(batch_size), int(start), int(positions.size))
        if self._queue and self._queue[0][0] == key:
            batch = self._queue.popleft()[1].result()
        else:
            self._drop_ahead()
            batch = self._read(positions)
        self._cursor += int(batch_size)
        at = self._queue[-1][0][0] if self._queue else self._cursor - int(batch_size)
        while len(self._queue) < self._prefetch:
            at += int(batch_size)
            ahead = self.positions(at, batch_size, start, stop)
            future = self._ahead.submit(self._read, ahead)
            self._queue.append(((at, int(batch_size), int(start), int(positions.size)), future))
        return batch

    def _drop_ahead(self) -> None:
        while self._queue:
            self._queue.popleft()[1].cancel()

    def next_batch(self, batch_size: int) -> Any:
        """The next ``batch_size`` samples (every row); advances :attr:`cursor`.

        Args:
          batch_size: samples in the batch (``>= 1``, a multiple of the
            process count); it may change between calls.

        Returns:
          The elements' pytree, stacked along a leading batch axis.
        """
        return self._take(batch_size, 0, None)

    def next_rows(self, batch_size: int, start: int, stop: int) -> Any:
        """Rows ``[start, stop)`` of the next ``batch_size``-sample batch; advances by all of it.

        Each process calls it with the same ``batch_size`` and its own rows
        and reads only those elements; every cursor moves by the whole batch.
        """
        return self._take(batch_size, start, check_count(stop, "stop"))

    def state_dict(self) -> dict[str, Any]:
        """The stream position as a JSON-able dict: ``{"kind", "cursor", "n", "fingerprint"}``."""
        return {
            "kind": _GRAIN_KIND,
            "cursor": self._cursor,
            "n": self._n,
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes at a position saved by :meth:`state_dict`, under any batch size or process count.

        Args:
          state: a dict from :meth:`state_dict` (possibly through JSON) of a
            dataset with the same length and transformations.
        """
        _check_state(state, _GRAIN_KIND, ("cursor", "n", "fingerprint"))
        if state["fingerprint"] != self._fingerprint or int(state["n"]) != self._n:
            raise ValueError(
                f"this data cursor was saved for another pipeline ({state['n']} elements: "
                f"{state['fingerprint']}), not this one ({self._n}: {self._fingerprint}); load "
                "it into the pipeline it was saved for"
            )
        self._drop_ahead()
        self._cursor = check_count(state["cursor"], "cursor")

    def close(self) -> None:
        """Stops the reading threads (the dataset cannot read afterwards)."""
        self._drop_ahead()
        for pool in (self._elements, self._ahead):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def __repr__(self) -> str:
        return f"GrainDataset({self._fingerprint}, n={self._n}, cursor={self._cursor})"
