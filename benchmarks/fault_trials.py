"""Fault trials: random ``kill -9``s and Ctrl-Cs aimed at saves, each followed by a resume.

The job is the fault tests' own (``tests/controller_job.py``), stretched: 8
simulated CPU devices, a policy-driven elastic run of 90 steps (batch 64 -> 32
at step 20, 8 -> 4 devices at 40, batch 96 at 60, 4 -> 8 devices at 80, the
learning rate halved at every third decision), a checkpoint every 20 steps.
One uninterrupted run is the reference. Then, each in a fresh run directory:

* ``--kills`` trials (default 10) of ``kill -9`` from outside: at a random step
  (the job holds there until signalled, ``tests/_handshake.py``), or at a
  random moment (0-0.3 s) after a rescale was decided, inside the transition
  (the job holds at the third step after it at the latest, so the kill can
  never miss it);
* ``--sigints`` trials (default 5) of Ctrl-C aimed at a save: the job holds
  inside Orbax's save of a random periodic checkpoint, once its writes were
  launched (``--hold-in-save``), and gets ``SIGINT`` there.

After each fault the job is started again and resumes to the end. A trial is
*bit-exact* when its final parameters equal the reference's bit for bit and
``metrics.jsonl`` holds every step once, in order. Counted too: Orbax
temporary directories left in ``checkpoints/`` after the interrupted run had
exited or closed (a ``kill -9`` may leave one, which no restore reads and the
next run's close removes; a Ctrl-C must leave none) and after the resumed run
(must be none), Ctrl-Cs whose save was finished, and runs that printed thread
tracebacks. The outcome does not depend on the machine's load, only the time.

Usage:
  python benchmarks/fault_trials.py [--kills 10] [--sigints 5] [--seed 37] [--quick]

Prints one line per trial and ends with
``kill9_bit_exact=A/10 sigint_bit_exact=B/5 sigint_saves_finished=C/5
temporary_dirs_left_after_sigint=D temporary_dirs_left_after_resume=E
thread_noise_runs=F`` (targets: all bit-exact, all finished, 0, 0, 0).
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
from _handshake import Gate  # noqa: E402

STEPS = 90
STRETCH = ["--checkpoint-every", "20", "--schedule-scale", "2"]
PERIODIC = [20, 40, 60, 80]  # the checkpoints a Ctrl-C is aimed at
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


def bit_exact(run_dir: str, reference: dict) -> bool:
    got = final_params(run_dir)
    same = got.keys() == reference.keys() and all(
        np.array_equal(got[k], reference[k]) for k in reference
    )
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f if line.strip()]
    return same and steps == list(range(1, STEPS + 1))


def resume_to_the_end(run_dir: str, reference: dict) -> tuple[bool, int, bool]:
    """``(bit_exact, temporary dirs left, thread noise)`` of a resume run to the end."""
    job = Job(run_dir)
    code = job.finish()
    if code != 0:
        print(job.output()[-3000:], file=sys.stderr)
        return False, len(temporary_dirs(run_dir)), True
    noise = any(n in job.output() for n in NOISE)
    return bit_exact(run_dir, reference), len(temporary_dirs(run_dir)), noise


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
    return {"kind": "kill -9", "where": where, "code": code, "run_dir": run_dir,
            "left": len(temporary_dirs(run_dir)), "finished_save": None}


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
    return {"kind": "SIGINT", "where": where, "code": code, "run_dir": run_dir,
            "left": len(temporary_dirs(run_dir)), "finished_save": finished, "noise": noise,
            "released": gate.released()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--sigints", type=int, default=5)
    parser.add_argument("--seed", type=int, default=37)
    parser.add_argument("--quick", action="store_true", help="2 kills and 1 Ctrl-C")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args()
    if args.quick:
        args.kills, args.sigints = 2, 1
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="adaptjax-fault-trials-")
    try:
        ref_dir = os.path.join(work, "reference")
        job = Job(ref_dir)
        if job.finish() != 0:
            raise SystemExit(f"the reference run failed:\n{job.output()[-3000:]}")
        reference = final_params(ref_dir)
        trials = [kill_trial(work, n, rng) for n in range(args.kills)]
        trials += [sigint_trial(work, n, rng) for n in range(args.sigints)]
        noise_runs = sum(bool(t.get("noise")) for t in trials)
        left_after_resume = 0
        for t in trials:
            exact, left, noise = resume_to_the_end(t["run_dir"], reference)
            t["bit_exact"], noise_runs = exact, noise_runs + noise
            left_after_resume += left
            extra = "" if t["kind"] == "kill -9" else (
                f", save finished={t['finished_save']}, released by {t['released']}")
            print(f"{t['kind']:8s} at {t['where']}: exit {t['code']}, temporary dirs left "
                  f"{t['left']}{extra}; resumed bit-exact={exact}", flush=True)
        kills = [t for t in trials if t["kind"] == "kill -9"]
        sigints = [t for t in trials if t["kind"] == "SIGINT"]
        print(
            f"kill9_bit_exact={sum(t['bit_exact'] for t in kills)}/{len(kills)} "
            f"sigint_bit_exact={sum(t['bit_exact'] for t in sigints)}/{len(sigints)} "
            f"sigint_saves_finished={sum(bool(t['finished_save']) for t in sigints)}/"
            f"{len(sigints)} "
            f"temporary_dirs_left_after_sigint={sum(t['left'] for t in sigints)} "
            f"temporary_dirs_left_after_resume={left_after_resume} "
            f"thread_noise_runs={noise_runs}"
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
