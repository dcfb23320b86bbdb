"""``kill -9`` of grain-fed runs at random moments: the resumed run consumes the elements the
uninterrupted run consumes and ends bit-identical to it (issue 47).

The job is the fault tests' (``tests/controller_job.py``), 25 steps with a
checkpoint every 10, fed through grain:

* ``--data grain``: ``adaptjax.GrainDataset`` over a shuffled
  ``grain.MapDataset`` of the job's records (read ahead on a thread), batch
  64 -> 32 decided at step 11 and 8 -> 4 devices at step 21;
* ``--data grain-iter``: ``GrainDataset.from_iter_dataset`` over a filtered,
  packed ``grain.IterDataset`` (``controller_job.packed_pipeline``), whose
  batch cannot change: 64 rows throughout, 8 -> 4 devices at step 21.

For each, one uninterrupted run is the reference. Another run directory gets
two ``kill -9``s, each followed by a resume, in the order they come: one at a
step drawn by a seeded ``random.Random`` (``ADAPTJAX_FAULT_SEED``), one inside
the rescale, in the save of its transition checkpoint (step 21) once its
writes were launched and before its commit. The job holds at either point
until killed (``tests/_handshake.py``), so nothing races. Resumed to the end,
the run must have fed the reference's elements in the reference's order (the
batches a resume feeds again must be the ones fed before the kill,
``tests/_fed.py``) and end with the reference's parameters, every step and
event logged once (``test_controller_faults.assert_same_run``).
"""

import os
import random
import signal
import sys

import pytest

import adaptjax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fed  # noqa: E402 - tests/ is on the path (conftest)
from test_controller_faults import Job, assert_same_run  # noqa: E402 - their harness

pytestmark = pytest.mark.slow

STEPS = 25
RESCALE_CHECKPOINT = 21  # the 8 -> 4 decision on step 20's metrics lands on step 21
SAMPLES = 640  # the job's records


def kill_at(run_dir, data, point):
    """Starts the job, waits until it holds at ``point`` and ``kill -9``s it there."""
    kind, step = point
    if kind == "step":
        j = Job(run_dir, STEPS, "--data", data, hold=f"step={step}")
        assert j.wait_held().startswith(f"step {step} "), j.output()
    else:
        j = Job(run_dir, STEPS, "--data", data, hold_in_save=step)
        assert j.wait_held() == f"save {step}", j.output()
    j.proc.send_signal(signal.SIGKILL)
    j.gate.go()  # the job is gone already: nothing can pass the hold
    assert j.finish() == -signal.SIGKILL, j.output()
    return j


@pytest.mark.parametrize("data", ["grain", "grain-iter"])
def test_kill_9_at_random_moments_of_a_grain_fed_run_loses_and_repeats_nothing(tmp_path, data):
    reference = tmp_path / "reference"
    j = Job(reference, STEPS, "--data", data)
    assert j.finish() == 0, j.output()

    rng = random.Random(int(os.environ.get("ADAPTJAX_FAULT_SEED", "47")))
    step = rng.choice([s for s in range(2, STEPS) if s != RESCALE_CHECKPOINT])
    run_dir = tmp_path / "run"
    for point in sorted([("step", step), ("save", RESCALE_CHECKPOINT)], key=lambda p: p[1]):
        j = kill_at(run_dir, data, point)
        if point[0] == "save":  # inside the rescale: decided, its checkpoint not committed
            assert "RESCALE 8 4\n" in j.lines, j.output()
            ckpts = run_dir / "checkpoints"
            assert RESCALE_CHECKPOINT not in adaptjax.RunCheckpoints(ckpts).all_steps()
            assert any(".orbax-checkpoint-tmp" in n for n in os.listdir(ckpts))
    print(f"{data}: killed at step {step} and inside the rescale's checkpoint")
    j = Job(run_dir, STEPS, "--data", data)
    assert j.finish() == 0, j.output()

    assert_same_run(run_dir, reference, STEPS)
    want, _ = _fed.stream(reference)
    got, agreed = _fed.stream(run_dir)
    assert agreed, "a resume fed other elements than the killed run had at the same cursor"
    assert got == want, f"killed at step {step} and in the rescale: another stream"
    if data == "grain":  # 64 x 11 + 32 x 14 (batch 32 from step 12): an epoch, then part of one
        assert len(want) == 1152 and sorted(want[:SAMPLES]) == list(range(SAMPLES))
        assert len(set(want[SAMPLES:])) == len(want) - SAMPLES
    else:  # every third record filtered out, the others packed several to a row
        assert set(want) == {i for i in range(SAMPLES) if i % 3}
