"""The cost model against math: α–β and compute fits, monotonicity, one-line refusals."""

import dataclasses
import itertools

import pytest

from adaptjax import Collective, RunConfig
from adaptjax.costs import CannotPredict, ComputeModel, LinkModel, StepTimeModel, rescale_report
from adaptjax.costs._compute import fit_compute
from adaptjax.costs._links import fit_alpha_beta, fit_operand_alpha, message_steps
from adaptjax.costs._model import Observation


def _allreduce(n, message_bytes, is_async=False):
    b = 2 * (n - 1) / n * message_bytes
    return Collective("all-reduce", "f32", (int(message_bytes // 4),), int(message_bytes // 4), n,
                      b, b, "f32", is_async=is_async)


def _gather(n, message_bytes):
    b = (n - 1) / n * message_bytes
    return Collective("all-gather", "u32", (1,), 1, n, b, b, "u32")


@pytest.mark.parametrize("kind", ["all-reduce", "all-gather", "all-to-all", "reduce-scatter"])
def test_alpha_beta_fit_recovers_known_alpha_and_beta(kind):
    alpha, beta = 3e-5, 2.5e-9
    groups, sizes = zip(*itertools.product([2, 4, 8], [1e3, 1e5, 4e6]), strict=True)
    secs = [message_steps(kind, n) * alpha + beta * b for n, b in zip(groups, sizes, strict=True)]
    link = fit_alpha_beta(kind, groups, sizes, secs)
    assert link.alpha == pytest.approx(alpha, rel=1e-9)
    assert link.beta == pytest.approx(beta, rel=1e-9)


def test_alpha_beta_fit_never_negative():
    # Times that fall with size: the unconstrained fit has β < 0; the constrained one is 0.
    link = fit_alpha_beta("all-reduce", [2, 2, 2], [1e3, 1e4, 1e5], [3e-3, 2e-3, 1e-3])
    assert link.beta == 0.0 and link.alpha == pytest.approx(2e-3 / 2)


def test_operand_alpha_fit_recovers_a_known_per_operand_latency():
    link = LinkModel(alpha=2e-4, beta=3e-9)
    alpha_operand = 7e-4
    groups, operands, sizes = [2, 2, 8, 8], [8, 4, 8, 2], [4e3, 4e3, 7e3, 7e3]
    secs = [message_steps("all-reduce", n) * (2e-4 + (k - 1) * alpha_operand) + 3e-9 * b
            for n, k, b in zip(groups, operands, sizes, strict=True)]
    fitted = fit_operand_alpha(link, "all-reduce", groups, operands, sizes, secs)
    assert fitted.alpha_operand == pytest.approx(alpha_operand, rel=1e-9)
    assert (fitted.alpha, fitted.beta) == (link.alpha, link.beta)
    # Tuples no slower than one operand: the per-operand latency is 0, never negative.
    assert fit_operand_alpha(link, "all-reduce", [2], [8], [4e3],
                             [link.time("all-reduce", 2, 4e3) / 2]).alpha_operand == 0.0
    with pytest.raises(ValueError, match="needs a timing with >= 2 operands on >= 2 devices"):
        fit_operand_alpha(link, "all-reduce", [2], [1], [4e3], [1e-3])


def test_a_tuple_all_reduce_pays_latency_per_operand():
    link = LinkModel(alpha=1e-4, beta=1e-8, alpha_operand=5e-4)
    model = StepTimeModel({"all-reduce": link}, ComputeModel(fixed=0.01))
    one = _allreduce(4, 4e6)
    three = dataclasses.replace(one, num_operands=3)
    extra = (model.predict(RunConfig(4, 64), [three]).comm
             - model.predict(RunConfig(4, 64), [one]).comm)
    assert extra == pytest.approx(6 * 2 * 5e-4)  # 6 message steps x 2 further operands


def test_compute_fit_recovers_known_per_sample_cost():
    fixed, per_sample = 0.004, 2e-4
    configs = [(1, 8), (1, 32), (2, 16), (2, 64), (4, 64), (4, 256)]
    secs = [fixed + per_sample * b / n for n, b in configs]
    model = fit_compute([n for n, _ in configs], [b for _, b in configs], [1] * 6, secs)
    assert model.fixed + model.per_microbatch == pytest.approx(fixed, rel=1e-6)
    assert model.per_sample == pytest.approx(per_sample, rel=1e-6)
    assert model.per_global_sample == pytest.approx(0.0, abs=1e-12)


def test_compute_fit_finds_host_shared_devices():
    # Simulated devices on one host: the step grows with the global batch n·b.
    configs = [(1, 8), (2, 16), (2, 64), (4, 64), (8, 64)]
    secs = [0.002 + 1e-4 * b for _, b in configs]
    model = fit_compute([n for n, _ in configs], [b for _, b in configs], [1] * 5, secs)
    assert model.per_global_sample == pytest.approx(1e-4, rel=1e-6)
    assert model.per_sample == pytest.approx(0.0, abs=1e-12)


def test_compute_fit_finds_per_replica_work_per_microbatch():
    # Host-shared cores: every replica's micro-batch adds its launch work in turn (n·k).
    configs = [(1, 16, 1), (1, 64, 1), (2, 32, 1), (2, 128, 2), (4, 32, 1), (4, 128, 2),
               (8, 64, 1), (8, 256, 2), (2, 64, 2), (4, 32, 2)]
    secs = [0.001 + 2e-5 * b + 1e-3 * n * k for n, b, k in configs]  # b: the global batch
    model = fit_compute(*zip(*configs, strict=True), secs)
    assert model.per_replica_microbatch == pytest.approx(1e-3, rel=1e-6)
    assert model.per_global_sample == pytest.approx(2e-5, rel=1e-6)
    assert model.fixed == pytest.approx(0.001, rel=1e-6)
    for name in ("per_microbatch", "per_sample", "per_replica"):
        assert getattr(model, name) == pytest.approx(0.0, abs=1e-9), name
    # On devices of their own, each replica's share is a cost per micro-batch.
    own = model.on_own_devices()
    assert own.per_microbatch == pytest.approx(1e-3, rel=1e-6)
    assert own.per_replica_microbatch == 0.0


def _model(link=None):
    link = link or LinkModel(alpha=1e-4, beta=1e-8)
    compute = ComputeModel(fixed=0.01, per_sample=1e-3)
    return StepTimeModel({"all-reduce": link, "all-gather": link}, compute)


def test_prediction_is_compute_plus_alpha_beta():
    p = _model().predict(RunConfig(4, 64), [_allreduce(4, 4e6)])
    assert p.compute == pytest.approx(0.01 + 1e-3 * 16)
    assert p.comm == pytest.approx(6 * 1e-4 + 1e-8 * 1.5 * 4e6)
    assert p.step_time == pytest.approx(p.compute + p.comm)
    assert p.bytes == pytest.approx(1.5 * 4e6)


def test_more_bytes_never_cheaper_on_the_same_link():
    model = _model()
    for n in (2, 4, 8):
        times = [model.predict(RunConfig(n, 64), [_allreduce(n, m)]).step_time
                 for m in (0, 1e3, 1e5, 1e6, 1e7, 1e8)]
        assert times == sorted(times)
        gathers = [model.predict(RunConfig(n, 64), [_gather(n, m)]).step_time
                   for m in (1e3, 1e5, 1e7)]
        assert gathers == sorted(gathers)


def test_faster_link_never_slower():
    slow, fast = LinkModel.from_bandwidth(1e8), LinkModel.from_bandwidth(1e9)
    wire = [_allreduce(8, 4e6)]
    assert (_model(fast).predict(RunConfig(8, 64), wire).step_time
            <= _model(slow).predict(RunConfig(8, 64), wire).step_time)


def test_overlap_hides_async_collectives_only_up_to_compute():
    model = StepTimeModel({"*": LinkModel(0.0, 1e-8)}, ComputeModel(fixed=0.01), overlap=1.0)
    sync = model.predict(RunConfig(2, 2), [_allreduce(2, 4e6)])
    hidden = model.predict(RunConfig(2, 2), [_allreduce(2, 4e6, is_async=True)])
    assert sync.hidden == 0.0
    assert hidden.hidden == pytest.approx(min(sync.comm, 0.01))
    assert hidden.step_time == pytest.approx(sync.step_time - hidden.hidden)


def test_fit_recovers_compute_and_codec_cost():
    link = LinkModel(alpha=1e-4, beta=1e-8)
    compute = ComputeModel(fixed=0.005, per_global_sample=2e-4)

    def observe(n, b, codec, extra, message):
        wire = [_allreduce(n, message)]
        t = (compute.time(devices=n, batch_size=b) + link.time("all-reduce", n, wire[0].bytes)
             + extra)
        return Observation(RunConfig(n, b, codec=codec), wire, t)

    dense = [(1, 8), (2, 16), (2, 64), (4, 64), (4, 256), (8, 128)]
    obs = [observe(n, b, None, 0.0, 4e6) for n, b in dense]
    obs += [observe(n, 64, "onebit()", 0.002 + 0.001 * n, 2e5) for n in (2, 8)]
    model = StepTimeModel.fit({"all-reduce": link}, obs)
    assert model.codecs[("onebit()", None)].fixed == pytest.approx(0.002, rel=1e-6)
    assert model.codecs[("onebit()", None)].per_device == pytest.approx(0.001, rel=1e-6)
    truth = observe(4, 32, "onebit()", 0.002 + 0.004, 2e5)
    assert model.predict(truth.config, truth.wire).step_time == pytest.approx(truth.step_time,
                                                                             rel=1e-6)


def test_rescale_report_keeps_the_message():
    report = rescale_report([_allreduce(2, 4e6), _gather(2, 1e6)], 8)
    assert [c.group_size for c in report.collectives] == [8, 8]
    assert report.collectives[0].bytes == pytest.approx(2 * 7 / 8 * 4e6)
    assert report.collectives[1].bytes == pytest.approx(7 / 8 * 1e6)


def test_unknown_codec_says_so_in_one_line():
    with pytest.raises(CannotPredict, match=r"cannot predict codec 'topk\(\)'.*measured") as e:
        _model().predict(RunConfig(4, 64, codec="topk()"), [_allreduce(4, 1e3)])
    assert "\n" not in str(e.value)


def test_a_precision_never_measured_says_so_in_one_line():
    # a model given no precisions holds for every one; a fitted one knows those it measured
    assert _model().precision_factor(RunConfig(4, 64, precision="bf16")) == 1.0
    model = dataclasses.replace(_model(), precisions={"float32": 1.0})
    assert model.precision_factor(RunConfig(4, 64)) == 1.0
    with pytest.raises(CannotPredict) as e:
        model.predict(RunConfig(4, 64, precision="bf16"), [_allreduce(4, 1e3)])
    assert str(e.value) == ("cannot predict precision 'bfloat16': no dense step in it was "
                            "measured; run a few steps in it and refit")


def test_one_device_calibration_cannot_predict_communication():
    model = StepTimeModel({}, ComputeModel(fixed=0.01))
    assert model.predict(RunConfig(1, 8), []).step_time == pytest.approx(0.01)
    with pytest.raises(CannotPredict, match="no collective was timed.*calibrated on one device"):
        model.predict(RunConfig(4, 8), [_allreduce(4, 1e3)])


def test_no_recorded_run_cannot_predict_compute():
    model = StepTimeModel.fit({"all-reduce": LinkModel(0, 1e-9)}, [])
    with pytest.raises(CannotPredict, match="no recorded step times"):
        model.predict(RunConfig(2, 8), [_allreduce(2, 1e3)])


def test_bad_inputs_name_the_fix():
    with pytest.raises(ValueError, match="needs >= 2 timings"):
        fit_alpha_beta("all-reduce", [2], [1e3], [1e-3])
    with pytest.raises(ValueError, match="distinct per-replica batch sizes"):
        fit_compute([2, 2], [8, 8], [1, 1], [0.1, 0.1])
    with pytest.raises(ValueError, match="alpha must be a finite number >= 0"):
        LinkModel(alpha=-1.0, beta=0.0)
    with pytest.raises(ValueError, match="positive number of bytes/s"):
        LinkModel.from_bandwidth(0)
    with pytest.raises(ValueError, match="step_time must be a positive number"):
        Observation(RunConfig(2, 8), [], 0.0)


def test_dense_lane_follows_the_links():
    from adaptjax.costs import choose_dense_lane

    same = LinkModel(alpha=1e-5, beta=1e-9)
    model = StepTimeModel({"all-reduce": same, "reduce-scatter": same, "all-gather": same})
    choice, times = choose_dense_lane(model, 4e6, 8)
    # Equal bytes and equal message steps (2(N-1) = (N-1) + (N-1)): a tie, one collective wins.
    assert times["all-reduce"] == pytest.approx(times["reduce-scatter+all-gather"])
    assert choice == "all-reduce"


def test_bucket_size_trades_latency_for_overlap():
    from adaptjax.costs import choose_bucket_bytes
    from adaptjax.costs._schedule import buckets

    assert sum(buckets([3e6, 1e5, 7e6], 1e6)) == pytest.approx(3e6 + 1e5 + 7e6)
    model = StepTimeModel({"all-reduce": LinkModel(alpha=1e-4, beta=1e-9)})
    sizes = (1e5, 1e6, 1e7, 1e8)
    best, times = choose_bucket_bytes(model, [1e6] * 32, 8, candidates=sizes)
    assert best == 1e8  # no overlap: fewest latencies
    assert [times[s] for s in sizes] == sorted((times[s] for s in sizes), reverse=True)
    best, _ = choose_bucket_bytes(model, [1e6] * 32, 8, candidates=sizes, overlap_compute=10.0)
    assert best == 1e5  # everything but the last bucket hides: the smallest last bucket wins


def test_a_link_model_that_claims_a_whole_step_does_not_zero_the_compute_fit():
    # The link model overestimates communication on 4 replicas (1 ms modelled against 0.2 ms
    # real): there the measured step minus modelled communication is negative. Such a row
    # must not pull every compute coefficient to zero (a one-replica step predicted at 0 s).
    compute = ComputeModel(fixed=5e-4, per_sample=1e-5)
    message = 1e5
    link = LinkModel(alpha=0.0, beta=1e-3 / (2 * 3 / 4 * message))  # 1 ms on 4 replicas

    def observe(n, b, real_comm):
        t = compute.time(devices=n, batch_size=b) + real_comm
        return Observation(RunConfig(n, b), [_allreduce(n, message)], t)

    obs = [observe(2, 32, 7e-4), observe(2, 64, 7e-4), observe(4, 32, 2e-4),
           observe(4, 64, 2e-4)]
    model = StepTimeModel.fit({"all-reduce": link}, obs)
    one = model.predict(RunConfig(1, 16), []).step_time
    assert one >= 0.25 * compute.time(devices=1, batch_size=16)
