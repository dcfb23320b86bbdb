"""No silent surprises (issue 37 item 9): what the controller does not do, it says, once."""

import os
import sys

import pytest
from _controller_args import make_controller, resume_controller  # noqa: E402

import adaptjax
from adaptjax import policies as ajp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import controller_job as job  # noqa: E402


def test_resume_warns_when_the_data_seed_passed_is_not_the_checkpoints(tmp_path):
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(policies=[]))  # seed=3
    ctrl.run(10)
    ctrl.close()
    other = adaptjax.ArrayDataset(job.make_data(), seed=5)
    with pytest.warns(UserWarning, match=r"seed=5 was passed.*checkpoint's seed=3") as record:
        resumed = resume_controller(tmp_path, **job.job_kwargs(policies=[], data=other))
    assert len(record) == 1, [str(w.message) for w in record]
    assert "\n" not in str(record[0].message)
    assert resumed.data.seed == 3  # the checkpoint's stream goes on
    resumed.close()
    # the same seed: nothing to say (warnings are errors in these tests)
    resume_controller(tmp_path, **job.job_kwargs(policies=[])).close()


def test_a_policy_asking_for_more_devices_than_max_devices_warns_once_and_the_run_goes_on(
    tmp_path,
):
    greedy = ajp.Schedule({2: ajp.Rescale(devices=16), 4: ajp.Rescale(devices=16)})
    with pytest.warns(UserWarning, match=r"^Schedule: Rescale\(devices=16") as record:
        ctrl = make_controller(
            run_dir=tmp_path, **job.job_kwargs(policies=[greedy], policy_every=1)
        )
        ctrl.run(6)  # today: ValueError 'cannot rescale to 16 devices' ends the run
    assert len(record) == 1, [str(w.message) for w in record]
    msg = str(record[0].message)
    assert "max_devices is 8" in msg and "\n" not in msg
    assert ctrl.step == 6 and ctrl.config.devices == 8
    ctrl.close()


def test_an_elastic_schedule_beyond_max_devices_warns_at_construction(tmp_path):
    elastic = ajp.ElasticScale({2: 16, 4: 8})
    with pytest.warns(UserWarning, match=r"^ElasticScale: schedule entry \{2: 16\}") as record:
        ctrl = make_controller(
            run_dir=tmp_path,
            **job.job_kwargs(policies=[ajp.cooldown(elastic, steps=1)], policy_every=1),
        )
        ctrl.run(4)  # today: the entry is capped at 8 devices (= the current count): nothing
    assert len(record) == 1, [str(w.message) for w in record]
    assert "max_devices=8" in str(record[0].message)
    ctrl.close()
