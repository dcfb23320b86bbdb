"""Adaptive batch size against fixed batches on the byte-level LM, at an equal token budget.

The claim under test (Merrill et al. 2025; McCandlish et al. 2018): warming the
batch up as the gradient noise scale grows reaches the loss of the best fixed
batch in far fewer optimizer steps, on the same number of tokens. Fewer steps
of a larger batch are time on hardware whose step time is nearly flat in the
batch (an accelerator), and must cost nothing where it is linear (a CPU).

Workload: ``examples/lm.py``'s byte-level transformer (``--layers``, ``--width``,
``--context``; no dropout) on this Python's standard-library ``.py`` sources,
Adam, ``--devices`` simulated CPU devices, the adaptjax controller with its
default monitors. For each of ``--seeds`` seeds (model init and data order):

* ``fixed-<b>`` for each of ``--sizes`` (default 8 16 32 64 128): batch ``b``
  all along, learning rate ``--lr`` x sqrt(b / smallest) (the square-root rule
  for Adam);
* ``adaptive``: starts at the smallest size with ``--lr``;
  ``BatchSizeWarmup(max_batch_size=largest)`` with its defaults (or the
  ``--variants`` given: ``warmup-<rule>[-<fraction>]`` with learning-rate rule
  none/sqrt/linear/adascale, ``goodput-<rule>`` for ``AdaptiveBatchSize``, e.g.
  ``--variants warmup warmup-sqrt warmup-none-1 goodput-sqrt`` to compare);

every run for ``--tokens`` tokens (rounded up to whole steps). Per run: the
final validation loss (``--val-windows`` windows, and the curve at tenths of
the budget), optimizer steps, tokens, wall time on this machine (training only:
evaluations and probes excluded, compiles included), the compiles' share of
it, the time its steps would take on the step-time profile T(M) of this
machine and of an accelerator, the batch sizes it used, and the noise scale it
measured along the way.

**The critical batch, measured.** Each adaptive run is probed at a quarter,
half and three quarters of its budget (``Probe(--probe-sizes, steps=
--probe-steps, lr_rule=--probe-lr-rule, lr_multipliers=--probe-lr-multipliers)``,
see :class:`adaptjax.policies.Probe`):
the controller branches from the live state, trains each size on the same
samples and fits the critical batch, leaving the run itself bit-exact. Its
critical batch is printed beside the noise scale measured at the same step,
with the probes' share of the run's time (``--probe-steps 0``: no probes).
The steps and the rate factors default to
:class:`adaptjax.policies.CriticalBatchProbe`'s (16 steps; with
``--probe-lr-rule sqrt``, that policy's rule, ``--quick`` read 188, 252 and
301, against 196, 264 and 323 with ``"adascale"``). 16 steps and
``"adascale"`` (which for Adam also gives each
branch its batch's second moment) are the shortest that made every branch's
drop positive on this LM, from batch-16 and batch-32 states, on any of
several sample offsets (issue 35). With 4 steps and ``"sqrt"`` branches at
batches other than the run's lost loss: a batch-8 branch at a ν fitted to
batch M takes too large steps, a batch-128 one at sqrt(B/M) x lr with the
run's momentum overshoots. At 8 steps the run's own continuation from a
batch-32 state moved the loss by -0.002 to +0.026 depending on the samples,
the size of the drops themselves. Evaluation noise was not the cause (1,024
and 8,192 evaluation samples gave drops within 0.004). The drops need not
follow ΔL(B) = ΔL_max / (1 + B_crit / B): at equal tokens that model makes
them fall with B, and on this LM, at the rule's rate alone, they rose to
32-64 (from batch 16) or to 128 (from batch 32) on every offset, which the fit
reads as a large or infinite critical batch. The reason is the rate: swept by
factors 1/16-4 from a batch-32 state (600 steps in), every batch's best loss
came at 1/4 of the rule's rate, with drops of 0.105 / 0.104 / 0.078 at batch
8 / 32 / 128 against 0.013 / 0.038 / 0.047 at the rule's rate, and those fit
B_crit = 332. Hence the default sweep, ``--probe-lr-multipliers 0.125 0.25
0.5 1``, four branches per batch: each batch is compared at its best rate.
That best rate is the best one for the next few thousand samples, well below
the run's: a short branch gains most from lowering the rate (the noise of the
run's iterates settles), so the probe measures the critical batch of that
short horizon.

**Profiles.** ``--measure-profile`` times the controller's step at each size
on this machine (the accelerator, where there is one: ``devices`` = the
accelerators, up to ``--devices``) and writes ``benchmarks/profiles/
lm-<platform>-<device>-<date>.json`` with the command, device, date, model and
the (M, seconds) points, then exits. A run prices steps with the newest
stored non-CPU profile of the same model (``--gpu-profile`` names one; ``nan``
without) and with this machine's own T(M), measured at its start the same way.

Usage:
  python benchmarks/adaptive_batch.py              # the full benchmark (<= 45 min, 2 idle cores)
  python benchmarks/adaptive_batch.py --quick      # a short look (one seed, 3 sizes, few tokens)
  python benchmarks/adaptive_batch.py --measure-profile   # on a GPU: store its T(M)

The last line is ``adaptive_loss_gap=<x> adaptive_steps_ratio=<y>
adaptive_cpu_time_ratio=<z> adaptive_gpu_time_ratio=<w> cbs_probe_vs_noise_scale=<v>``:
the adaptive run's mean final validation loss relative to the best fixed
batch's (by mean final loss), its steps, and its time priced on this machine's
and the accelerator's profile, each over the best fixed batch's; the last is
the median, over the probes of every seed's first adaptive run, of the
probe's critical batch over the noise scale at its step. Targets: x <= 0.005,
y <= 0.7, z <= 1.05, w <= 0.75.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import adaptjax  # noqa: E402
from adaptjax import policies as ajp  # noqa: E402

# The main job's model, loss and data (examples/lm.py), so both measure the same thing.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import lm_data  # noqa: E402
from adaptjax.policies._goodput import fit_throughput
from lm import ByteLM, LMConfig, loss_fn, make_eval  # noqa: E402

PROFILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
POLICY_EVERY = 10
CURVE_POINTS = 10  # validation losses at tenths of the token budget
LR_RULES = ("none", "sqrt", "linear", "adascale")


# ----------------------------------------------------------------------------- training
class Recorder:
    """``on_step`` hook: batch size and time of every step, noise-scale readings, the
    validation curve at fixed token counts, and a stop at the budget."""

    def __init__(self, budget, evaluate, checkpoints, probe=None):
        self.budget, self.evaluate = budget, evaluate
        self.checkpoints = list(checkpoints)  # samples at which to evaluate
        self.sizes, self.readings, self.curve = [], [], []
        self.eval_seconds = self.probe_seconds = 0.0
        self.probe = probe  # a Probe asked for at a quarter, half and three quarters
        self.probe_at = [budget * k // 4 for k in (1, 2, 3)] if probe is not None else []
        self.t0 = time.perf_counter()

    def __call__(self, ctrl):
        # Configuration changes happen after this hook, so this is the step's own batch.
        self.sizes.append(ctrl.config.batch_size)
        metrics = ctrl.latest_metrics  # of the step before (read one step behind)
        if ctrl.step % POLICY_EVERY == 0:
            self.readings.append((ctrl.step, ctrl.samples_seen, ctrl.config.batch_size,
                                  float(metrics.get("noise_scale", math.nan)),
                                  float(metrics.get("noise_scale_valid", 1.0))))
        if self.checkpoints and ctrl.samples_seen >= self.checkpoints[0]:
            self.checkpoints.pop(0)
            t0 = time.perf_counter()
            self.curve.append((ctrl.samples_seen, self.evaluate(ctrl.model)["loss"]))
            self.eval_seconds += time.perf_counter() - t0
        if self.probe_at and ctrl.samples_seen >= self.probe_at[0]:
            self.probe_at.pop(0)
            t0 = time.perf_counter()
            ctrl.apply([self.probe])  # the run goes on bit-exactly
            self.probe_seconds += time.perf_counter() - t0
        if ctrl.samples_seen >= self.budget:
            self.wall = (time.perf_counter() - self.t0 - self.eval_seconds
                         - self.probe_seconds)
            ctrl.apply([ajp.Stop("token budget reached")])


def make_controller(data, cfg, *, devices, batch, lr, seed, policies=(), on_step=None):
    train_windows, _ = data
    spec = adaptjax.RunSpec(
        run_dir=tempfile.mkdtemp(prefix="adaptive_batch_"), devices=devices, batch_size=batch,
        learning_rate=lr, policy_every=POLICY_EVERY, policies=list(policies),
        # Every run pays for its own compiles: no persistent cache shared between runs.
        compile=adaptjax.CompileOptions(cache_dir=None),
    )
    return adaptjax.Controller(
        ByteLM(cfg, nnx.Rngs(params=seed, dropout=seed + 1)), loss_fn, optax.adam(lr),
        adaptjax.ArrayDataset({"tokens": train_windows}, seed=seed), spec,
        hooks=[adaptjax.Hook(on_step)],
    )


def train(data, cfg, *, budget, evaluate, probe=None, curve_points=CURVE_POINTS, **kwargs):
    """One run to ``budget`` samples (probed three times with ``probe``); what the table needs.

    The validation curve has ``curve_points`` points, evenly spaced in samples.
    """
    checkpoints = [budget * (i + 1) // curve_points for i in range(curve_points)]
    recorder = Recorder(budget, evaluate, checkpoints, probe)
    ctrl = make_controller(data, cfg, on_step=recorder, **kwargs)
    run_dir = ctrl.run_dir
    try:
        recorder.t0 = time.perf_counter()
        ctrl.run(10**9)  # the recorder stops it at the token budget
        events = ctrl.log.events
        samples = ctrl.samples_seen
        ctrl.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    compiles = [e for e in events if e["kind"] == "compile"]
    return {
        "sizes": recorder.sizes,
        "samples": samples,
        "curve": recorder.curve,
        "final": recorder.curve[-1][1],
        "wall": recorder.wall,
        "readings": recorder.readings,
        "compile_s": sum(e["latency_s"] for e in compiles if not e.get("probe")),
        "decisions": [(e["step"], e["actions"]) for e in events if e["kind"] == "decision"],
        "probes": [e for e in events if e["kind"] in ("probe", "probe_skipped")],
        "probe_s": recorder.probe_seconds,
    }


# ----------------------------------------------------------------------------- profiles
def measure_step_times(data, cfg, sizes, *, devices, steps, rounds=4):
    """Seconds per step of the controller at each batch size (steady state, after compiling).

    The controller reads metrics one step behind, so in steady state the
    interval between two dispatches is the step's time on the device. The
    sizes take turns in ``rounds`` blocks (a slow spell of the machine falls on
    all of them); the median interval is kept.
    """
    ctrls, stamps = {}, {b: [] for b in sizes}
    intervals = {b: [] for b in sizes}
    block = max(steps // rounds, 3)
    try:
        for b in sizes:
            ctrls[b] = make_controller(data, cfg, devices=devices, batch=b, lr=1e-3, seed=0,
                                       on_step=lambda c, s=stamps[b]: s.append(time.perf_counter()))
            ctrls[b].run(3)  # compile and warm up
        for r in range(rounds):
            for b in sizes[r % len(sizes):] + sizes[: r % len(sizes)]:
                stamps[b].clear()
                ctrls[b].run(ctrls[b].step + block)
                intervals[b] += list(np.diff(stamps[b]))
    finally:
        for ctrl in ctrls.values():
            run_dir = ctrl.run_dir
            ctrl.close()
            shutil.rmtree(run_dir, ignore_errors=True)
    return {b: float(np.median(intervals[b])) for b in sizes}


def device_name() -> tuple[str, str]:
    device = jax.devices()[0]
    return device.platform, getattr(device, "device_kind", device.platform)


def write_profile(cfg, devices, times) -> str:
    platform, kind = device_name()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H%M%SZ")
    profile = {
        "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable), *sys.argv]),
        "device": kind,
        "platform": platform,
        "devices": devices,
        "date": date,
        "jax": jax.__version__,
        "model": dataclasses.asdict(cfg),
        "points": [[b, times[b]] for b in sorted(times)],
    }
    os.makedirs(PROFILES, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", kind).strip("-").lower()
    path = os.path.join(PROFILES, f"lm-{platform}-{slug}-{date}.json")
    with open(path, "w") as f:
        json.dump(profile, f, indent=1)
        f.write("\n")
    return path


def find_gpu_profile(cfg, path=None):
    """The named profile, else the newest stored non-CPU one measured on this model."""
    paths = [path] if path else sorted(glob.glob(os.path.join(PROFILES, "*.json")))
    found = []
    for p in paths:
        with open(p) as f:
            profile = json.load(f)
        if path is None and (profile["platform"] == "cpu"
                             or profile["model"] != dataclasses.asdict(cfg)):
            continue
        found.append((profile["date"], p, profile))
    return max(found)[1:] if found else (None, None)


def price(sizes, points) -> float:
    """Seconds the steps of batch ``sizes`` take on the profile (interpolated in M)."""
    if points is None:
        return math.nan
    ms, ts = zip(*sorted(points), strict=True)
    counts = np.bincount(np.asarray(sizes))
    used = np.nonzero(counts)[0]
    if used.min() < ms[0] or used.max() > ms[-1]:
        raise SystemExit(f"the profile covers batches {ms[0]}..{ms[-1]}, the run used {used}")
    return float(np.sum(counts[used] * np.interp(used, ms, ts)))


# ----------------------------------------------------------------------------- report
def used(sizes):
    """``8x1200 16x400 ...``: each batch size and its steps, in order of first use."""
    counts = {}
    for b in sizes:
        counts[b] = counts.get(b, 0) + 1
    return " ".join(f"{b}x{n}" for b, n in counts.items())


def noise_trajectory(run, parts=5):
    """The median valid noise-scale reading and the batch in each fifth of the run."""
    readings, total = run["readings"], run["samples"]
    out = []
    for i in range(parts):
        lo, hi = total * i / parts, total * (i + 1) / parts
        part = [r for r in readings if lo <= r[1] < hi]
        valid = [r[3] for r in part if r[4] > 0 and math.isfinite(r[3])]
        ns = f"{statistics.median(valid):.0f}" if valid else "-"
        batch = part[-1][2] if part else "-"
        out.append(f"{ns}@{batch}")
    return " ".join(out)


def variant_policy(name, largest):
    """The policy of an adaptive run: ``warmup`` (``BatchSizeWarmup``'s defaults),
    ``warmup-<rule>[-<fraction>]`` or ``goodput-<rule>`` (``AdaptiveBatchSize``)."""
    kind, *rest = name.split("-")
    if kind == "warmup":
        extra = dict(zip(("lr_rule", "fraction"), rest, strict=False))
        if "fraction" in extra:
            extra["fraction"] = float(extra["fraction"])
        return ajp.BatchSizeWarmup(max_batch_size=largest, **extra)
    if kind != "goodput" or len(rest) != 1:
        raise ValueError(name)
    return ajp.AdaptiveBatchSize(max_batch_size=largest, lr_rule=rest[0], optimizer_kind="adam")


def print_tables(runs, names, cpu_points, gpu_points, cfg):
    print(f"\n{'run':>14} {'seed':>4} | {'final val':>9} | {'steps':>6} | {'tokens':>9} | "
          f"{'wall s':>7} | {'cpu T(M) s':>10} | {'gpu T(M) s':>10} | {'compile s':>9} | "
          f"{'share':>5} | batch x steps")
    summary = {}
    for name in names:
        for seed, r in enumerate(runs[name]):
            r["cpu"], r["gpu"] = price(r["sizes"], cpu_points), price(r["sizes"], gpu_points)
            print(f"{name:>14} {seed:>4} | {r['final']:>9.4f} | {len(r['sizes']):>6} | "
                  f"{r['samples'] * cfg.context:>9} | {r['wall']:>7.1f} | {r['cpu']:>10.2f} | "
                  f"{r['gpu']:>10.3f} | {r['compile_s']:>9.1f} | "
                  f"{r['compile_s'] / r['wall']:>5.0%} | {used(r['sizes'])}")
        rs = runs[name]
        summary[name] = {k: float(np.mean([r[k] for r in rs])) for k in ("final", "cpu", "gpu")}
        summary[name]["steps"] = float(np.mean([len(r["sizes"]) for r in rs]))
        summary[name]["wall"] = float(np.mean([r["wall"] for r in rs]))
    print("\nvalidation loss at tenths of the token budget (mean over seeds):")
    for name in names:
        curve = np.mean([[loss for _, loss in r["curve"]] for r in runs[name]], axis=0)
        print(f"{name:>14}: " + " ".join(f"{x:.3f}" for x in curve))
    print("\nnoise scale measured (median valid reading @ batch, per fifth of the run; seed 0):")
    for name in names:
        print(f"{name:>14}: {noise_trajectory(runs[name][0])}")
    return summary


# ----------------------------------------------------------------------------- main
def add_workload_args(parser) -> None:
    """The LM and its pricing, as frontier_run.py takes them too."""
    parser.add_argument("--val-windows", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--max-train-bytes", type=int, default=8_000_000)
    parser.add_argument("--profile-steps", type=int, default=40, help="timed steps per size")
    parser.add_argument("--gpu-profile", default=None, help="a stored profile to price with")


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, sizes 8 32 128, 1/4 tokens")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--fixed", type=int, nargs="*", default=None,
                        help="the fixed batches to run (default: every size; for a study)")
    parser.add_argument("--tokens", type=int, default=3_200_000, help="token budget of every run")
    parser.add_argument("--lr", type=float, default=2e-3, help="learning rate at the smallest")
    parser.add_argument("--variants", nargs="+", default=["warmup"],
                        help="adaptive runs: warmup (BatchSizeWarmup's defaults), "
                        "warmup-<rule>[-<fraction>] or goodput-<rule> (AdaptiveBatchSize); the "
                        "first is 'adaptive' in the last line")
    parser.add_argument("--devices", type=int, default=2)
    add_workload_args(parser)
    parser.add_argument("--measure-profile", action="store_true",
                        help="time T(M) on this machine, store it under benchmarks/profiles/, exit")
    parser.add_argument("--probe-sizes", type=int, nargs="+", default=None,
                        help="the probes' branch batches (default: --sizes)")
    # The policy's defaults: the benchmark measures what CriticalBatchProbe asks for.
    probe_defaults = {f.name: f.default for f in dataclasses.fields(ajp.CriticalBatchProbe)}
    parser.add_argument("--probe-steps", type=int, default=probe_defaults["steps"],
                        help="optimizer steps of the largest probe branch (0: no probes)")
    parser.add_argument("--probe-lr-rule", default="adascale", choices=LR_RULES,
                        help="the probe branches' learning-rate rule from the run's batch")
    parser.add_argument("--probe-lr-multipliers", type=float, nargs="+",
                        default=list(probe_defaults["lr_multipliers"]),
                        help="factors on each branch's rate; each batch's best loss counts")
    return parser


def check_args(parser, args):
    if args.quick:
        args.seeds, args.sizes, args.tokens = 1, [8, 32, 128], args.tokens // 4
    args.sizes = sorted(set(args.sizes))
    args.fixed = args.sizes if args.fixed is None else sorted(set(args.fixed))
    if len(args.sizes) < 2 or args.sizes[0] % args.devices:
        parser.error(f"--sizes: give 2+ sizes, the smallest a multiple of --devices={args.devices}")
    if min(args.seeds, args.tokens, args.val_windows, args.profile_steps) < 1:
        parser.error("--seeds, --tokens, --val-windows and --profile-steps must be positive")
    args.probe_sizes = sorted(set(args.probe_sizes or args.sizes))
    if args.probe_steps < 0 or (args.probe_steps and (
            len(args.probe_sizes) < 3 or args.probe_sizes[0] % args.devices)):
        parser.error("--probe-sizes: give 3+ sizes, multiples of --devices; --probe-steps >= 0")
    if not all(0 < m < math.inf for m in args.probe_lr_multipliers):
        parser.error(f"--probe-lr-multipliers: every factor must be > 0 and finite, got "
                     f"{args.probe_lr_multipliers}")
    for name in args.variants:
        try:
            variant_policy(name, args.sizes[-1])
        except (ValueError, TypeError):
            parser.error(f"--variants: {name!r} is not warmup, warmup-<rule>[-<fraction>] or "
                         f"goodput-<rule> with a rule in {', '.join(LR_RULES)}")


def profiles(data, cfg, args, devices):
    """This machine's (M, seconds) points, measured now, and the stored accelerator's or None."""
    cpu_times = measure_step_times(data, cfg, args.sizes, devices=devices,
                                   steps=args.profile_steps)
    cpu_points = sorted(cpu_times.items())
    alpha, beta = fit_throughput(*zip(*cpu_points, strict=True))
    print("this machine's T(M), ms: " + ", ".join(f"{b}: {t * 1e3:.2f}" for b, t in cpu_points)
          + f" (fit {alpha * 1e3:.2f} ms + {beta * 1e6:.1f} us x M)", flush=True)
    gpu_path, gpu = find_gpu_profile(cfg, args.gpu_profile)
    if gpu is None:
        print(f"no accelerator profile of this model under {PROFILES}: GPU-priced time is nan "
              "(store one with --measure-profile on a GPU)")
        return cpu_points, None
    gpu_points = [tuple(p) for p in gpu["points"]]
    print(f"accelerator profile {os.path.basename(gpu_path)} ({gpu['device']}, {gpu['date']}): "
          + ", ".join(f"{b}: {t * 1e3:.3f}" for b, t in gpu_points) + " ms")
    return cpu_points, gpu_points


def run_all(data, cfg, args, devices, budget):
    """Every seed's fixed and adaptive runs: ``{name: [run per seed]}``."""
    evaluate = make_eval(data[1], ByteLM(cfg, nnx.Rngs(0)))
    small, large = args.sizes[0], args.sizes[-1]
    runs = {f"fixed-{b}": [] for b in args.fixed}
    runs.update({v: [] for v in args.variants})
    for seed in range(args.seeds):
        common = dict(devices=devices, seed=seed, budget=budget, evaluate=evaluate)
        for b in args.fixed:
            r = train(data, cfg, batch=b, lr=args.lr * math.sqrt(b / small), **common)
            runs[f"fixed-{b}"].append(r)
            print(f"seed {seed} fixed-{b}: {len(r['sizes'])} steps, final val loss "
                  f"{r['final']:.4f}, {r['wall']:.0f} s", flush=True)
        probe = None
        if args.probe_steps:
            probe = ajp.Probe(args.probe_sizes, steps=args.probe_steps,
                              lr_rule=args.probe_lr_rule,
                              lr_multipliers=args.probe_lr_multipliers)
        for name in args.variants:
            policy = variant_policy(name, large)
            r = train(data, cfg, batch=small, lr=args.lr, policies=[policy], probe=probe,
                      **common)
            runs[name].append(r)
            print(f"seed {seed} {name}: {len(r['sizes'])} steps, final val loss "
                  f"{r['final']:.4f}, {r['wall']:.0f} s; batches {used(r['sizes'])}", flush=True)
    return runs


def print_probes(runs, name, context):
    """The probes of ``name``'s runs: critical batch beside the noise scale; the median ratio."""
    ratios = []
    print(f"\ncritical-batch probes of {name} (Probe at 1/4, 1/2, 3/4 of the budget):")
    print(f"{'seed':>4} {'step':>6} {'tokens':>9} {'batch':>5} | {'noise scale':>11} | "
          f"{'critical batch':>14} | {'ratio':>6} | {'probe s':>7} | drops per branch")
    for seed, r in enumerate(runs[name]):
        for e in r["probes"]:
            if e["kind"] == "probe_skipped":
                print(f"{seed:>4} {e['step']:>6}: skipped ({e['reason']})")
                continue
            phi, c = e.get("noise_scale") or math.nan, e["critical_batch"]
            ratio = c / phi if phi and math.isfinite(phi) and phi > 0 else math.nan
            if math.isfinite(ratio):
                ratios.append(ratio)
            batch = r["sizes"][e["step"] - 1]
            best = e.get("lr_multipliers") or [None] * len(e["drops"])
            drops = " ".join(f"{b}:{d:+.4f}" + (f" (x{m:g})" if m is not None else "")
                             for b, d, m in zip(e["batch_sizes"], e["drops"], best, strict=True))
            print(f"{seed:>4} {e['step']:>6} {sum(r['sizes'][:e['step']]) * context:>9} "
                  f"{batch:>5} | {phi:>11.1f} | {c:>14.1f} | {ratio:>6.2f} | "
                  f"{e['latency_s']:>7.1f} | {drops}")
        total = r["wall"] + r["probe_s"]
        print(f"{seed:>4} probes took {r['probe_s']:.1f} s: {r['probe_s'] / total:.1%} of the "
              f"run's {total:.1f} s (training {r['wall']:.1f} s)")
    return statistics.median(ratios) if ratios else math.nan


def compare(summary, variants, cbs_ratio=math.nan):
    """Each adaptive run against the best fixed batch by mean final loss; the last line."""
    fixed = [n for n in summary if n.startswith("fixed-")]
    if not fixed:
        return
    best = min(fixed, key=lambda n: summary[n]["final"])
    f = summary[best]
    print(f"\nbest fixed by mean final validation loss: {best} ({f['final']:.4f})")
    for name in variants:
        s = summary[name]
        print(f"{name}: loss {s['final'] / f['final'] - 1:+.2%}, "
              f"steps x{s['steps'] / f['steps']:.3f}, "
              f"wall x{s['wall'] / f['wall']:.3f}, cpu T(M) x{s['cpu'] / f['cpu']:.3f}, "
              f"gpu T(M) x{s['gpu'] / f['gpu']:.3f}")
    s = summary[variants[0]]
    print(
        f"adaptive_loss_gap={s['final'] / f['final'] - 1:.4f} "
        f"adaptive_steps_ratio={s['steps'] / f['steps']:.4f} "
        f"adaptive_cpu_time_ratio={s['cpu'] / f['cpu']:.4f} "
        f"adaptive_gpu_time_ratio={s['gpu'] / f['gpu']:.4f} "
        f"cbs_probe_vs_noise_scale={cbs_ratio:.4f}"
    )


def main():
    parser = build_parser()
    args = parser.parse_args()
    check_args(parser, args)
    cfg = LMConfig(layers=args.layers, width=args.width, heads=4, context=args.context,
                   dropout=0.0)
    train_w, val_w, info = lm_data.load_corpus(context=cfg.context,
                                               max_train_bytes=args.max_train_bytes)
    data = (train_w, lm_data.evenly_spaced(val_w, args.val_windows))
    devices = min(args.devices, len(jax.devices()))
    if args.measure_profile:
        times = measure_step_times(data, cfg, args.sizes, devices=devices,
                                   steps=args.profile_steps)
        path = write_profile(cfg, devices, times)
        print("T(M), ms: " + ", ".join(f"{b}: {t * 1e3:.3f}" for b, t in times.items()))
        print(f"profile written to {path}")
        return
    budget = -(-args.tokens // cfg.context)  # samples
    budget = -(-budget // args.sizes[-1]) * args.sizes[-1]  # whole steps of every size
    params = sum(int(np.prod(p.shape)) for p in
                 jax.tree.leaves(nnx.state(ByteLM(cfg, nnx.Rngs(0)), nnx.Param)))
    print(f"model: {dataclasses.asdict(cfg)} ({params} parameters); corpus {info['root']}: "
          f"{len(train_w)} train windows of {cfg.context + 1} bytes, {len(data[1])} validation; "
          f"devices={devices}; budget {budget} samples = {budget * cfg.context} tokens; "
          f"seeds={args.seeds}; lr {args.lr} at batch {args.sizes[0]}", flush=True)
    cpu_points, gpu_points = profiles(data, cfg, args, devices)
    runs = run_all(data, cfg, args, devices, budget)
    summary = print_tables(runs, list(runs), cpu_points, gpu_points, cfg)
    ratio = print_probes(runs, args.variants[0], cfg.context) if args.probe_steps else math.nan
    compare(summary, args.variants, ratio)


if __name__ == "__main__":
    main()
