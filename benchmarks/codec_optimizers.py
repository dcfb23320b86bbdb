"""Every codec's defaults against dense sync, with SGD+momentum and with AdamW, on two workloads.

The table codec x optimizer x workload: the final test accuracy (the CNN) or
validation loss (the LM) relative to dense sync at equal steps (``gap``: the
fraction worse than dense, mean over the seeds; positive is worse), and the
total bytes each device sends over the run, read from the compiled step's HLO
(:func:`adaptjax.wire_bytes` x steps). Every run is
``adaptjax.data_parallel_step`` with ``optax.chain(adaptjax.sync_gradients(
"data", codec=...), optimizer)`` on 8 simulated CPU devices:

* ``cnn``: the flax NNX MNIST tutorial's CNN (Conv 32 → BatchNorm → Dropout →
  avg-pool, Conv 64 → BatchNorm → Dropout → avg-pool, Linear 256 → Dropout →
  Linear 10; each Dropout its own rng stream) on scikit-learn's digits, each
  8x8 image padded with zeros to 28x28 (no download), 200 steps of batch 32;
  SGD+momentum (0.05, 0.9) and AdamW (0.005); test accuracy on 20% held out.
* ``lm``: ``examples/lm.py``'s byte-level ``ByteLM`` (size ``small``, dropout
  off), batch 32 windows of 64 bytes of the standard library's sources, 250
  steps; AdamW (2e-3, weight decay 0.01, the example's) and SGD+momentum
  (0.05, 0.9); validation loss (nats per byte) on 512 held-out windows.

Codecs: each factory's default construction (``topk()``, ``randomk()`` and
``dgc()`` default to the ratios the guide uses, 0.01, 0.01 and 0.001;
``powersgd()`` to rank 4), plus ``onebit(error_feedback="ef21")`` and, with
AdamW only, ``onebit_adam`` (1-bit Adam, the same learning rate and weight
decay) with ``freeze_step`` at 15% of the run: DeepSpeed recommends a warm-up
of 15-25% of the steps, and the least of it leaves the most steps compressed.
Its step holds both phases in a ``lax.cond``: its bytes are the warm-up
branch's times ``freeze_step`` plus the compressed branch's times the rest
(``WireReport.branch_totals()``). ``warns`` marks a pairing that warns when its
step compiles (``codec.pairing_warning``).

The control ``dense-ulp`` is dense sync from the same seed's parameters moved
by one float32 ulp: its gap (``rounding_control_gap``, printed per workload and
optimizer) is how far a result moves with one rounding, the floor below which
no codec's gap says anything about the codec. ``unwarned_beyond_rounding``
names the worst default pairing that does not warn although its gap is over
both 1% and that floor (``none``: every such pairing warns).

Usage:
  python benchmarks/codec_optimizers.py [--quick] [--seeds 2] [--workloads cnn,lm]
      [--codecs dense,topk] [--steps N] [--optimizers adamw] [--freeze-fraction 0.15]

``--quick``: one seed, 100 steps of each workload, the codecs dense, onebit,
powersgd and onebit_adam (7.5 minutes on 2 busy cores; one seed of every
codec, the LM at 200 steps, took 37 minutes). Last line:
``onebit_adam_loss_gap=<x> onebit_adam_bytes_ratio=<dense bytes / its bytes>
worst_default_gap=<x> (<codec>+<optimizer>)``: 1-bit Adam's validation loss on
the LM relative to dense AdamW's, dense AdamW's bytes over 1-bit Adam's, and the
largest gap of a default codec construction (every workload and optimizer).
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# XLA:CPU's client thread pool: with one thread per simulated device a launch
# blocked on a full queue can starve a collective (tests/conftest.py).
os.environ.setdefault("PJRT_NPROC", "16")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import adaptjax  # noqa: E402
from adaptjax import compression as ajc  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import lm_data  # noqa: E402
from lm import SIZES, ByteLM, loss_fn, make_eval  # noqa: E402

DEVICES = 8
FREEZE_FRACTION = [0.15]  # --freeze-fraction sets it

CODECS = {  # name -> the codec's default construction (None: dense sync)
    "dense": lambda: None,
    "bf16": ajc.bf16,
    "fp16": ajc.fp16,
    "onebit": ajc.onebit,
    "onebit-ef21": functools.partial(ajc.onebit, error_feedback="ef21"),
    "terngrad": ajc.terngrad,
    "qsgd": ajc.qsgd,
    "natural": ajc.natural,
    "topk": ajc.topk,
    "randomk": ajc.randomk,
    "dgc": ajc.dgc,
    "powersgd": ajc.powersgd,
    "onebit_adam": None,  # the optimizer and its sync in one (AdamW only)
    "dense-ulp": lambda: None,  # the control: dense from params one float32 ulp away
}
NOT_DEFAULT = ("dense", "onebit-ef21", "onebit_adam", "dense-ulp")  # not in worst_default_gap
QUICK_CODECS = ("dense", "onebit", "powersgd", "onebit_adam")


class CNN(nnx.Module):
    """The flax NNX MNIST tutorial's CNN, each Dropout with its own rng stream."""

    def __init__(self, seed: int):
        rngs = nnx.Rngs(params=seed)
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.drop1 = nnx.Dropout(0.025, rngs=nnx.Rngs(dropout=seed * 10 + 1))
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.drop2 = nnx.Dropout(0.025, rngs=nnx.Rngs(dropout=seed * 10 + 2))
        self.linear1 = nnx.Linear(7 * 7 * 64, 256, rngs=rngs)
        self.drop3 = nnx.Dropout(0.025, rngs=nnx.Rngs(dropout=seed * 10 + 3))
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        x = pool(self.drop1(nnx.relu(self.norm1(self.conv1(x)))))
        x = pool(self.drop2(nnx.relu(self.norm2(self.conv2(x)))))
        x = self.drop3(nnx.relu(self.linear1(x.reshape(x.shape[0], -1))))
        return self.linear2(x)


def cnn_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, its data and the optimizers it is trained with."""

    name: str
    model: object  # seed -> nnx.Module (in train mode)
    loss: object
    data: object  # seed -> ArrayDataset
    batch: int
    evaluate: object  # nnx.Module -> (metric, higher is better)
    optimizers: dict  # name -> (learning rate, weight decay or None)


def digits_workload() -> Workload:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = np.pad((x / 16.0).reshape(-1, 8, 8, 1), ((0, 0), (10, 10), (10, 10), (0, 0)))
    x_train, x_test, y_train, y_test = train_test_split(
        x.astype(np.float32), y.astype(np.int32), test_size=0.2, random_state=0, stratify=y)

    def evaluate(model):
        model.eval()
        return float(np.mean(np.argmax(model(jnp.asarray(x_test)), -1) == y_test)), True

    def model(seed):
        m = CNN(seed)
        m.train()
        return m

    return Workload(
        "cnn", model, cnn_loss,
        lambda seed: adaptjax.ArrayDataset({"x": x_train, "y": y_train}, seed=seed), 32,
        evaluate, {"sgdm": (0.05, None), "adamw": (0.005, 1e-4)})


def lm_workload() -> Workload:
    cfg = dataclasses.replace(SIZES["small"], dropout=0.0)
    train, val, _ = lm_data.load_corpus(context=cfg.context, max_train_bytes=1_000_000,
                                        max_val_bytes=100_000)
    val = lm_data.evenly_spaced(val, 512)
    evaluate = make_eval(val, ByteLM(cfg, nnx.Rngs(0)))
    return Workload(
        "lm", lambda seed: ByteLM(cfg, nnx.Rngs(seed)), loss_fn,
        lambda seed: adaptjax.ArrayDataset({"tokens": train}, seed=seed), 32,
        lambda model: (evaluate(model)["loss"], False),
        {"adamw": (2e-3, 0.01), "sgdm": (0.05, None)})


def optimizer(kind: str, lr: float, wd, codec_name: str, steps: int):
    """``(tx, freeze_step or None)`` of one pairing."""
    if codec_name == "onebit_adam":
        freeze = max(1, round(FREEZE_FRACTION[0] * steps))
        return ajc.onebit_adam(lr, weight_decay=wd, freeze_step=freeze), freeze
    inner = optax.sgd(lr, momentum=0.9) if kind == "sgdm" else optax.adamw(lr, weight_decay=wd)
    return optax.chain(adaptjax.sync_gradients("data", codec=CODECS[codec_name]()), inner), None


def run_bytes(step, state, batch, steps: int, freeze) -> float:
    """Bytes each device sends over ``steps`` steps, from the compiled step's HLO."""
    report = adaptjax.wire_bytes(step, state, batch)
    if freeze is None:
        return report.total * steps
    compressed, warm_up = report.branch_totals()  # lax.cond: false, then true
    return warm_up * freeze + compressed * (steps - freeze)


def train(work: Workload, kind: str, codec_name: str, seeds: int, steps: int, mesh) -> dict:
    """One pairing over ``seeds`` seeds: the final metrics, the bytes over the run, its warnings."""
    lr, wd = work.optimizers[kind]
    tx, freeze = optimizer(kind, lr, wd, codec_name, steps)
    start = nudged if codec_name == "dense-ulp" else (lambda model: model)
    states = [adaptjax.init_state(start(work.model(seed)), tx, mesh) for seed in range(seeds)]
    step = adaptjax.data_parallel_step(work.loss, tx, mesh)  # one compile for every seed
    metrics, sent, warned = [], None, []
    for seed, state in enumerate(states):
        data = work.data(seed)
        if sent is None:  # the first trace: a codec's pairing warning comes here
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sent = run_bytes(step, state, data.batch_at(0, work.batch), steps, freeze)
            warned = [str(w.message) for w in caught if "than dense sync" in str(w.message)]
        for _ in range(steps):
            state, _ = step(state, data.next_batch(work.batch))
        metric, higher_better = work.evaluate(state.model)
        metrics.append(metric)
    return {"metrics": metrics, "higher": higher_better, "bytes": sent, "warned": warned}


def nudged(model):
    """``model`` with every parameter one float32 ulp larger (``nextafter`` toward +inf).

    Dense sync from there is the rounding control: the same run but for one
    rounding, so its gap to dense is how far this workload's result moves with
    a perturbation no codec can make smaller.
    """
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: jnp.nextafter(p, jnp.inf), params))
    return model


def gap(metric: float, dense: float, higher_better: bool) -> float:
    """The fraction by which ``metric`` is worse than ``dense`` (positive: worse)."""
    return (dense - metric) / dense if higher_better else (metric - dense) / dense


def pairings(work: Workload, codecs, kinds=None) -> list[tuple[str, str]]:
    """``(optimizer, codec)`` of a workload: 1-bit Adam with AdamW only."""
    return [(kind, c) for kind in work.optimizers for c in codecs
            if (c != "onebit_adam" or kind == "adamw") and (kinds is None or kind in kinds)]


def measure(work: Workload, codecs, seeds: int, steps: int, mesh, kinds=None) -> list[dict]:
    """One row per pairing of ``work``: metric (mean over seeds), gap to dense, bytes."""
    rows = []
    for kind, codec in pairings(work, codecs, kinds):
        t0 = time.perf_counter()
        rows.append({"workload": work.name, "optimizer": kind, "codec": codec,
                     **train(work, kind, codec, seeds, steps, mesh)})
        print(f"  {work.name} {kind} {codec}: {rows[-1]['metrics']} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    for row in rows:
        dense = next(r for r in rows if r["optimizer"] == row["optimizer"]
                     and r["codec"] == "dense")
        pairs = zip(row["metrics"], dense["metrics"], strict=True)
        row["gaps"] = [gap(m, d, row["higher"]) for m, d in pairs]
        row["gap"] = float(np.mean(row["gaps"]))
        row["bytes_ratio"] = dense["bytes"] / row["bytes"]
    return rows


def gap_text(g: float) -> str:
    """A gap as a percentage; ``diverged`` past 10x worse than dense (or not finite)."""
    return f"{100 * g:+.1f}%" if np.isfinite(g) and g <= 10 else "diverged"


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    lines = ["| workload | optimizer | codec | metric (per seed) | gap vs dense | "
             "MB sent per device | dense / codec bytes | warns |", "|---" * 8 + "|"]
    for r in rows:
        metric = " ".join(f"{m:.4f}" if abs(m) < 1e3 else f"{m:.1e}" for m in r["metrics"])
        lines.append(
            f"| {r['workload']} | {r['optimizer']} | {r['codec']} | {metric} | "
            f"{gap_text(r['gap'])} | {r['bytes'] / 1e6:,.1f} | {r['bytes_ratio']:.1f}x | "
            f"{'yes' if r['warned'] else ''} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """The last line (see the module docstring)."""
    lm = {(r["optimizer"], r["codec"]): r for r in rows if r["workload"] == "lm"}
    ob = lm.get(("adamw", "onebit_adam"))
    defaults = [r for r in rows if r["codec"] not in NOT_DEFAULT]
    unwarned = [r for r in defaults if not r["warned"]]
    control = {(r["workload"], r["optimizer"]): r for r in rows if r["codec"] == "dense-ulp"}
    for (work, kind), r in control.items():
        print(f"rounding_control_gap={r['gap']:.4f} ({work} {kind}; per seed "
              f"{' '.join(f'{g:+.4f}' for g in r['gaps'])})")
    if unwarned:
        w = max(unwarned, key=lambda r: r["gap"])
        print(f"worst_unwarned_default_gap={w['gap']:.4f} ({w['codec']}+{w['optimizer']}, "
              f"{w['workload']})")
    if unwarned and control:  # a gap says something about the codec beyond 1% and the control
        beyond = [r for r in unwarned if r["gap"] > max(0.01, control[
            r["workload"], r["optimizer"]]["gap"])]
        w = max(beyond, key=lambda r: r["gap"]) if beyond else None
        print("unwarned_beyond_rounding=" + (f"{w['gap']:.4f} ({w['codec']}+{w['optimizer']}, "
                                             f"{w['workload']})" if w else "none"))
    head = (f"onebit_adam_loss_gap={ob['gap']:.4f} onebit_adam_bytes_ratio={ob['bytes_ratio']:.2f}"
            if ob else "onebit_adam_loss_gap=nan onebit_adam_bytes_ratio=nan")
    if not defaults:  # e.g. --codecs dense,onebit_adam: no default construction was run
        return f"{head} worst_default_gap=nan (none run)"
    worst = max(defaults, key=lambda r: r["gap"])
    g = f"{worst['gap']:.4f}" if gap_text(worst["gap"]) != "diverged" else "inf"
    return f"{head} worst_default_gap={g} ({worst['codec']}+{worst['optimizer']})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, fewer codecs and steps")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--workloads", default="cnn,lm")
    parser.add_argument("--codecs", default=None, help="comma-separated names of CODECS")
    parser.add_argument("--steps", type=int, default=None, help="steps of every workload")
    parser.add_argument("--optimizers", default=None, help="comma-separated: adamw, sgdm")
    parser.add_argument("--freeze-fraction", type=float, default=FREEZE_FRACTION[0],
                        help="onebit_adam's freeze_step as a fraction of the steps")
    args = parser.parse_args(argv)
    seeds = args.seeds or (1 if args.quick else 2)
    codecs = QUICK_CODECS if args.quick else tuple(CODECS)
    codecs = tuple(args.codecs.split(",")) if args.codecs else codecs
    steps = {"cnn": 100, "lm": 100} if args.quick else {"cnn": 200, "lm": 250}
    steps = {k: args.steps or v for k, v in steps.items()}
    FREEZE_FRACTION[0] = args.freeze_fraction
    kinds = args.optimizers.split(",") if args.optimizers else None
    mesh = adaptjax.make_mesh(DEVICES)
    builders = {"cnn": digits_workload, "lm": lm_workload}
    rows = []
    t0 = time.perf_counter()
    for name in args.workloads.split(","):
        print(f"{name}: {steps[name]} steps, {seeds} seed(s), {DEVICES} devices", flush=True)
        rows += measure(builders[name](), codecs, seeds, steps[name], mesh, kinds)
    print(table(rows))
    print(f"({time.perf_counter() - t0:.0f} s in all; onebit_adam freeze_step = "
          f"{FREEZE_FRACTION[0]:.0%} of the steps)")
    print(summary(rows))


if __name__ == "__main__":
    main()
