"""A ``grain.IterDataset`` pipeline (packing, filtering) as data, resumed by its iterator state.

A packed or filtered pipeline has no sample index: element ``p`` of its
stream depends on everything before it, so it cannot be re-split like
:class:`adaptjax.GrainDataset`'s ``MapDataset`` (grain's ``ElasticIterator``
rejects such pipelines for the same reason). ``GrainIterDataset`` reads
one grain iterator forward instead, ``batch_size`` elements a step, and its
position is the iterator's own state (grain's ``get_state()``), saved with
every checkpoint and handed back with ``set_state()``, so a resumed run
continues at the exact element.

What it guarantees, and what it refuses:

* the per-read batch is fixed (``batch_size`` elements, stacked leaf by leaf);
  the controller's batch still changes when it is carried by accumulated
  micro-steps of that batch (``RunSpec(micro_batch_size=batch_size)``: a
  batch of ``k x batch_size`` is ``k`` reads, in order);
* a mesh change in one process continues exactly (the stream does not depend
  on the mesh);
* the pipeline's iterator must have ``get_state``/``set_state``;
* it runs on one process: a checkpoint holds one iterator state, and an
  iterator state cannot be re-split over another process count, so a saved
  state is refused under any other process count.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from adaptjax._data import _check_state, check_count
from adaptjax._grain_pipeline import _chain, _grain, _stack

_KIND = "GrainIterDataset"
_NAME = "GrainDataset.from_iter_dataset"  # how users build one (in messages)


def _check_pipeline(dataset) -> None:
    """One-line ``ValueError`` unless ``dataset`` is an unbatched ``grain.IterDataset``."""
    grain = _grain()
    if isinstance(dataset, grain.MapDataset):
        raise ValueError(
            f"{_NAME} reads a grain.IterDataset, got a MapDataset; feed a MapDataset "
            "through adaptjax.GrainDataset (it also survives batch-size and process changes)"
        )
    if isinstance(dataset, grain.DatasetIterator):
        raise ValueError(
            f"{_NAME} needs the grain.IterDataset itself, got its iterator "
            f"{type(dataset).__name__}; pass the dataset (it creates its own iterators)"
        )
    if not isinstance(dataset, grain.IterDataset):
        raise ValueError(
            f"{_NAME} needs a grain.IterDataset, got {type(dataset).__name__}; build it "
            "with grain.MapDataset.source(...).to_iter_dataset() (or use adaptjax.IterableDataset)"
        )
    for ds in _chain(dataset):
        if type(ds).__name__ == "BatchIterDataset":
            raise ValueError(
                f"{_NAME} needs an unbatched IterDataset, this one is batched; remove "
                ".batch(...): from_iter_dataset stacks batch_size elements itself"
            )


def _check_resumable(iterator) -> None:
    for name in ("get_state", "set_state"):
        if not callable(getattr(iterator, name, None)):
            raise ValueError(
                f"the pipeline's iterator ({type(iterator).__name__}) has no {name}(), so its "
                "position cannot be saved with a checkpoint; build the pipeline from grain's "
                "own datasets, whose iterators have get_state/set_state"
            )


class GrainIterDataset:
    """A ``grain.IterDataset`` read forward, ``batch_size`` elements a step, resumable exactly.

    Each :meth:`next_batch` takes the iterator's next ``batch_size``
    elements and stacks them leaf by leaf; :meth:`state_dict` holds the
    iterator's ``get_state()``, which :meth:`load_state_dict` restores with
    ``set_state()``, so the element after the saved ones comes next. The
    pipeline must not end: repeat its source (``.repeat()`` on the
    ``MapDataset`` before ``.to_iter_dataset()``).

    Args:
      dataset: an unbatched ``grain.IterDataset`` (e.g. ``.filter`` or
        ``grain.experimental.FirstFitPackIterDataset`` after
        ``.to_iter_dataset()``) whose iterator has ``get_state``/``set_state``.
      batch_size: elements in every batch: the controller's
        ``RunSpec.micro_batch_size`` (its batch size then any multiple of it),
        or its batch size, which then stays at it.

    Example:
      >>> import grain
      >>> odd = grain.MapDataset.range(10).repeat().to_iter_dataset().filter(lambda i: i % 2)
      >>> ds = GrainIterDataset(odd, batch_size=3)
      >>> ds.next_batch(3).tolist(), ds.cursor
      ([1, 3, 5], 3)
      >>> again = GrainIterDataset(odd, batch_size=3)
      >>> again.load_state_dict(ds.state_dict())
      >>> again.next_batch(3).tolist()  # 9, then the repeated range again
      [7, 9, 1]
    """

    def __init__(self, dataset: Any, batch_size: int) -> None:
        _check_pipeline(dataset)
        if jax.process_count() > 1:
            raise ValueError(
                f"{_NAME} runs on one process, this job has {jax.process_count()}: a "
                "checkpoint keeps one iterator state and a packed or filtered stream cannot be "
                "re-split; feed a MapDataset through adaptjax.GrainDataset"
            )
        self._dataset = dataset
        self._batch = check_count(batch_size, "batch_size", positive=True)
        self._fingerprint = " <- ".join(type(ds).__name__ for ds in _chain(dataset))
        self._iter = self._new_iterator()
        self._cursor = 0

    def _new_iterator(self):
        iterator = iter(self._dataset)
        _check_resumable(iterator)
        return iterator

    @property
    def cursor(self) -> int:
        """int: elements handed out so far."""
        return self._cursor

    @property
    def batch_size(self) -> int:
        """int: elements in every batch."""
        return self._batch

    @property
    def fingerprint(self) -> str:
        """The pipeline's transformations (guards :meth:`load_state_dict`)."""
        return self._fingerprint

    def _read(self, iterator, count: int, at: int) -> Any:
        elements = []
        for _ in range(count):
            try:
                elements.append(next(iterator))
            except StopIteration:
                raise ValueError(
                    f"the IterDataset ended after {at + len(elements)} elements; make it "
                    "endless (.repeat() on the MapDataset before .to_iter_dataset())"
                ) from None
        return _stack(elements, np.arange(at, at + count))

    def batch_at(self, cursor: int, batch_size: int) -> Any:
        """The first ``batch_size`` elements of a fresh iterator (``cursor`` must be 0).

        Lets the controller check the loss on the pipeline's elements before
        it compiles; the stream is read forward only, so no other cursor.
        """
        if check_count(cursor, "cursor") != 0:
            raise ValueError(
                f"{_NAME} reads forward only and cannot read at cursor {cursor}; "
                "features that re-read the data (probes) need adaptjax.GrainDataset"
            )
        fresh = self._new_iterator()
        try:
            return self._read(fresh, check_count(batch_size, "batch_size", positive=True), 0)
        finally:
            getattr(fresh, "close", lambda: None)()

    def next_batch(self, batch_size: int) -> Any:
        """The next ``batch_size`` elements, stacked; advances :attr:`cursor`.

        Args:
          batch_size: must be :attr:`batch_size` (the batch of this pipeline is fixed).
        """
        b = check_count(batch_size, "batch_size", positive=True)
        if b != self._batch:
            raise ValueError(
                f"{_NAME} serves batches of {self._batch} elements, asked for {b}; keep "
                f"each step's batch at {self._batch} and grow the optimizer's batch in "
                f"accumulated micro-steps: RunSpec(micro_batch_size={self._batch})"
            )
        batch = self._read(self._iter, b, self._cursor)
        self._cursor += b
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position: ``{"kind", "cursor", "batch_size", "process_count", "fingerprint",
        "iterator"}``, ``iterator`` being grain's ``get_state()`` (JSON values)."""
        return {
            "kind": _KIND,
            "cursor": self._cursor,
            "batch_size": self._batch,
            "process_count": jax.process_count(),
            "fingerprint": self._fingerprint,
            "iterator": json.loads(json.dumps(self._iter.get_state())),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues at the element after those a :meth:`state_dict` had handed out.

        Args:
          state: a dict from :meth:`state_dict` (possibly through JSON) of the
            same pipeline, saved under the same process count.
        """
        keys = ("cursor", "batch_size", "process_count", "fingerprint", "iterator")
        _check_state(state, _KIND, keys)
        if state["fingerprint"] != self._fingerprint:
            raise ValueError(
                f"this iterator state was saved for another pipeline ({state['fingerprint']}), "
                f"not this one ({self._fingerprint}); load it into the pipeline it was saved for"
            )
        saved = check_count(state["process_count"], "process_count", positive=True)
        if saved != jax.process_count():
            raise ValueError(
                f"this IterDataset state was saved by {saved} processes and this job has "
                f"{jax.process_count()}: a packed or filtered stream has no sample index to "
                f"re-split; resume on {saved} or feed a MapDataset through adaptjax.GrainDataset"
            )
        try:
            self._iter.set_state(state["iterator"])
        except (KeyError, TypeError, ValueError) as e:
            text = (str(e).strip().splitlines() or [""])[0]
            raise ValueError(
                f"the pipeline's iterator refused the saved state ({type(e).__name__}: {text}); "
                "load it into the pipeline it was saved for"
            ) from None
        self._cursor = check_count(state["cursor"], "cursor")

    def __repr__(self) -> str:
        return (
            f"GrainIterDataset({self._fingerprint}, batch_size={self._batch}, "
            f"cursor={self._cursor})"
        )
