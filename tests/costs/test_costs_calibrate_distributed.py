"""Link calibration across real processes (CPU, gloo, 127.0.0.1) under ``adaptjax launch``."""

import io
import json
import sys

import pytest

from adaptjax.launch._launcher import launch

pytestmark = pytest.mark.slow

SCRIPT = """
import json, adaptjax
adaptjax.initialize_distributed()
import jax
from adaptjax.costs._calibrate import calibrate_links, time_collectives
rows = time_collectives(4, kinds=("all-reduce", "all-gather"), sizes=(4096, 65536), repeats=3)
links = calibrate_links(4, kinds=("all-reduce",), sizes=(4096, 65536), repeats=3)
print("RESULT " + json.dumps({"rank": jax.process_index(), "rows": rows,
                              "beta": links["all-reduce"].beta}))
"""


def test_links_calibrate_across_four_processes(tmp_path):
    script = tmp_path / "calibrate.py"
    script.write_text(SCRIPT)
    out, err = io.StringIO(), io.StringIO()
    rc = launch([sys.executable, str(script)], processes=4, devices_per_process=1,
                out=out, err=err, backoff=0.1, max_restarts=0)
    assert rc == 0, out.getvalue()[-3000:] + err.getvalue()
    results = [json.loads(line.split("RESULT ", 1)[1])
               for line in out.getvalue().splitlines() if "RESULT " in line]
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    for r in results:
        # Only the group of all four processes is timed (a group of two would leave
        # two processes out of the program): every kind at both sizes, the bytes of
        # the ring formula for s bytes per device, N = 4: all-reduce 2(N-1)/N * s,
        # all-gather (N-1)/N * N*s.
        assert [(k, n) for k, n, _, _ in r["rows"]] == [
            ("all-reduce", 4), ("all-gather", 4)] * 2
        sent = sorted(b for _, _, b, _ in r["rows"])
        assert sent == sorted([1.5 * 4096, 3.0 * 4096, 1.5 * 65536, 3.0 * 65536])
        assert all(s >= 0.0 for *_, s in r["rows"])
        assert r["beta"] >= 0.0
