"""benchmarks/network.py's arithmetic and its rows without torch (no root, no torch, no jax run)."""

import importlib.util
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def nw():
    spec = importlib.util.spec_from_file_location(
        "network_benchmark", os.path.join(ROOT, "benchmarks", "network.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def test_torch_is_a_benchmarks_extra_only():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    names = lambda reqs: {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in reqs}
    assert "torch" in names(project["optional-dependencies"]["benchmarks"])
    assert "torch" not in names(project["dependencies"])
    assert "torch" not in names(project["optional-dependencies"]["dev"])
