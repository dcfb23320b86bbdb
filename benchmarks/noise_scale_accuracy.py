"""Noise-scale error against analytic truth at 200 and 1000 steps (issue 10, items 1-2).

Linear regression on 8 simulated CPU devices, 16 examples per device (global
batch 128), the weights held fixed (learning rate 0) so the truth is fixed.
Inputs x ~ N(0, diag(s²)), w* = 0, w = δ, noise σ = 1: the per-example gradient
has mean G = Sδ and covariance Σ = (δᵀSδ + σ²)S + GGᵀ, so
B_simple = tr Σ / ‖G‖² and Pollux's preconditioned B_pre = Σ P_j²Σ_jj / Σ P_j²G_j²
with P_j² = 1/E[ḡ_j²] = 1/(G_j² + Σ_jj/128).

Problems:
  item 1: preconditioned, s = logspace(-1, 1, 16), δ = 0.2   (B_pre = 167.5)
  item 2: plain, s = 1, δ_j = 1/√1001                         (B_simple = 1018)

Each row: mean and std over independent seeds of (estimate / truth − 1) at
steps 200 and 1000, and the fraction of steps flagged invalid.

Usage:
  python benchmarks/noise_scale_accuracy.py [--seeds 16]
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import adaptjax  # noqa: E402
from adaptjax._metrics import collect_metrics

D, SIGMA, LOCAL_BATCH, DEVICES, STEPS = 16, 1.0, 16, 8, 1000


def truth(scales, delta):
    s2 = np.asarray(scales, np.float64) ** 2
    g = s2 * delta
    diag = (float(np.sum(s2 * delta**2)) + SIGMA**2) * s2 + g**2
    p2 = 1.0 / (g**2 + diag / (LOCAL_BATCH * DEVICES))
    return float(diag.sum() / (g @ g)), float((p2 * diag).sum() / (p2 * g**2).sum())


def run(monitor, scales, delta, seeds):
    """Every step's metrics, shape (seeds, STEPS)."""
    mesh = adaptjax.make_mesh(DEVICES)
    tx = optax.chain(adaptjax.sync_gradients("data", monitors=(monitor,)), optax.adam(0.0))
    params = {"w": jnp.asarray(delta, jnp.float32)}
    sc = jnp.asarray(scales, jnp.float32)

    def loss(p, x, y):
        return 0.5 * jnp.mean((x @ p["w"] - y) ** 2)

    def one(params, key):
        me = jax.lax.axis_index("data")

        def body(state, t):
            kx, ky = jax.random.split(jax.random.fold_in(jax.random.fold_in(key, t), me))
            x = jax.random.normal(kx, (LOCAL_BATCH, D)) * sc
            y = SIGMA * jax.random.normal(ky, (LOCAL_BATCH,))
            g = jax.grad(loss)(params, x, y)
            _, state = tx.update(g, state, params, local_batch_size=LOCAL_BATCH)
            return state, collect_metrics(state)

        return jax.lax.scan(body, tx.init(params), jnp.arange(STEPS))[1]

    fn = jax.shard_map(
        lambda p, k: jax.vmap(one, in_axes=(None, 0))(p, k),
        mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False,
    )
    keys = jax.random.split(jax.random.key(1), seeds)
    return jax.tree.map(np.asarray, jax.jit(fn)(params, keys))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=16)
    args = parser.parse_args()
    iso = np.ones(D)
    aniso = np.logspace(-1, 1, D)
    item1 = np.full(D, 0.2)
    item2 = np.full(D, np.sqrt(1 / 1001))
    cases = [
        ("item1 precond decay=0.95", aniso, item1, 1, dict(decay=0.95, preconditioned=True)),
        ("item1 precond decay=0.99", aniso, item1, 1, dict(decay=0.99, preconditioned=True)),
        ("item2 plain   decay=0.95", iso, item2, 0, dict(decay=0.95)),
        ("item2 plain   decay=0.99", iso, item2, 0, dict(decay=0.99)),
    ]
    print(f"devices={DEVICES} global_batch={DEVICES * LOCAL_BATCH} seeds={args.seeds}")
    for label, scales, delta, which, kw in cases:
        mon = adaptjax.GradientNoiseScale(**kw)
        want = truth(scales, delta)[which]
        m = run(mon, scales, delta, args.seeds)
        est, valid = m[mon.name], m[mon.name + "_valid"]
        cols = []
        for t in (200, 1000):
            err = est[:, t - 1] / want - 1.0
            cols.append(f"step {t}: {err.mean():+.3f} ± {err.std():.3f}")
        print(
            f"{label}  truth {want:8.1f}  " + "  ".join(cols)
            + f"  invalid {1.0 - valid.mean():.3f}  max/truth {est.max() / want:.2f}"
        )


if __name__ == "__main__":
    main()
