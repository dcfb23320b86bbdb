"""Monitor overhead: a plain data-parallel step vs the same step with monitors.

8 simulated CPU devices, an MLP of about 2M parameters, 32 samples per device.
Baseline: grads -> pmean -> adam. Monitored: grads -> adaptjax.sync_gradients
with GradientNoiseScale + GradientSNR -> adam. Both steps are the same
hand-written shard_map function; only the sync transformation differs. Runs
are interleaved (A, B, A, B, ...) and the medians compared.

Usage:
  python benchmarks/monitor_overhead.py [--steps 250] [--norm-chunks 16]

The last line is ``monitor_overhead_ratio=<monitored median / plain median>``.
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import adaptjax  # noqa: E402

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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--monitor-every", type=int, default=1)
    parser.add_argument(
        "--norm-chunks",
        type=int,
        default=16,
        help="rotating-chunk sampling of the norm passes (1 = exact)",
    )
    args = parser.parse_args()

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
        "monitored": optax.chain(
            adaptjax.sync_gradients(
                "data",
                monitors=monitors,
                monitor_every=args.monitor_every,
                norm_chunks=args.norm_chunks,
            ),
            optax.adam(1e-3),
        ),
    }
    batch = jax.device_put(make_arrays(global_batch), jax.NamedSharding(mesh, P("data")))
    steps, states = {}, {}
    for name, tx in variants.items():
        steps[name] = build_step(tx, mesh, per_device)
        # Host copies, then device_put: every leaf gets its own (donatable) buffer.
        host = jax.tree.map(np.array, (params, tx.init(params)))
        states[name] = jax.device_put(host, jax.NamedSharding(mesh, P()))
        for _ in range(3):  # compile and warm up
            states[name] = steps[name](*states[name], batch)
        jax.block_until_ready(states[name])
    times = {name: [] for name in variants}
    for _ in range(args.steps):
        for name in variants:
            t0 = time.perf_counter()
            states[name] = steps[name](*states[name], batch)
            jax.block_until_ready(states[name])
            times[name].append(time.perf_counter() - t0)
    med = {name: float(np.median(t)) for name, t in times.items()}
    print(
        f"params={n_params} devices=8 per_device_batch={per_device} steps={args.steps} "
        f"monitor_every={args.monitor_every} norm_chunks={args.norm_chunks}"
    )
    for name in variants:
        print(f"{name:>10}: median {med[name] * 1e3:8.2f} ms")
    print("metrics:", adaptjax.read_metrics(states["monitored"][1]))
    print(f"noise floor (identical steps): {med['plain_again'] / med['plain']:.4f}")
    print(f"monitor_overhead_ratio={med['monitored'] / med['plain']:.4f}")


if __name__ == "__main__":
    main()
