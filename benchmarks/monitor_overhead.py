"""Monitor overhead: a plain data-parallel step vs the same step with monitors.

8 simulated CPU devices, an MLP of about 2M parameters, 32 samples per device.
Baseline: grads -> pmean -> adam. Monitored: grads -> adaptjax.sync_gradients
with GradientNoiseScale + GradientSNR -> adam, once per ``--norm-chunks``
setting (default: 1, the exact norm passes, and the library's default). All
steps are the same hand-written shard_map function; only the sync
transformation differs. Runs are interleaved (A, B, C, ... in a fresh random
order each round) over a cycle of batches and the medians compared; an
identical copy of the baseline gives the noise floor. Each variant runs as
``--instances`` separate instances (default 2), each with its own buffers, and
a round's time is their mean: on a shared machine two identical programs run
at steadily different speeds for a whole process (up to 20% here, wherever
their buffers landed), which one instance each would read as overhead.

The monitors never change the update (the mean gradient is the same psum), so
every variant sees the same gradients at every step: the spread of the chunked
noise scale around the exact one (``norm_chunks=1``) at the same step is the
variance that chunking adds to the estimate.

Each variant's minor page faults per step are printed beside its time. On
XLA:CPU a step's temporary buffers (16 MB per device here) are malloc'ed and
freed every step; with glibc's default per-thread arenas a freed heap can go
back to the OS and be faulted in and zeroed again on the next step. Which
program that happens to depends on the process (0 to about 4,000 faults per
step here, for the plain and the monitored step alike), and it moved the
monitored/plain ratio between 1.02 and 1.16 from run to run. ``--steady-malloc``
restarts the benchmark with :data:`STEADY_MALLOC` in its environment (one
arena, no trimming), which keeps those buffers mapped: the remaining ratio is
what the monitors cost.

Usage:
  python benchmarks/monitor_overhead.py [--steps 250] [--norm-chunks 1 16]
      [--steady-malloc]

The last line is ``monitor_overhead_ratio=<monitored median / plain median>
monitor_overhead_vs_sync=<monitored median / sync median>`` for the last
``--norm-chunks`` value (the library's default unless given); ``sync`` is
``adaptjax.sync_gradients`` without monitors, so the second ratio is what the
monitors alone cost. ``se=`` after the first ratio is its bootstrap standard
error over the rounds (how far it moves between runs from the sampling of
rounds alone). It ends with ``noise_floor=<identical copy / plain>
malloc=<default or steady>``.
"""

import argparse
import inspect
import os
import resource
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import adaptjax  # noqa: E402

#: glibc malloc settings that keep freed memory mapped in one arena (read at process start).
STEADY_MALLOC = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
}


def restart_with_steady_malloc():
    """Re-executes this script with :data:`STEADY_MALLOC` set, unless it already is."""
    if malloc_setting() == "steady":
        return
    os.environ.update(STEADY_MALLOC)
    os.execv(sys.executable, [sys.executable, *sys.argv])


def malloc_setting():
    """``"steady"`` when :data:`STEADY_MALLOC` is in force, else ``"default"``."""
    steady = all(os.environ.get(k) == v for k, v in STEADY_MALLOC.items())
    return "steady" if steady else "default"


def minor_faults():
    """This process's minor page faults so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def bootstrap_standard_error(statistic, *samples, resamples=2000, seed=0):
    """The bootstrap standard error of ``statistic(*samples)``, the samples resampled as
    pairs: how far a reported figure moves between runs from the sampling of its rounds
    (or blocks) alone."""
    samples = [np.asarray(x) for x in samples]
    picks = np.random.default_rng(seed).integers(0, len(samples[0]),
                                                 size=(resamples, len(samples[0])))
    return float(np.std([statistic(*(x[p] for x in samples)) for p in picks]))


def ratio_of_medians(a, b):
    return np.median(a) / np.median(b)


SIZES = (784, 1024, 1024, 256, 10)  # 784*1024 + 1024*1024 + 1024*256 + 256*10 ≈ 2.1M


def make_arrays(n=4096, seed=0):
    """``n`` random samples for the MLP: ``{"x": float32 (n, SIZES[0]), "y": int32 labels}``."""
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(n, SIZES[0])).astype(np.float32),
        "y": rng.integers(0, SIZES[-1], size=n).astype(np.int32),
    }


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True)):
        params[f"w{i}"] = jnp.asarray(rng.normal(size=(a, b)).astype(np.float32) / np.sqrt(a))
        params[f"b{i}"] = jnp.zeros(b, jnp.float32)
    return params


def loss_fn(params, batch):
    h = batch["x"]
    n = len(SIZES) - 1
    for i in range(n):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            h = jax.nn.relu(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()


def pmean_gradients(axis_name):
    """The plain optax baseline: average gradients with one pmean."""
    return optax.GradientTransformation(
        lambda params: optax.EmptyState(),
        lambda g, s, params=None: (jax.lax.pmean(g, axis_name), s),
    )


def build_step(tx, mesh, local_batch):
    def local_step(params, opt_state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params, local_batch_size=local_batch)
        return optax.apply_updates(params, updates), opt_state

    fn = jax.shard_map(
        local_step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()), check_vma=False
    )
    return jax.jit(fn, donate_argnums=(0, 1))


def main():
    default_chunks = inspect.signature(adaptjax.sync_gradients).parameters["norm_chunks"].default
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--monitor-every", type=int, default=1)
    parser.add_argument("--instances", type=int, default=2,
                        help="separate instances of each variant, averaged (see the docstring)")
    parser.add_argument(
        "--norm-chunks",
        type=int,
        nargs="+",
        default=sorted({1, default_chunks}),
        help="rotating-chunk sampling of the norm passes (1 = exact); several settings "
        "are measured side by side",
    )
    parser.add_argument("--steady-malloc", action="store_true",
                        help="restart with glibc's malloc kept in one untrimmed arena "
                        "(see the docstring)")
    args = parser.parse_args()
    if args.steady_malloc:
        restart_with_steady_malloc()

    mesh = adaptjax.make_mesh(8)
    per_device = 32
    global_batch = per_device * 8
    params = init_params()
    n_params = sum(x.size for x in jax.tree.leaves(params))
    monitors = (adaptjax.GradientNoiseScale(), adaptjax.GradientSNR())
    variants = {
        "plain": optax.chain(pmean_gradients("data"), optax.adam(1e-3)),
        # An identical copy of the baseline: its ratio to "plain" is the noise floor.
        "plain_again": optax.chain(pmean_gradients("data"), optax.adam(1e-3)),
    }
    # The same sync without monitors: adaptjax's one all-reduce with the mean fused
    # into the optimizer can be faster than the pmean above, so this isolates the
    # monitors' own cost.
    variants["sync"] = optax.chain(adaptjax.sync_gradients("data", monitors=()),
                                   optax.adam(1e-3))
    for c in args.norm_chunks:
        variants[f"chunks={c}"] = optax.chain(
            adaptjax.sync_gradients(
                "data", monitors=monitors, monitor_every=args.monitor_every, norm_chunks=c
            ),
            optax.adam(1e-3),
        )
    sharding = jax.NamedSharding(mesh, P("data"))
    data = make_arrays(8 * global_batch)
    batches = [
        jax.device_put(jax.tree.map(lambda x, i=i: x[i::8], data), sharding) for i in range(8)
    ]
    steps, states = {}, {}
    for name, tx in variants.items():
        steps[name] = build_step(tx, mesh, per_device)
        for j in range(args.instances):
            # Host copies, then device_put: every leaf gets its own (donatable) buffer.
            host = jax.tree.map(np.array, (params, tx.init(params)))
            key = (name, j)
            states[key] = jax.device_put(host, jax.NamedSharding(mesh, P()))
            for i in range(3):  # compile and warm up
                states[key] = steps[name](*states[key], batches[i])
            jax.block_until_ready(states[key])
    keys = list(states)
    times = {key: [] for key in keys}
    faults = {name: 0 for name in variants}
    noise = {name: [] for name in variants if name.startswith("chunks=")}
    order = np.random.default_rng(0)
    for t in range(args.steps):
        batch = batches[t % len(batches)]
        # A fresh order each round: load that drifts within a round biases no variant.
        for k in order.permutation(len(keys)):
            key = keys[k]
            f0 = minor_faults()
            t0 = time.perf_counter()
            states[key] = steps[key[0]](*states[key], batch)
            jax.block_until_ready(states[key])
            times[key].append(time.perf_counter() - t0)
            faults[key[0]] += minor_faults() - f0
        for name in noise:  # read after timing: not part of the step
            noise[name].append(adaptjax.read_metrics(states[name, 0][1])["noise_scale"])
    # a round's time for a variant: the mean over its instances
    rounds = {name: np.mean([times[name, j] for j in range(args.instances)], axis=0)
              for name in variants}
    med = {name: float(np.median(t)) for name, t in rounds.items()}
    print(
        f"params={n_params} devices=8 per_device_batch={per_device} steps={args.steps} "
        f"monitor_every={args.monitor_every} norm_chunks={args.norm_chunks} "
        f"(library default {default_chunks}), {args.instances} instances of each "
        f"(load average {os.getloadavg()[0]:.1f}), malloc {malloc_setting()}"
    )
    per_step = args.steps * args.instances
    for name in variants:
        print(f"{name:>12}: median {med[name] * 1e3:8.2f} ms  ratio {med[name] / med['plain']:.4f}"
              f"  page faults/step {faults[name] / per_step:7.0f}")
    print(f"noise floor (identical steps): {med['plain_again'] / med['plain']:.4f}")
    exact = np.asarray(noise.get("chunks=1", []))
    for name, values in noise.items():
        if name == "chunks=1" or not exact.size:  # nothing exact to compare with
            continue
        rel = np.asarray(values)[20:] / exact[20:] - 1.0  # after the EMA's first steps
        own = np.std(exact[20:]) / np.mean(exact[20:])
        print(
            f"{name}: noise_scale vs exact at the same step (EMA decay 0.95): "
            f"relative std {np.std(rel):.4f}, mean {np.mean(rel):+.4f}; the exact "
            f"estimate's own step-to-step relative std {own:.4f}"
        )
    last = f"chunks={args.norm_chunks[-1]}"
    se = bootstrap_standard_error(ratio_of_medians, rounds[last], rounds["plain"])
    print(f"monitor_overhead_ratio={med[last] / med['plain']:.4f} se={se:.4f} "
          f"monitor_overhead_vs_sync={med[last] / med['sync']:.4f} "
          f"noise_floor={med['plain_again'] / med['plain']:.4f} malloc={malloc_setting()}")


if __name__ == "__main__":
    main()
