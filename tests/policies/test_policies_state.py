"""Policy state survives a checkpoint: a resumed run makes exactly the same decisions."""

import dataclasses
import json
import math

import pytest
from adaptjax.policies._policy import validate_actions

from adaptjax import policies as ajp

CODEC = "onebit"  # an opaque codec stand-in


def build():
    return ajp.any_of(
        ajp.cooldown(ajp.AdaptiveBatchSize(2048, lr_rule="adascale"), steps=30),
        ajp.hysteresis(
            ajp.SwitchCompression(CODEC, when_comm_share_above=0.35, off_below=0.1), times=2
        ),
        ajp.ElasticScale({120: 8}, predicate=lambda m, c: 4 if m["loss"] < 0.6 else None),
        ajp.ReduceLROnPlateau(patience=40, min_delta=1e-3),
        ajp.Schedule({100: ajp.Checkpoint(), 250: ajp.Checkpoint()}),
        ajp.EarlyStop("eval_accuracy", patience=150, min_delta=0.02),
    )


def metrics_at(step, c):
    """Deterministic metrics that depend on the step and on the configuration in effect."""
    metrics = {
        "loss": max(2.0 - 0.01 * step, 0.55) + 0.01 * math.sin(step),
        "step_time": 0.05 + 0.5 * 8 / c.devices * (1.0 if c.codec is None else 0.3)
        + 0.001 * c.batch_size / c.devices,
        "comm_share": (0.4 if c.codec is None else 0.08) + 0.05 * math.sin(0.3 * step),
        "noise_scale": 40.0 + 4.0 * step,
        "grad_variance": 40.0 + 4.0 * step,
        "grad_sqnorm": 1.0,
    }
    if step % 50 == 0:
        metrics["eval_accuracy"] = min(0.5 + step / 500, 0.8)
    if step < 20:  # early on, some metrics are missing
        for key in ("noise_scale", "grad_variance", "grad_sqnorm"):
            metrics.pop(key)
    return metrics


def apply(c, actions, step):
    """What a controller would do with the actions (the parts the Context sees)."""
    changes = {"step": step}
    for action in actions:
        if isinstance(action, ajp.SetBatchSize):
            changes["batch_size"] = action.batch_size
        elif isinstance(action, ajp.SetHyperparams):
            changes["hyperparams"] = {**c.hyperparams, **action.values}
        elif isinstance(action, ajp.Rescale):
            changes["devices"] = action.devices
        elif isinstance(action, ajp.SetCodec):
            changes["codec"] = action.codec
    return dataclasses.replace(c, **changes)


def run(policy, c, steps):
    log = []
    for step in steps:
        c = dataclasses.replace(c, step=step)
        actions = validate_actions(policy.decide(metrics_at(step, c), c))
        log.append((step, actions))
        c = apply(c, actions, step)
    return log, c


START = ajp.Context(step=0, batch_size=64, microbatches=1, devices=2, max_devices=8,
                    hyperparams={"learning_rate": 1e-3})


@pytest.mark.parametrize("resume_at", [35, 120, 200, 265])
def test_resumed_policy_makes_identical_decisions(resume_at):
    original = build()
    _, c = run(original, START, range(0, resume_at, 5))
    saved = json.dumps(original.state_dict())  # what a checkpoint stores

    resumed = build()
    resumed.load_state_dict(json.loads(saved))
    later = range(resume_at, 450, 5)
    expected, _ = run(original, c, later)
    got, _ = run(resumed, c, later)
    assert got == expected
    assert json.dumps(resumed.state_dict()) == json.dumps(original.state_dict())

    # The comparison is not vacuous: there are decisions after the resume point, and
    # a policy that forgot its state decides differently.
    kinds = {type(a) for _, actions in expected for a in actions}
    assert len(kinds) >= 2
    forgetful, _ = run(build(), c, later)
    assert forgetful != expected


def test_whole_run_uses_every_builtin():
    log, c = run(build(), START, range(0, 450, 5))
    kinds = {type(a).__name__ for _, actions in log for a in actions}
    assert kinds >= {"SetBatchSize", "SetHyperparams", "SetCodec", "Rescale", "Checkpoint",
                     "Stop"}
    assert c.batch_size > START.batch_size


def test_state_dicts_are_json_and_round_trip_for_each_builtin():
    policies = [
        ajp.AdaptiveBatchSize(1024),
        ajp.ElasticScale({10: 4}),
        ajp.SwitchCompression(CODEC),
        ajp.ReduceLROnPlateau(patience=5),
        ajp.Schedule({10: ajp.Checkpoint()}),
        ajp.EarlyStop("loss", target=0.1, mode="min", patience=10),
        ajp.cooldown(ajp.ElasticScale({10: 4}), steps=5),
        ajp.hysteresis(ajp.SwitchCompression(CODEC), times=3),
        ajp.when(lambda m, c: True, ajp.Checkpoint()),
    ]
    for policy in policies:
        run(policy, START, range(0, 40, 5))
        state = policy.state_dict()
        text = json.dumps(state, allow_nan=False)
        policy.load_state_dict(json.loads(text))
        assert policy.state_dict() == state
        # state_dict returns a copy: mutating it does not touch the policy.
        if "fired" in state:
            state["fired"].append(999)
            assert 999 not in policy.state_dict()["fired"]
