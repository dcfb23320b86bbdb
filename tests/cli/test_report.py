"""``adaptjax report``: a picture and summary.md of a run with every kind of event.

Decisions come from the built-in policies themselves (their actions carry a
reason naming the policy), so the test checks the chain policy -> reason ->
log row -> summary.md. The picture is checked to be a PNG file; its content was
looked at by eye when the report was written.
"""

import json
import math
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _controller_args import make_controller  # noqa: E402
from adaptjax.policies._actions import with_reason

import adaptjax
from adaptjax import policies as ajp
from adaptjax.cli import _report as _report
from adaptjax.cli._main import main as cli_main
from adaptjax.cli._main import summary


def _ctx(step, batch=64, devices=8, codec=None, lr=1e-3):
    return ajp.Context(step=step, batch_size=batch, microbatches=1, devices=devices,
                       max_devices=8, hyperparams={"learning_rate": lr}, codec=codec)


def _decisions():
    """(step, actions, metrics) from real policies, one decision of each kind."""
    out = []
    grow = ajp.AdaptiveBatchSize(max_batch_size=512)
    m = {"noise_scale": 5000.0, "step_time": 0.2, "loss": 2.0}
    out.append((10, grow.decide(m, _ctx(10)), m))
    m = {"loss": 1.9}
    out.append((20, ajp.ElasticScale({20: 4}).decide(m, _ctx(20)), m))
    m = {"comm_share": 0.7}
    out.append((30, ajp.SwitchCompression("onebit", when_comm_share_above=0.5).decide(
        m, _ctx(30, devices=4)), m))
    plateau = ajp.ReduceLROnPlateau("loss", patience=5)
    plateau.decide({"loss": 1.0}, _ctx(30))
    m = {"loss": 1.5}
    out.append((40, plateau.decide(m, _ctx(40)), m))
    m = {"eval_loss": 0.5}
    out.append((50, ajp.EarlyStop("eval_loss", target=0.6, mode="min").decide(m, _ctx(50)), m))
    out.append((45, [ajp.Rollback("loss became NaN")], {"nonfinite_count": 3.0}))
    out.append((35, ajp.Schedule({35: ajp.Checkpoint()}).decide({}, _ctx(35)), {}))
    return out


def _run_dir(path):
    rows = []
    for s in range(1, 51):
        rows.append({
            "step": s, "loss": 3.0 / math.sqrt(s), "noise_scale": 20.0 + s,
            "noise_scale_valid": 1.0, "batch_size": 64.0 if s <= 10 else 128.0,
            "devices": 8.0 if s <= 20 else 4.0, "learning_rate": 1e-3,
            "step_time": 0.1, "comm_time": 0.05, "wire_bytes": 4e6 if s <= 30 else 1.3e5,
            "nonfinite": 1.0 if s in (14, 15) else 0.0,
            **({"eval_loss": 3.2 / math.sqrt(s)} if s % 10 == 0 else {}),
        })
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"devices": 8, "batch_size": 64, "microbatches": 1, "codec": None}
    events = [{"time": 0.0, "kind": "compile", "step": 1, "latency_s": 2.0, "config": cfg}]
    for step, actions, metrics in _decisions():
        events.append({"time": 1.0, "kind": "decision", "step": step + 1, "metrics_step": step,
                       "actions": [repr(a) for a in actions],
                       "reasons": [a.reason for a in actions], "metrics": metrics})
    events += [
        {"time": 2, "kind": "set_hyperparams", "step": 11, "learning_rate": 2e-3},
        {"time": 2, "kind": "batch_rounded", "step": 11, "requested": 130, "batch_size": 128},
        {"time": 3, "kind": "rescale", "step": 21, "devices_from": 8, "devices_to": 4,
         "latency_s": 0.4},
        {"time": 4, "kind": "set_codec", "step": 31, "codec": "_OneBit(axis_name='data')"},
        {"time": 5, "kind": "checkpoint", "step": 36, "latency_s": 0.1},
        {"time": 6, "kind": "rollback", "step": 46, "latency_s": 0.2, "reason": "NaN",
         "to_checkpoint": 36},
        {"time": 7, "kind": "resume", "step": 36, "latency_s": 1.0},
        {"time": 8, "kind": "checkpoint_skipped", "step": 36, "skipped_step": 40,
         "reason": "checksum", "moved_to": "quarantine/40"},
        {"time": 9, "kind": "eval", "step": 40, "latency_s": 0.1, "eval_loss": 0.5},
        {"time": 9, "kind": "stop", "step": 51, "reason": "eval_loss reached 0.5"},
        {"time": 9, "kind": "preempted", "step": 51, "exit_code": 75},
    ]
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_builtin_policies_give_every_action_a_reason_naming_them():
    for _, actions, _ in _decisions():
        assert actions
        for a in actions:
            assert a.reason, a
    names = [_report.split_reason(a.reason)[0] for _, acts, _ in _decisions() for a in acts]
    assert {"AdaptiveBatchSize", "ElasticScale", "SwitchCompression", "ReduceLROnPlateau",
            "Schedule"} <= set(names)


def test_reason_is_a_description_not_part_of_the_decision():
    a, b = ajp.SetBatchSize(128, reason="why"), ajp.SetBatchSize(128)
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
    assert with_reason(ajp.Rescale(devices=4), "x").reason == "x"
    with pytest.raises(ValueError, match="reason"):
        ajp.SetCodec(None, reason=3)


def test_report_writes_png_and_summary_naming_each_decision(tmp_path):
    run = _run_dir(tmp_path)
    assert cli_main(["report", str(run)]) == 0
    png = (run / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    text = (run / "summary.md").read_text()
    for _, actions, metrics in _decisions():
        for a in actions:
            assert repr(a) in text
            policy, why = _report.split_reason(a.reason)
            assert why in text and (policy or "(not named)") in text
        for key in metrics:
            assert key in text
    for kind in ("rescale", "rollback", "resume", "checkpoint_skipped", "stop", "preempted",
                 "set_codec", "set_hyperparams", "batch_rounded"):
        assert f"**{kind}**" in text
    lines = summary(str(run)).splitlines()
    assert any("by AdaptiveBatchSize:" in line and "SetBatchSize" in line for line in lines)
    assert "- steps skipped as non-finite: 2 (steps 14, 15)" in text.splitlines()


def test_controller_logs_reasons_metrics_and_the_learning_rate(tmp_path):
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)  # noqa: E731
    ctrl = make_controller(
        model={"w": jnp.zeros(4)}, loss_fn=loss,
        optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        data=adaptjax.ArrayDataset({"x": x, "y": x.sum(1)}, seed=0), devices=2, batch_size=8,
        policies=[ajp.Schedule({4: ajp.SetHyperparams({"learning_rate": 0.05})})],
        policy_every=2, run_dir=tmp_path, progress=False, tensorboard=False)
    ctrl.run(8)
    ctrl.close()
    rows = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    # The decision on step 4's metrics acts before step 6 is dispatched (Controller docs).
    lrs = {r["step"]: r["learning_rate"] for r in rows}
    assert lrs[1] == pytest.approx(0.1) and lrs[8] == pytest.approx(0.05)
    assert sorted(set(np.round(list(lrs.values()), 6))) == [0.05, 0.1]
    decision = [e for e in ctrl.log.events if e["kind"] == "decision"][0]
    assert decision["reasons"] == ["Schedule: entry for step 4"]
    assert decision["metrics"]["loss"] == pytest.approx(
        [r for r in rows if r["step"] == 4][0]["loss"])


def test_the_noise_scale_line_breaks_where_no_reading_is_valid():
    rows = [{"step": 1, "noise_scale": 0.0, "noise_scale_valid": 0.0, "loss": 1.0},
            {"step": 2, "noise_scale": 50.0, "noise_scale_valid": 1.0},
            {"step": 3, "noise_scale": 50.0, "noise_scale_valid": 0.0},  # held, not measured
            {"step": 4, "loss": 1.0},  # no monitor row
            {"step": 5, "noise_scale": 70.0}]  # logs without the flag: valid
    steps, values = _report.noise_scale_series(rows)
    assert steps == [1, 2, 3, 5]
    assert [math.isnan(v) for v in values] == [True, False, True, False]
    assert values[1] == 50.0 and values[3] == 70.0


def test_the_sync_band_names_the_default_strategy():
    events = [{"kind": "compile", "step": 0, "config": {"devices": 8, "sync": None}},
              {"kind": "compile", "step": 5, "config": {"devices": 8, "sync": "DiLoCo(H=4)"}}]
    rows = [{"step": s, "devices": 8} for s in range(1, 11)]
    bands = _report._bands(rows, events)
    assert bands["sync"] == [(0, 5, "all-reduce (S-SGD)"), (5, 10, "DiLoCo(H=4)")]
