"""SwitchSync: a rule over the metrics picks the strategy; plain numbers, no jax."""

import dataclasses

import pytest

from adaptjax import policies as ajp

CTX = ajp.Context(step=10, batch_size=128, microbatches=1, devices=8, max_devices=8,
                  hyperparams={})


def test_threshold_relative_to_batch_switches_once_and_not_to_the_running_strategy():
    policy = ajp.SwitchSync("diloco", metric="noise_scale", below=0.5, relative_to_batch=True)
    assert policy.decide({"noise_scale": 63.9}, CTX) == [ajp.SetSync("diloco")]  # < 0.5 * 128
    assert policy.decide({"noise_scale": 64.0}, CTX) == []
    assert policy.decide({}, CTX) == []  # no metric (monitors off under local strategies)
    running = dataclasses.replace(CTX, sync="diloco")
    assert policy.decide({"noise_scale": 1.0}, running) == []
    assert policy.required_metrics() == frozenset({"noise_scale"})


def test_back_to_ssgd_is_none_and_ssgd_is_not_re_emitted():
    policy = ajp.SwitchSync(None, metric="loss", above=2.0)
    assert policy.decide({"loss": 3.0}, dataclasses.replace(CTX, sync="gossip")) == [
        ajp.SetSync(None)
    ]
    assert policy.decide({"loss": 3.0}, CTX) == []  # sync=None: S-SGD already runs


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "give exactly one of when="),
        ({"metric": "loss"}, "give exactly one of below= and above="),
        ({"metric": "loss", "below": 1.0, "above": 2.0}, "give exactly one of below="),
        ({"when": 3}, "when must be callable"),
        ({"metric": "loss", "below": float("nan")}, "below"),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        ajp.SwitchSync("diloco", **kwargs)
    assert "\n" not in str(info.value)


def test_set_sync_signature_names_the_strategy():
    assert ajp._actions.action_signature(ajp.SetSync("gossip")) == ["SetSync", "gossip"]
