"""``kill -9`` during a rescale of a sharded mesh: the run resumes in the new shape, bit-exact.

The job (``tests/controller_job.py --sharded``) trains on a (data 2, fsdp 4)
mesh and rescales to (1, 4) at step 20 and to (4, 2) at step 40, each through
a checkpoint of the step its decision lands on (21, 41) and a restore onto the
new shardings. Killed between that checkpoint's commit and the restore, it
resumes from that checkpoint in the new shape; killed inside the write of the
second one, from the periodic checkpoint before it, in the old shape, and
makes the same decision again. Either way the run ends bit-identical to the
uninterrupted one, with every step and event logged once
(``test_controller_faults.assert_same_run``).
"""

import os
import signal
import sys

import pytest

import adaptjax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_controller_faults import STEPS, Job, assert_same_run  # noqa: E402 - their harness

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sharded_reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sharded-reference") / "run"
    j = Job(run_dir, STEPS, "--sharded")
    assert j.finish() == 0, j.output()
    return run_dir


def test_kill_9_inside_a_2d_rescale_resumes_in_the_new_shape(tmp_path, sharded_reference):
    run_dir = tmp_path / "run"
    j = Job(run_dir, STEPS, "--sharded", hold="restore")
    where = j.wait_held()
    assert where == "restore 21 mesh {'data': 1, 'fsdp': 4}", where
    j.proc.send_signal(signal.SIGKILL)
    j.gate.go()
    assert j.finish() == -signal.SIGKILL, j.output()
    meta = adaptjax.RunCheckpoints(run_dir / "checkpoints").read_meta(21)
    assert meta["config"]["mesh_shape"] == [["data", 1], ["fsdp", 4]]  # the shape it goes on in

    j = Job(run_dir, STEPS, "--sharded", "--kill-in-save", "41")
    assert j.wait_for(lambda w: w[:1] == ["RESUMED"]) == "RESUMED 21\n", j.output()
    assert j.wait_for(lambda w: w[:2] == ["STEP", "22"]) == "STEP 22 1\n"  # on data = 1
    assert j.finish() == 17, j.output()  # inside the (1, 4) -> (4, 2) checkpoint's write
    assert any(".orbax-checkpoint-tmp" in n for n in os.listdir(run_dir / "checkpoints"))

    j = Job(run_dir, STEPS, "--sharded")
    assert j.wait_for(lambda w: w[:1] == ["RESUMED"]) == "RESUMED 40\n", j.output()
    assert j.finish() == 0, j.output()
    assert_same_run(run_dir, sharded_reference)
    meta = adaptjax.RunCheckpoints(run_dir / "checkpoints").read_meta()
    assert meta["config"]["mesh_shape"] == [["data", 4], ["fsdp", 2]]
