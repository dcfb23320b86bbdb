"""Adaptive batch size vs fixed batch sizes on the byte-level LM: time to a target loss.

The main job's workload (``examples/lm.py``): a byte-level decoder-only
transformer on this Python's standard-library ``.py`` sources (train and
validation split by file), Adam, ``--devices`` simulated CPU devices, the
adaptjax controller. Sized small (``--layers``, ``--width``, ``--context``) so
the whole benchmark runs in about 15 minutes on 2 CPU cores. In one run, for
each seed (model init and data order):

* ``fixed-<b>``: the controller with no policy at a fixed global batch ``b``
  for each of ``--sizes`` (default 32 64 128 256 512), learning rate
  ``--lr`` x sqrt(b / smallest) (the square-root rule for Adam);
* ``adaptive``: starts at the smallest size with ``--lr`` and
  ``cooldown(AdaptiveBatchSize(max_batch_size=largest, lr_rule='sqrt',
  multiple_of=8, prior_overhead=<measured>), steps=--cooldown)`` asked every 10
  steps: the same square-root rule.

Every run evaluates the validation loss (``--val-windows`` windows, no dropout)
every ``--eval-every`` steps and stops at the first evaluation at or below
``--target`` (or at the ``--budget`` sample cap). Per run it reports steps,
samples and *measured wall time* to the target (compilation included, the
evaluations themselves excluded), and *modelled time*: the sum over the run's
steps of T(M) = α + β·M fitted (``adaptjax.policies.fit_throughput``) to a bare
loop of the controller's compiled step at each size, timed round-robin before
training.

Warm-up: the adaptive run's steps to the target against the fixed batch its
schedule ends at (the noise-scale-driven warm-up's saving; published: 43% fewer
steps for a 1B LM, McCandlish et al. / Pollux-style warm-up).

Usage:
  python benchmarks/adaptive_batch.py [--seeds 3] [--sizes 32 64 128 256 512]
      [--target 2.35] [--budget 16000]

Ends with ``adaptive_vs_best_fixed_time=<x> adaptive_vs_median_fixed_time=<y>``:
the adaptive runs' mean measured wall time to the target over the best and the
median fixed batch's (a fixed size that misses the target counts as the budget
time, which favours it). Targets: x <= 1.0, y <= 0.7.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
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
from lm import ByteLM, LMConfig, loss_fn, make_eval  # noqa: E402

POLICY_EVERY = 10
BLOCK = 5  # steps per timing block


class Recorder:
    """``on_step`` hook: each step's batch size and end time; stops at the target or budget."""

    def __init__(self, budget, target):
        self.budget, self.target = budget, target
        self.sizes, self.times, self.noise_scale = [], [], []
        self.t0 = time.perf_counter()

    def __call__(self, ctrl):
        # Configuration changes happen after this hook, so this is the step's own batch.
        self.sizes.append(ctrl.config.batch_size)
        self.times.append(time.perf_counter() - self.t0)
        self.noise_scale.append(ctrl.latest_metrics.get("noise_scale", math.nan))
        if ctrl.latest_metrics.get("eval_loss", math.inf) <= self.target:
            ctrl.apply([ajp.Stop("target reached")])
        elif ctrl.samples_seen >= self.budget:
            ctrl.apply([ajp.Stop("sample budget reached")])


def train(data, cfg, *, devices, batch, lr, seed, budget, target, eval_every, policies=()):
    train_windows, val_windows = data
    evaluate = make_eval(val_windows, ByteLM(cfg, nnx.Rngs(0)))
    recorder = Recorder(budget, target)
    run_dir = tempfile.mkdtemp(prefix="adaptive_batch_")
    try:
        ctrl = adaptjax.Controller(
            model=ByteLM(cfg, nnx.Rngs(params=seed, dropout=seed + 1)),
            loss_fn=loss_fn,
            optimizer=optax.adam,
            hyperparams={"learning_rate": lr},
            data=adaptjax.ArrayDataset({"tokens": train_windows}, seed=seed),
            devices=devices,
            batch_size=batch,
            policies=list(policies),
            policy_every=POLICY_EVERY,
            eval_fn=evaluate,
            eval_every=eval_every,
            run_dir=run_dir,
            progress=False,
            tensorboard=False,
            on_step=recorder,
        )
        recorder.t0 = time.perf_counter()
        ctrl.run(10**9)  # the recorder stops it at the target or the sample budget
        events = ctrl.log.events
        ctrl.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    evals = [(e["step"], e["eval_loss"], e["latency_s"]) for e in events if e["kind"] == "eval"]
    return {
        "sizes": recorder.sizes,
        "times": recorder.times,
        "noise_scale": recorder.noise_scale,
        "evals": evals,
        "final": evals[-1][1] if evals else math.nan,
        "compile_s": sum(e["latency_s"] for e in events if e["kind"] == "compile"),
        "decisions": [(e["step"], e["actions"]) for e in events if e["kind"] == "decision"],
    }


def time_steps(data, cfg, devices, sizes, rounds):
    """Seconds per step of the controller's compiled step at each batch size (bare loop)."""
    train_windows, _ = data
    run_dir = tempfile.mkdtemp(prefix="adaptive_batch_timing_")
    try:
        ctrl = adaptjax.Controller(
            model=ByteLM(cfg, nnx.Rngs(0)),
            loss_fn=loss_fn,
            optimizer=optax.adam,
            hyperparams={"learning_rate": 1e-3},
            data=adaptjax.ArrayDataset({"tokens": train_windows}, seed=0),
            devices=devices,
            batch_size=min(sizes),
            run_dir=run_dir,
            progress=False,
            tensorboard=False,
        )
        stream = adaptjax.ArrayDataset({"tokens": train_windows}, seed=1)
        steps = {b: ctrl.steps.step(adaptjax.RunConfig(devices=devices, batch_size=b))
                 for b in sizes}
        state = ctrl.state
        for b, fn in steps.items():  # compile and warm up
            for _ in range(2):
                state, _ = fn(state, stream.next_batch(b))
        jax.block_until_ready(state)
        times = {b: [] for b in sizes}
        order = list(sizes)
        for r in range(rounds):
            for b in order[r % len(order):] + order[: r % len(order)]:
                fn = steps[b]
                t0 = time.perf_counter()
                for _ in range(BLOCK):
                    state, _ = fn(state, stream.next_batch(b))
                jax.block_until_ready(state)
                times[b].append((time.perf_counter() - t0) / BLOCK)
        ctrl.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {b: float(np.median(t)) for b, t in times.items()}


def to_target(run, alpha, beta, target):
    """(steps, samples, wall s, modelled s) to the first evaluation <= target, else infs.

    Wall time runs from the start of ``run()`` to the end of the step that reached the
    target, compilation included, minus the evaluations before it.
    """
    cum_samples = np.cumsum(run["sizes"])
    cum_model = np.cumsum([alpha + beta * b for b in run["sizes"]])
    spent_eval = 0.0
    for step, loss, latency in run["evals"]:
        if loss <= target:
            wall = run["times"][step - 1] - spent_eval
            return step, int(cum_samples[step - 1]), wall, float(cum_model[step - 1])
        spent_eval += latency
    return math.inf, math.inf, math.inf, math.inf


def spread(values, fmt):
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < len(values):
        return f"{len(values) - len(finite)}/{len(values)} never"
    mean = float(np.mean(values))
    return f"{fmt.format(mean)} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    parser.add_argument("--target", type=float, default=2.35, help="validation loss, nats/byte")
    parser.add_argument("--budget", type=int, default=16_000, help="sample cap of every run")
    parser.add_argument("--lr", type=float, default=2e-3, help="learning rate at the smallest")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--val-windows", type=int, default=64)
    parser.add_argument("--cooldown", type=int, default=20, help="steps between batch changes")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--timing-rounds", type=int, default=4)
    args = parser.parse_args()
    sizes = sorted(set(args.sizes))
    if sizes[0] % args.devices or len(sizes) < 2:
        parser.error(f"--sizes: give 2+ sizes, the smallest a multiple of --devices={args.devices}")
    if min(args.seeds, args.eval_every, args.timing_rounds, args.budget) < 1:
        parser.error("--seeds, --eval-every, --timing-rounds and --budget must be positive")

    cfg = LMConfig(layers=args.layers, width=args.width, heads=4, context=args.context,
                   dropout=0.0)
    train_w, val_w, info = lm_data.load_corpus(
        context=cfg.context, max_train_bytes=4_000_000,
    )
    data = (train_w, lm_data.evenly_spaced(val_w, args.val_windows))
    params = sum(int(np.prod(p.shape)) for p in
                 jax.tree.leaves(nnx.state(ByteLM(cfg, nnx.Rngs(0)), nnx.Param)))
    small, large = sizes[0], sizes[-1]

    step_time = time_steps(data, cfg, args.devices, sizes, args.timing_rounds)
    alpha, beta = ajp.fit_throughput(sizes, [step_time[b] for b in sizes])
    prior = min(alpha / (alpha + beta * small), 0.95)
    print(
        f"model: {dataclasses.asdict(cfg)} ({params} parameters); corpus {info['root']}: "
        f"{len(train_w)} train windows of {cfg.context + 1} bytes, {len(data[1])} validation; "
        f"devices={args.devices} target={args.target} budget={args.budget} samples "
        f"eval_every={args.eval_every} seeds={args.seeds}",
        flush=True,
    )
    print(
        "step time (bare loop, median ms): "
        + ", ".join(f"{b}: {step_time[b] * 1e3:.1f}" for b in sizes)
        + f"; fit T(M) = {alpha * 1e3:.2f} ms + {beta * 1e6:.1f} us x M -> fixed fraction at "
        f"{small}: {prior:.2f} (the adaptive policy's prior)",
        flush=True,
    )

    configs = [(f"fixed-{b}", b, args.lr * math.sqrt(b / small)) for b in sizes]
    runs = {name: [] for name, *_ in configs}
    runs["adaptive"] = []
    common = dict(devices=args.devices, seed=0, budget=args.budget, target=args.target,
                  eval_every=args.eval_every)
    for seed in range(args.seeds):
        common["seed"] = seed
        for name, batch, lr in configs:
            t0 = time.perf_counter()
            runs[name].append(train(data, cfg, batch=batch, lr=lr, **common))
            r = runs[name][-1]
            print(f"seed {seed} {name}: {len(r['sizes'])} steps, final val loss "
                  f"{r['final']:.3f}, {time.perf_counter() - t0:.0f} s", flush=True)
        policy = ajp.cooldown(
            ajp.AdaptiveBatchSize(max_batch_size=large, lr_rule="sqrt", optimizer_kind="adam",
                                  multiple_of=8, prior_overhead=prior),
            steps=args.cooldown,
        )
        t0 = time.perf_counter()
        run = train(data, cfg, batch=small, lr=args.lr, policies=[policy], **common)
        runs["adaptive"].append(run)
        changes = [(s, a[0].split("=")[1].split(",")[0]) for s, a in run["decisions"]]
        print(f"seed {seed} adaptive: {len(run['sizes'])} steps, final val loss "
              f"{run['final']:.3f}, {time.perf_counter() - t0:.0f} s; batch changes "
              f"(step, batch): {changes}", flush=True)

    print(
        f"{'run':>10} | {'steps to target':>16} | {'samples to target':>22} | "
        f"{'wall s to target':>18} | {'modelled s':>18} | {'final val loss':>20} | compile s"
    )
    wall, modelled = {}, {}
    for name, rs in runs.items():
        hits = [to_target(r, alpha, beta, args.target) for r in rs]
        steps, samples, seconds, model_s = (list(x) for x in zip(*hits, strict=True))
        # A run that missed counts as its whole wall time (a lower bound on its time to target).
        wall[name] = float(np.mean([s if math.isfinite(s) else r["times"][-1]
                                    for s, r in zip(seconds, rs, strict=True)]))
        modelled[name] = float(np.mean([m if math.isfinite(m) else math.inf for m in model_s]))
        print(
            f"{name:>10} | {spread(steps, '{:.0f}'):>16} | {spread(samples, '{:.0f}'):>22} | "
            f"{spread(seconds, '{:.1f}'):>18} | {spread(model_s, '{:.1f}'):>18} | "
            f"{spread([r['final'] for r in rs], '{:.3f}'):>20} | "
            f"{np.mean([r['compile_s'] for r in rs]):.1f}",
            flush=True,
        )
    fixed = {n: t for n, t in wall.items() if n != "adaptive"}
    best = min(fixed, key=fixed.get)
    median = float(np.median(list(fixed.values())))
    fixed_m = {n: t for n, t in modelled.items() if n != "adaptive"}
    best_m = min(fixed_m, key=fixed_m.get)
    print(
        f"best fixed by wall time: {best} ({fixed[best]:.1f} s); median fixed {median:.1f} s; "
        f"adaptive {wall['adaptive']:.1f} s. Modelled: best fixed {best_m} "
        f"({fixed_m[best_m]:.1f} s), median {np.median(list(fixed_m.values())):.1f} s, adaptive "
        f"{modelled['adaptive']:.1f} s -> {modelled['adaptive'] / fixed_m[best_m]:.3f} x best, "
        f"{modelled['adaptive'] / np.median(list(fixed_m.values())):.3f} x median"
    )
    # Warm-up: adaptive steps to target against the fixed batch its schedule ended at.
    saved = []
    for seed, run in enumerate(runs["adaptive"]):
        hit = to_target(run, alpha, beta, args.target)[0]
        if not math.isfinite(hit):
            continue
        end = run["sizes"][hit - 1]
        if f"fixed-{end}" not in runs:
            print(f"seed {seed}: adaptive ended at batch {end}, not among --sizes")
            continue
        fixed_steps = to_target(runs[f"fixed-{end}"][seed], alpha, beta, args.target)[0]
        saved.append((seed, end, hit, fixed_steps))
    if saved:
        text = ", ".join(
            f"seed {i}: ends at {e}, {h} vs {f} steps"
            + (f" ({1 - h / f:.0%} fewer)" if math.isfinite(f) else " (fixed never reached)")
            for i, e, h, f in saved
        )
        print(f"warm-up (adaptive vs the fixed batch it ends at): {text}")
    print(
        f"adaptive_vs_best_fixed_time={wall['adaptive'] / fixed[best]:.4f} "
        f"adaptive_vs_median_fixed_time={wall['adaptive'] / median:.4f}"
    )


if __name__ == "__main__":
    main()
