"""Policies asking a planner for predicted step times (plain numbers, no jax)."""

import pytest
from adaptjax.policies import Candidate, Context

from adaptjax import policies as ajp


def _ctx(devices=8, batch_size=64, codec=None, max_devices=8):
    return Context(step=10, batch_size=batch_size, microbatches=1, devices=devices,
                   max_devices=max_devices, hyperparams={"learning_rate": 0.1}, codec=codec)


class Table:
    """step time = f(candidate); records what it was told."""

    def __init__(self, fn, explore=None):
        self.fn = fn
        self.seen = []
        self._explore = explore

    def step_time(self, c):
        return self.fn(c)

    def observe(self, c, t):
        self.seen.append((c, t))

    def explore(self, candidates):
        return self._explore(candidates) if self._explore else None


def test_switch_compression_follows_predicted_step_time_both_ways():
    fast_codec = Table(lambda c: 0.05 if c.codec else 0.1)
    slow_codec = Table(lambda c: 0.3 if c.codec else 0.1)
    on = ajp.SwitchCompression("onebit", planner=fast_codec)
    assert on.decide({"step_time": 0.1}, _ctx()) == [ajp.SetCodec("onebit")]
    assert fast_codec.seen == [(Candidate(8, 64, 1, None), 0.1)]
    # "Don't compress": the codec is on and predicted slower than the dense sync.
    off = ajp.SwitchCompression("onebit", planner=slow_codec)
    assert off.decide({}, _ctx(codec="onebit")) == [ajp.SetCodec(None)]
    assert off.decide({"comm_share": 0.99}, _ctx()) == []


def test_switch_compression_needs_min_gain():
    close = Table(lambda c: 0.097 if c.codec else 0.1)  # 3% faster
    assert ajp.SwitchCompression("q", planner=close).decide({}, _ctx()) == []
    assert ajp.SwitchCompression("q", planner=close, min_gain=0.01).decide({}, _ctx()) == [
        ajp.SetCodec("q")
    ]


def test_switch_compression_probes_what_the_planner_cannot_predict():
    unknown = Table(lambda c: None if c.codec else 0.1, explore=lambda cs: cs[0])
    assert ajp.SwitchCompression("q", planner=unknown).decide({}, _ctx()) == [ajp.SetCodec("q")]
    # Without a search, the thresholds on comm_share decide as before.
    blind = Table(lambda c: None if c.codec else 0.1)
    policy = ajp.SwitchCompression("q", planner=blind, when_comm_share_above=0.3)
    assert policy.decide({"comm_share": 0.2}, _ctx()) == []
    assert policy.decide({"comm_share": 0.5}, _ctx()) == [ajp.SetCodec("q")]


def test_adaptive_batch_size_maximises_goodput_of_predicted_step_times():
    alpha, beta, phi = 1.0, 0.01, 400.0
    planner = Table(lambda c: alpha + beta * c.batch_size)
    policy = ajp.AdaptiveBatchSize(max_batch_size=4096, lr_rule="none", planner=planner)
    actions = policy.decide({"noise_scale": phi}, _ctx())  # no step time measured yet

    def g(m):
        return ajp.goodput(m, noise_scale=phi, alpha=alpha, beta=beta, base_batch_size=64)

    candidates = [64 * 2**k for k in range(7)]  # powers of two within [64, 4096]
    assert actions == [ajp.SetBatchSize(max(candidates, key=g))]
    assert max(candidates, key=g) == 256  # M* = sqrt(αφ/β) = 200 lies between 128 and 256


def test_elastic_scale_picks_the_fastest_predicted_device_count():
    planner = Table(lambda c: 1.0 / c.devices + 0.1 * (c.devices - 1))  # t(4) = 0.55 is least
    policy = ajp.ElasticScale(planner=planner)
    assert policy.decide({}, _ctx(devices=8)) == [ajp.Rescale(devices=4)]
    assert policy.decide({}, _ctx(devices=4)) == []


def test_planner_argument_is_checked():
    with pytest.raises(ValueError, match="planner must have a step_time"):
        ajp.SwitchCompression("q", planner=object())
    with pytest.raises(ValueError, match="planner must have a step_time"):
        ajp.ElasticScale(planner=3)
    with pytest.raises(ValueError, match="give a schedule"):
        ajp.ElasticScale()
