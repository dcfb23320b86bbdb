"""Heterogeneous replicas: each replica trains on its own non-IID shard.

For local SGD and DiLoCo (replicas that train apart) the question FedTune
asks is how the replicas' *data* differ. :func:`dirichlet_split` partitions a
labelled dataset over ``n`` replicas with a Dirichlet(α) label skew (Hsu et
al., 2019): for every class ``k`` the proportions ``p_k ~ Dir(α 1_n)`` say
which share of the class each replica holds. Small α: each replica sees few
classes; α → ∞: every class split evenly (the IID split). The split is a pure
function of ``(labels, n_replicas, alpha, seed)``: a resume or a rescale back
to the same ``n`` finds the same shards.

:class:`SplitArrayDataset` serves an :class:`adaptjax.ArrayDataset`'s arrays so
that rows ``[r b/n, (r+1) b/n)`` of every global batch (the rows the step
gives replica ``r``) come from replica ``r``'s shard. A language model's
windows split by source file: label each window with the file it starts in
(``examples/lm_data.py``'s ``load_corpus`` returns these as
``info["train_sources"]``), and a small α gives each replica mostly whole files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from adaptjax._data import ArrayDataset, check_count

_TRIES = 100  # redraws of the proportions until no shard is empty


def _check_alpha(alpha) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise ValueError(
            f"alpha (the Dirichlet concentration) must be a number > 0 (math.inf: the IID "
            f"split), got {alpha!r}"
        )
    return float(alpha)


def _round_counts(total: int, p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Integer counts summing to ``total``, each within 1 of ``total * p`` (largest remainder).

    Ties among remainders are broken by a random order, so that no replica
    collects every class's extra sample.
    """
    exact = total * p
    counts = np.floor(exact).astype(np.int64)
    order = np.lexsort((rng.permutation(p.size), -(exact - counts)))
    counts[order[: total - int(counts.sum())]] += 1
    return counts


def dirichlet_split(labels: Any, n_replicas: int, alpha: float, seed: int = 0) -> tuple:
    """Partitions the sample indices over replicas with a Dirichlet(α) label skew.

    For each class ``k`` (its ``c_k`` indices in a seeded random order), the
    proportions ``p_k ~ Dir(α 1_n)`` are drawn and the class is cut into
    ``n`` consecutive pieces of ``c_k p_{k,r}`` samples, rounded by largest
    remainder (each count within 1 of ``c_k p_{k,r}``, summing to ``c_k``).
    ``alpha=math.inf`` takes ``p_{k,r} = 1/n``: the stratified IID split,
    every replica within one sample of ``c_k / n`` of every class. When a
    draw leaves a replica with no sample the proportions are drawn again
    (from the same seed, so the result stays a pure function of the arguments).

    Args:
      labels: integer labels, one per sample (1-D).
      n_replicas: the number of shards, ``>= 1``.
      alpha: the concentration, ``> 0``; ``math.inf`` for IID.
      seed: seeds the split.

    Returns:
      ``n_replicas`` sorted int64 index arrays, disjoint, covering ``0..N-1``.

    References:
      Hsu, Qi and Brown, "Measuring the effects of non-identical data
      distribution for federated visual classification", 2019 (arXiv:1909.06335).

    Example:
      >>> import math, numpy as np, adaptjax.sync
      >>> shards = adaptjax.sync.dirichlet_split(np.repeat([0, 1], 4), 2, math.inf)
      >>> [np.bincount(np.repeat([0, 1], 4)[s]).tolist() for s in shards]
      [[2, 2], [2, 2]]
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"labels must be a 1-D integer array (one class per sample), got "
            f"{labels.dtype}{list(labels.shape)}"
        )
    n = check_count(n_replicas, "n_replicas", positive=True)
    alpha = _check_alpha(alpha)
    seed = check_count(seed, "seed")
    if labels.size < n:
        raise ValueError(
            f"{labels.size} samples cannot fill {n} shards; use n_replicas <= {labels.size}"
        )
    classes = np.unique(labels)
    for attempt in range(_TRIES):
        rng = np.random.default_rng([seed, n, attempt])
        pieces: list[list[np.ndarray]] = [[] for _ in range(n)]
        for k in classes:
            idx = np.flatnonzero(labels == k)
            idx = idx[rng.permutation(idx.size)]
            p = np.full(n, 1.0 / n) if math.isinf(alpha) else rng.dirichlet(np.full(n, alpha))
            bounds = np.cumsum(_round_counts(idx.size, p, rng))[:-1]
            for r, part in enumerate(np.split(idx, bounds)):
                pieces[r].append(part)
        shards = tuple(np.sort(np.concatenate(p)) for p in pieces)
        if all(s.size for s in shards):
            return shards
    raise ValueError(
        f"alpha={alpha} leaves a replica without samples in {_TRIES} draws of {n} shards; "
        "use a larger alpha or fewer replicas"
    )


class SplitArrayDataset(ArrayDataset):
    """An :class:`adaptjax.ArrayDataset` whose replicas each read their own shard.

    The shards are :func:`dirichlet_split` ``(labels, n_replicas, alpha,
    seed)``. Replica ``r`` reads an endless stream over its shard ``S_r``:
    its epoch ``e`` visits ``S_r`` once, in the order
    ``default_rng([seed, n, r, e]).permutation(|S_r|)`` (index order without
    ``shuffle``). A global batch of ``b`` rows at cursor ``c`` gives replica
    ``r`` rows ``[r b/n, (r+1) b/n)``: positions ``c // n, ..., c // n + b/n - 1``
    of its stream. Every replica reads ``b/n`` samples a step, so shards of
    different sizes wrap at different steps; over its own epoch each replica
    reads its shard once, and the shards partition the samples.

    **Rescales** (:meth:`set_replicas`): the shards for the new count ``m``
    are ``dirichlet_split(labels, m, alpha, seed)`` and each replica resumes
    its stream at position ``cursor // m``. The same count always gives the
    same shards (``8 -> 4 -> 8`` finds the first shards again); a change of
    count gives a new partition, so an epoch in progress is not completed.
    :meth:`state_dict` saves ``alpha``; ``n_replicas`` is the run's (the
    dataset is built or set for the mesh it feeds).

    Args:
      *arrays: as :class:`adaptjax.ArrayDataset` (one array, several, or a dict).
      labels: the integer class of every sample (1-D, the arrays' length).
      n_replicas: the replicas the batches are split over.
      alpha: the Dirichlet concentration (``math.inf``: IID).
      seed: seeds the split and the streams.
      shuffle: shuffle each replica's epochs.

    Example:
      >>> import math, numpy as np, adaptjax.sync
      >>> y = np.repeat([0, 1], 4)
      >>> ds = adaptjax.sync.SplitArrayDataset(y, labels=y, n_replicas=2, alpha=0.01)
      >>> sorted(np.bincount(y[s], minlength=2).tolist() for s in ds.shards)
      [[0, 4], [4, 0]]
    """

    def __init__(
        self,
        *arrays: Any,
        labels: Any,
        n_replicas: int,
        alpha: float,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        super().__init__(*arrays, seed=seed, shuffle=shuffle)
        labels = np.asarray(labels)
        if labels.shape[:1] != (self.num_samples,):
            raise ValueError(
                f"labels has {labels.shape[:1]} samples, the arrays {self.num_samples}; give "
                "one label per sample"
            )
        self._labels = labels
        self._alpha = _check_alpha(alpha)
        self.set_replicas(n_replicas)

    @property
    def shards(self) -> tuple:
        """Each replica's sample indices (sorted), for the current replica count."""
        return self._shards

    @property
    def n_replicas(self) -> int:
        """The replica count the batches are split over."""
        return len(self._shards)

    def set_replicas(self, n_replicas: int) -> None:
        """Splits for ``n_replicas`` from now on (a rescale; see the class docstring)."""
        n = check_count(n_replicas, "n_replicas", positive=True)
        self._shards = dirichlet_split(self._labels, n, self._alpha, self.seed)

    def replica_indices(self, replica: int, position: int, count: int) -> np.ndarray:
        """Sample indices at positions ``position ... position + count - 1`` of ``replica``."""
        shard = self._shards[replica]
        n, size = self.n_replicas, shard.size
        positions = position + np.arange(count, dtype=np.int64)
        out = np.empty(count, np.int64)
        for e in np.unique(positions // size):
            sel = positions // size == e
            if self._shuffle:
                order = np.random.default_rng([self.seed, n, replica, int(e)]).permutation(size)
            else:
                order = np.arange(size)
            out[sel] = shard[order[positions[sel] % size]]
        return out

    def indices_at(self, cursor: int, batch_size: int) -> np.ndarray:
        """Sample indices of the ``batch_size``-row batch at ``cursor``, replica by replica."""
        cursor = check_count(cursor, "cursor")
        b = check_count(batch_size, "batch_size", positive=True)
        n = self.n_replicas
        if b % n:
            raise ValueError(
                f"batch_size {b} does not split over {n} replicas; use a multiple of {n}"
            )
        return np.concatenate([self.replica_indices(r, cursor // n, b // n) for r in range(n)])

    def state_dict(self) -> dict[str, Any]:
        """:meth:`adaptjax.ArrayDataset.state_dict` and the split's ``alpha``."""
        return {**super().state_dict(), "alpha": self._alpha}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes a stream saved by :meth:`state_dict`; the saved ``alpha`` must be this one's."""
        if not isinstance(state, Mapping) or state.get("alpha") != self._alpha:
            saved = state.get("alpha") if isinstance(state, Mapping) else None
            raise ValueError(
                f"this data cursor was saved for alpha={saved!r}, this split has "
                f"alpha={self._alpha!r}; build the dataset with the saved alpha"
            )
        super().load_state_dict(state)
        self.set_replicas(self.n_replicas)  # the saved seed may differ from this one's
