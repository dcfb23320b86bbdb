"""benchmarks/network.py's arithmetic and its rows without torch (no root, no torch, no jax run)."""

import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def nw(load_script):
    return load_script("benchmarks/network.py")


def test_smoothed_is_the_trailing_mean_over_at_most_five_steps(nw):
    losses = [5.0, 3.0, 1.0, 1.0, 0.0, 10.0]
    assert nw.smoothed(losses) == [5.0, 4.0, 3.0, 2.5, 2.0, 3.0]


def test_time_to_loss_counts_steps_to_the_first_hit_times_seconds_per_step(nw):
    result = {"losses": [4.0, 2.0, 0.0, 0.0], "s_per_step": 0.5}
    # smoothed: 4, 3, 2, 1.5 -> first <= 2.0 at the third step
    assert nw.time_to_loss(result, 2.0) == pytest.approx(1.5)
    assert math.isnan(nw.time_to_loss(result, 1.0))


def test_a_missing_torch_reads_as_the_extra_to_install(nw):
    row = nw._row("ddp", None, 12)
    assert row.startswith("ddp") and row.strip().endswith("n/a (pip install adaptjax[benchmarks])")


def test_every_variant_of_the_issue_is_in_the_table(nw):
    assert set(nw.VARIANTS) == {"dense", "bf16", "onebit", "powersgd4", "ddp", "ddp_fp16"}
    assert set(nw.VARIANTS) <= set(nw.ALL)
    assert set(nw.JAX_CODECS) | set(nw.JAX_SYNCS) == {v for v in nw.ALL if not v.startswith("ddp")}
    assert set(nw.JAX_SYNCS) == set(nw.SYNC_VARIANTS)


def test_codecs_are_bucketed_by_default_with_their_one_exchange_rows_beside(nw):
    for v in ("bf16", "onebit", "powersgd4"):
        assert nw.JAX_CODECS[v].bucketed and f"{v}_unbucketed" in nw.ALL
        unbucketed = nw.JAX_CODECS[f"{v}_unbucketed"]
        assert not unbucketed.bucketed and unbucketed.codec == nw.JAX_CODECS[v].codec
        # the pair differs in nothing else
        assert unbucketed._replace(bucketed=True) == nw.JAX_CODECS[v]
    assert nw.BUCKET_BYTES == 4 << 20


def test_overlap_recovered_is_the_share_of_the_gap_to_compute(nw):
    # unbucketed 0.30 s, bucketed 0.20 s, compute 0.10 s: half of the 0.2 s gap removed
    assert nw.overlap_recovered(0.30, 0.20, 0.10) == pytest.approx(0.5)
    assert nw.overlap_recovered(0.30, 0.10, 0.10) == pytest.approx(1.0)
    assert nw.overlap_recovered(0.30, 0.30, 0.10) == 0.0
    assert math.isnan(nw.overlap_recovered(0.10, 0.10, 0.10))  # no gap to recover


def _r(t, coll=None):
    return {"s_per_step": t, "s_min": t, "s_mean": t, "losses": [], "wire": None,
            "collectives": coll}


def test_the_last_line_adds_onebit_against_the_compute_only_step(nw):
    results = {"dense": _r(0.3), "ddp": _r(0.3), "bf16": _r(0.2), "ddp_fp16": _r(0.25),
               "onebit": _r(0.092), "compute": _r(0.08)}
    assert nw.ratios_line(results) == (
        "network_dense_vs_ddp=1.000 network_bf16_vs_ddp_fp16=0.800 "
        "network_onebit_vs_ddp=0.307 network_onebit_vs_compute=1.150")
    assert nw.ratios_line({"onebit": _r(0.1)}).endswith("network_onebit_vs_compute=nan")


def test_overlap_lines_name_the_gaps_and_the_bare_collectives(nw):
    results = {"compute": _r(0.08), "onebit": _r(0.10), "onebit_unbucketed": _r(0.14),
               "bare onebit": _r(0.01, coll=5)}
    lines = nw.overlap_lines(results)
    assert lines[0].endswith("80.0 ms")
    assert lines[1] == ("onebit: step - compute 60.0 ms unbucketed, 20.0 ms bucketed; its 5 "
                        "collectives alone 10.0 ms; overlap recovered 67% of the gap")
    assert nw.overlap_lines({"onebit": _r(0.1)}) == []


def test_torch_is_a_benchmarks_extra_only():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    names = lambda reqs: {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in reqs}
    assert "torch" in names(project["optional-dependencies"]["benchmarks"])
    assert "torch" not in names(project["dependencies"])
    assert "torch" not in names(project["optional-dependencies"]["dev"])
