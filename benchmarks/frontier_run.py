"""The fixed-batch frontier, run: steps to a target loss, fixed batches against adaptive ones.

Workload and runs are ``benchmarks/adaptive_batch.py``'s (its ``train()``: the
byte-level LM of ``examples/lm.py``, Adam, the controller on ``--devices``
simulated CPU devices), every run to the same token budget, the validation
loss at ``--curve-points`` (>= 40) evenly spaced sample counts:

* ``fixed-<b>`` for each of ``--sizes``: batch ``b`` all along at its own best
  rate, chosen on seed 0 among ``{1/2, 1, 2} ×`` the square-root rule's rate
  ``--lr × sqrt(b / smallest)`` (lowest final validation loss; a tie goes to
  the rule's), then run on every seed;
* each of ``--variants`` (``warmup``, ``warmup-<rule>[-<fraction>]``,
  ``goodput-<rule>``, as adaptive_batch.py): from the smallest batch at that
  batch's best rate;
* ``step-decay-<b>``: batch ``--seesaw-batch`` from ``--seesaw-lr`` × its
  best constant rate (a decaying schedule starts above the best constant
  rate), halved at ``--seesaw-at`` fractions of the budget (an optax schedule
  of the step); ``seesaw-<b>``: the same schedule under
  :class:`adaptjax.policies.Seesaw` with its defaults, which doubles the
  batch and lets the rate fall by √2 only at the first milestone
  (``growths=1``) and leaves the later ones to the schedule, at the same
  sample counts (so in fewer steps).

The arithmetic is ``benchmarks/frontier.py``'s: ``L*`` = the best fixed run's
mean final loss + ``--margin``; ``S(L*)``, the frontier ``F`` per seed, and
``frontier_steps_ratio = S_adaptive(L*) / F``, printed for every adaptive run;
the last line's is Seesaw's, the batch policy this benchmark shows beating the
frontier. Seesaw is also judged against its own schedule at a fixed batch: the
steps it takes to that run's mean final loss (+ margin) over the steps that
run takes. Runs are priced on this
machine's T(M) and any stored accelerator profile, as adaptive_batch.py does;
``benchmarks/accumulate.py`` gives accumulated micro-steps' overhead against
one compiled step of the same batch and the compiles per batch change.

Usage:
  python benchmarks/frontier_run.py            # full: 3 seeds, 5 sizes (32 minutes here)
  python benchmarks/frontier_run.py --quick    # 1 seed, sizes 8 16 64, 1/4 tokens, warmup-sqrt
                                               # only

Measured on the project's shared 2-core machine (docs/benchmarks.md, "The
fixed-batch frontier"): the default run, 3 seeds of sizes 8-128 at 400,000
tokens, took 32 minutes next to another benchmark. ``--quick`` once ran sizes
8, 32 and 128, without batch 16, which set the frontier in that run: its
ratio (0.505) flattered the adaptive run. It runs 8, 16 and 64 now.

The last line is ``frontier_steps_ratio=<mean> spread=<min-max>
loss_vs_target=<first variant's mean final / L*> seesaw_steps_ratio=<mean>
accumulate_overhead=<x> recompiles_per_change=<n>``.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accumulate  # noqa: E402
import adaptive_batch as ab  # noqa: E402
import frontier as fr  # noqa: E402

from adaptjax import policies as ajp  # noqa: E402

MULTIPLIERS = (0.5, 1.0, 2.0)


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 seed, sizes 8 16 64, 1/4 of the tokens, fewer timing rounds")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--tokens", type=int, default=400_000, help="token budget of every run")
    parser.add_argument("--lr", type=float, default=2e-3, help="the rule's rate at the smallest")
    parser.add_argument("--variants", nargs="+", default=None,
                        help="adaptive runs as adaptive_batch.py's (default: warmup-sqrt warmup; "
                        "--quick: warmup-sqrt)")
    parser.add_argument("--seesaw-batch", type=int, default=None,
                        help="the step-decay runs' first batch (default: the second size)")
    parser.add_argument("--seesaw-at", type=float, nargs="+", default=[0.5, 0.75, 0.875],
                        help="fractions of the budget where the schedule halves the rate")
    parser.add_argument("--seesaw-lr", type=float, default=math.sqrt(2),
                        help="the schedule's first rate over the batch's best constant rate")
    parser.add_argument("--seesaw-growths", type=int, default=None,
                        help="Seesaw's growths (default: the policy's own default)")
    parser.add_argument("--curve-points", type=int, default=40)
    parser.add_argument("--margin", type=float, default=0.005)
    parser.add_argument("--devices", type=int, default=2)
    ab.add_workload_args(parser)
    parser.add_argument("--accumulate-rounds", type=int, default=20,
                        help="benchmarks/accumulate.py's rounds (0: skip it)")
    parser.add_argument("--curves-out", default=None, help="write every run's curve as JSON")
    parser.add_argument("--plot", default=None,
                        help="draw every run's validation loss against steps into this PNG")
    return parser


def check_args(parser, args):
    if args.quick:
        args.seeds, args.sizes, args.tokens = 1, [8, 16, 64], args.tokens // 4
        args.profile_steps, args.accumulate_rounds = 12, min(args.accumulate_rounds, 5)
        args.variants = args.variants or ["warmup-sqrt"]
    args.variants = args.variants or ["warmup-sqrt", "warmup"]
    args.sizes = sorted(set(args.sizes))
    if len(args.sizes) < 2 or args.sizes[0] % args.devices:
        parser.error(f"--sizes: give 2+ sizes, the smallest a multiple of --devices={args.devices}")
    if args.curve_points < 40:
        parser.error(f"--curve-points must be >= 40, got {args.curve_points}")
    if args.seesaw_batch is None:
        args.seesaw_batch = args.sizes[1]
    growths = seesaw_policy(args, [1]).growths
    growth = 2 ** min(len(args.seesaw_at), len(args.seesaw_at) if growths is None else growths)
    if args.seesaw_batch not in args.sizes or args.seesaw_batch * growth > args.sizes[-1]:
        parser.error(f"--seesaw-batch must be one of --sizes with x{growth} (a doubling per "
                     f"growing milestone) at most {args.sizes[-1]}, got {args.seesaw_batch}")
    args.probe_steps = 0  # adaptive_batch's probes are not part of this benchmark
    for name in args.variants:
        ab.variant_policy(name, args.sizes[-1])


def curve(run):
    """``(steps, losses)`` of a run's validation curve."""
    samples, losses = zip(*run["curve"], strict=True)
    return fr.steps_at(run["sizes"], samples), list(losses)


def sweep_fixed(train, args, small):
    """Each fixed batch's best rate multiplier (seed 0) and its runs on every seed."""
    runs, rates = {}, {}
    for b in args.sizes:
        rule = args.lr * math.sqrt(b / small)
        tried = {m: train(batch=b, lr=rule * m, seed=0) for m in MULTIPLIERS}
        best = fr.best_multiplier({m: r["final"] for m, r in tried.items()})
        print(f"fixed-{b}: final val loss at x" + ", x".join(
            f"{m:g} {r['final']:.4f}" for m, r in tried.items()) + f" -> x{best:g}", flush=True)
        rates[f"fixed-{b}"] = rule * best
        runs[f"fixed-{b}"] = [tried[best]] + [train(batch=b, lr=rule * best, seed=s)
                                             for s in range(1, args.seeds)]
    return runs, rates


def seesaw_policy(args, milestones):
    """Seesaw with its defaults (``--seesaw-growths`` overrides ``growths``)."""
    if args.seesaw_growths is None:
        return ajp.Seesaw(milestones=milestones, max_batch_size=args.sizes[-1])
    return ajp.Seesaw(milestones=milestones, max_batch_size=args.sizes[-1],
                      growths=args.seesaw_growths)


def seesaw_runs(train, args, budget, lr):
    """The step-decay schedule at a fixed batch, and under Seesaw, on every seed."""
    b = args.seesaw_batch
    fixed_at = fr.milestone_steps(args.seesaw_at, budget, b)
    growths = seesaw_policy(args, [1]).growths
    seesaw_at = fr.milestone_steps(args.seesaw_at, budget, b, growth=2, growths=growths)
    decay = optax.piecewise_constant_schedule(lr, {m: 0.5 for m in fixed_at})
    sched = optax.piecewise_constant_schedule(lr, {m: 0.5 for m in seesaw_at})
    print(f"step decay at batch {b} from rate {lr:.2e}: halved at steps {fixed_at}; Seesaw at "
          f"steps {seesaw_at}", flush=True)
    runs = {f"step-decay-{b}": [], f"seesaw-{b}": []}
    for seed in range(args.seeds):
        runs[f"step-decay-{b}"].append(train(batch=b, lr=decay, seed=seed))
        policy = seesaw_policy(args, seesaw_at)
        runs[f"seesaw-{b}"].append(train(batch=b, lr=sched, seed=seed, policies=[policy]))
    return runs


def run_all(data, cfg, args, devices, budget):
    """Every run: ``{name: [run per seed]}`` and ``{name: its (first) rate}``."""
    evaluate = ab.make_eval(data[1], ab.ByteLM(cfg, nnx.Rngs(0)))

    def train(**kwargs):
        t0 = time.perf_counter()
        r = ab.train(data, cfg, devices=devices, budget=budget, evaluate=evaluate,
                     curve_points=args.curve_points, **kwargs)
        lr = kwargs["lr"]
        lr = lr(0) if callable(lr) else lr
        print(f"  seed {kwargs['seed']} batch {kwargs['batch']} lr {float(lr):.2e}"
              f"{' +policy' if kwargs.get('policies') else ''}: {len(r['sizes'])} steps, "
              f"final {r['final']:.4f}, {time.perf_counter() - t0:.0f} s", flush=True)
        return r

    small = args.sizes[0]
    runs, rates = sweep_fixed(train, args, small)
    for name in args.variants:
        policy = ab.variant_policy(name, args.sizes[-1])
        rates[name] = rates[f"fixed-{small}"]
        runs[name] = [train(batch=small, lr=rates[name], seed=s, policies=[policy])
                      for s in range(args.seeds)]
    lr = rates[f"fixed-{args.seesaw_batch}"] * args.seesaw_lr
    for name, rs in seesaw_runs(train, args, budget, lr).items():
        runs[name], rates[name] = rs, lr
    return runs, rates


def frontier(runs, args):
    """``L*``, each run's S(L*) per seed, and the frontier F per seed."""
    fixed = {n: rs for n, rs in runs.items() if n.startswith("fixed-")}
    target = fr.target_loss({n: [r["final"] for r in rs] for n, rs in fixed.items()},
                            args.margin)
    s = {n: [fr.steps_to_loss(*curve(r), target) for r in rs] for n, rs in runs.items()}
    f = [min(s[n][seed] for n in fixed) for seed in range(args.seeds)]
    return target, s, f


def print_table(runs, rates, s, cfg, points):
    cpu, gpu = points
    print(f"\n{'run':>16} {'seed':>4} | {'rate':>8} | {'final val':>9} | {'S(L*)':>7} | "
          f"{'steps':>6} | {'tokens':>8} | {'compile s':>9} | {'cpu T(M) s':>10} | "
          f"{'gpu T(M) s':>10} | batch x steps")
    for name, rs in runs.items():
        for seed, r in enumerate(rs):
            print(f"{name:>16} {seed:>4} | {rates[name]:>8.2e} | {r['final']:>9.4f} | "
                  f"{s[name][seed]:>7.0f} | {len(r['sizes']):>6} | "
                  f"{r['samples'] * cfg.context:>8} | {r['compile_s']:>9.1f} | "
                  f"{ab.price(r['sizes'], cpu):>10.2f} | {ab.price(r['sizes'], gpu):>10.3f} | "
                  f"{ab.used(r['sizes'])}")


def print_curves(runs, every=4):
    print(f"\nvalidation loss against steps (seed 0, every {every}th of the points):")
    for name, rs in runs.items():
        steps, losses = curve(rs[0])
        print(f"{name:>16}: " + " ".join(f"{st}:{loss:.3f}" for st, loss in
                                         list(zip(steps, losses, strict=True))[every - 1::every]))


def plot(curves, target, path):
    """Every run's validation loss against steps (log steps), one colour per run, L* dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (name, runs) in enumerate(curves.items()):
        for seed, (steps, losses) in enumerate(runs):
            ax.plot(steps, losses, color=f"C{i % 10}", alpha=1.0 if seed == 0 else 0.35,
                    linestyle="-" if name.startswith("fixed-") else "--",
                    label=name if seed == 0 else None)
    ax.axhline(target, color="k", linestyle=":", label="L*")
    ax.set(xscale="log", xlabel="optimizer steps", ylabel="validation loss",
           ylim=(target * 0.97, target * 1.3))
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"curves drawn in {path}")


def main():
    parser = build_parser()
    args = parser.parse_args()
    check_args(parser, args)
    cfg = ab.LMConfig(layers=args.layers, width=args.width, heads=4, context=args.context,
                      dropout=0.0)
    train_w, val_w, info = ab.lm_data.load_corpus(context=cfg.context,
                                                  max_train_bytes=args.max_train_bytes)
    data = (train_w, ab.lm_data.evenly_spaced(val_w, args.val_windows))
    devices = min(args.devices, len(jax.devices()))
    budget = -(-args.tokens // cfg.context)
    budget = -(-budget // args.sizes[-1]) * args.sizes[-1]  # whole steps of every size
    print(f"model {cfg}; {len(train_w)} train windows, {len(data[1])} validation; devices="
          f"{devices}; budget {budget} samples = {budget * cfg.context} tokens; seeds="
          f"{args.seeds}; sizes {args.sizes}; curve points {args.curve_points}", flush=True)
    points = ab.profiles(data, cfg, args, devices)
    runs, rates = run_all(data, cfg, args, devices, budget)
    target, s, f = frontier(runs, args)
    print_table(runs, rates, s, cfg, points)
    print_curves(runs)
    if args.curves_out:
        with open(args.curves_out, "w") as out:
            json.dump({n: [curve(r) for r in rs] for n, rs in runs.items()}, out)
    if args.plot:
        plot({n: [curve(r) for r in rs] for n, rs in runs.items()}, target, args.plot)
    report(runs, args, target, s, f)


def report(runs, args, target, s, f):
    small, large = f"fixed-{args.sizes[0]}", f"fixed-{args.sizes[-1]}"
    mean = {n: statistics.fmean(r["final"] for r in rs) for n, rs in runs.items()}
    print(f"\nL* = {target:.4f} (best fixed mean final + {args.margin:.1%}); frontier F per "
          f"seed: {', '.join(f'{x:.0f}' for x in f)}; separation {large} vs {small}: "
          f"{mean[large] / mean[small] - 1:+.2%} (>= 2% in either direction: they separate)")
    b = args.seesaw_batch
    headline = None
    for name in [*args.variants, f"step-decay-{b}", f"seesaw-{b}"]:
        ratios = fr.frontier_ratios({n: s[n] for n in s if n.startswith("fixed-")}, s[name])
        m, lo, hi = fr.summary(ratios)
        print(f"{name}: frontier_steps_ratio per seed {', '.join(f'{x:.3f}' for x in ratios)}"
              f"; mean {m:.3f}; final / L* {mean[name] / target:.4f}")
        headline = (m, lo, hi, mean[name] / target)  # the last: Seesaw's
    pairs = [[curve(r) for r in runs[f"{k}-{b}"]] for k in ("step-decay", "seesaw")]
    sd_target, sd_ratios = fr.paired_steps_ratio(*pairs, margin=args.margin)
    print(f"seesaw-{b} against step-decay-{b}: target {sd_target:.4f}; steps ratio per seed "
          f"{', '.join(f'{x:.3f}' for x in sd_ratios)}; final {mean[f'seesaw-{b}']:.4f} "
          f"vs {mean[f'step-decay-{b}']:.4f}", flush=True)
    acc = {"ratio": math.nan, "recompiles": -1}
    if args.accumulate_rounds:
        acc = accumulate.main(["--k", "4", "--rounds", str(args.accumulate_rounds),
                               "--devices", str(min(8, len(jax.devices())))])
    m, lo, hi, vs = headline
    print(f"frontier_steps_ratio={m:.4f} spread={lo:.4f}-{hi:.4f} loss_vs_target={vs:.4f} "
          f"seesaw_steps_ratio={statistics.fmean(sd_ratios):.4f} "
          f"accumulate_overhead={acc['ratio']:.4f} recompiles_per_change={acc['recompiles']}")


if __name__ == "__main__":
    main()
