"""Synchronisation strategies side by side: bytes on the wire, validation loss, steps to target.

For S-SGD, synchronous model averaging, local SGD (H = 8, 32), DiLoCo
(H = 32, 128) and gossip (ring, exponential), on 8 simulated CPU devices with
the same inner optimizer (AdamW, at a constant learning rate or, with
``--schedule cosine``, a 5% warm-up then a cosine decay to 10%), data order
and step count, this prints:

* bytes each device sends per step, read from the compiled HLO
  (:func:`adaptjax.wire_bytes`; local SGD and DiLoCo amortised over ``H``:
  the outer sync sits in one branch of a ``lax.cond``),
* the final validation loss of the model each strategy ends with (the mean of
  the replicas' models, :func:`adaptjax.sync.consensus_params`) and its gap to
  S-SGD's,
* the first evaluated step at which the validation loss reaches ``--target``
  and its ratio to S-SGD's.

The workload is one function, :func:`digits_workload` (an MLP 64-256-256-10
on scikit-learn's 8x8 digits, the model of ``examples/digits.py`` as a plain
pytree): swap it for another that returns a :class:`Workload` (e.g. the
transformer LM of ``examples/lm.py``, built in as ``--workload lm``: the
``small`` size, dropout off, on the standard library's sources) with
``--workload module:function``.

Times are not reported: simulated CPU devices share a host and have no link.
The bytes, not a wall clock, are what a real interconnect would carry.

Usage:
  python benchmarks/sync_strategies.py [--steps 512] [--quick]
      [--outer-lr 0.7 --outer-momentum 0.9] [--inner-lr X] [--workload digits|lm|module:function]
      [--only "local SGD H=32,DiLoCo H=32"] [--schedule constant|cosine]

The last line is ``diloco_bytes_ratio=<S-SGD bytes / DiLoCo H=32 bytes>
diloco_loss_gap=<(DiLoCo H=32 final val loss - S-SGD's) / S-SGD's>``.
"""

import argparse
import dataclasses
import importlib
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import adaptjax  # noqa: E402


@dataclasses.dataclass
class Workload:
    """What the benchmark trains: initial params, a loss, training and validation data."""

    params: Any
    loss_fn: Callable[[Any, dict], jax.Array]
    train: dict  # arrays with a leading example axis
    val: dict
    learning_rate: float = 1e-3


def digits_workload(seed: int = 0) -> Workload:
    """An MLP 64-256-256-10 on scikit-learn's digits (1437 train / 360 validation)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_tr, x_va, y_tr, y_va = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    keys = jax.random.split(jax.random.key(seed), 3)
    sizes = [(64, 256), (256, 256), (256, 10)]
    params = {
        f"l{i}": {
            "w": jax.random.normal(k, s, jnp.float32) * np.sqrt(2.0 / s[0]),
            "b": jnp.zeros(s[1], jnp.float32),
        }
        for i, (k, s) in enumerate(zip(keys, sizes, strict=True))
    }

    def loss_fn(p, batch):
        h = batch["x"]
        for i in range(3):
            h = h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
            h = jax.nn.relu(h) if i < 2 else h
        return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()

    return Workload(params, loss_fn, {"x": x_tr, "y": y_tr}, {"x": x_va, "y": y_va})


def lm_workload(seed: int = 0, size: str = "small", val_windows: int = 256) -> Workload:
    """``examples/lm.py``'s byte-level transformer (dropout off) on the stdlib's sources."""
    import sys

    from flax import nnx

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    import lm
    import lm_data

    cfg = dataclasses.replace(lm.SIZES[size], dropout=0.0)
    graphdef, params, rest = nnx.split(lm.ByteLM(cfg, nnx.Rngs(seed)), nnx.Param, ...)
    train, val, _ = lm_data.load_corpus(context=cfg.context, max_train_bytes=2_000_000)

    def loss_fn(p, batch):
        return lm.loss_fn(nnx.merge(graphdef, p, rest), batch)

    return Workload(
        params,
        loss_fn,
        {"tokens": train},
        {"tokens": val[:val_windows]},
    )


def strategies(outer_lr: float = 0.7, outer_momentum: float = 0.9) -> dict:
    """The strategies compared; DiLoCo's outer step as given (the paper's 0.7 / 0.9 by default)."""
    outer = {"outer_lr": outer_lr, "outer_momentum": outer_momentum}
    return {
        "S-SGD": adaptjax.sync.SSGD(),
        "SMA": adaptjax.sync.ModelAveraging(),
        "local SGD H=8": adaptjax.sync.LocalSGD(H=8),
        "local SGD H=32": adaptjax.sync.LocalSGD(H=32),
        "DiLoCo H=32": adaptjax.sync.DiLoCo(H=32, **outer),
        "DiLoCo H=128": adaptjax.sync.DiLoCo(H=128, **outer),
        "gossip ring": adaptjax.sync.Gossip("ring"),
        "gossip exp": adaptjax.sync.Gossip("exponential"),
    }


def batches(train: dict, steps: int, batch: int, seed: int):
    """The same sequence of global batches for every strategy (epochs reshuffled)."""
    n = len(jax.tree.leaves(train)[0])
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(n) for _ in range(steps * batch // n + 1)])
    for t in range(steps):
        idx = order[t * batch : (t + 1) * batch]
        yield {k: v[idx] for k, v in train.items()}


def learning_rate(base: float, schedule: str, steps: int):
    """The inner optimizer's learning rate: constant, or warm-up then cosine decay to 10%."""
    if schedule == "constant":
        return base
    return optax.warmup_cosine_decay_schedule(
        0.0, base, max(1, steps // 20), steps, end_value=base / 10
    )


def run(work: Workload, strategy, *, devices: int, steps: int, batch: int, eval_every: int,
        schedule: str = "constant", inner_lr: float | None = None):
    lr = learning_rate(inner_lr or work.learning_rate, schedule, steps)
    tx = adaptjax.sync.sync_chain(optax.adamw(lr, weight_decay=1e-4), strategy)
    mesh = adaptjax.make_mesh(devices)
    state = adaptjax.init_state(work.params, tx, mesh)
    step = adaptjax.data_parallel_step(work.loss_fn, tx, mesh, sync=strategy)
    example = jax.tree.map(lambda v: v[:batch], work.train)
    report = adaptjax.wire_bytes(step.jitted, state, example)
    wire = strategy.amortised_bytes(report)
    val_loss = jax.jit(work.loss_fn)
    curve = []
    for t, b in enumerate(batches(work.train, steps, batch, seed=0), start=1):
        state, _ = step(state, b)
        if t % eval_every == 0 or t == steps:
            model = adaptjax.sync.consensus_params(state.params, state.opt_state)
            model = jax.device_put(jax.device_get(model), jax.devices()[0])
            curve.append((t, float(val_loss(model, work.val))))
    return wire, curve


def first_at(curve, target):
    return next((t for t, v in curve if v <= target), None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64, help="global batch (all replicas)")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=16)
    parser.add_argument("--target", type=float, default=0.15, help="validation loss to reach")
    parser.add_argument(
        "--workload", default="digits",
        help="digits, lm (examples/lm.py, small, dropout off) or module:function -> Workload",
    )
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer lr")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo's (Nesterov)")
    parser.add_argument(
        "--schedule", choices=("constant", "cosine"), default="constant",
        help="inner learning rate: constant, or 5%% warm-up then cosine decay to 10%%",
    )
    parser.add_argument(
        "--inner-lr", type=float, default=None,
        help="the inner learning rate of every strategy but S-SGD (default: the workload's, "
        "which S-SGD always uses; the DiLoCo paper tunes it separately)",
    )
    parser.add_argument("--quick", action="store_true", help="S-SGD and DiLoCo H=32 only")
    parser.add_argument(
        "--only", default=None, help="comma-separated strategy names to run (S-SGD always runs)"
    )
    args = parser.parse_args()

    if args.workload == "digits":
        work = digits_workload()
    elif args.workload == "lm":
        work = lm_workload()
    else:
        module, fn = args.workload.split(":")
        work = getattr(importlib.import_module(module), fn)()
    table = strategies(args.outer_lr, args.outer_momentum)
    names = ["S-SGD", "DiLoCo H=32"] if args.quick else list(table)
    if args.only:
        unknown = sorted(set(args.only.split(",")) - set(table))
        if unknown:
            parser.error(f"unknown strategies {unknown}; choose from {list(table)}")
        names = ["S-SGD", *[n for n in args.only.split(",") if n != "S-SGD"]]
    n_params = sum(x.size for x in jax.tree.leaves(work.params))
    print(f"{n_params} parameters, {args.devices} devices, global batch {args.batch}, "
          f"{args.steps} steps, AdamW inner optimizer ({args.schedule} learning rate), "
          f"validation every {args.eval_every} steps, "
          f"DiLoCo outer lr {args.outer_lr} momentum {args.outer_momentum} (Nesterov), "
          f"inner lr {args.inner_lr or work.learning_rate} (S-SGD {work.learning_rate})")
    results = {}
    for name in names:
        results[name] = run(
            work, table[name], devices=args.devices, steps=args.steps, batch=args.batch,
            eval_every=args.eval_every, schedule=args.schedule,
            inner_lr=None if name == "S-SGD" else args.inner_lr,
        )
    base_wire, base_curve = results["S-SGD"]
    base_loss, base_hit = base_curve[-1][1], first_at(base_curve, args.target)
    print(f"{'strategy':<16}{'bytes/dev/step':>16}{'vs S-SGD':>10}{'val loss':>10}"
          f"{'gap':>9}{'steps to ' + str(args.target):>16}{'vs S-SGD':>10}")
    for name, (wire, curve) in results.items():
        loss, hit = curve[-1][1], first_at(curve, args.target)
        ratio = base_wire / wire if wire else float("inf")
        hit_ratio = "-" if hit is None or base_hit is None else f"{hit / base_hit:.2f}x"
        gap = (loss - base_loss) / base_loss
        print(f"{name:<16}{wire:>16,.0f}{ratio:>9.1f}x{loss:>10.4f}{gap:>+9.1%}"
              f"{'never' if hit is None else hit:>16}{hit_ratio:>10}")
    if "DiLoCo H=32" in results:  # left out by --only
        d_wire, d_curve = results["DiLoCo H=32"]
        gap = (d_curve[-1][1] - base_loss) / base_loss
        print(f"diloco_bytes_ratio={base_wire / d_wire:.2f} diloco_loss_gap={gap:.4f}")


if __name__ == "__main__":
    main()
