"""The planner turns the communication knobs (dense lane, quantizer buckets) by predicted time."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _controller_args import make_controller  # noqa: E402

import adaptjax
from adaptjax import compression as ajc
from adaptjax.controller._step_cache import StepCache
from adaptjax.costs import (
    ComputeModel,
    LinkModel,
    Planner,
    StepTimeModel,
    choose_bucket_bytes,
    choose_dense_lane,
)
from adaptjax.costs._schedule import buckets, exchange_time

RSAG = "reduce-scatter+all-gather"
SLOW, FAST = LinkModel(1e-3, 1e-8), LinkModel(1e-6, 1e-9)
# the pair's two kinds fast and the all-reduce slow, and the other way round
LINKS = {
    RSAG: {"all-reduce": SLOW, "reduce-scatter": FAST, "all-gather": FAST, "all-to-all": FAST},
    "all-reduce": {"all-reduce": FAST, "reduce-scatter": SLOW, "all-gather": SLOW,
                   "all-to-all": SLOW},
}
PARAMS = {"b": jnp.zeros(5), "v": jnp.zeros(3000), "w": jnp.zeros((8, 512))}


def _loss(p, batch):
    pred = batch["x"] @ p["w"][:, :8] + p["v"][:8].sum() + p["b"][0]
    return jnp.mean((pred - batch["y"]) ** 2)


def _controller(tmp_path, **kw):
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(256, 8)).astype(np.float32),
            "y": rng.normal(size=(256, 8)).astype(np.float32)}
    return make_controller(
        model=PARAMS, loss_fn=_loss,
        optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.01),
        data=adaptjax.ArrayDataset(data, seed=0), devices=4, batch_size=32, run_dir=tmp_path,
        checkpoint_every=None, progress=False, tensorboard=False, monitors=(), **kw)


@pytest.mark.parametrize("lane", [RSAG, "all-reduce"])
def test_planner_builds_the_step_with_the_faster_dense_lane(tmp_path, lane):
    grad_bytes = 4.0 * sum(x.size for x in PARAMS.values())
    planner = Planner(LINKS[lane])
    assert choose_dense_lane(planner.model, grad_bytes, 4)[0] == lane  # what the links say
    ctrl = _controller(tmp_path)
    planner.attach(ctrl)
    ctrl.run(steps=2)
    report = planner.wire_of(ctrl.config)  # the compiled step the controller ran
    assert ctrl.steps.options_of[ctrl.config] == {"dense_lane": lane}
    if lane == RSAG:
        assert report.count("reduce-scatter") == report.count("all-gather") == 1
        assert max(c.bytes for c in report.collectives if c.kind == "all-reduce") < 64
    else:
        assert report.count("reduce-scatter") == report.count("all-gather") == 0
    (event,) = [e for e in ctrl.log.events if e["kind"] == "schedule"]
    assert event["dense_lane"] == lane and event["config"]["devices"] == 4
    assert set(event["predicted_s"]) == {"all-reduce", RSAG}
    ctrl.close()
    row = json.loads(json.dumps(planner.to_json()))["schedules"][0]
    assert row["dense_lane"] == lane


# all-gather's bandwidth slow: the owner-compute transport (an all-to-all, then 1/N
# of the bytes in an all-gather) sends less of it than one all-gather of everything
SLOW_GATHER = {"*": LinkModel(1e-4, 1e-9), "all-gather": LinkModel(1e-4, 1e-5)}


@pytest.mark.parametrize("links, transport", [({"*": LinkModel(1e-4, 1e-9)}, "allgather"),
                                              (SLOW_GATHER, "owner")])
def test_planner_buckets_a_quantizer_only_where_overlap_hides_them(tmp_path, links, transport):
    planner = Planner(links)
    ctrl = _controller(tmp_path, codec=ajc.onebit())
    planner.attach(ctrl)
    # the α–β model alone: every extra bucket pays its latency again, so one exchange;
    # equal links: one all-gather (one latency) beats two collectives for so few bytes
    assert planner.schedule(ctrl.config) == {"bucket_bytes": None, "transport": transport}
    # with a fitted overlap and a long backward pass, all but the last bucket hide
    planner.model = dataclasses.replace(planner.model, compute=ComputeModel(fixed=1.0),
                                        overlap=1.0)
    report = planner.wire_of(ctrl.config)  # builds the controller's step, which asks schedule
    chosen = ctrl.steps.options_of[ctrl.config]
    # the codec's buckets: whole leaves from the last, w then v (b is under min_size)
    lane = [4.0 * 8 * 512, 4.0 * 3000]
    count = len(buckets(lane, chosen["bucket_bytes"], split=False))
    # two buckets leave only v exposed; the largest bucket that still makes two wins ties
    assert chosen == {"bucket_bytes": 16384, "transport": transport} and count == 2
    assert planner.schedules[ctrl.config]["buckets"] == count
    # owner-compute: an all-to-all and an all-gather per bucket; all-gather: one per bucket
    assert report.count("all-to-all") == (count if transport == "owner" else 0)
    assert report.count("all-gather") == count
    ctrl.close()


def test_owner_compute_exchange_and_one_bucket_without_overlap():
    model = StepTimeModel({"*": LinkModel(1e-4, 1e-9)})
    n, e = 4, 4e6
    # all-to-all of E plus all-gather of E/N: 2(N-1) message steps, 2(N-1)/N·E bytes
    assert exchange_time(model, "owner-compute", n, e) == pytest.approx(
        2 * (n - 1) * 1e-4 + 2 * (n - 1) / n * e * 1e-9)
    # 2 replicas: one all-gather of E (the same bytes, one latency step)
    assert exchange_time(model, "owner-compute", 2, e) == pytest.approx(1e-4 + e * 1e-9)
    lane = [4e6, 1e5, 3e6]
    best, times = choose_bucket_bytes(model, lane, 8, kind="owner-compute",
                                      candidates=(1e5, 1e6, sum(lane)), wire_fraction=1 / 32)
    assert best == sum(lane) and times[1e5] > times[1e6] > times[best]
    with pytest.raises(ValueError, match=r"^unknown collective kind 'ring': use one of .*"
                                         r"or 'owner-compute'$"):
        exchange_time(model, "ring", 4, e)
    with pytest.raises(ValueError, match=r"^wire_fraction must be > 0, got 0$"):
        choose_bucket_bytes(model, lane, 8, wire_fraction=0)


def test_step_cache_without_a_schedule_builds_as_before():
    cache = StepCache(model=PARAMS, loss_fn=_loss,
                      optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
    config = adaptjax.RunConfig(4, 32)
    cache.step(config)
    assert cache.options_of[config] == {}
    assert cache.tx(None, None) is cache.tx(None) is cache.tx(None, dense_lane="all-reduce")
    assert cache.tx(None, dense_lane=RSAG) is not cache.tx(None)
    cache.schedule = lambda c: {"ring": True}
    with pytest.raises(ValueError, match=r"^schedule returned unknown step options \['ring'\]; "
                                         r"use \('dense_lane', 'bucket_bytes', 'transport'\)$"):
        cache.step(adaptjax.RunConfig(2, 32))
