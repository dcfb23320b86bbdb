"""``adaptjax plan``: the ranked table from a run's costs.json; the planner attached to a run."""

import contextlib
import io
import json
import os
import sys

import pytest
from _controller_args import make_controller  # noqa: E402
from adaptjax.policies import Candidate

import adaptjax
from adaptjax import Collective
from adaptjax import policies as ajp
from adaptjax.cli._main import main
from adaptjax.costs import ComputeModel, LinkModel, Planner

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import controller_job as job  # noqa: E402
from adaptjax.policies._goodput import statistical_efficiency

LINK = LinkModel(alpha=0.0, beta=1e-8)
COMPUTE = ComputeModel(fixed=0.05, per_sample=1e-4)


def _wire(config):
    n = config.devices
    b = 2 * (n - 1) / n * 4e6
    return [Collective("all-reduce", "f32", (1,), 1, n, b, b, "f32")]


def _truth(c):
    return (COMPUTE.time(devices=c.devices, batch_size=c.batch_size)
            + LINK.time("all-reduce", c.devices, _wire(c)[0].bytes))


def _plan(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *argv]) == 0
    return out.getvalue().splitlines()


def test_plan_ranks_by_predicted_goodput(tmp_path):
    planner = Planner({"all-reduce": LINK}, wire_of=_wire)
    planner.run_dir = str(tmp_path)
    for c in (Candidate(2, 64), Candidate(2, 256), Candidate(4, 256)):
        planner.observe(c, _truth(c))
    phi = 100.0
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 1, "noise_scale": phi}) + "\n")
    lines = _plan(str(tmp_path))
    assert "noise scale 100" in lines[0]
    rows = [line.split() for line in lines[2:]]

    def goodput(n, b):
        t = _truth(Candidate(n, b))
        return b / t * statistical_efficiency(phi, b, 64)

    expected = sorted(((n, b) for n in range(1, 5) for b in (64, 256) if b % n == 0),
                      key=lambda nb: -goodput(*nb))
    assert [(int(r[1]), int(r[2])) for r in rows] == expected
    assert float(rows[0][4]) == pytest.approx(_truth(Candidate(*expected[0])) * 1e3, abs=0.01)
    # The measured step shown beside the prediction; the model is exact, so they agree.
    measured = {(2, 64), (2, 256), (4, 256)}
    for r in rows:
        if (int(r[1]), int(r[2])) in measured:
            assert float(r[5]) == pytest.approx(float(r[4]), abs=0.01)
        else:
            assert r[5] == "-"


def test_plan_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(SystemExit, match="not a run directory"):
        main(["plan", str(tmp_path)])
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit, match="no costs.json"):
        main(["plan", str(tmp_path)])
    script = tmp_path / "train.py"
    script.write_text("")  # a script is probed: this one never runs a controller
    with pytest.raises(SystemExit, match="without running an adaptjax.Controller"):
        main(["plan", str(script)])


@pytest.mark.slow
def test_planner_attached_to_a_controller_records_costs(tmp_path):
    planner = Planner(bandwidth=1e9)  # pinned: no calibration in a test
    # Two batch sizes measured: enough to split fixed from per-sample compute.
    policies = [ajp.ElasticScale(planner=planner, min_gain=10.0),
                ajp.Schedule({5: ajp.SetBatchSize(64)})]
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(
        policies=policies, checkpoint_every=None, devices=4, batch_size=32))
    planner.attach(ctrl)
    ctrl.run(steps=16)
    ctrl.close()
    assert {c.batch_size for c in planner._times} == {32, 64}
    assert planner.step_time(Candidate(4, 32)) is not None
    assert planner.step_time(Candidate(2, 128)) is not None  # never run: rescaled collectives
    assert planner.step_time(Candidate(4, 32, codec="never")) is None
    loaded = Planner.load(str(tmp_path))
    assert loaded.step_time(Candidate(4, 32)) == pytest.approx(planner.step_time(
        Candidate(4, 32)))
    assert "dev batch" in _plan(str(tmp_path))[1]


@pytest.mark.slow
def test_simulate_a_recorded_run_on_slower_links(tmp_path):
    from adaptjax.costs import Cluster, simulate
    from adaptjax.costs._simulate import predicted_times, wire_for

    planner = Planner(bandwidth=1e9)
    policies = [ajp.ElasticScale(planner=planner, min_gain=10.0),
                ajp.Schedule({5: ajp.SetBatchSize(64)})]
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(
        policies=policies, checkpoint_every=None, devices=4, batch_size=32))
    planner.attach(ctrl)
    ctrl.run(steps=16)
    ctrl.close()
    model = Planner.load(str(tmp_path)).model

    def replay(bandwidth):
        times = predicted_times(model, Cluster(devices=8, bandwidth=bandwidth))
        return simulate(str(tmp_path), [ajp.Schedule({5: ajp.SetBatchSize(64)})],
                        step_time=times, policy_every=5, max_devices=8)

    fast, slow = replay(1e9), replay(1e6)
    assert [(e.step, e.kind) for e in fast.events] == [(e.step, e.kind) for e in slow.events]
    assert fast.config.batch_size == 64
    # Same steps, same compute; only the links differ: every step pays its bytes at 1 MB/s.
    sent = wire_for(model, adaptjax.RunConfig(4, 32)).compiled_total
    assert sent > 0
    assert slow.seconds - fast.seconds == pytest.approx(16 * sent * (1 / 1e6 - 1 / 1e9))
