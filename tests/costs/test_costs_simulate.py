"""The simulator replays a recorded controller run's decisions exactly on its own times."""

import os
import sys

import pytest
from _controller_args import make_controller  # noqa: E402

import adaptjax
from adaptjax import policies as ajp
from adaptjax.costs import CannotPredict, Cluster, simulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import controller_job as job  # noqa: E402


class TimeDriven(ajp.Policy):
    """Sets a learning rate that depends on the step time it is shown (and its own calls)."""

    def __init__(self):
        self.calls = 0

    def decide(self, metrics, ctx):
        self.calls += 1
        if "step_time" not in metrics or self.calls % 2:
            return []
        # and on what the controller says about compiles (AdaptiveBatchSize reads them)
        seconds = metrics["step_time"] + metrics["train_seconds"] + metrics["compile_seconds"]
        lr = ctx.hyperparams["learning_rate"] * (1.0 + (seconds * 1e6 % 97) / 1e3)
        return [ajp.SetHyperparams({"learning_rate": lr})]


def _policies():
    schedule = ajp.Schedule({10: ajp.SetBatchSize(32), 20: ajp.Rescale(devices=4)})
    return [job.LossDrivenPolicy(), TimeDriven(), schedule]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    ctrl = make_controller(run_dir=run_dir, **job.job_kwargs(
        policies=_policies(), monitors=(), checkpoint_every=None))
    ctrl.run(steps=32)
    ctrl.close()
    return str(run_dir)


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return (xs[(n - 1) // 2] + xs[n // 2]) / 2


def _recorded_decisions(run_dir):
    _, events = adaptjax.costs.read_run(run_dir)
    return [(e["metrics_step"], tuple(e["actions"])) for e in events if e["kind"] == "decision"]


@pytest.mark.slow
def test_replay_on_measured_times_makes_the_recorded_decisions(recorded):
    sim = simulate(recorded, _policies(), hyperparams={"learning_rate": 1e-2}, policy_every=5)
    assert list(sim.decisions) == _recorded_decisions(recorded)
    assert sim.diverged_at is None
    assert sim.steps == 32 and sim.config.devices == 4 and sim.config.batch_size == 32
    # Measured times: every step costs what the run recorded (its first, untimed, step borrows
    # its configuration's median).
    metrics, _ = adaptjax.costs.read_run(recorded)
    timed = [r["step_time"] for r in metrics if "step_time" in r]
    assert sim.seconds >= sum(timed)


@pytest.mark.slow
def test_replay_on_a_cluster_with_half_the_step_time_takes_half_as_long(recorded):
    def measured(c):  # the recorded run's own median per configuration
        metrics, _ = adaptjax.costs.read_run(recorded)
        rows = [r["step_time"] for r in metrics if "step_time" in r
                and (r["devices"], r["batch_size"]) == (c.devices, c.batch_size)]
        return sorted(rows)[len(rows) // 2]

    full = simulate(recorded, _policies()[2:], step_time=measured, policy_every=5)
    half = simulate(recorded, _policies()[2:], step_time=lambda c: measured(c) / 2,
                    policy_every=5)
    assert [(e.step, e.kind) for e in full.events] == [(e.step, e.kind) for e in half.events]
    compile_s = sum(1 for e in full.events if e.kind == "compile")  # each costs the same
    assert compile_s >= 3  # the start, batch 32 on 8 devices, then on 4
    _, events = adaptjax.costs.read_run(recorded)
    fixed = sum(_median([e["latency_s"] for e in events if e["kind"] == k]) * count
                for k, count in (("compile", compile_s), ("rescale", 1)))
    assert half.seconds - fixed == pytest.approx((full.seconds - fixed) / 2)


@pytest.mark.slow
def test_replay_cannot_time_a_configuration_the_run_never_ran(recorded):
    with pytest.raises(CannotPredict, match="the run never ran it"):
        simulate(recorded, [ajp.Schedule({5: ajp.SetBatchSize(128)})], policy_every=5)


def test_bad_inputs_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="not a run directory"):
        simulate(str(tmp_path), [])
    with pytest.raises(ValueError, match="devices must be an int >= 1"):
        Cluster(devices=0)
    for steps in (0, -3, 2.5):  # 0 once ended in an UnboundLocalError
        with pytest.raises(ValueError, match=r"^steps must be an integer >= 1 \(or None"):
            simulate(str(tmp_path), [], steps=steps)


def _write_rows(run_dir, rows):
    import json

    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


@pytest.mark.parametrize("logged, devices, expected", [
    ({"noise_scale": 50.0}, 2, 2),  # the default noise scale: two samples, as the Controller
    ({}, 2, 1),  # no noise scale measured: nothing asks for a split
    ({"noise_scale": 50.0}, 1, 1),  # started on one device without micro-batches: differencing
])
def test_replay_splits_the_batch_on_one_device_as_the_controller_does(
        tmp_path, logged, devices, expected):
    rows = [{"step": s, "step_time": 0.1, "devices": float(devices), "batch_size": 64.0,
             **logged} for s in range(1, 21)]
    _write_rows(str(tmp_path), rows)
    schedule = {10: ajp.Rescale(devices=1)} if devices == 2 else {10: ajp.SetBatchSize(32)}
    sim = simulate(str(tmp_path), [ajp.Schedule(schedule)], step_time=lambda c: 0.1)
    assert (sim.config.devices, sim.config.microbatches) == (1, expected)


@pytest.mark.slow
def test_a_replay_off_the_recorded_path_tells_policies_its_own_age(recorded):
    class Sees(ajp.Policy):
        def __init__(self):
            self.seen = []

        def decide(self, metrics, ctx):
            self.seen.append((ctx.step, metrics["compile_seconds"], metrics["train_seconds"]))
            return []

    sees = Sees()
    sim = simulate(recorded, [sees], step_time=lambda c: 0.5, policy_every=5)
    _, events = adaptjax.costs.read_run(recorded)
    waits = [e["latency_s"] for e in events
             if e["kind"] == "compile" and not e.get("compiled_ahead")]
    compile_cost = _median([e["latency_s"] for e in events if e["kind"] == "compile"])
    # one configuration all along (no actions): the start's compile, then 0.5 s a step
    assert sim.steps == 32
    assert [s for s, _, _ in sees.seen] == list(range(5, 33, 5))
    for step, compile_seconds, age in sees.seen:
        assert compile_seconds == _median(waits)
        assert age == pytest.approx(compile_cost + 0.5 * step)
