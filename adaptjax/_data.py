"""Deterministic datasets whose position is one integer: the sample cursor.

A dataset here is an *infinite stream of samples*: epoch 0, then epoch 1, and
so on, back to back. Its position is ``cursor``, the number of samples handed
out so far. ``next_batch(b)`` returns the next ``b`` samples of the stream and
moves the cursor by ``b``, crossing epoch boundaries seamlessly, so when the
batch size or the mesh changes between two calls no sample is skipped or
repeated: every epoch still visits every sample exactly once.

The position is saved as a small JSON-able dict (``state_dict()``) that goes
into a checkpoint's metadata next to the train state, and
``load_state_dict()`` resumes at exactly the next sample.

* :class:`ArrayDataset` wraps in-memory numpy arrays (leading axis =
  samples). Epoch ``e`` visits the samples in the order
  ``np.random.default_rng([seed, e]).permutation(n)`` (or ``0..n-1`` with
  ``shuffle=False``), so any position of the stream is a pure function of
  ``(seed, cursor)``; :meth:`ArrayDataset.batch_at` reads one without moving.
  With ``features=adaptjax.InputCodec("int8")`` it keeps its float features
  quantized (see :mod:`adaptjax._input_codec`): batches carry the codes and
  :meth:`ArrayDataset.decode` turns them back into floats inside the step.
* :class:`IterableDataset` adapts a user's own iterable (of examples or of
  batches) by counting the samples it consumed and, on resume, re-creating the
  iterable and skipping them. It is exact only if the iterable is
  deterministic.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.typing import DTypeLike

from adaptjax._input_codec import FeatureCodec, InputCodec

_ARRAY_KIND = "ArrayDataset"
_ITER_KIND = "IterableDataset"


def check_count(value, name: str, *, positive: bool = False) -> int:
    """``value`` as an int, or a one-line ValueError naming ``name`` (bools refused)."""
    kind = "positive" if positive else "non-negative"
    try:
        if isinstance(value, bool):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a {kind} integer, got {value!r}") from None
    if v < int(positive):
        raise ValueError(f"{name} must be a {kind} integer, got {v}")
    return v


def _check_state(state, kind: str, keys: tuple[str, ...]) -> None:
    if not isinstance(state, Mapping):
        raise ValueError(
            f"a {kind} state must be a dict from state_dict(), got {type(state).__name__}"
        )
    if state.get("kind") != kind:
        raise ValueError(
            f"this state was saved by {state.get('kind')!r}, not {kind!r}; load it into the "
            "dataset class that saved it"
        )
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"{kind} state is missing {missing}; pass a dict from state_dict()")


class ArrayDataset:
    """In-memory arrays served as a deterministic, resumable stream of batches.

    Epoch ``e`` visits all ``n`` samples once, in the order
    ``np.random.default_rng([seed, e]).permutation(n)`` (``arange(n)`` when
    ``shuffle=False``); the epochs follow each other without a gap. Stream
    position ``p`` therefore holds sample ``perm(p // n)[p % n]``, and a batch
    of ``b`` samples at cursor ``c`` is positions ``c, ..., c + b - 1`` — a
    batch may straddle two epochs (or several, when ``b > n``).

    Batches have the container shape the arrays were given in: one array
    gives an array, several positional arrays give a tuple, a dict gives a
    dict. Batches are numpy arrays on the host.

    With ``features``, float arrays are stored quantized (BiFeat): the
    dataset keeps only their codes (int8 with a per-column scale and offset,
    or bfloat16), batches carry the codes (a quarter or half of the bytes to
    move to the devices: :attr:`bytes_per_sample`,
    ``batch_bytes``), and :meth:`decode` — called inside the
    compiled step, e.g. through ``adaptjax.with_precision(loss_fn, precision,
    decode=ds.decode)`` — returns the floats. The stream, its position
    (:meth:`state_dict`, whose fingerprint describes the arrays as given) and
    :meth:`next_rows` are the same with or without a codec.

    Args:
      *arrays: one or more arrays with the same leading length ``n >= 1``, or
        a single dict of such arrays.
      seed: seeds the per-epoch permutations.
      shuffle: shuffle each epoch (else serve samples in index order).
      features: an :class:`adaptjax.InputCodec` for every float array, or a
        mapping from array names (dict keys; positions ``0, 1, ...`` for
        positional arrays) to codecs; ``None`` stores the arrays as given.

    Example:
      >>> import numpy as np, adaptjax
      >>> ds = adaptjax.ArrayDataset(np.arange(5), np.arange(5) * 10, shuffle=False)
      >>> x, y = ds.next_batch(3)
      >>> x.tolist(), y.tolist()
      ([0, 1, 2], [0, 10, 20])
      >>> ds.next_batch(4)[0].tolist(), ds.cursor, ds.epoch
      ([3, 4, 0, 1], 7, 1)
      >>> state = ds.state_dict()
      >>> fresh = adaptjax.ArrayDataset(np.arange(5), np.arange(5) * 10, shuffle=False)
      >>> fresh.load_state_dict(state)
      >>> fresh.next_batch(2)[0].tolist()
      [2, 3]
    """

    def __init__(
        self,
        *arrays: Any,
        seed: int = 0,
        shuffle: bool = True,
        features: InputCodec | Mapping[Any, InputCodec | None] | None = None,
    ) -> None:
        if len(arrays) == 1 and isinstance(arrays[0], Mapping):
            names = [str(k) for k in arrays[0]]
            values = list(arrays[0].values())
            self._container = "dict"
            self._keys = list(arrays[0].keys())
        else:
            names = [f"arrays[{i}]" for i in range(len(arrays))]
            values = list(arrays)
            self._container = "single" if len(arrays) == 1 else "tuple"
            self._keys = None
        if not values:
            raise ValueError("ArrayDataset needs at least one array (or a dict of arrays)")
        arrs = [np.asarray(v) for v in values]
        for name, a in zip(names, arrs, strict=True):
            if a.ndim == 0:
                raise ValueError(f"{name} is a scalar; every array needs a leading sample axis")
        lengths = {name: int(a.shape[0]) for name, a in zip(names, arrs, strict=True)}
        if len(set(lengths.values())) != 1:
            raise ValueError(
                f"arrays disagree on the number of samples {lengths}; give every array "
                "the same leading dimension"
            )
        n = next(iter(lengths.values()))
        if n < 1:
            raise ValueError("ArrayDataset needs at least one sample; the arrays are empty")
        self._n = n
        self._seed = check_count(seed, "seed")
        self._shuffle = bool(shuffle)
        self._cursor = 0
        self._fingerprint = " ".join(
            f"{name}={a.dtype}{list(a.shape)}" for name, a in zip(names, arrs, strict=True)
        )
        self._perm_cache: dict[int, np.ndarray] = {}
        keys = self._keys if self._keys is not None else list(range(len(arrs)))
        chosen = _chosen_codecs(features, keys, names, arrs)
        self._codecs: list[FeatureCodec | None] = [
            None if c is None else c.fit(a, name)
            for c, a, name in zip(chosen, arrs, names, strict=True)
        ]
        # only the codes are kept: the float arrays are not held on the host
        self._arrays = [
            a if c is None else c.encode(a) for c, a in zip(self._codecs, arrs, strict=True)
        ]

    # -- the stream ----------------------------------------------------------------

    def __len__(self) -> int:
        return self._n

    @property
    def num_samples(self) -> int:
        """Samples per epoch, ``n``."""
        return self._n

    @property
    def cursor(self) -> int:
        """int: samples handed out so far, the stream position of the next batch."""
        return self._cursor

    @property
    def epoch(self) -> int:
        """The epoch the next sample belongs to (``cursor // n``)."""
        return self._cursor // self._n

    @property
    def seed(self) -> int:
        """The seed of the per-epoch permutations."""
        return self._seed

    @property
    def fingerprint(self) -> str:
        """Names, dtypes and shapes of the arrays (guards :meth:`load_state_dict`)."""
        return self._fingerprint

    @property
    def codecs(self) -> dict[Any, FeatureCodec]:
        """The fitted codec of each quantized array, by name (dict key or position)."""
        keys = self._keys if self._keys is not None else list(range(len(self._arrays)))
        return {k: c for k, c in zip(keys, self._codecs, strict=True) if c is not None}

    @property
    def bytes_per_sample(self) -> int:
        """Bytes one sample of a batch holds (codes for quantized arrays)."""
        return int(sum(a.itemsize * int(np.prod(a.shape[1:])) for a in self._arrays))

    def decode(self, batch: Any, dtype: DTypeLike | None = None) -> Any:
        """The batch with every quantized array decoded to floats (jit-friendly).

        Call it inside the compiled step (the codes are what cross to the
        devices); arrays without a codec pass through unchanged, so it is the
        identity for a dataset without ``features``. It works on any number of
        rows: a whole batch or one replica's shard of it.

        Args:
          batch: a batch of this dataset (its container shape).
          dtype: the float dtype to decode to (default float32).

        Returns:
          The batch, same container shape.

        Example:
          >>> import numpy as np, adaptjax
          >>> x = np.linspace(0, 1, 12, dtype=np.float32).reshape(6, 2)
          >>> ds = adaptjax.ArrayDataset({"x": x, "y": np.arange(6)}, shuffle=False,
          ...                            features=adaptjax.InputCodec("int8"))
          >>> batch = ds.next_batch(4)
          >>> from adaptjax._input_codec import batch_bytes
          >>> batch["x"].dtype, batch_bytes(batch), ds.bytes_per_sample
          (dtype('int8'), 40, 10)
          >>> error = np.abs(np.asarray(ds.decode(batch)["x"]) - x[:4])
          >>> bool(np.all(error <= ds.codecs["x"].max_error() + 1e-7))
          True
        """
        if not any(c is not None for c in self._codecs):
            return batch
        out_dtype = np.float32 if dtype is None else dtype
        if self._container == "single":
            parts = [batch]
        elif self._container == "tuple":
            parts = list(batch)
        else:
            parts = [batch[k] for k in self._dict_keys()]
        parts = [
            p if c is None else c.decode(p, out_dtype)
            for c, p in zip(self._codecs, parts, strict=True)
        ]
        return self._pack(parts)

    def _dict_keys(self) -> list[Any]:
        assert self._keys is not None  # kept for the dict container
        return self._keys

    def _pack(self, parts: list[Any]) -> Any:
        """``parts`` in the container shape the arrays were given in."""
        if self._container == "single":
            return parts[0]
        if self._container == "tuple":
            return tuple(parts)
        return dict(zip(self._dict_keys(), parts, strict=True))

    def permutation(self, epoch: int) -> np.ndarray:
        """The order in which epoch ``epoch`` visits the ``n`` sample indices."""
        epoch = check_count(epoch, "epoch")
        perm = self._perm_cache.get(epoch)
        if perm is None:
            if self._shuffle:
                perm = np.random.default_rng([self._seed, epoch]).permutation(self._n)
            else:
                perm = np.arange(self._n)
            if len(self._perm_cache) >= 2:  # a batch rarely spans more than two epochs
                self._perm_cache.pop(next(iter(self._perm_cache)))
            self._perm_cache[epoch] = perm
        return perm

    def indices_at(self, cursor: int, batch_size: int) -> np.ndarray:
        """Sample indices at stream positions ``cursor, ..., cursor + batch_size - 1``.

        Pure: the dataset's own cursor does not move.
        """
        cursor = check_count(cursor, "cursor")
        b = check_count(batch_size, "batch_size", positive=True)
        positions = cursor + np.arange(b, dtype=np.int64)
        epochs = positions // self._n
        offsets = positions % self._n
        out = np.empty(b, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.permutation(int(e))[offsets[sel]]
        return out

    def batch_at(self, cursor: int, batch_size: int) -> Any:
        """The batch of ``batch_size`` samples starting at stream position ``cursor``.

        Pure: the same arguments always give the same batch, and the dataset's
        own cursor does not move.

        Args:
          cursor: a stream position (``>= 0``).
          batch_size: samples in the batch (``>= 1``).

        Returns:
          The batch, in the container shape the arrays were given in.
        """
        idx = self.indices_at(cursor, batch_size)
        return self._pack([a[idx] for a in self._arrays])

    def next_batch(self, batch_size: int) -> Any:
        """The next ``batch_size`` samples of the stream; advances :attr:`cursor`.

        Args:
          batch_size: samples in the batch (``>= 1``); it may change between
            calls.

        Returns:
          The batch, in the container shape the arrays were given in.
        """
        batch = self.batch_at(self._cursor, batch_size)
        self._cursor += int(batch_size)
        return batch

    def next_rows(self, batch_size: int, start: int, stop: int) -> Any:
        """Rows ``[start, stop)`` of the next ``batch_size``-sample batch; advances by all of it.

        In a multi-process job each process feeds only its own rows of the global
        batch: every process calls this with the same ``batch_size`` and its own
        rows, reads only those samples, and every cursor moves by the whole
        batch, so the stream position stays global and exact.

        Example:
          >>> import numpy as np, adaptjax
          >>> ds = adaptjax.ArrayDataset(np.arange(10), shuffle=False)
          >>> ds.next_rows(4, 2, 4).tolist(), ds.cursor
          ([2, 3], 4)
        """
        b = check_count(batch_size, "batch_size", positive=True)
        start, stop = check_count(start, "start"), check_count(stop, "stop")
        if not start < stop <= b:
            raise ValueError(
                f"rows [{start}, {stop}) are not inside a batch of {b}; "
                f"use 0 <= start < stop <= {b}"
            )
        # rows of the batch's indices: a subclass may order a batch's rows its own way
        idx = self.indices_at(self._cursor, b)[start:stop]
        self._cursor += b
        return self._pack([a[idx] for a in self._arrays])

    def seek(self, cursor: int) -> None:
        """Moves the stream to position ``cursor`` (the next batch starts there)."""
        self._cursor = check_count(cursor, "cursor")

    # -- saving the position -------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The stream position as a JSON-able dict.

        Returns:
          ``{"kind", "cursor", "seed", "shuffle", "n", "fingerprint"}``.
        """
        return {
            "kind": _ARRAY_KIND,
            "cursor": self._cursor,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "n": self._n,
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes the stream saved by :meth:`state_dict`.

        The saved ``seed`` and ``shuffle`` replace this dataset's, so the
        stream continues exactly as it was saved. The saved fingerprint (array
        names, dtypes, shapes) must match this dataset's.

        Args:
          state: a dict from :meth:`state_dict` (possibly through JSON).
        """
        _check_state(state, _ARRAY_KIND, ("cursor", "seed", "shuffle", "n", "fingerprint"))
        if state["fingerprint"] != self._fingerprint or int(state["n"]) != self._n:
            raise ValueError(
                f"this data cursor was saved for another dataset ({state['fingerprint']}), "
                f"not this one ({self._fingerprint}); load it into the dataset it was saved for"
            )
        cursor = check_count(state["cursor"], "cursor")
        self._seed = check_count(state["seed"], "seed")
        self._shuffle = bool(state["shuffle"])
        self._perm_cache.clear()
        self._cursor = cursor

    def __repr__(self) -> str:
        codecs = self.codecs
        coded = "" if not codecs else f", features={ {k: c.dtype for k, c in codecs.items()} }"
        return (
            f"ArrayDataset({self._fingerprint}, seed={self._seed}, shuffle={self._shuffle}, "
            f"cursor={self._cursor}{coded})"
        )


def _chosen_codecs(features, keys: list, names: list[str], arrays: list[np.ndarray]) -> list:
    """The :class:`InputCodec` (or ``None``) of each array, from ``features=``."""
    if features is None:
        return [None] * len(arrays)
    if isinstance(features, InputCodec):
        floats = [np.issubdtype(a.dtype, np.floating) for a in arrays]
        if not any(floats):
            kinds = ", ".join(f"{n}={a.dtype}" for n, a in zip(names, arrays, strict=True))
            raise ValueError(
                f"features={features!r} found no float array to encode ({kinds}); an input "
                "codec quantizes float features, not integer labels"
            )
        return [features if f else None for f in floats]
    if not isinstance(features, Mapping):
        raise ValueError(
            f"features must be an adaptjax.InputCodec or a mapping from array names to codecs, "
            f"got {type(features).__name__}"
        )
    chosen: list = [None] * len(arrays)
    for key, codec in features.items():
        if key not in keys:
            raise ValueError(
                f"features names {key!r}, which is not one of the dataset's arrays {keys}"
            )
        if not isinstance(codec, InputCodec):
            raise ValueError(
                f"features[{key!r}] must be an adaptjax.InputCodec, got {type(codec).__name__}"
            )
        chosen[keys.index(key)] = codec
    return chosen


def _leading(chunk) -> int:
    sizes = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in jax.tree.leaves(chunk)}
    if not sizes or -1 in sizes:
        raise ValueError(
            "every leaf of a batch from the iterable needs a leading batch axis; with "
            "per-example items pass batched=False"
        )
    if len(sizes) != 1:
        raise ValueError(
            f"leaves of a batch from the iterable disagree on its size: {sorted(sizes)}"
        )
    return sizes.pop()


class IterableDataset:
    """Adapts your own iterable to a resumable stream with a sample cursor.

    ``iterable_factory(epoch)`` is called with ``epoch = 0, 1, 2, ...`` and
    must return an iterable over that epoch's data: single examples (pytrees
    of arrays or scalars, stacked into batches here) or, with
    ``batched=True``, batches of any size whose leaves share a leading axis
    (re-cut here to the batch size asked for). When one epoch's iterable is
    exhausted, the next is created, so the stream never ends.

    The position is counted in samples: ``cursor`` (total) and the offset
    inside the current epoch. On resume (:meth:`load_state_dict`) the epoch's
    iterable is re-created and the samples already consumed in it are read and
    dropped. **This is exact only if** ``iterable_factory(epoch)`` **yields the
    same samples in the same order every time** (seed any shuffling with the
    epoch); otherwise resuming silently serves different samples. Skipping
    costs the time to read the skipped samples.

    Args:
      iterable_factory: ``epoch -> iterable`` of examples (or of batches).
      batched: the iterable yields batches instead of single examples.

    Example:
      >>> import numpy as np, adaptjax
      >>> def examples(epoch):
      ...     order = np.random.default_rng(epoch).permutation(4)
      ...     return ({"x": np.float32(i)} for i in order)
      >>> ds = adaptjax.IterableDataset(examples)
      >>> first = [ds.next_batch(3)["x"].tolist() for _ in range(2)]
      >>> state = ds.state_dict()
      >>> state["cursor"], state["epoch"], state["offset"]
      (6, 1, 2)
      >>> again = adaptjax.IterableDataset(examples)
      >>> again.load_state_dict(state)
      >>> again.next_batch(2)["x"].tolist() == ds.next_batch(2)["x"].tolist()
      True
    """

    def __init__(self, iterable_factory: Callable[[int], Iterable[Any]], *, batched: bool = False):
        if not callable(iterable_factory):
            raise ValueError(
                f"iterable_factory must be callable as iterable_factory(epoch), got "
                f"{type(iterable_factory).__name__}"
            )
        self._factory = iterable_factory
        self._batched = bool(batched)
        self._cursor = 0
        self._epoch = 0
        self._offset = 0  # samples consumed from the current epoch
        self._iter = None  # iterator of the current epoch, created lazily
        self._skip = 0  # samples still to drop after a resume
        self._buf: deque = deque()  # [chunk, start] pulled but not yet handed out

    @property
    def cursor(self) -> int:
        """Samples handed out so far."""
        return self._cursor

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from."""
        return self._epoch

    def _new_epoch_iter(self):
        try:
            return iter(self._factory(self._epoch))
        except TypeError as e:
            raise ValueError(
                f"iterable_factory({self._epoch}) did not return an iterable ({e}); it must "
                "be callable as iterable_factory(epoch)"
            ) from None

    def _pull(self) -> bool:
        """Appends the next chunk of the current epoch; False when the epoch is over."""
        if self._iter is None:
            self._iter = self._new_epoch_iter()
        while True:
            try:
                item = next(self._iter)
            except StopIteration:
                return False
            if not self._batched:
                chunk = jax.tree.map(lambda x: np.asarray(x)[None], item)
                break
            chunk = jax.tree.map(np.asarray, item)
            if _leading(chunk):  # skip empty batches
                break
        self._buf.append([chunk, 0])
        return True

    def _take(self, count: int, keep: bool) -> list:
        """Consumes ``count`` samples of the current epoch (crossing into the next)."""
        parts = []
        while count:
            if not self._buf and not self._pull():
                if self._skip:
                    raise ValueError(
                        f"iterable_factory({self._epoch}) ended after {self._offset} samples but "
                        f"the saved position is {self._skip} samples into it; resuming needs a "
                        "deterministic iterable that yields the same samples every time"
                    )
                if self._offset == 0:
                    raise ValueError(
                        f"iterable_factory({self._epoch}) yielded no samples; every epoch "
                        "needs at least one"
                    )
                self._epoch += 1
                self._offset = 0
                self._iter = None
                continue
            chunk, start = self._buf[0]
            size = _leading(chunk)
            take = min(count, size - start)
            if keep:
                parts.append(jax.tree.map(lambda x, s=start, t=take: x[s : s + t], chunk))
            if start + take == size:
                self._buf.popleft()
            else:
                self._buf[0][1] = start + take
            self._offset += take
            count -= take
        return parts

    def _resume(self) -> None:
        if self._skip:
            skip, self._offset = self._skip, 0
            self._take(skip, keep=False)
            self._skip = 0

    def next_batch(self, batch_size: int) -> Any:
        """The next ``batch_size`` samples, stacked; advances :attr:`cursor`.

        Args:
          batch_size: samples in the batch (``>= 1``); it may change between
            calls.

        Returns:
          The batch, the examples' pytree structure with a leading batch axis.
        """
        b = check_count(batch_size, "batch_size", positive=True)
        self._resume()
        parts = self._take(b, keep=True)
        self._cursor += b
        if len(parts) == 1:
            return parts[0]
        try:
            return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *parts)
        except ValueError as e:
            raise ValueError(
                f"examples from the iterable do not stack into one batch ({e}); every example "
                "needs the same structure and shapes"
            ) from None

    def state_dict(self) -> dict[str, Any]:
        """The position as a JSON-able dict.

        Returns:
          ``{"kind", "cursor", "epoch", "offset", "batched"}``; ``offset`` counts
          the samples consumed from epoch ``epoch``.
        """
        return {
            "kind": _ITER_KIND,
            "cursor": self._cursor,
            "epoch": self._epoch,
            "offset": self._offset if not self._skip else self._skip,
            "batched": self._batched,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes at a position saved by :meth:`state_dict`.

        The epoch's iterable is re-created and the samples already consumed
        in it are skipped on the next :meth:`next_batch` (exact only for a
        deterministic iterable).

        Args:
          state: a dict from :meth:`state_dict` (possibly through JSON).
        """
        _check_state(state, _ITER_KIND, ("cursor", "epoch", "offset", "batched"))
        if bool(state["batched"]) != self._batched:
            raise ValueError(
                f"this data cursor was saved with batched={bool(state['batched'])}, this "
                f"dataset has batched={self._batched}; use the same setting"
            )
        cursor = check_count(state["cursor"], "cursor")
        epoch = check_count(state["epoch"], "epoch")
        offset = check_count(state["offset"], "offset")
        self._cursor, self._epoch, self._offset = cursor, epoch, 0
        self._iter = None
        self._buf.clear()
        self._skip = offset

    def __repr__(self) -> str:
        return (
            f"IterableDataset(batched={self._batched}, cursor={self._cursor}, epoch={self._epoch})"
        )
