"""Deployment search (issue 49 item 5): a catalogue whose optimum is worked out by hand.

The catalogue: a model whose gradients are 4000 bytes, 64-sample batches, 3600
steps (so a deployment's hours equal its seconds per step), every step 10 ms
of overhead. Kind ``a`` computes 1 ms per sample at $1 per device-hour, kind
``b`` 0.25 ms per sample at $2; links move 4e6 bytes/s. A data-parallel
all-reduce over n devices sends 2(n−1)/n · 4000 bytes: 1 ms at n = 2,
1.5 ms at 4, 1.75 ms at 8; FSDP over 2 sends 1.5 times as much as an
all-reduce over 2, so every ``fsdp > 1`` mesh is slower than ``data`` alone.
Seconds per step and dollars (= s · n · price):

=====  ==================  ==================
n      a                   b
=====  ==================  ==================
1      0.074    $0.074     0.026    $0.052
2      0.043    $0.086     0.019    $0.076
4      0.0275   $0.110     0.0155   $0.124
8      0.01975  $0.158     0.01375  $0.220
=====  ==================  ==================
"""

import json
import math

import pytest

from adaptjax.cli._main import main
from adaptjax.costs import Catalogue, Deployment, search_deployment


def _catalogue(b_flops=4e12, **b_extra):
    b = {"name": "b", "price_per_hour": 2.0, "devices": [1, 8], "flops": b_flops,
         "bandwidth": 4e6, "step_overhead": 0.01, **b_extra}
    return {"model": {"parameters": 1000, "flops_per_sample": 1e9}, "batch_sizes": [64],
            "kinds": [{"name": "a", "price_per_hour": 1.0, "devices": [1, 8], "flops": 1e12,
                       "bandwidth": 4e6, "step_overhead": 0.01}, b]}


CAT = Catalogue.from_json(_catalogue())


def _is(d: Deployment, kind, devices, data, seconds):
    mesh = {"data": data, "fsdp": devices // data}
    assert (d.kind, d.devices, dict(d.mesh), d.batch_size) == (kind, devices, mesh, 64)
    assert d.step_time == pytest.approx(seconds, rel=1e-9)
    assert d.hours == pytest.approx(seconds * 3600 / 3600, rel=1e-9)
    price = {"a": 1.0, "b": 2.0}[kind]
    assert d.cost == pytest.approx(seconds * devices * price, rel=1e-9)


def test_step_times_are_the_tables():
    for devices, a, b in ((1, 0.074, 0.026), (2, 0.043, 0.019), (4, 0.0275, 0.0155),
                          (8, 0.01975, 0.01375)):
        assert CAT.step_time("a", {"data": devices}, 64) == pytest.approx(a, rel=1e-9)
        assert CAT.step_time("b", {"data": devices}, 64) == pytest.approx(b, rel=1e-9)
    # FSDP over 2: 32 ms + 10 ms, two all-gathers and a reduce-scatter of 2000 bytes each
    assert CAT.step_time("a", {"data": 1, "fsdp": 2}, 64) == pytest.approx(0.0435, rel=1e-9)


@pytest.mark.parametrize("kind, mesh", [("c", {"data": 1}), ("a", {"model": 2})])
def test_step_time_refuses_what_the_catalogue_does_not_offer(kind, mesh):
    with pytest.raises(ValueError, match=f"^catalogue: no deployment '{kind}' on .*: kinds are "
                       "a, b, mesh axes data, fsdp$"):
        CAT.step_time(kind, mesh, 64)


def test_the_model_alone_finds_the_cheapest_deployment_meeting_the_deadline():
    # s <= 0.02: a needs 8 devices ($0.158), b 2 ($0.076)
    _is(search_deployment(CAT, steps=3600, deadline=0.02), "b", 2, 2, 0.019)
    # a samples job is ceil(samples / batch) steps
    _is(search_deployment(CAT, samples=3600 * 64 - 5, deadline=0.02), "b", 2, 2, 0.019)


def test_budget_mode_finds_the_fastest_deployment_within_it():
    # <= $0.13: b on 4 (0.0155 s, $0.124) beats a on 4 (0.0275 s, $0.110)
    _is(search_deployment(CAT, steps=3600, budget=0.13), "b", 4, 4, 0.0155)
    with pytest.raises(ValueError) as e:
        search_deployment(CAT, steps=3600, budget=0.05)
    assert str(e.value) == (
        "no deployment finishes 3600 steps within the budget: the cheapest, 1 x b "
        "(data=1,fsdp=1) batch 64, costs $0.05; raise the budget or offer cheaper devices"
    )


def test_a_deadline_no_deployment_meets_names_the_fastest_in_one_line():
    msg = ("no deployment finishes 3600 steps in 0.01 h: the fastest, 8 x b (data=8,fsdp=1) "
           "batch 64, takes 0.0138 h; extend the deadline or offer faster devices")
    with pytest.raises(ValueError) as e:
        search_deployment(CAT, steps=3600, deadline=0.01)
    assert str(e.value) == msg and "\n" not in msg
    with pytest.raises(ValueError) as e:  # with probes: the fastest it measured
        search_deployment(CAT, steps=3600, deadline=0.01, probe=CAT.step_time, method="random",
                          max_probes=100)
    assert str(e.value) == msg


@pytest.mark.parametrize("method", ["heterbo", "ei", "random"])
def test_probing_finds_the_true_optimum_where_the_model_is_wrong(method):
    # b really computes 0.6 ms per sample: it meets s <= 0.02 only on 8 devices
    # (0.01655 s, $0.265), so the optimum is a on 8 (0.01975 s, $0.158); the model says b on 2.
    truth = Catalogue.from_json(_catalogue(b_flops=1e9 / 0.6e-3))
    found = search_deployment(CAT, steps=3600, deadline=0.02, probe=truth.step_time,
                              method=method, max_probes=20, seed=1)
    _is(found, "a", 8, 8, 0.01975)
    assert found.exploration_cost == pytest.approx(
        math.fsum(20 * p.step_time * p.cost / p.hours for p in found.probes) / 3600)
    if method != "random":  # there are 20 deployments; a Bayesian search probes fewer
        assert len(found.probes) < 20


def test_heterbo_spends_less_probing_than_plain_ei_when_the_model_is_right():
    # the prior is exact: HeterBO's first probe is the optimum; plain EI starts at random
    kw = dict(steps=3600, deadline=0.02, probe=CAT.step_time, max_probes=20, seed=0)
    hetero = search_deployment(CAT, method="heterbo", **kw)
    plain = search_deployment(CAT, method="ei", **kw)
    _is(hetero, "b", 2, 2, 0.019)
    _is(plain, "b", 2, 2, 0.019)
    first = hetero.probes[0]
    assert (first.kind, first.devices, first.mesh["data"]) == ("b", 2, 2)
    assert hetero.exploration_cost < plain.exploration_cost


def test_a_measured_kind_is_fitted_by_the_cost_model():
    # steps measured on kind b's own law (0.01 + 0.25 ms x per-device batch + all-reduce)
    measured = [[1, 32, 0.018], [1, 64, 0.026], [2, 64, 0.019]]
    raw = _catalogue()
    raw["kinds"][1] = {"name": "b", "price_per_hour": 2.0, "devices": [1, 8],
                       "bandwidth": 4e6, "measured": measured}
    cat = Catalogue.from_json(raw)
    for devices in (4, 8):
        assert cat.step_time("b", {"data": devices}, 64) == pytest.approx(
            CAT.step_time("b", {"data": devices}, 64), rel=1e-6)


def test_memory_rules_out_meshes_whose_state_does_not_fit():
    # 1000 parameters x 16 bytes = 16000 bytes of state; 9000 bytes per device needs fsdp >= 2
    raw = _catalogue()
    for kind in raw["kinds"]:
        kind["memory_gb"] = 9000 / 2**30
    found = search_deployment(Catalogue.from_json(raw), steps=3600, deadline=0.02)
    assert found.mesh["fsdp"] >= 2
    for kind in raw["kinds"]:
        kind["memory_gb"] = 1000 / 2**30
    with pytest.raises(ValueError, match="^catalogue: no deployment holds the model's state in "
                       "its devices' memory; offer more devices"):
        search_deployment(Catalogue.from_json(raw), steps=3600, deadline=0.02)


@pytest.mark.parametrize("kw, msg", [
    (dict(deadline=1.0), "give the job's remaining steps= or samples=, not both"),
    (dict(steps=1, samples=1, deadline=1.0), "give the job's remaining steps= or samples="),
    (dict(steps=1), r"give a deadline= \(hours\) or a budget= \(\$\), not both"),
    (dict(steps=1, deadline=1.0, budget=1.0), r"give a deadline= \(hours\) or a budget="),
    (dict(steps=1, deadline=-1.0), "deadline must be a positive number, got -1.0"),
    (dict(steps=1, deadline=1.0, method="bo"), "method must be one of"),
    (dict(steps=1, deadline=1.0, method="ei"), "method='ei' needs a probe"),
])
def test_bad_jobs_are_refused_in_one_line(kw, msg):
    with pytest.raises(ValueError, match="^search_deployment: " + msg):
        search_deployment(CAT, **kw)


@pytest.mark.parametrize("change, msg", [
    (lambda c: c.pop("kinds"), "catalogue: needs 'model' .with 'parameters'.. 'batch_sizes'"),
    (lambda c: c["kinds"][0].pop("bandwidth"), "catalogue kind 'a': needs price_per_hour"),
    (lambda c: c["kinds"][0].pop("flops"), "catalogue kind 'a': give 'measured' steps, or"),
    (lambda c: c["kinds"][0].update(measured=[[1, 64, 0.1], [2, 128, 0.1]]),
     "catalogue kind 'a': 'measured' needs steps at >= 2 per-device batch sizes"),
    (lambda c: c["kinds"][0].update(devices=[0, 4, 8]), "catalogue kind 'a': device counts must "
     "be >= 1, got"),
])
def test_bad_catalogues_are_refused_in_one_line(change, msg):
    raw = _catalogue()
    change(raw)
    with pytest.raises(ValueError, match="^" + msg):
        Catalogue.from_json(raw)


def _plan(capsys, *argv):
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_cli_plans_from_a_catalogue_file(tmp_path, capsys):
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(_catalogue()))
    assert _plan(capsys, "--catalogue", str(path), "--deadline", "0.02",
                 "--remaining-steps", "3600") == [
        "the cheapest deployment finishing 3600 steps in 0.02 h (the cost model's prediction):",
        "  2 x b (data=2,fsdp=1) batch 64: 0.019 s/step, 0.019 h, $0.08",
    ]
    out = _plan(capsys, "--catalogue", str(path), "--budget", "0.13", "--remaining-samples",
                str(3600 * 64))
    assert out[1] == "  4 x b (data=4,fsdp=1) batch 64: 0.0155 s/step, 0.0155 h, $0.12"
    with pytest.raises(SystemExit, match="^adaptjax plan: no deployment finishes 3600 steps in "
                       "0.01 h: the fastest, 8 x b"):
        main(["plan", "--catalogue", str(path), "--deadline", "0.01", "--remaining-steps",
              "3600"])


@pytest.mark.parametrize("argv, msg", [
    (["--catalogue", "p.json", "runs/x", "--deadline", "1"], "--catalogue plans from prices "
     "alone; drop runs/x"),
    (["--deadline", "1", "runs/x"], "--deadline, --budget and --remaining-steps/samples need "
     "--catalogue FILE"),
    ([], "give a RUN_DIR_OR_SCRIPT, or --catalogue FILE"),
    (["--catalogue", "p.json", "--deadline", "1"], "search_deployment: give the job's "
     "remaining steps= or samples="),
])
def test_cli_refuses_a_mixed_plan_in_one_line(tmp_path, monkeypatch, argv, msg):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.json").write_text(json.dumps(_catalogue()))
    with pytest.raises(SystemExit, match="^adaptjax plan: " + msg):
        main(["plan", *argv])
