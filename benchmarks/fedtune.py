"""FedTune against the best single learning rate: per-replica inner rates on non-IID replicas.

Issue 49's figure. scikit-learn's digits (1797 8x8 images) are split three
ways per seed, stratified: a test set (20%), a small IID **proxy** set the
server holds (15% of the rest) and the replicas' data, split over 8 replicas
by a Dirichlet(α = 0.1) label skew (:class:`adaptjax.sync.SplitArrayDataset`).
The model is an MLP 64-128-10; each replica trains with SGD on 8 samples a
step; local SGD (``H = 8``) or DiLoCo (``H = 8``, outer Nesterov 0.7 / 0.9)
averages them; every run has the same rounds.

* **Best global rate.** One inner rate for every replica, swept over
  ``--grid`` (8 rates from 0.03 to 3, dense around the optimum: a coarse grid
  lets FedTune's continuous search win by resolution alone); the rate with
  the best mean test score over the seeds (the sweep sees the test set: the
  strongest baseline this split allows). FedTune searches the grid's range.
* **FedTune.** On the proxy set alone (never a replica's data), per seed:
  8 simulated clients at each heterogeneity level (Dirichlet α in
  ``--levels``); each level's best inner rate by GP expected improvement
  (:func:`adaptjax.sync.fedtune_search`, ``--probes`` proxy runs of
  the same rounds, judged by the consensus model's loss on the whole proxy
  set); the level's metric is its clients' mean gradient dissimilarity at
  the last sync. The fitted mapping (:class:`adaptjax.sync.LrMapping`) sets
  each real replica's rate from its own dissimilarity at the latest sync, as
  the :class:`adaptjax.sync.FedTune` policy does under the Controller: after
  the first round (run at the mapping's rate for the mean level) and again
  after every round as the metric drifts.

``--workload lm``: ``examples/lm.py``'s byte-level LM (the ``tiny`` size,
dropout off) on the standard library's sources, the replicas split by source
file (α over files), 4 windows per replica a step, the proxy set 10% of the
training windows drawn IID; the score is minus the validation loss (held-out
files), and the gain is in nats per byte.

Rates are per-replica factors on ``optax.sgd(1.0)``
(:func:`adaptjax.sync.set_replica_lr`), so one compiled step serves every
run and no rate change compiles. Accuracy is the consensus model's on the
test set after the last round.

Usage::

    python benchmarks/fedtune.py [--workload digits|lm] [--seeds 0 1 2] [--rounds 40]
        [--quick]

The last line is ``fedtune_gain=<FedTune's mean score minus the best global
rate's, per strategy: accuracy points on digits, nats on the LM>
fedtune_proxy_steps=<proxy steps per seed and strategy>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import adaptjax  # noqa: E402
import adaptjax.sync  # noqa: E402

REPLICAS = 8


@dataclasses.dataclass(frozen=True)
class Split:
    """One seed's data (dicts of arrays, a leading sample axis) and the replicas' split labels."""

    train: dict
    labels: np.ndarray  # what the Dirichlet split skews: a class, or a source file
    proxy: dict
    proxy_labels: np.ndarray
    test: dict


@dataclasses.dataclass(frozen=True)
class Workload:
    """What is trained: data per seed, the model, its loss, its test score (higher: better)."""

    name: str
    split: Callable[[int], Split]
    init_params: Callable[[int], Any]
    loss_fn: Callable[[Any, dict], jax.Array]
    score: Callable[[Any, dict], jax.Array]
    score_name: str
    per_replica: int = 8


def digits_split(seed: int) -> Split:
    """Stratified test (20%) and proxy (15% of the rest) sets; the replicas get the rest."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_rest, x_te, y_rest, y_te = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y)
    x_tr, x_px, y_tr, y_px = train_test_split(
        x_rest, y_rest, test_size=0.15, random_state=seed, stratify=y_rest)
    return Split({"x": x_tr, "y": y_tr}, y_tr, {"x": x_px, "y": y_px}, y_px,
                 {"x": x_te, "y": y_te})


def digits_params(seed: int) -> dict:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "l0": {"w": jax.random.normal(k1, (64, 128)) * np.sqrt(2 / 64), "b": jnp.zeros(128)},
        "l1": {"w": jax.random.normal(k2, (128, 10)) * np.sqrt(1 / 128), "b": jnp.zeros(10)},
    }


def digits_logits(p, x):
    h = jax.nn.relu(x @ p["l0"]["w"] + p["l0"]["b"])
    return h @ p["l1"]["w"] + p["l1"]["b"]


def digits_loss(p, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
        digits_logits(p, batch["x"]), batch["y"]).mean()


def digits_accuracy(p, batch):
    return jnp.mean(jnp.argmax(digits_logits(p, batch["x"]), -1) == batch["y"])


DIGITS = Workload("digits", digits_split, digits_params, digits_loss, digits_accuracy,
                  "accuracy")


def lm_workload(size: str = "tiny", train_bytes: int = 600_000) -> Workload:
    """``examples/lm.py``'s byte-level LM (dropout off), replicas split by source file.

    The proxy set is 10% of the training windows drawn at random (IID over
    the files); the test set is the validation files' windows; the score is
    minus the validation loss (nats per byte).
    """
    from flax import nnx

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    import lm
    import lm_data

    cfg = dataclasses.replace(lm.SIZES[size], dropout=0.0)
    graphdef, _, rest = nnx.split(lm.ByteLM(cfg, nnx.Rngs(0)), nnx.Param, ...)
    train, val, info = lm_data.load_corpus(context=cfg.context, max_train_bytes=train_bytes)
    sources = np.asarray(info["train_sources"])

    def split(seed: int) -> Split:
        order = np.random.default_rng(seed).permutation(len(train))
        px, tr = order[: len(train) // 10], order[len(train) // 10:]
        return Split({"tokens": train[tr]}, sources[tr], {"tokens": train[px]}, sources[px],
                     {"tokens": val[:512]})

    def loss_fn(p, batch):
        return lm.loss_fn(nnx.merge(graphdef, p, rest), batch)

    return Workload(
        "lm", split, lambda seed: nnx.split(lm.ByteLM(cfg, nnx.Rngs(seed)), nnx.Param, ...)[1],
        loss_fn, lambda p, batch: -loss_fn(p, batch), "-val loss", per_replica=4)


class Trainer:
    """One compiled step per strategy; a run: a fresh state, a data split, per-replica rates."""

    def __init__(self, work: Workload, strategy, rounds: int):
        self.work, self.rounds, self.H = work, rounds, strategy.H
        self.mesh = adaptjax.make_mesh(REPLICAS)
        self.tx = adaptjax.sync.sync_chain(optax.sgd(1.0), strategy)
        self.step = adaptjax.data_parallel_step(work.loss_fn, self.tx, self.mesh, sync=strategy)
        self.eval_loss = jax.jit(work.loss_fn)
        self.eval_score = jax.jit(work.score)

    def run(self, seed: int, data: dict, labels, alpha: float, rates) -> tuple[Any, list[dict]]:
        """Trains ``rounds`` rounds; ``rates(round, history) -> per-replica rates or None``.

        Returns the consensus params and each round's replica metrics.
        """
        ds = adaptjax.sync.SplitArrayDataset(
            labels, labels=labels, n_replicas=REPLICAS, alpha=alpha, seed=seed)
        state = adaptjax.init_state(self.work.init_params(seed), self.tx, self.mesh)
        history: list[dict] = []
        cursor, batch = 0, REPLICAS * self.work.per_replica
        for r in range(self.rounds):
            factors = rates(r, history)
            if factors is not None:
                opt = adaptjax.sync.set_replica_lr(state.opt_state, factors)
                state = dataclasses.replace(state, opt_state=opt)
            for _ in range(self.H):
                idx = ds.indices_at(cursor, batch)
                state, _ = self.step(state, {k: v[idx] for k, v in data.items()})
                cursor += batch
            history.append(adaptjax.sync.replica_metrics(state.opt_state))
        params = adaptjax.sync.consensus_params(state.params, state.opt_state)
        return jax.device_put(jax.device_get(params), jax.devices()[0]), history

    def score(self, params, data: dict) -> float:
        return float(self.eval_score(params, data))

    def loss(self, params, data: dict) -> float:
        return float(self.eval_loss(params, data))


def dissimilarity(history: list[dict]) -> np.ndarray:
    """Each replica's gradient dissimilarity at the latest sync in ``history``."""
    return np.array([history[-1][f"grad_dissimilarity/{i}"] for i in range(REPLICAS)])


def constant(lr: float):
    return lambda r, history: [lr] * REPLICAS if r == 0 else None


def proxy_search(trainer: Trainer, sp: Split, seed: int, levels, probes: int, grid):
    """FedTune's search on the proxy set: returns the ``FedTuneSearch``."""

    def run_proxy(alpha: float, lr: float) -> adaptjax.sync.ProxyRun:
        params, history = trainer.run(seed, sp.proxy, sp.proxy_labels, alpha, constant(lr))
        loss = trainer.loss(params, sp.proxy)
        loss = loss if np.isfinite(loss) else 1e3  # a diverged run: a large, finite loss
        metric = float(dissimilarity(history).mean())
        return adaptjax.sync.ProxyRun(metric, loss, trainer.rounds * trainer.H)

    return adaptjax.sync.fedtune_search(
        run_proxy, levels, min(grid), max(grid), probes=probes, seed=seed)


def fedtune_rates(mapping, start: float):
    """Round 0 at ``start``; then each replica's rate from its latest dissimilarity.

    What :class:`adaptjax.sync.FedTune` sets under the Controller: the mapping
    of each replica's metric at the latest sync.
    """

    def rates(r, history):
        if r == 0:
            return [start] * REPLICAS
        return [mapping(m) for m in dissimilarity(history)]

    return rates


def compare(trainer: Trainer, splits: dict, args, name: str) -> tuple[float, list[int]]:
    """The sweep of global rates and FedTune on every seed; FedTune's gain and proxy steps."""
    sweep = {}
    for lr in args.grid:
        sweep[lr] = [trainer.score(trainer.run(s, sp.train, sp.labels, args.alpha,
                                               constant(lr))[0], sp.test)
                     for s, sp in splits.items()]
        print(f"{name:<14} global lr {lr:<6g} {trainer.work.score_name} {_mean_spread(sweep[lr])}")
    best_lr = max(sweep, key=lambda lr: statistics.mean(sweep[lr]))
    tuned, steps = [], []
    for s, sp in splits.items():
        search = proxy_search(trainer, sp, s, args.levels, args.probes, args.grid)
        steps.append(search.steps)
        start = search.mapping(statistics.mean(m for m, _ in search.points))
        params, history = trainer.run(s, sp.train, sp.labels, args.alpha,
                                      fedtune_rates(search.mapping, start))
        tuned.append(trainer.score(params, sp.test))
        points = ", ".join(f"{m:.3g}->{lr:.3g}" for m, lr in search.points)
        final = ", ".join(f"{search.mapping(m):.3g}" for m in dissimilarity(history))
        print(f"{name:<14} seed {s} proxy (metric->lr) {points}; {search.steps} proxy steps; "
              f"replica rates {final}; {trainer.work.score_name} {tuned[-1]:.4f}")
    gain = statistics.mean(tuned) - statistics.mean(sweep[best_lr])
    print(f"{name:<14} best global lr {best_lr:g}: {_mean_spread(sweep[best_lr])}; "
          f"FedTune: {_mean_spread(tuned)}; gain {gain:+.4f}")
    return gain, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("digits", "lm"), default="digits")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--grid", type=float, nargs="+",
                        default=[0.03, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 3.0])
    parser.add_argument("--levels", type=float, nargs="+", default=[0.05, 0.3, 3.0, 100.0])
    parser.add_argument("--probes", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="one seed, 15 rounds, 4 probes")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.rounds, args.probes = args.seeds[:1], 15, 4
    t0 = time.perf_counter()
    work = DIGITS if args.workload == "digits" else lm_workload()
    splits = {s: work.split(s) for s in args.seeds}
    print(f"{work.name}, {REPLICAS} replicas, Dirichlet alpha={args.alpha}, "
          f"{work.per_replica} samples per replica a step, {args.rounds} rounds, "
          f"seeds {args.seeds}")
    strategies = {"local SGD H=8": adaptjax.sync.LocalSGD(H=8),
                  "DiLoCo H=8": adaptjax.sync.DiLoCo(H=8)}
    gains, proxy_steps = {}, []
    for name, strategy in strategies.items():
        gains[name], steps = compare(Trainer(work, strategy, args.rounds), splits, args, name)
        proxy_steps += steps
    print(f"{time.perf_counter() - t0:.0f} s")
    scale = 100 if work.name == "digits" else 1  # accuracy points; nats
    gain = ",".join(f"{k.split()[0]}:{scale * v:+.4f}" for k, v in gains.items())
    print(f"fedtune_gain={gain} fedtune_proxy_steps={int(statistics.mean(proxy_steps))}")
    return 0


def _mean_spread(values) -> str:
    return f"{statistics.mean(values):.4f} [{min(values):.4f}, {max(values):.4f}]"


if __name__ == "__main__":
    sys.exit(main())
