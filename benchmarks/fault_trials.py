"""Fault trials: random ``kill -9``s, Ctrl-Cs aimed at saves, and ``adaptjax launch`` faults.

The job is the fault tests' own (``tests/controller_job.py``), stretched: 8
simulated CPU devices, a policy-driven elastic run of 90 steps (batch 64 -> 32
at step 20, 8 -> 4 devices at 40, batch 96 at 60, 4 -> 8 devices at 80, the
learning rate halved at every third decision), a checkpoint every 20 steps.
It runs in three kinds, each with its own uninterrupted reference run:
``array`` (an ``ArrayDataset``), ``sharded`` (``--sharded``: a (data 2, fsdp 4)
mesh whose rescales at 40 and 80 are 2-D, to (1, 4) and to (4, 2)) and
``grain`` (``--data grain``: the records through ``adaptjax.GrainDataset``
over a shuffled ``grain.MapDataset``). Then, each in a fresh run directory:

* ``--kills`` trials (default 10) of ``kill -9`` of the ``array`` job from
  outside: at a random step (the job holds there until signalled,
  ``tests/_handshake.py``), or at a random moment (0-0.3 s) after a rescale
  was decided, inside the transition (the job holds at the third step after it
  at the latest, so the kill can never miss it);
* ``--sigints`` trials (default 5) of Ctrl-C aimed at a save: the job holds
  inside Orbax's save of a random periodic checkpoint, once its writes were
  launched (``--hold-in-save``), and gets ``SIGINT`` there;
* ``--sharded-kills`` trials (default 4) of ``kill -9`` of the ``sharded`` job:
  inside a 2-D rescale (steps 41 or 81), held after its checkpoint's commit and
  before the restore onto the new mesh (``--hold restore=S``, always so in the
  first trial) or inside that checkpoint's write (``--hold-in-save``), or at a
  random step;
* ``--grain-kills`` trials (default 4) of ``kill -9`` of the ``grain`` job:
  inside the write of a rescale's checkpoint (always so in the first trial), or
  at a random step.

After each fault the job is started again and resumes to the end. A trial is
*bit-exact* when its final parameters equal its kind's reference bit for bit,
``metrics.jsonl`` holds every step once, in order, and the run fed the
reference's elements in the reference's order (``tests/_fed.py``: a batch fed
again after a resume is the one fed before the kill). A kill has *landed* when
the job died of it (exit -9). Counted too: Orbax temporary directories left in
``checkpoints/`` after the interrupted run had exited or closed (a ``kill -9``
may leave one, which no restore reads and the next run's close removes; a
Ctrl-C must leave none) and after the resumed run (must be none), Ctrl-Cs whose
save was finished, and runs that printed thread tracebacks.

Then the launcher (``benchmarks/_launch_faults.py``, ``tests/distributed_job.py``
under the ``adaptjax`` command): ``--locked`` trials (default 2) of a second
``adaptjax launch`` on a run directory a held first launch locks (refused:
exit 73 after one start, never restarted; the first then finishes alone), and
``--hangs`` trials (default 2) of a worker stopped by ``SIGSTOP`` at a held
step, timed from the signal to the launcher's report with ``--hang-timeout``
10 s (``--hang-timeout`` here; the launcher's default is 60 s): with a
heartbeat every ``min(5, T / 4)`` s, between 7.5 and about 10.1 s.
``hang_reported_s`` is the longest of them. The counts do not depend on the
machine's load, only the time (and ``hang_reported_s`` a little).

Usage:
  python benchmarks/fault_trials.py [--kills 10] [--sigints 5] [--sharded-kills 4]
      [--grain-kills 4] [--locked 2] [--hangs 2] [--hang-timeout 10] [--seed 37] [--quick]

``--quick``: 2 kills of the ``array`` job and one trial of every other kind.
Prints one line per trial, then the other counts (``kill9_array=.. kill9_sharded=..
kill9_grain=.. kill9_landed=.. sigint_bit_exact=.. sigint_saves_finished=..
temporary_dirs_left_after_sigint=0 temporary_dirs_left_after_resume=0
thread_noise_runs=0 launcher_first_job_unharmed=..``) and last
``kill9_bit_exact=<n>/<m> launcher_locked_refused=<n>/<m> hang_reported_s=<x>``
(``m``: the kills that landed, all of them; targets: all bit-exact, all refused).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "controller_job.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))
import _fed  # noqa: E402
from _handshake import Gate  # noqa: E402
from _launch_faults import hang_trial, locked_trial  # noqa: E402

STEPS = 90
STRETCH = ["--checkpoint-every", "20", "--schedule-scale", "2"]
PERIODIC = [20, 40, 60, 80]  # the checkpoints a Ctrl-C is aimed at
RESCALE_CHECKPOINTS = [41, 81]  # where the rescales decided on steps 40 and 80 land
#: The job's arguments for each kind of run.
KINDS = {"array": (), "sharded": ("--sharded",), "grain": ("--data", "grain")}
NOISE = ("Exception in thread", "Event loop is closed", "ERROR:absl")
WATCHDOG_S = 600


class Job:
    """``tests/controller_job.py`` as a subprocess; its output is read by a thread."""

    def __init__(self, run_dir: str, gate: Gate | None = None, *extra: str):
        held = ["--gate", gate.directory] if gate is not None else []
        self.proc = subprocess.Popen(
            [sys.executable, "-u", JOB, run_dir, str(STEPS), *STRETCH, *held, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: list[str] = []
        self.rescaled = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._watchdog = threading.Timer(WATCHDOG_S, self.proc.kill)
        self._watchdog.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("RESCALE"):
                self.rescaled.set()

    def finish(self) -> int:
        code = self.proc.wait()
        self._reader.join()
        self._watchdog.cancel()
        return code

    def output(self) -> str:
        return "".join(self.lines)


def temporary_dirs(run_dir: str) -> list[str]:
    ckpts = os.path.join(run_dir, "checkpoints")
    return [n for n in os.listdir(ckpts) if "tmp" in n] if os.path.isdir(ckpts) else []


def final_params(run_dir: str) -> dict:
    with np.load(os.path.join(run_dir, "final_params.npz")) as f:
        return {k: f[k] for k in f.files}


def reference_run(work: str, kind: str) -> dict:
    """The uninterrupted run of ``kind``: its final parameters and the elements it fed."""
    run_dir = os.path.join(work, f"reference-{kind}")
    job = Job(run_dir, None, *KINDS[kind])
    if job.finish() != 0:
        raise SystemExit(f"the {kind} reference run failed:\n{job.output()[-3000:]}")
    return {"params": final_params(run_dir), "fed": _fed.stream(run_dir)[0]}


def bit_exact(run_dir: str, reference: dict) -> bool:
    """Final parameters bit-equal to the reference's, every step in ``metrics.jsonl`` once in
    order, and the reference's elements fed in its order (``tests/_fed.py``: a batch fed
    again after a resume must be the one fed before the kill)."""
    got, want = final_params(run_dir), reference["params"]
    same = got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f if line.strip()]
    fed, agreed = _fed.stream(run_dir)
    return same and steps == list(range(1, STEPS + 1)) and agreed and fed == reference["fed"]


def resume_to_the_end(trial: dict, reference: dict) -> tuple[bool, int, bool]:
    """``(bit_exact, temporary dirs left, thread noise)`` of a resume run to the end."""
    run_dir = trial["run_dir"]
    job = Job(run_dir, None, *KINDS[trial["data"]])
    code = job.finish()
    if code != 0:
        print(job.output()[-3000:], file=sys.stderr)
        return False, len(temporary_dirs(run_dir)), True
    noise = any(n in job.output() for n in NOISE)
    return bit_exact(run_dir, reference), len(temporary_dirs(run_dir)), noise


def killed(work: str, name: str, data: str, hold: list[str]) -> dict:
    """Starts the ``data`` job with ``hold`` (a ``--hold...`` option), waits until it holds
    there and ``kill -9``s it."""
    run_dir = os.path.join(work, name)
    gate = Gate(os.path.join(work, f"gate-{name}"))
    job = Job(run_dir, gate, *KINDS[data], *hold)
    where, _ = gate.wait_at(alive=lambda: job.proc.poll() is None)
    job.proc.send_signal(signal.SIGKILL)
    gate.go()
    code = job.finish()
    return {"kind": "kill -9", "data": data, "where": where, "code": code, "run_dir": run_dir,
            "left": len(temporary_dirs(run_dir)), "finished_save": None}


def sharded_kill_trial(work: str, n: int, rng: random.Random) -> dict:
    """One ``kill -9`` of the sharded job: inside a 2-D rescale, between its checkpoint's
    commit and the restore onto the new mesh (``restore``) or in that checkpoint's write
    (``save``), or at a random step. The first trial is always inside a rescale."""
    moment = rng.choice(["restore", "save", "step"])
    at = rng.choice(RESCALE_CHECKPOINTS)
    moment = "restore" if n == 0 else moment
    hold = {"restore": ["--hold", f"restore={at}"], "save": ["--hold-in-save", str(at)],
            "step": ["--hold", f"step={rng.randint(1, STEPS - 1)}"]}[moment]
    return killed(work, f"kill-sharded-{n}", "sharded", hold)


def grain_kill_trial(work: str, n: int, rng: random.Random) -> dict:
    """One ``kill -9`` of the grain-fed job: in the write of a rescale's checkpoint, or at a
    random step. The first trial is always inside a rescale."""
    moment = "save" if n == 0 else rng.choice(["save", "step"])
    at = rng.choice(RESCALE_CHECKPOINTS) if moment == "save" else rng.randint(1, STEPS - 1)
    hold = ["--hold-in-save", str(at)] if moment == "save" else ["--hold", f"step={at}"]
    return killed(work, f"kill-grain-{n}", "grain", hold)


def kill_trial(work: str, n: int, rng: random.Random) -> dict:
    """One ``kill -9``: at a held step, or at a random moment inside a transition."""
    run_dir = os.path.join(work, f"kill-{n}")
    gate = Gate(os.path.join(work, f"gate-kill-{n}"))
    if rng.random() < 0.6:
        step = rng.randint(1, STEPS - 1)
        job = Job(run_dir, gate, "--hold", f"step={step}")
        where, _ = gate.wait_at(alive=lambda: job.proc.poll() is None)
    else:
        rescale_at = rng.choice([40, 80])  # decided on the metrics of that step
        delay = rng.uniform(0.0, 0.3)
        job = Job(run_dir, gate, "--hold", f"step={rescale_at + 3}")
        # the RESCALE line comes before the hold: wait for one of them
        while not job.rescaled.is_set() and not gate.held() and job.proc.poll() is None:
            job.rescaled.wait(0.01)
        if rescale_at == 80:  # the second rescale: skip the first one's line
            job.rescaled.clear()
            while not job.rescaled.is_set() and not gate.held() and job.proc.poll() is None:
                job.rescaled.wait(0.01)
        time.sleep(delay)  # picks the moment; the hold is what makes it safe
        where = f"{delay:.2f} s after the rescale decided on step {rescale_at}"
    job.proc.send_signal(signal.SIGKILL)
    gate.go()
    code = job.finish()
    return {"kind": "kill -9", "data": "array", "where": where, "code": code,
            "run_dir": run_dir, "left": len(temporary_dirs(run_dir)), "finished_save": None}


def sigint_trial(work: str, n: int, rng: random.Random) -> dict:
    """One Ctrl-C, inside Orbax's save of a random periodic checkpoint."""
    run_dir = os.path.join(work, f"sigint-{n}")
    gate = Gate(os.path.join(work, f"gate-sigint-{n}"))
    step = rng.choice(PERIODIC)
    job = Job(run_dir, gate, "--hold-in-save", str(step))
    where, _ = gate.wait_at(alive=lambda: job.proc.poll() is None)
    job.proc.send_signal(signal.SIGINT)
    gate.go()
    code = job.finish()
    ckpts = os.path.join(run_dir, "checkpoints")
    finished = os.path.isdir(os.path.join(ckpts, str(step)))
    noise = any(n in job.output() for n in NOISE)
    return {"kind": "SIGINT", "data": "array", "where": where, "code": code, "run_dir": run_dir,
            "left": len(temporary_dirs(run_dir)), "finished_save": finished, "noise": noise,
            "released": gate.released()}


def controller_trials(args, work: str, rng: random.Random) -> list[dict]:
    """Every kill and Ctrl-C trial, then each one's resume to the end (printed as it ends)."""
    trials = [kill_trial(work, n, rng) for n in range(args.kills)]
    trials += [sigint_trial(work, n, rng) for n in range(args.sigints)]
    trials += [sharded_kill_trial(work, n, rng) for n in range(args.sharded_kills)]
    trials += [grain_kill_trial(work, n, rng) for n in range(args.grain_kills)]
    references = {kind: reference_run(work, kind) for kind in KINDS
                  if any(t["data"] == kind for t in trials)}
    for t in trials:
        t["bit_exact"], t["left_after_resume"], t["resume_noise"] = resume_to_the_end(
            t, references[t["data"]])
        extra = "" if t["kind"] == "kill -9" else (
            f", save finished={t['finished_save']}, released by {t['released']}")
        print(f"{t['kind']:8s} {t['data']:7s} at {t['where']}: exit {t['code']}, temporary "
              f"dirs left {t['left']}{extra}; resumed bit-exact={t['bit_exact']}", flush=True)
    return trials


def launcher_trials(args, work: str) -> tuple[list[dict], list[dict]]:
    """The locked and the hang trials of ``adaptjax launch`` (``_launch_faults.py``)."""
    locked = []
    for n in range(args.locked):
        t = locked_trial(work, n)
        locked.append(t)
        print(f"second launch on a held run directory: exit {t['code']}, refused without a "
              f"restart={t['refused']}; the first finished alone={t['unharmed']}", flush=True)
        if not t["refused"]:
            print(t["said"], file=sys.stderr)
    hangs = []
    for n in range(args.hangs):
        t = hang_trial(work, n, args.hang_timeout)
        hangs.append(t)
        after = "never" if t["reported_s"] is None else f"{t['reported_s']:.2f} s"
        print(f"SIGSTOP of a worker, --hang-timeout {args.hang_timeout:g}: reported after "
              f"{after}, launcher exit {t['code']}", flush=True)
    return locked, hangs


def summary(trials: list[dict], locked: list[dict], hangs: list[dict]) -> list[str]:
    """The two last lines: the other counts, then the issue's line."""
    kills = [t for t in trials if t["kind"] == "kill -9"]
    landed = [t for t in kills if t["code"] == -signal.SIGKILL]
    sigints = [t for t in trials if t["kind"] == "SIGINT"]
    noise = sum(bool(t.get("noise")) + t["resume_noise"] for t in trials)
    by_kind = " ".join(
        f"kill9_{kind}={sum(t['bit_exact'] for t in landed if t['data'] == kind)}/"
        f"{sum(t['data'] == kind for t in landed)}" for kind in KINDS)
    reported = [t["reported_s"] for t in hangs]
    hang = ("none" if not hangs else "never" if None in reported else f"{max(reported):.2f}")
    return [
        f"{by_kind} kill9_landed={len(landed)}/{len(kills)} "
        f"sigint_bit_exact={sum(t['bit_exact'] for t in sigints)}/{len(sigints)} "
        f"sigint_saves_finished={sum(bool(t['finished_save']) for t in sigints)}/{len(sigints)} "
        f"temporary_dirs_left_after_sigint={sum(t['left'] for t in sigints)} "
        f"temporary_dirs_left_after_resume={sum(t['left_after_resume'] for t in trials)} "
        f"thread_noise_runs={noise} "
        f"launcher_first_job_unharmed={sum(t['unharmed'] for t in locked)}/{len(locked)}",
        f"kill9_bit_exact={sum(t['bit_exact'] for t in landed)}/{len(landed)} "
        f"launcher_locked_refused={sum(t['refused'] for t in locked)}/{len(locked)} "
        f"hang_reported_s={hang}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--sigints", type=int, default=5)
    parser.add_argument("--sharded-kills", type=int, default=4)
    parser.add_argument("--grain-kills", type=int, default=4)
    parser.add_argument("--locked", type=int, default=2, help="second-launch trials")
    parser.add_argument("--hangs", type=int, default=2, help="SIGSTOP trials")
    parser.add_argument("--hang-timeout", type=float, default=10.0, help="the launcher's, s")
    parser.add_argument("--seed", type=int, default=37)
    parser.add_argument("--quick", action="store_true", help="one trial of each kind, 2 kills")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args()
    if args.quick:
        args.kills, args.sigints, args.sharded_kills, args.grain_kills = 2, 1, 1, 1
        args.locked, args.hangs = 1, 1
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="adaptjax-fault-trials-")
    try:
        trials = controller_trials(args, work, rng)
        locked, hangs = launcher_trials(args, work)
        for line in summary(trials, locked, hangs):
            print(line, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
