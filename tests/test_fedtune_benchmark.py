"""benchmarks/fedtune.py runs, and its proxy search spends what its arguments say.

A smoke run on digits (two rounds, one heterogeneity level, three probes):
the last line's proxy steps are levels x probes x rounds x H exactly, and
with one level the fitted mapping is constant, so every replica's final rate
is the rate the search chose, one of the probed rates.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture
def fedtune():
    sys.path.insert(0, BENCH)
    try:
        import fedtune

        yield fedtune
    finally:
        sys.path.remove(BENCH)


@pytest.mark.slow
def test_a_smoke_run_prints_its_figures(fedtune, capsys):
    args = ["--seeds", "0", "--rounds", "2", "--probes", "3", "--levels", "1.0",
            "--grid", "0.1", "1.0"]
    assert fedtune.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    last = re.fullmatch(r"fedtune_gain=local:(\S+),DiLoCo:(\S+) fedtune_proxy_steps=(\d+)", out[-1])
    assert last is not None, out[-1]
    assert int(last.group(3)) == 1 * 3 * 2 * 8  # levels x probes x rounds x H
    for line in (line for line in out if " seed 0 proxy " in line):
        chosen = re.search(r"->(\S+?);", line).group(1)
        rates = re.search(r"replica rates (.*?);", line).group(1).split(", ")
        assert rates == [chosen] * 8
        # the three probes: both ends of the range and the middle of its 256-point log grid
        assert chosen in {f"{p:.3g}" for p in (0.1, 0.1 * 10 ** (128 / 255), 1.0)}
