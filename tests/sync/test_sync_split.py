"""The Dirichlet split: a partition, IID as alpha -> inf, stable across rescales, exact rows."""

import math

import numpy as np
import pytest

import adaptjax
import adaptjax.sync

K, N = 10, 1797  # the digits data set's classes and samples
LABELS = np.random.default_rng(0).integers(0, K, size=N)
COUNTS = np.bincount(LABELS, minlength=K)


def _is_partition(shards, n_samples):
    every = np.concatenate(shards)
    return every.size == n_samples and np.array_equal(np.sort(every), np.arange(n_samples))


@pytest.mark.parametrize("alpha", [0.1, 1.0, 100.0, math.inf])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_shards_partition_the_samples(alpha, n):
    shards = adaptjax.sync.dirichlet_split(LABELS, n, alpha, seed=3)
    assert len(shards) == n and all(s.size for s in shards)
    assert _is_partition(shards, N)


def test_infinite_alpha_is_the_stratified_iid_split():
    """Largest-remainder rounding of c_k / n: every count within 1 of it.

    Histogram bound: with |count_rk - c_k/n| < 1 and | |S_r| - N/n | < K (one
    sample per class at most), |count_rk N - c_k |S_r|| < N + c_k K <= N (1 + K),
    so |count_rk / |S_r| - c_k / N| < (1 + K) / |S_r|.
    """
    n = 8
    for shards in (adaptjax.sync.dirichlet_split(LABELS, n, math.inf, seed=s) for s in range(3)):
        for s in shards:
            counts = np.bincount(LABELS[s], minlength=K)
            assert np.all(np.abs(counts - COUNTS / n) < 1)
            hist_gap = np.abs(counts / s.size - COUNTS / N)
            assert np.all(hist_gap < (1 + K) / s.size)


def test_large_alpha_tends_to_the_iid_split():
    """alpha = 1e9: p_rk ~ Beta(alpha, (n-1) alpha), sd = sqrt((1/n)(1-1/n)/(n alpha + 1)).

    Rounding keeps each count within 1 of c_k p_rk, so |count - c_k/n| < 1 + c_k |p - 1/n|;
    half a sample more than the IID bound is over 60 standard deviations of c_k p here
    (fixed seed: the test is deterministic).
    """
    n, alpha = 8, 1e9
    sd = math.sqrt((1 / n) * (1 - 1 / n) / (n * alpha + 1))
    assert COUNTS.max() * sd * 60 < 0.5
    for s in adaptjax.sync.dirichlet_split(LABELS, n, alpha, seed=1):
        counts = np.bincount(LABELS[s], minlength=K)
        assert np.all(np.abs(counts - COUNTS / n) < 1.5)


def test_small_alpha_skews_the_labels():
    """At alpha = 0.1 most of a replica's samples come from few classes (not an IID split)."""
    shards = adaptjax.sync.dirichlet_split(LABELS, 8, 0.1, seed=0)
    top2 = [np.sort(np.bincount(LABELS[s], minlength=K))[-2:].sum() / s.size for s in shards]
    # IID would give about 2/K = 0.2; Dir(0.1) puts most of a class on one or two replicas
    assert np.mean(top2) > 0.6


def test_split_is_a_pure_function_and_survives_a_rescale():
    y = LABELS
    ds = adaptjax.sync.SplitArrayDataset(np.arange(N), labels=y, n_replicas=8, alpha=0.5, seed=4)
    first = ds.shards
    ds.set_replicas(4)
    assert len(ds.shards) == 4 and _is_partition(ds.shards, N)
    ds.set_replicas(8)
    assert all(np.array_equal(a, b) for a, b in zip(first, ds.shards, strict=True))
    again = adaptjax.sync.dirichlet_split(y, 8, 0.5, seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


def test_every_replica_reads_its_shard_once_per_epoch():
    n, rows = 4, 3  # rows per replica per step
    ds = adaptjax.sync.SplitArrayDataset(np.arange(N), labels=LABELS, n_replicas=n, alpha=0.3)
    longest = max(s.size for s in ds.shards)
    seen = [[] for _ in range(n)]
    for _ in range(-(-longest // rows)):
        batch = ds.next_batch(n * rows)
        for r in range(n):
            seen[r].extend(batch[r * rows : (r + 1) * rows].tolist())
    for r, shard in enumerate(ds.shards):
        epoch0 = np.array(seen[r][: shard.size])
        assert np.array_equal(np.sort(epoch0), shard)  # once each, only its own


def test_rows_resume_and_per_process_rows_match_the_batch():
    ds = adaptjax.sync.SplitArrayDataset(
        {"x": np.arange(N), "y": LABELS}, labels=LABELS, n_replicas=4, alpha=1.0, seed=2
    )
    ds.next_batch(8)
    state = ds.state_dict()
    whole = ds.batch_at(ds.cursor, 8)
    fresh = adaptjax.sync.SplitArrayDataset(
        {"x": np.arange(N), "y": LABELS}, labels=LABELS, n_replicas=4, alpha=1.0, seed=9
    )
    fresh.load_state_dict(state)
    part = fresh.next_rows(8, 2, 6)
    assert np.array_equal(part["x"], whole["x"][2:6]) and fresh.cursor == 16


def test_bad_inputs_are_one_line_errors():
    split = adaptjax.sync.dirichlet_split
    with pytest.raises(ValueError, match=r"alpha \(the Dirichlet concentration\) must be"):
        split(LABELS, 4, 0.0)
    with pytest.raises(ValueError, match="labels must be a 1-D integer array"):
        split(LABELS.astype(float), 4, 1.0)
    with pytest.raises(ValueError, match="n_replicas must be a positive integer"):
        split(LABELS, 0, 1.0)
    with pytest.raises(ValueError, match="3 samples cannot fill 4 shards"):
        split(LABELS[:3], 4, 1.0)
    with pytest.raises(ValueError, match="leaves a replica without samples"):
        split(np.zeros(8, int), 8, 1e-3)
    ds = adaptjax.sync.SplitArrayDataset(np.arange(N), labels=LABELS, n_replicas=4, alpha=1.0)
    with pytest.raises(ValueError, match="batch_size 6 does not split over 4 replicas"):
        ds.next_batch(6)
    with pytest.raises(ValueError, match="one label per sample"):
        adaptjax.sync.SplitArrayDataset(np.arange(N), labels=LABELS[:5], n_replicas=2, alpha=1.0)
    other = adaptjax.sync.SplitArrayDataset(np.arange(N), labels=LABELS, n_replicas=4, alpha=2.0)
    with pytest.raises(ValueError, match="saved for alpha=1.0, this split has alpha=2.0"):
        other.load_state_dict(ds.state_dict())
