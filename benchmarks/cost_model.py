"""Cost model accuracy: predicted vs measured step time on configurations it never saw.

On 8 simulated CPU devices (``--xla_force_host_platform_device_count=8``), an
MLP of about 333K parameters (128-512-512-10), SGD, and every codec of
``adaptjax.compression`` (plus the dense sync):

1. **Calibration** (what a run sees anyway): the α–β fit of each collective
   kind from timed micro-collectives (:func:`calibrate_links`),
   the dense step at 9 configurations (1, 2, 4 and 8 devices, several batch
   sizes, two with 2 micro-batches) and each codec at 2 configurations
   (2 devices x 64 and 8 devices x 128).
2. **Held out**: every codec and the dense sync at (4 devices, 64) and
   (6, 96), plus dense at (1, 128), (4, 128), (8, 128) and (2, 64 in 2
   micro-batches) — 26 configurations, none used in calibration.

3. **Held out on a real link** (issue 14: "where the multi-process network
   benchmark exists"; needs root and iproute2, else it is skipped and says
   so): the workload of ``benchmarks/network.py`` (an 8.4M-parameter MLP,
   1024-2048-2048-1024-10) across 2 processes x 1 CPU device joined by its
   veth pair capped at 1 Gbit/s, gloo. Its calibration is what a run there
   would have: the dense step at 4 configurations and each codec at 2
   devices x 64 timed in ONE process on 2 simulated devices (no network),
   and the link's α–β timed by :func:`calibrate_links` in
   the two processes. Held out: every codec and the dense sync at a global
   batch of 128 and 256 across the link (22 configurations, each differs from
   every calibration step in its link and its batch).

Every configuration is compiled first; then ``--rounds`` rounds time
``--steps`` steps of each configuration in a shuffled order (so the machine's
drifting load spreads over all of them) and the step time is the median over
rounds. The compiled step's collectives come from :func:`adaptjax.wire_bytes`.

Printed: per held-out configuration the predicted and measured step time and
the relative error; the median and 90th-percentile absolute relative error;
Kendall's τ between predicted and measured step times; and the planner's
choices: for each (devices, batch) of the grid the codec (or none) with the
lowest predicted step time, for each codec the configuration with the highest
predicted throughput, and the overall highest-throughput configuration — a
choice counts when its measured value is within 5% of the best measured one.
On the link, the planner picks the codec (or none) at each batch and the
highest-throughput configuration. The summary figures cover every held-out
configuration; Kendall's τ is the smaller of the two parts' τ (their step
times differ by 10x, so a τ over both together would count easy pairs).

On a shared machine the timings drift with other jobs' load (the summary line
prints the load average), so compare within one run only.

Usage::

    python benchmarks/cost_model.py [--rounds 9] [--steps 5] [--no-link] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

if __name__ == "__main__" and "--link-worker" in sys.argv:  # one device per process
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"
elif __name__ == "__main__":
    _FLAG = "--xla_force_host_platform_device_count=8"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("PJRT_NPROC", "16")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import adaptjax  # noqa: E402
from adaptjax import RunConfig, costs  # noqa: E402
from adaptjax import compression as ajc  # noqa: E402
from adaptjax._run_config import codec_key  # noqa: E402
from adaptjax.costs._calibrate import calibrate_links  # noqa: E402
from adaptjax.costs._model import Observation

SIZES = (128, 512, 512, 10)
NET_SIZES = (1024, 2048, 2048, 1024, 10)  # benchmarks/network.py's MLP
NET_CALIB = [("dense", 1, 64), ("dense", 1, 256), ("dense", 2, 64), ("dense", 2, 512)]
NET_BATCHES = (128, 256)  # global batch of the held-out steps across the link


def codecs() -> dict:
    return {
        "dense": None,
        "bf16": ajc.bf16(),
        "fp16": ajc.fp16(),
        "onebit": ajc.onebit(),
        "terngrad": ajc.terngrad(),
        "qsgd": ajc.qsgd(),
        "natural": ajc.natural(),
        "topk": ajc.topk(0.01),
        "randomk": ajc.randomk(0.01),
        "dgc": ajc.dgc(0.01),
        "powersgd": ajc.powersgd(4),
    }


def init_params(seed=0, sizes=SIZES):
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        params[f"w{i}"] = jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32)
        params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
    return params


def loss_fn(params, batch):
    h = batch["x"]
    layers = len(params) // 2
    for i in range(layers):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers - 1:
            h = jax.nn.relu(h)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]))


class Runner:
    """One configuration's compiled step, state and batch."""

    def __init__(self, name, codec, devices, batch, micro=1, sizes=SIZES):
        self.name = name
        self.config = RunConfig(devices, batch, micro, codec_key(codec))
        tx = optax.chain(adaptjax.sync_gradients("data", codec=codec), optax.sgd(0.01))
        mesh = adaptjax.make_mesh(devices)
        self.step = adaptjax.data_parallel_step(loss_fn, tx, mesh, microbatches=micro)
        self.state = adaptjax.init_state(init_params(sizes=sizes), tx, mesh)
        self.batch = make_batch(mesh, batch, sizes, seed=devices * 1000 + batch)
        # Compiled once: the executable both runs and is read for its collectives.
        self.compiled = self.step.jitted.lower(self.state, self.batch).compile()
        self.wire = adaptjax.wire_bytes(self.compiled)
        self.times, self.cpu_times = [], []
        self.run(2)  # warm up
        self.cpu_times.clear()

    def run(self, steps):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.state, metrics = self.compiled(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))
        self.cpu_times.append((time.process_time() - c0) / steps)
        return (time.perf_counter() - t0) / steps

    @property
    def measured(self):
        return statistics.median(self.times)

    @property
    def fastest(self):
        return min(self.times)

    @property
    def cpu(self):
        return statistics.median(self.cpu_times)


def time_rounds(runners: dict, rounds: int, steps: int, seed: int) -> None:
    """``rounds`` rounds of ``steps`` steps of every runner, in a shuffled order each round.

    The machine's drifting load then spreads over all of them; the same seed
    gives the same order in every process (their collectives pair up).
    """
    order = list(runners)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for spec in order:
            runners[spec].times.append(runners[spec].run(steps))


def make_batch(mesh, batch, sizes, seed):
    """A global batch of ``batch`` rows on ``mesh``; each process gives its own rows."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(seed)
    full = {"x": rng.normal(size=(batch, sizes[0])).astype(np.float32),
            "y": rng.integers(0, sizes[-1], size=(batch,)).astype(np.int32)}
    rows = batch // jax.process_count()
    start = jax.process_index() * rows
    sharding = NamedSharding(mesh, P("data"))
    return {k: jax.make_array_from_process_local_data(sharding, v[start:start + rows], v.shape)
            for k, v in full.items()}


# ---------------------------------------------------------------- the 1 Gbit/s link
def _network():
    """``benchmarks/network.py``: its namespaces, veth pair and gloo start-up."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import network

    return network


def link_worker(rank: int, coordinator: str, rounds: int, steps: int) -> dict:
    """One of the two processes across the link: calibrate it, time the held-out steps."""
    from adaptjax.costs._planner import _wire_json

    _network()._jax_start(rank, coordinator)  # gloo, jax.distributed.initialize
    t0 = time.perf_counter()
    # What a run there does at start-up; 4 MB too, the dense step sends 34 MB.
    links = calibrate_links(2, sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 22))
    t_links = time.perf_counter() - t0
    all_codecs = codecs()
    runners = {(name, b): Runner(name, all_codecs[name], 2, b, sizes=NET_SIZES)
               for b in NET_BATCHES for name in all_codecs}
    time_rounds(runners, rounds, steps, seed=0)
    return {
        "links": {k: [v.alpha, v.beta, v.pinned, v.alpha_operand] for k, v in links.items()},
        "links_seconds": t_links,
        "rows": [{"codec": name, "devices": 2, "batch_size": b, "microbatches": 1,
                  "wire": _wire_json(r.wire), "measured_s": r.measured,
                  "fastest_s": r.fastest} for (name, b), r in runners.items()],
    }


def _run_link_workers(rounds: int, steps: int) -> dict:
    net = _network()
    return net.run_pair(
        os.path.abspath(__file__),
        ["--link-worker", "--rounds", str(rounds), "--steps", str(steps)],
        f"{net.ADDR[0]}:{29500 + os.getpid() % 400 * 2}", "link worker")


def link_rows(args, local_links, all_codecs) -> list[dict] | None:
    """Held-out rows across the real link, predicted from a one-process calibration."""
    import dataclasses
    import shutil

    from adaptjax.costs._planner import _wire_from_json

    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        print("\nlink part skipped: it needs root and iproute2 (ip, tc) for the veth pair")
        return None
    t0 = time.perf_counter()
    calib = [*NET_CALIB, *[(name, 2, 64) for name in all_codecs if name != "dense"]]
    runners = {spec: Runner(spec[0], all_codecs[spec[0]], spec[1], spec[2], sizes=NET_SIZES)
               for spec in calib}
    time_rounds(runners, args.rounds, args.steps, seed=1)
    model = costs.StepTimeModel.fit(local_links, [
        Observation(r.config, r.wire, r.measured) for r in runners.values()])
    del runners
    print(f"\nlink workload {'-'.join(map(str, NET_SIZES))}: {len(calib)} calibration "
          f"configurations in one process on 2 simulated devices in "
          f"{time.perf_counter() - t0:.0f} s; compute model: {model.compute}")
    net = _network()
    net.setup("1gbit")
    try:
        result = _run_link_workers(args.rounds, args.steps)
    finally:
        net.teardown()
    veth = {k: costs.LinkModel(*v) for k, v in result["links"].items()}
    print(f"link calibrated in {result['links_seconds']:.1f} s across 2 processes "
          f"(veth, tbf 1gbit, gloo):")
    for kind, link in veth.items():
        print(f"  {kind:15s} alpha={link.alpha * 1e6:8.1f} us  beta={link.beta * 1e9:.4f} ns/B "
              f"({1 / link.beta / 1e6 if link.beta else float('inf'):.0f} MB/s)"
              f"  alpha per further operand={link.alpha_operand * 1e6:.1f} us")
    on_link = dataclasses.replace(model, links=veth)
    rows = []
    for row in result["rows"]:
        config = RunConfig(2, row["batch_size"], 1, codec_key(all_codecs[row["codec"]]))
        wire = _wire_from_json(row.pop("wire"))
        pred = on_link.predict(config, wire)
        rows.append({**row, "link": True, "bytes": wire.total, "predicted_s": pred.step_time,
                     "error": (pred.step_time - row["measured_s"]) / row["measured_s"]})
    return rows


def kendall_tau(a, b) -> float:
    from scipy.stats import kendalltau

    return float(kendalltau(a, b).statistic)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-link", action="store_true",
                        help="skip the held-out configurations across the 1 Gbit/s link")
    parser.add_argument("--link-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.link_worker:
        print(json.dumps(link_worker(args.rank, args.coordinator, args.rounds, args.steps)))
        return 0

    t_start = time.perf_counter()
    links = calibrate_links(8)
    t_links = time.perf_counter() - t_start
    print(f"links calibrated in {t_links:.1f} s (8 devices, {len(links)} kinds):")
    for kind, link in links.items():
        print(f"  {kind:15s} alpha={link.alpha * 1e6:8.1f} us  beta={link.beta * 1e9:.4f} ns/B"
              f"  alpha per further operand={link.alpha_operand * 1e6:.1f} us")

    all_codecs = codecs()
    calib, held = [], []
    for n, b, k in [(1, 16, 1), (1, 64, 1), (2, 32, 1), (2, 128, 1), (4, 32, 1), (8, 64, 1),
                    (8, 256, 1), (4, 32, 2), (8, 128, 2)]:
        calib.append(("dense", n, b, k))
    for name in all_codecs:
        if name != "dense":
            calib += [(name, 2, 64, 1), (name, 8, 128, 1)]
    grid = [(4, 64), (6, 96)]
    for n, b in grid:
        held += [(name, n, b, 1) for name in all_codecs]
    held += [("dense", 1, 128, 1), ("dense", 4, 128, 1), ("dense", 8, 128, 1),
             ("dense", 2, 64, 2)]

    t0 = time.perf_counter()
    runners = {}
    for spec in calib + held:
        name, n, b, k = spec
        runners[spec] = Runner(name, all_codecs[name], n, b, k)
    print(f"compiled {len(runners)} configurations in {time.perf_counter() - t0:.0f} s")

    time_rounds(runners, args.rounds, args.steps, seed=0)

    obs = [Observation(runners[s].config, runners[s].wire, runners[s].measured)
           for s in calib]
    model = costs.StepTimeModel.fit(links, obs)
    print(f"compute model: {model.compute}")

    rows = []
    for spec in held:
        r = runners[spec]
        pred = model.predict(r.config, r.wire)
        rows.append({
            "codec": spec[0], "devices": spec[1], "batch_size": spec[2], "microbatches": spec[3],
            "bytes": r.wire.total, "predicted_s": pred.step_time, "measured_s": r.measured,
            "error": (pred.step_time - r.measured) / r.measured,
            "fastest_s": r.fastest,
        })
    print()
    print(f"{'codec':9s} {'dev':>3s} {'batch':>5s} {'mb':>2s} {'bytes/dev':>10s} "
          f"{'pred ms':>8s} {'meas ms':>8s} {'err':>7s}")
    for row in rows:
        print(f"{row['codec']:9s} {row['devices']:3d} {row['batch_size']:5d} "
              f"{row['microbatches']:2d} {row['bytes']:10.0f} {row['predicted_s'] * 1e3:8.2f} "
              f"{row['measured_s'] * 1e3:8.2f} {row['error'] * 100:6.1f}%")
    tau_sim = kendall_tau([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    on_link = None if args.no_link else link_rows(args, links, all_codecs)
    if on_link:
        print(f"\n{'across the link':15s} {'batch':>5s} {'bytes/dev':>10s} {'pred ms':>8s} "
              f"{'meas ms':>8s} {'err':>7s}")
        for row in on_link:
            print(f"{row['codec']:15s} {row['batch_size']:5d} {row['bytes']:10.0f} "
                  f"{row['predicted_s'] * 1e3:8.2f} {row['measured_s'] * 1e3:8.2f} "
                  f"{row['error'] * 100:6.1f}%")
        link_err = sorted(abs(r["error"]) for r in on_link)
        tau_link = kendall_tau([r["predicted_s"] for r in on_link],
                               [r["measured_s"] for r in on_link])
        print(f"across the link: median error {statistics.median(link_err):.3f}, p90 "
              f"{float(np.percentile(link_err, 90)):.3f}, kendall tau {tau_link:.3f}; simulated "
              f"devices: kendall tau {tau_sim:.3f}")
    held_rows = rows + (on_link or [])
    errors = sorted(abs(r["error"]) for r in held_rows)
    median = statistics.median(errors)
    p90 = float(np.percentile(errors, 90))
    # Step times on the link are ~10x those on simulated devices: a tau over both
    # together would count those easy pairs, so the smaller of the two is reported.
    tau = min(tau_sim, tau_link) if on_link else tau_sim
    # The same against each configuration's fastest round (load only ever adds time).
    model_min = costs.StepTimeModel.fit(links, [
        Observation(runners[s].config, runners[s].wire, runners[s].fastest) for s in calib])
    err_min = sorted(abs(model_min.predict(runners[s].config, runners[s].wire).step_time
                         - runners[s].fastest) / runners[s].fastest for s in held)
    print(f"\nagainst the fastest round instead of the median (side figure): median error "
          f"{statistics.median(err_min):.3f}, p90 {float(np.percentile(err_min, 90)):.3f}")
    # And against CPU seconds per step (all threads), which other jobs' load barely moves:
    # how well the model's structure fits when contention is taken out (side figure).
    model_cpu = costs.StepTimeModel.fit(links, [
        Observation(runners[s].config, runners[s].wire, runners[s].cpu) for s in calib])
    pred_cpu = [model_cpu.predict(runners[s].config, runners[s].wire).step_time for s in held]
    meas_cpu = [runners[s].cpu for s in held]
    err_cpu = sorted(abs(p - m) / m for p, m in zip(pred_cpu, meas_cpu, strict=True))
    print(f"against CPU seconds per step (side figure): median error "
          f"{statistics.median(err_cpu):.3f}, p90 {float(np.percentile(err_cpu, 90)):.3f}, "
          f"kendall tau {kendall_tau(pred_cpu, meas_cpu):.3f}")

    # The planner's choices, judged by measured values.
    cases = []
    for n, b in grid:
        group = [r for r in rows if (r["devices"], r["batch_size"], r["microbatches"]) == (n, b, 1)]
        cases.append((f"codec at {n}x{b}", group, lambda r: r["predicted_s"],
                      lambda r: r["measured_s"]))
    for name in all_codecs:
        group = [r for r in rows if r["codec"] == name]
        cases.append((f"config for {name}", group, lambda r: -r["batch_size"] / r["predicted_s"],
                      lambda r: -r["batch_size"] / r["measured_s"]))
    cases.append(("any config", rows, lambda r: -r["batch_size"] / r["predicted_s"],
                  lambda r: -r["batch_size"] / r["measured_s"]))
    for b in NET_BATCHES if on_link else ():
        group = [r for r in on_link if r["batch_size"] == b]
        cases.append((f"codec on link 2x{b}", group, lambda r: r["predicted_s"],
                      lambda r: r["measured_s"]))
    if on_link:
        cases.append(("any config on link", on_link,
                      lambda r: -r["batch_size"] / r["predicted_s"],
                      lambda r: -r["batch_size"] / r["measured_s"]))
    print()
    hits, best_dense = 0, 0
    for label, group, by_pred, by_meas in cases:
        pick = min(group, key=by_pred)
        best = min(group, key=by_meas)
        # Both are costs (seconds, or minus throughput): within 5% of the best measured.
        ok = abs(by_meas(pick)) <= 1.05 * abs(by_meas(best)) if by_meas(best) > 0 else (
            abs(by_meas(pick)) >= abs(by_meas(best)) / 1.05)
        hits += ok
        best_dense += best["codec"] == "dense"
        print(f"planner {label:22s} picks {pick['codec']:8s} {pick['devices']}x"
              f"{pick['batch_size']:<4d} best measured {best['codec']:8s} {best['devices']}x"
              f"{best['batch_size']:<4d} {'ok' if ok else 'MISS'}")
    within = hits / len(cases)
    link_note = (f" ({len(on_link)} of them across the 1 Gbit/s link)" if on_link else
                 " (none across a link)")
    print(f"\n{len(held_rows)} held-out configurations{link_note}, {len(calib)} calibration "
          f"configurations on simulated devices; "
          f"{len(cases)} planner cases ({best_dense} where the best is no compression); "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; medians of "
          f"{args.rounds} rounds x "
          f"{args.steps} steps; total {time.perf_counter() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": held_rows, "median": median, "p90": p90, "tau": tau,
                       "planner_within_5pct": within}, f, indent=1)
    print(f"cost_model_median_error={median:.3f} cost_model_p90_error={p90:.3f} "
          f"kendall_tau={tau:.3f} planner_within_5pct={within:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
