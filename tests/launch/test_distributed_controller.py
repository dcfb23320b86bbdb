"""The controller across real processes (CPU, gloo, 127.0.0.1) under ``adaptjax launch``.

Each run is ``tests/distributed_job.py`` (a tiny MLP, Adam, global batch 32).
A multi-process run must reach the parameters and optimizer state of one
process with as many devices: the same global batches reach the same replicas,
only the order of the floating-point sums inside the all-reduce differs
(gloo across processes vs. XLA in one), hence ``rtol=1e-6`` with an ``atol``
of a few float32 ulps for entries near zero.
"""

import collections
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from adaptjax.launch._launcher import launch

pytestmark = pytest.mark.slow

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(TESTS, "distributed_job.py")
STEPS = 12
N_SAMPLES = 256  # distributed_job.make_data


def reference(run_dir, devices, *args):
    """The job as one process on ``devices`` simulated devices."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    for key in [k for k in env if k.startswith("ADAPTJAX_")]:
        del env[key]
    subprocess.run(
        [sys.executable, JOB, str(run_dir), *map(str, args)],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return dict(np.load(os.path.join(run_dir, "final.npz")))


def launched(run_dir, n, per_process, *args, **kwargs):
    """The job under the launcher; returns (final arrays, stdout lines, launcher lines)."""
    out, err = io.StringIO(), io.StringIO()
    rc = launch(
        [sys.executable, JOB, str(run_dir), *map(str, args)],
        processes=n,
        devices_per_process=per_process,
        out=out,
        err=err,
        backoff=0.1,
        check_decisions=True,
        **kwargs,
    )
    assert rc == 0, out.getvalue()[-3000:] + err.getvalue()
    final = dict(np.load(os.path.join(run_dir, "final.npz")))
    return final, out.getvalue().splitlines(), err.getvalue().splitlines()


def assert_same_state(got, want, exact=False):
    assert sorted(got) == sorted(want)
    for key in want:
        if exact:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        else:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)


def rows(run_dir, name):
    with open(os.path.join(run_dir, name)) as f:
        return [json.loads(line) for line in f]


def assert_logged_once(run_dir, steps):
    """Every step in metrics.jsonl once; every checkpoint event once (one writer)."""
    assert [r["step"] for r in rows(run_dir, "metrics.jsonl")] == list(range(1, steps + 1))
    ckpts = [e["step"] for e in rows(run_dir, "events.jsonl") if e["kind"] == "checkpoint"]
    assert len(ckpts) == len(set(ckpts)), ckpts


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {}, tmp_path_factory


def get(runs, name, make):
    cache, factory = runs
    if name not in cache:
        cache[f"{name}:dir"] = factory.mktemp(name)
        cache[name] = make(cache[f"{name}:dir"])
    return cache[name]


def all_reduces(run_dir):
    with open(os.path.join(run_dir, "all_reduces.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("codec", [None, "onebit"])
def test_two_processes_match_one(runs, codec):
    extra = ["--codec", codec, "--count-all-reduces"] if codec else ["--count-all-reduces"]
    one = get(runs, f"one-{codec}", lambda d: reference(d, 4, STEPS, *extra))
    run_dir = runs[1].mktemp(f"two-{codec}")
    two, _, _ = launched(run_dir, 2, 2, STEPS, *extra)
    runs[0][f"two-{codec}"] = two
    assert_same_state(two, one)
    assert_logged_once(run_dir, STEPS)
    # Process 0 alone writes logs: no TensorBoard/extra files from process 1, one lock owner.
    assert not os.path.exists(os.path.join(run_dir, "tensorboard"))
    if codec:
        assert any("codec_state" in k for k in two)
    else:
        # Across processes every psum stays its own all-reduce (issued as its gradient is
        # ready); in one process XLA's combiner fuses them into one.
        within, across = all_reduces(runs[0]["one-None:dir"]), all_reduces(run_dir)
        assert within["traced"] == across["traced"] > 1
        assert within["compiled"] == 1
        assert across["compiled"] == across["traced"]


def test_kill9_restarts_and_resumes_to_the_same_params(runs, tmp_path):
    # Uninterrupted: the same two-process run without the kill.
    want = get(runs, "two-None", lambda d: launched(d, 2, 2, STEPS)[0])
    got, out, err = launched(tmp_path, 2, 2, STEPS, "--kill", "1:8", max_restarts=2)
    assert any("process 1 ended (killed by SIGKILL)" in line for line in err)
    assert any(line.startswith("[0] RESUMED 5") for line in out), out
    assert_same_state(got, want, exact=True)
    assert_logged_once(tmp_path, STEPS)
    # Seconds from the death to the first step after the resume (printed for the notes).
    kill = next(float(m[1]) for line in out if (m := re.search(r"KILL (\S+)", line)))
    resumed = out.index(next(line for line in out if "RESUMED" in line))
    first = next(line for line in out[resumed:] if re.search(r"\] STEP 6 ", line))
    print(f"restart after kill -9: {float(first.split()[-1]) - kill:.1f} s to step 6")


def test_rescale_two_four_two_processes_through_the_exit_code(runs, tmp_path):
    args = (18, "--codec", "onebit", "--rescale", "6:8", "12:4")
    want = get(runs, "one-rescale", lambda d: reference(d, 8, *args))
    got, _, err = launched(tmp_path, 2, 2, *args, max_processes=4, max_restarts=0)
    assert any("relaunching with 4 process(es) (was 2)" in line for line in err)
    assert any("relaunching with 2 process(es) (was 4)" in line for line in err)
    # Optimizer and error-feedback state carried through both relaunches.
    assert any("codec_state" in k and np.size(got[k]) > 1 for k in got)
    assert_same_state(got, want)
    assert_logged_once(tmp_path, 18)
    relaunches = [e for e in rows(tmp_path, "events.jsonl") if e["kind"] == "relaunch"]
    assert [(e["step"], e["processes"]) for e in relaunches] == [(7, 4), (13, 2)]
    # Every sample index fed once per epoch: the last attempt's rows of each batch count.
    fed = {}
    for r in rows(tmp_path, "fed.jsonl"):
        fed[(r["cursor"], r["rank"])] = r["idx"]  # later attempts override earlier ones
    stream = []
    for cursor in sorted({c for c, _ in fed}):
        stream += [i for (c, _), idx in sorted(fed.items()) if c == cursor for i in idx]
    assert len(stream) == 18 * 32
    for epoch in range(len(stream) // N_SAMPLES):
        seen = collections.Counter(stream[epoch * N_SAMPLES : (epoch + 1) * N_SAMPLES])
        assert sorted(seen) == list(range(N_SAMPLES)) and set(seen.values()) == {1}


def test_two_processes_on_a_sharded_mesh_match_one_through_rescales(runs, tmp_path):
    """2 processes x 4 devices on a (data 2, fsdp 4) mesh: each process holds one replica
    on every axis and feeds its rows. A rescale to (4, 2) stays on two processes (a
    checkpoint, then each process restores its shards); one to (1, 4) needs one process
    (exit code 76, the launcher relaunches), and the run ends where one process does."""
    args = (16, "--mesh", "data=2,fsdp=4", "--rescale", "5:data=4,fsdp=2", "10:data=1,fsdp=4")
    want = get(runs, "one-sharded", lambda d: reference(d, 8, *args))
    got, _, err = launched(tmp_path, 2, 4, *args, max_processes=2, max_restarts=0)
    assert any("relaunching with 1 process(es) (was 2)" in line for line in err), err
    assert_same_state(got, want)
    assert_logged_once(tmp_path, 16)
    moves = [(e["step"], e["mesh_to"]) for e in rows(tmp_path, "events.jsonl")
             if e["kind"] == "rescale"]
    assert moves == [(6, {"data": 4, "fsdp": 2}), (11, {"data": 1, "fsdp": 4})]
    fed = [r for r in rows(tmp_path, "fed.jsonl") if r["cursor"] == 32]  # step 1's rows
    assert sorted((r["rank"], len(r["idx"])) for r in fed) == [(0, 16), (1, 16)]


def test_a_grain_pipeline_is_read_in_elastic_iterators_shards_across_a_relaunch(runs, tmp_path):
    """2 processes, then 4 after a rescale to 8 devices (a relaunch), fed by a shuffled
    grain MapDataset: the run ends where one process on 8 devices does, and at each step
    process k of K fed grain's shard k of the global batch (positions c + k, c + k + K, ...
    of the stream, as ``grain.experimental.ElasticIterator`` and ``ShardByJaxProcess``)."""
    from _distributed_data import grain_pipeline

    args = (12, "--data", "grain", "--rescale", "6:8")
    want = get(runs, "one-grain", lambda d: reference(d, 8, *args))
    got, _, err = launched(tmp_path, 2, 2, *args, max_processes=4, max_restarts=0)
    assert any("relaunching with 4 process(es) (was 2)" in line for line in err), err
    # Each device's rows are other samples than in one process (process k holds every K-th
    # position), so the noise-scale monitors' per-device readings differ; their mean, the
    # gradient, does not: parameters and Adam's state are those of one process.
    monitors = [k for k in want if "monitor_states" in k or k == "opt['sync'].metrics.values"]
    assert len(monitors) == 3 and sorted(got) == sorted(want)
    assert_same_state({k: v for k, v in got.items() if k not in monitors},
                      {k: v for k, v in want.items() if k not in monitors})
    assert_logged_once(tmp_path, 12)
    fed = {}
    for r in rows(tmp_path, "fed.jsonl"):
        fed[(r["cursor"], r["rank"])] = r["idx"]  # a later attempt's rows override
    stream = grain_pipeline().repeat()
    cursors = sorted({c for c, _ in fed})
    assert cursors == [32 * (s + 1) for s in range(12)]  # the cursor after each step's read
    for c in cursors:
        ranks = sorted(k for cc, k in fed if cc == c)
        n = len(ranks)
        assert ranks == list(range(n)) and n in (2, 4), (c, ranks)
        for k in ranks:
            want_idx = [int(stream[p]["idx"]) for p in range(c - 32 + k, c, n)]
            assert fed[(c, k)] == want_idx, (c, k)
    seen = collections.Counter(i for c in cursors for k in range(4) for i in fed.get((c, k), []))
    assert sum(seen.values()) == 12 * 32 and max(seen.values()) <= 2  # 384 = 1.5 epochs
