"""costs.Planner: online refits from observed step times, unknowns, cost-aware probing."""

import pytest
from adaptjax.policies import Candidate

from adaptjax import Collective
from adaptjax import policies as ajp
from adaptjax.costs import CannotPredict, ComputeModel, LinkModel, Planner

LINK = LinkModel(alpha=1e-4, beta=1e-8)
COMPUTE = ComputeModel(fixed=0.01, per_sample=1e-3)
CODEC_S = 0.004  # the codec's own seconds per step


def _wire(config):
    n = config.devices
    message = 4e6 if config.codec is None else 2e5
    b = 2 * (n - 1) / n * message
    return [Collective("all-reduce", "f32", (1,), 1, n, b, b, "f32")]


def _truth(c: Candidate) -> float:
    config = Planner.config_of(c)
    wire = _wire(config)[0]
    extra = 0.0 if c.codec is None else CODEC_S
    return (COMPUTE.time(devices=c.devices, batch_size=c.batch_size)
            + LINK.time("all-reduce", c.devices, wire.bytes) + extra)


def _planner(**kwargs):
    return Planner({"all-reduce": LINK}, wire_of=_wire, **kwargs)


def test_planner_refits_online_and_predicts_held_out_configurations():
    planner = _planner()
    for c in (Candidate(2, 16), Candidate(2, 64), Candidate(8, 64), Candidate(4, 128, codec="q"),
              Candidate(8, 128, codec="q")):
        planner.observe(c, _truth(c))
    for c in (Candidate(4, 32), Candidate(6, 96), Candidate(2, 32, codec="q")):
        assert planner.step_time(c) == pytest.approx(_truth(c), rel=1e-6)


def test_bfloat16_steps_fit_a_factor_on_float32_compute_and_leave_float32_alone():
    # bfloat16 computes in 0.6x float32's time; the collectives cost the same
    def truth(c, factor):
        config = Planner.config_of(c)
        comm = LINK.time("all-reduce", c.devices, _wire(config)[0].bytes)
        return factor * COMPUTE.time(devices=c.devices, batch_size=c.batch_size) + comm

    fp32 = (Candidate(2, 16), Candidate(2, 64), Candidate(8, 64))
    alone = _planner()
    for c in fp32:
        alone.observe(c, truth(c, 1.0))
    mixed = _planner()
    for c in fp32:
        mixed.observe(c, truth(c, 1.0))
    assert mixed.step_time(Candidate(4, 32, precision="bfloat16")) is None  # never measured
    # the same configuration in bfloat16 (the controller's context says "float32" for float32)
    mixed.observe(Candidate(2, 64, precision="bfloat16"), truth(Candidate(2, 64), 0.6))
    mixed.observe(Candidate(2, 64, precision="float32"), truth(Candidate(2, 64), 1.0))
    assert len(mixed._times) == 4  # kept apart, not overwritten
    assert mixed.model.precisions == {"float32": 1.0, "bfloat16": pytest.approx(0.6, rel=1e-9)}
    for c in (Candidate(4, 32), Candidate(6, 96)):
        assert mixed.step_time(c) == pytest.approx(alone.step_time(c), rel=1e-12)
        bf16 = c._replace(precision="bfloat16")
        assert mixed.step_time(bf16) == pytest.approx(truth(c, 0.6), rel=1e-6)


def test_a_run_in_bfloat16_from_its_start_fits_compute_in_bfloat16():
    planner = _planner()
    for b in (16, 64):
        c = Candidate(2, b, precision="bfloat16")
        planner.observe(c, _truth(c))
    assert planner.model.precisions == {"bfloat16": 1.0}
    for c in (Candidate(4, 32, precision="bfloat16"), Candidate(8, 128, precision="bfloat16")):
        assert planner.step_time(c) == pytest.approx(_truth(c), rel=1e-6)
    assert planner.step_time(Candidate(4, 32)) is None  # float32 was never measured


def test_a_candidate_keeps_its_sync_strategy():
    import adaptjax

    config = Planner.config_of(Candidate(4, 64, sync=adaptjax.sync.LocalSGD(H=8), precision="bf16"))
    assert (config.sync, config.precision) == ("LocalSGD(H=8)", "bfloat16")
    assert Planner.config_of(Candidate(4, 64, sync=adaptjax.sync.SSGD())).sync is None


def test_planner_says_unknown_for_a_codec_never_measured():
    planner = _planner()
    for c in (Candidate(2, 16), Candidate(2, 64)):
        planner.observe(c, _truth(c))
    assert planner.step_time(Candidate(2, 64, codec="never")) is None
    with pytest.raises(CannotPredict, match="cannot predict codec 'never'"):
        planner.predict(Candidate(2, 64, codec="never"))


def test_explore_probes_an_unknown_codec_only_when_the_horizon_pays_for_it():
    cands = [Candidate(8, 64, codec="never")]
    long_run, short_run = _planner(horizon_steps=100_000), _planner(horizon_steps=1)
    for planner in (long_run, short_run):
        for c in (Candidate(8, 64), Candidate(8, 256)):
            planner.observe(c, _truth(c))
    assert long_run.explore(cands) == cands[0]
    assert short_run.explore(cands) is None
    assert long_run.explore([Candidate(8, 64)]) is None  # measured already


def test_switch_compression_with_the_planner_says_dont_compress():
    planner = _planner()
    # A codec that costs 10x the dense step on its own: compressing never pays.
    for c in (Candidate(2, 16), Candidate(2, 64), Candidate(2, 64, codec="q")):
        planner.observe(c, _truth(c) + (1.0 if c.codec else 0.0))
    policy = ajp.SwitchCompression("q", planner=planner)
    ctx = ajp.Context(step=10, batch_size=64, microbatches=1, devices=2, max_devices=8,
                      hyperparams={}, codec="q")
    assert policy.decide({"step_time": _truth(Candidate(2, 64, codec="q")) + 1.0}, ctx) == [
        ajp.SetCodec(None)
    ]


def test_save_and_load_round_trip(tmp_path):
    planner = _planner()
    for c in (Candidate(2, 16), Candidate(2, 64), Candidate(8, 64)):
        planner.observe(c, _truth(c))
    planner.save(str(tmp_path / "costs.json"))
    loaded = Planner.load(str(tmp_path))
    c = Candidate(4, 32)  # never compiled: collectives rescaled from the 8-device step
    assert loaded.step_time(c) == pytest.approx(_truth(c), rel=1e-6)
    with pytest.raises(ValueError, match="no costs.json"):
        Planner.load(str(tmp_path / "missing"))


def test_save_and_load_keep_the_per_operand_latency(tmp_path):
    link = LinkModel(alpha=1e-4, beta=1e-8, alpha_operand=3e-4)

    def wire(config):  # a tuple all-reduce of 5 operands, as XLA's combiner makes
        n = config.devices
        b = 2 * (n - 1) / n * 4e6
        return [Collective("all-reduce", "f32", ((1,),) * 5, 5, n, b, b, "f32", num_operands=5)]

    def truth(c):
        return (COMPUTE.time(devices=c.devices, batch_size=c.batch_size)
                + link.time("all-reduce", c.devices, wire(c)[0].bytes, operands=5))

    planner = Planner({"all-reduce": link}, wire_of=wire)
    for c in (Candidate(2, 16), Candidate(2, 64), Candidate(8, 64)):
        planner.observe(c, truth(c))
    planner.save(str(tmp_path / "costs.json"))
    loaded = Planner.load(str(tmp_path))
    assert loaded.links["all-reduce"] == link
    c = Candidate(4, 32)
    assert loaded.step_time(c) == pytest.approx(truth(c), rel=1e-6)


def test_calibrate_times_only_the_kinds_asked_for():
    planner = Planner()
    links = planner.calibrate(2, kinds=("all-gather",))
    assert list(links) == ["all-gather"] and planner.model.links == links
    assert Planner().calibrate(1) == {}  # one device: nothing to time
