"""Deployment search: what HeterBO spends probing before it finds a near-optimal cluster.

20 simulated jobs (issue 49 item 5). The catalogue has 3 device kinds — a
fast, dear one, a middle one and a slow, cheap one on a slow network — at
1–64 devices (powers of two), 5 global batches and every ``data × fsdp``
mesh whose state fits the kind's memory. Each job draws a transformer-sized
model (1e8–3e9 parameters, 6 FLOP per parameter and token, 512 tokens per
sample), its remaining samples and a deadline: the 30th percentile of the
job's true hours over all deployments (30% meet it; the searches see only
the number).

**Truth.** The searches see the catalogue's spec sheet: peak FLOP/s, the
nominal bandwidth, no latency or per-step overhead. The job's truth is the
same cost model (:meth:`adaptjax.costs.Catalogue.step_time`) fed what the
devices really deliver, drawn per job and kind: 30–90% of peak compute,
30–100% of the nominal bandwidth, 5–100 µs of latency per message step and
5–50 ms of overhead per step. Each probe returns the true seconds per step
times ``exp(0.05·N(0, 1))`` (5% multiplicative noise). So HeterBO's prior mean
is informative but wrong, as a spec sheet is.

**Measure.** A probe runs 20 steps and costs their seconds × the
deployment's price. For each job and method: the dollars spent probing until
the first probe of a deployment whose true cost is within 5% of the true
cheapest deployment meeting the deadline (probing stops there; a search that
gets no such probe in ``--max-probes`` is counted at what it spent, a lower
bound, and reported). Methods: HeterBO (the model as prior mean, expected
improvement per dollar of probing), plain EI (CherryPick: a constant mean,
three random probes first) and random search; the median over jobs of each,
and the ratios of medians.

Usage::

    python benchmarks/deployment_search.py [--jobs 20] [--max-probes 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import numpy as np

from adaptjax.costs import Catalogue, search_deployment

KINDS = (  # name, $/device-hour, peak FLOP/s, bandwidth B/s, memory GiB
    ("fast", 4.0, 4e14, 5e10, 80),
    ("mid", 1.5, 1.2e14, 1.25e10, 40),
    ("slow", 0.4, 3e13, 1.25e9, 16),
)
BATCHES = (128, 256, 512, 1024, 2048)
PROBE_STEPS = 20


def catalogue(params: float, truth: dict | None = None) -> Catalogue:
    """The spec-sheet catalogue, or with ``truth`` ({name: dict}) what the devices deliver."""
    kinds = []
    for name, price, flops, bandwidth, memory in KINDS:
        kind = dict(name=name, price_per_hour=price, devices=[1, 64], flops=flops,
                    bandwidth=bandwidth, memory_gb=memory)
        if truth is not None:
            t = truth[name]
            kind.update(flops=flops * t["compute"], bandwidth=bandwidth * t["bandwidth"],
                        latency=t["latency"], step_overhead=t["overhead"])
        kinds.append(kind)
    return Catalogue.from_json({"model": {"parameters": params,
                                          "flops_per_sample": 6 * params * 512},
                                "batch_sizes": list(BATCHES), "kinds": kinds})


class _Found(Exception):
    pass


def one_job(rng: np.random.Generator, max_probes: int) -> dict[str, tuple[float, int, bool]]:
    """``{method: (dollars probing until a near-optimal probe, probes, found)}`` for one job."""
    params = float(10 ** rng.uniform(8, 9.5))
    truth = {name: dict(compute=rng.uniform(0.3, 0.9), bandwidth=rng.uniform(0.3, 1.0),
                        latency=rng.uniform(5e-6, 1e-4), overhead=rng.uniform(0.005, 0.05))
             for name, *_ in KINDS}
    spec, real = catalogue(params), catalogue(params, truth)
    samples = int(rng.uniform(2e6, 2e7))
    cands = real._candidates()
    hours = [math.ceil(samples / c.batch_size) * real._predict(c) / 3600 for c in cands]
    deadline = float(np.quantile(hours, 0.3))
    best = search_deployment(real, samples=samples, deadline=deadline)  # the true optimum
    price = {name: p for name, p, *_ in KINDS}
    out = {}
    for method in ("heterbo", "ei", "random"):
        noise = np.random.default_rng(rng.integers(2**31))
        spent = [0.0, 0]

        def probe(kind, mesh, batch, noise=noise, spent=spent):
            true = real.step_time(kind, mesh, batch)
            seconds = true * math.exp(0.05 * noise.standard_normal())
            devices = mesh["data"] * mesh["fsdp"]
            spent[0] += PROBE_STEPS * seconds * price[kind] * devices / 3600
            spent[1] += 1
            true_hours = math.ceil(samples / batch) * true / 3600
            if true_hours <= deadline and true_hours * price[kind] * devices <= 1.05 * best.cost:
                raise _Found
            return seconds

        try:
            search_deployment(spec, samples=samples, deadline=deadline, probe=probe,
                              method=method, probe_steps=PROBE_STEPS, max_probes=max_probes,
                              tolerance=0.0, seed=int(rng.integers(2**31)))
            out[method] = (spent[0], spent[1], False)
        except _Found:
            out[method] = (spent[0], spent[1], True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--max-probes", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    runs = [one_job(rng, args.max_probes) for _ in range(args.jobs)]
    cands = len(catalogue(1e8)._candidates()), len(catalogue(10**9.5)._candidates())
    print(f"{args.jobs} jobs; {cands[1]}-{cands[0]} deployments each (fewer hold a bigger model)")
    print(f"{'job':>4} {'heterbo $ (probes)':>19} {'plain ei $ (probes)':>19} "
          f"{'random $ (probes)':>19}")
    for j, r in enumerate(runs):
        cells = " ".join(f"{r[m][0]:>10.3f} ({r[m][1]:>3}){'' if r[m][2] else '+'}"
                         for m in ("heterbo", "ei", "random"))
        print(f"{j:>4} {cells}")
    medians = {m: statistics.median(r[m][0] for r in runs) for m in ("heterbo", "ei", "random")}
    for m, v in medians.items():
        missed = sum(not r[m][2] for r in runs)
        probes = statistics.median(r[m][1] for r in runs)
        print(f"{m}: median exploration ${v:.3f} in a median {probes:g} probes; {missed} of "
              f"{len(runs)} jobs found no "
              f"deployment within 5% of the optimum in {args.max_probes} probes ('+')")
    print(f"({time.perf_counter() - t0:.0f} s)")
    print(f"heterbo_vs_plain_ei={medians['ei'] / medians['heterbo']:.2f} "
          f"heterbo_vs_random={medians['random'] / medians['heterbo']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
