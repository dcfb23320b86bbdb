"""The pure parts of multi-process support, in one process: rows, process counts, bad env."""

import numpy as np
import pytest

import adaptjax
from adaptjax.controller._run_log import NullRunLog
from adaptjax.launch._distributed import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    can_give,
    mesh_devices,
    process_rows,
    processes_for,
)


def test_next_rows_reads_a_slice_and_moves_by_the_whole_batch():
    ds = adaptjax.ArrayDataset(np.arange(10), seed=4)
    full = adaptjax.ArrayDataset(np.arange(10), seed=4)
    a = ds.next_rows(8, 0, 4)
    b = adaptjax.ArrayDataset(np.arange(10), seed=4).next_rows(8, 4, 8)
    np.testing.assert_array_equal(np.concatenate([a, b]), full.next_batch(8))
    assert ds.cursor == full.cursor == 8
    # Across an epoch boundary too: positions 8..15 straddle epochs 0 and 1.
    np.testing.assert_array_equal(ds.next_rows(8, 2, 6), full.next_batch(8)[2:6])


@pytest.mark.parametrize(("start", "stop"), [(4, 4), (0, 9), (5, 2)])
def test_next_rows_outside_the_batch_is_one_line(start, stop):
    with pytest.raises(ValueError, match=r"rows \[.*\) are not inside a batch of 8; use 0 <="):
        adaptjax.ArrayDataset(np.arange(10)).next_rows(8, start, stop)


def test_process_counts_are_the_fewest_equal_shares():
    # P >= n / K and P divides n, smallest such P.
    for n in range(1, 17):
        for k in (1, 2, 4):
            p = processes_for(n, k)
            assert n % p == 0 and n // p <= k
            assert all(n % q or n // q > k for q in range(1, p))


def test_one_process_gives_its_first_devices_and_all_rows():
    assert process_rows(32, 4) == (0, 32)
    assert can_give(8) and not can_give(9)
    assert mesh_devices(3) == adaptjax.make_mesh(3).devices.tolist()


def test_null_run_log_writes_nothing(tmp_path):
    log = NullRunLog()
    log.metrics(1, {"loss": 1.0})
    log.event("checkpoint", step=1)
    log.sync()
    log.close()
    assert [e["kind"] for e in log.events] == ["checkpoint"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("n", "rank", "match"),
    [
        ("x", "0", "ADAPTJAX_NUM_PROCESSES='x' is not an integer"),
        ("0", "0", "ADAPTJAX_NUM_PROCESSES=0 is out of range"),
        ("2", "2", "ADAPTJAX_PROCESS_ID=2 but ADAPTJAX_NUM_PROCESSES=2; ids run 0..1"),
    ],
)
def test_bad_launcher_environment_is_one_line(monkeypatch, n, rank, match):
    monkeypatch.setenv(ENV_COORDINATOR, "127.0.0.1:1")
    monkeypatch.setenv(ENV_NUM_PROCESSES, n)
    monkeypatch.setenv(ENV_PROCESS_ID, rank)
    with pytest.raises(ValueError, match=match):
        adaptjax.initialize_distributed()
