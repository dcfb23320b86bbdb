"""Adaptive batch size vs fixed batch sizes on digits: time to a target test accuracy.

The main job's setting (``examples/digits.py``): scikit-learn's 8x8 digits
(1437 train / 360 test samples, split with ``random_state=0``), a flax NNX MLP
(64-256-256-10), Adam, 8 simulated CPU devices, the adaptjax controller. In
one run, for each seed (model init and data order):

* ``fixed-<b>``: the controller with no policy at a fixed global batch ``b``
  for every power of two from ``--small`` to ``--large``, learning rate
  ``--lr`` x sqrt(b / small) (the square-root rule for Adam, from the
  small-batch learning rate);
* ``adaptive``: starts at ``--small`` with ``--lr`` and
  ``cooldown(AdaptiveBatchSize(max_batch_size=large, lr_rule=..., multiple_of=8,
  prior_overhead=...), steps=--cooldown)`` asked every 10 steps; its learning
  rate rule defaults to the same square-root rule (``--lr-rule adascale``
  for AdaScale).

Every run trains on the same number of samples (``--epochs`` passes over the
training set) and evaluates test accuracy every ``--eval-every`` steps (the
controller's ``eval_fn``; a jitted forward pass). Not every step: the
controller's measured ``step_time``, which the policy reads, is the interval
between step completions and includes the evaluation that ran in between, so
frequent evaluation would distort the policy's inputs. Per run it reports the
steps, samples and *modelled time* to the first evaluation at or above
``--target``, and the final test accuracy.

Modelled time is the sum over a run's steps of the measured time of a step at
that step's batch size. Step times are measured here, after the training runs
and for every batch size any run used: a bare loop of the controller's own
compiled step on 8 devices, blocks of 10 steps, the batch sizes interleaved
round-robin (rotating the order) for ``--timing-rounds`` rounds; the median
per batch size. Compilation (once per batch size and run) is not part of the
modelled time; its measured total is shown per configuration.

The policy's prior: ``AdaptiveBatchSize`` assumes a fraction
``prior_overhead`` of the step time is fixed per-step cost until it has
measured two batch sizes. With ``--prior measured`` (the default) that
fraction is measured on this machine before training, from the same bare-loop
timing of the power-of-two batch sizes: fit T(M) = α + β·M
(``adaptjax.policies.fit_throughput``) and take α / T(small), capped at 0.95.
``--prior default`` keeps the policy's default (0.5).

Usage:
  python benchmarks/adaptive_batch.py [--seeds 3] [--target 0.96] [--epochs 20]
      [--prior measured|default] [--lr-rule sqrt|adascale]

Ends with ``adaptive_vs_best_fixed_time=<x>``: the adaptive run's mean modelled
time to the target over the best fixed batch's (the fixed configuration with
the lowest mean). Target: <= 0.8 (at least 20% less), at equal final accuracy.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import adaptjax  # noqa: E402
from adaptjax import policies as ajp  # noqa: E402

# The main job's model, loss and split (examples/digits.py), so both measure the same thing.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from digits import MLP, load, loss_fn  # noqa: E402

DEVICES = 8
POLICY_EVERY = 10
BLOCK = 10  # steps per timing block


@nnx.jit
def _accuracy(model, x, y):
    return jnp.mean(jnp.argmax(model(x), axis=-1) == y)


def make_eval(x_test, y_test):
    x, y = jnp.asarray(x_test), jnp.asarray(y_test)

    def evaluate(model):
        return {"accuracy": float(_accuracy(model, x, y))}

    return evaluate


class Recorder:
    """``on_step`` hook: the batch size of every step; stops the run at the sample budget."""

    def __init__(self, budget):
        self.budget = budget
        self.sizes = []
        self.noise_scale = []  # the latest measured noise scale at each step (one step behind)

    def __call__(self, ctrl):
        # Configuration changes happen after this hook, so this is the step's own batch.
        self.sizes.append(ctrl.config.batch_size)
        self.noise_scale.append(ctrl.latest_metrics.get("noise_scale", math.nan))
        if ctrl.samples_seen >= self.budget:
            ctrl.apply([ajp.Stop("sample budget reached")])


def train(data, *, batch, lr, seed, budget, eval_every, policies=()):
    x_train, x_test, y_train, y_test = data
    evaluate = make_eval(x_test, y_test)
    recorder = Recorder(budget)
    run_dir = tempfile.mkdtemp(prefix="adaptive_batch_")
    try:
        ctrl = adaptjax.Controller(
            model=MLP(nnx.Rngs(seed)),
            loss_fn=loss_fn,
            optimizer=optax.adam,
            hyperparams={"learning_rate": lr},
            data=adaptjax.ArrayDataset({"x": x_train, "y": y_train}, seed=seed),
            devices=DEVICES,
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
        t0 = time.perf_counter()
        ctrl.run(10**9)  # the recorder stops it at the sample budget
        wall = time.perf_counter() - t0
        final = evaluate(ctrl.model)["accuracy"]
        events = ctrl.log.events
        ctrl.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "sizes": recorder.sizes,
        "noise_scale": recorder.noise_scale,
        "evals": [(e["step"], e["eval_accuracy"]) for e in events if e["kind"] == "eval"],
        "final": final,
        "compile_s": sum(e["latency_s"] for e in events if e["kind"] == "compile"),
        "wall": wall,
        "decisions": [(e["step"], e["actions"]) for e in events if e["kind"] == "decision"],
    }


def time_steps(data, sizes, rounds):
    """Seconds per step of the controller's compiled step at each batch size (bare loop)."""
    x_train, _, y_train, _ = data
    run_dir = tempfile.mkdtemp(prefix="adaptive_batch_timing_")
    try:
        ctrl = adaptjax.Controller(
            model=MLP(nnx.Rngs(0)),
            loss_fn=loss_fn,
            optimizer=optax.adam,
            hyperparams={"learning_rate": 1e-3},
            data=adaptjax.ArrayDataset({"x": x_train, "y": y_train}, seed=0),
            devices=DEVICES,
            batch_size=min(sizes),
            run_dir=run_dir,
            progress=False,
            tensorboard=False,
        )
        stream = adaptjax.ArrayDataset({"x": x_train, "y": y_train}, seed=1)
        configs = {b: adaptjax.RunConfig(devices=DEVICES, batch_size=b) for b in sizes}
        steps = {b: ctrl.steps.step(c) for b, c in configs.items()}
        state = ctrl.state
        for b, fn in steps.items():  # compile and warm up
            for _ in range(3):
                state, _ = fn(state, stream.next_batch(b))
        jax.block_until_ready(state)
        times = {b: [] for b in sizes}
        order = list(sizes)
        for r in range(rounds):
            for b in order[r % len(order) :] + order[: r % len(order)]:
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


def to_target(run, step_time, target):
    """(steps, samples, modelled seconds) to the first evaluation >= target, else infs."""
    cum_time = np.cumsum([step_time[b] for b in run["sizes"]])
    cum_samples = np.cumsum(run["sizes"])
    for step, acc in run["evals"]:
        if acc >= target:
            return step, int(cum_samples[step - 1]), float(cum_time[step - 1])
    return math.inf, math.inf, math.inf


def spread(values, fmt):
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < len(values):
        return f"{len(values) - len(finite)}/{len(values)} never"
    mean = float(np.mean(values))
    return f"{fmt.format(mean)} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.96, help="test accuracy to reach")
    parser.add_argument("--epochs", type=float, default=20, help="sample budget of every run")
    parser.add_argument("--small", type=int, default=64, help="smallest (and adaptive start) batch")
    parser.add_argument("--large", type=int, default=512, help="largest batch")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate at --small")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--cooldown", type=int, default=20, help="steps between batch changes")
    parser.add_argument("--prior", choices=("measured", "default"), default="measured")
    parser.add_argument("--lr-rule", choices=("sqrt", "adascale"), default="sqrt")
    parser.add_argument("--timing-rounds", type=int, default=15)
    args = parser.parse_args()
    if args.small < DEVICES or args.small % DEVICES or args.large < 2 * args.small:
        parser.error(f"--small must be a multiple of {DEVICES} and --large >= 2 x --small")
    if args.seeds < 1 or args.eval_every < 1 or args.timing_rounds < 1 or args.epochs <= 0:
        parser.error("--seeds, --eval-every, --timing-rounds and --epochs must be positive")

    data = load()
    budget = int(args.epochs * len(data[0]))
    grid = []
    b = args.small
    while b <= args.large:
        grid.append(b)
        b *= 2

    # The policy's prior, measured on this machine (before any training run).
    first = time_steps(data, grid, args.timing_rounds)
    alpha, beta = ajp.fit_throughput(grid, [first[b] for b in grid])
    measured_f = min(alpha / (alpha + beta * args.small), 0.95)
    prior = measured_f if args.prior == "measured" else 0.5
    print(
        f"train={len(data[0])} test={len(data[1])} devices={DEVICES} budget={budget} samples "
        f"({args.epochs:g} epochs) target={args.target} eval_every={args.eval_every} "
        f"seeds={args.seeds}",
        flush=True,
    )
    print(
        "step time before training (bare loop, median ms): "
        + ", ".join(f"{b}: {first[b] * 1e3:.2f}" for b in grid)
        + f"; fit T(M) = {alpha * 1e3:.2f} ms + {beta * 1e6:.2f} us x M -> fixed fraction at "
        f"{args.small}: {alpha / (alpha + beta * args.small):.2f}",
        flush=True,
    )
    print(
        f"adaptive: cooldown(AdaptiveBatchSize(max_batch_size={args.large}, "
        f"lr_rule={args.lr_rule!r}, optimizer_kind='adam', multiple_of=8, "
        f"prior_overhead={prior:.2f} [{args.prior}]), steps={args.cooldown}) every "
        f"{POLICY_EVERY} steps; fixed: lr = {args.lr:g} x sqrt(b / {args.small})",
        flush=True,
    )

    configs = [(f"fixed-{b}", b, args.lr * math.sqrt(b / args.small), ()) for b in grid]
    runs = {name: [] for name, *_ in configs}
    runs["adaptive"] = []
    for seed in range(args.seeds):
        for name, batch, lr, _ in configs:
            runs[name].append(
                train(
                    data, batch=batch, lr=lr, seed=seed, budget=budget, eval_every=args.eval_every
                )
            )
        policy = ajp.cooldown(
            ajp.AdaptiveBatchSize(
                max_batch_size=args.large,
                lr_rule=args.lr_rule,
                optimizer_kind="adam",
                multiple_of=8,
                prior_overhead=prior,
            ),
            steps=args.cooldown,
        )
        run = train(
            data,
            batch=args.small,
            lr=args.lr,
            seed=seed,
            budget=budget,
            eval_every=args.eval_every,
            policies=[policy],
        )
        runs["adaptive"].append(run)
        changes = [(s, a[0].split("=")[1].split(",")[0]) for s, a in run["decisions"]]
        print(f"seed {seed}: adaptive batch changes (step, batch): {changes}", flush=True)

    used = sorted({b for rs in runs.values() for r in rs for b in r["sizes"]})
    step_time = time_steps(data, used, args.timing_rounds)
    print(
        "step time per batch size used (bare loop, median ms, measured after training): "
        + ", ".join(f"{b}: {t * 1e3:.2f}" for b, t in step_time.items()),
        flush=True,
    )

    print(
        f"{'run':>10} | {'steps to target':>18} | {'samples to target':>23} | "
        f"{'modelled s to target':>21} | {'final accuracy':>21} | compile s"
    )
    mean_time = {}
    for name, rs in runs.items():
        hits = [to_target(r, step_time, args.target) for r in rs]
        steps, samples, seconds = (list(x) for x in zip(*hits, strict=True))
        mean_time[name] = float(np.mean(seconds))
        print(
            f"{name:>10} | {spread(steps, '{:.0f}'):>18} | {spread(samples, '{:.0f}'):>23} | "
            f"{spread(seconds, '{:.3f}'):>21} | {spread([r['final'] for r in rs], '{:.3f}'):>21} "
            f"| {np.mean([r['compile_s'] for r in rs]):.1f}",
            flush=True,
        )
    fixed = {n: t for n, t in mean_time.items() if n != "adaptive"}
    best = min(fixed, key=fixed.get)
    per_seed = [
        to_target(a, step_time, args.target)[2] / to_target(f, step_time, args.target)[2]
        for a, f in zip(runs["adaptive"], runs[best], strict=True)
    ]
    print(
        f"best fixed: {best}; adaptive/best per seed: {', '.join(f'{x:.3f}' for x in per_seed)}; "
        f"final accuracy adaptive {np.mean([r['final'] for r in runs['adaptive']]):.3f} vs "
        f"{best} {np.mean([r['final'] for r in runs[best]]):.3f}"
    )
    # What the goodput model itself allows: at each step of the best fixed runs up to
    # their target, the fixed batch's goodput over the best goodput at that noise scale.
    # An ideal adaptive schedule needs at best mean(g_fixed / g_best) of the fixed time.
    a_fit, b_fit = ajp.fit_throughput(used, [step_time[b] for b in used])
    b_best = int(best.split("-")[1])
    shares, peaks = [], []
    for r in runs[best]:
        hit = to_target(r, step_time, args.target)[0]
        for phi in r["noise_scale"][: hit if math.isfinite(hit) else None]:
            if not math.isfinite(phi):
                continue
            phi = max(phi, 0.0)
            kw = dict(noise_scale=phi, alpha=a_fit, beta=b_fit, base_batch_size=args.small)
            peak = math.sqrt(a_fit * phi / b_fit) if b_fit > 0 else math.inf
            m_star = min(max(peak, args.small), args.large)
            peaks.append(m_star)
            shares.append(ajp.goodput(b_best, **kw) / ajp.goodput(m_star, **kw))
    if shares:
        print(
            f"goodput model (T(M) = {a_fit * 1e3:.2f} ms + {b_fit * 1e6:.2f} us x M, noise scale "
            f"of the {best} runs until their target, {len(shares)} steps): the best batch in "
            f"[{args.small}, {args.large}] is {np.percentile(peaks, 10):.0f}-"
            f"{np.percentile(peaks, 90):.0f} (10th-90th percentile); {best} has "
            f"{np.mean(shares):.1%} of its goodput on average, so an ideal adaptive schedule "
            f"could need at best {np.mean(shares):.3f} x the fixed time"
        )
    print(f"adaptive_vs_best_fixed_time={mean_time['adaptive'] / fixed[best]:.4f}")


if __name__ == "__main__":
    main()
