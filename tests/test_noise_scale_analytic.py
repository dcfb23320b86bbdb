"""Noise scale, tr(Σ), SNR and norms against math you can state.

Linear regression with Gaussian inputs x ~ N(0, I_d), targets y = x·w* + ε,
ε ~ N(0, σ²), per-example loss ½(x·w − y)². At fixed w with δ = w − w*, the
per-example gradient x(xᵀδ − ε) has mean G = δ and covariance
Σ = ‖δ‖²I + δδᵀ + σ²I (Isserlis), so tr(Σ) = (d+1)‖δ‖² + dσ² and
B_simple = tr(Σ)/‖G‖².
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax

D = 16
SIGMA = 1.0


def _loss(p, b):
    return 0.5 * jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def _analytic(delta):
    d2 = float(np.sum(delta**2))
    trace = (D + 1) * d2 + D * SIGMA**2
    return trace / d2, trace, d2


def _run(monitors, *, devices, microbatches, batch, steps, delta, seed=0):
    """Runs the step with a zero learning rate so w stays at w* + δ."""
    mesh = adaptjax.make_mesh(devices)
    tx = optax.chain(adaptjax.sync_gradients("data", monitors=monitors), optax.sgd(0.0))
    step = adaptjax.data_parallel_step(_loss, tx, mesh, microbatches=microbatches)
    w_star = np.zeros(D, np.float32)
    state = adaptjax.init_state({"w": jnp.asarray(w_star + delta)}, tx, mesh)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = rng.normal(size=(batch, D)).astype(np.float32)
        y = (x @ w_star + SIGMA * rng.normal(size=batch)).astype(np.float32)
        state, metrics = step(state, {"x": x, "y": y})
    return adaptjax.read_metrics(state.opt_state), metrics


def _delta():
    return np.full(D, 0.25, np.float32)  # ‖δ‖² = 1


@pytest.mark.parametrize(
    "devices,microbatches,monitor_kwargs",
    [(8, 1, {}), (1, 8, {}), (1, 1, {"differencing": True}), (4, 2, {})],
    ids=["8-replicas", "1-replica-8-micro", "1-replica-differencing", "4x2"],
)
def test_noise_scale_matches_analytic_b_simple(devices, microbatches, monitor_kwargs):
    delta = _delta()
    b_simple, trace, g2 = _analytic(delta)
    mon = adaptjax.GradientNoiseScale(decay=0.99, **monitor_kwargs)
    values, metrics = _run(
        (mon,), devices=devices, microbatches=microbatches, batch=64, steps=400, delta=delta
    )
    assert values["noise_scale"] == pytest.approx(b_simple, rel=0.10)
    assert values["grad_variance"] == pytest.approx(trace, rel=0.10)
    assert values["grad_sqnorm"] == pytest.approx(g2, rel=0.10)
    assert float(metrics["noise_scale"]) == values["noise_scale"]


def test_noise_scale_never_negative_or_nan_on_noiseless_problem():
    # Every example has the same gradient (x fixed, no noise): tr(Σ) = 0, and the
    # unbiased per-step estimate of tr(Σ) is rounding noise around 0.
    mesh = adaptjax.make_mesh(8)
    tx = optax.chain(
        adaptjax.sync_gradients(
            "data",
            monitors=(adaptjax.GradientNoiseScale(decay=0.5), adaptjax.GradientSNR(decay=0.5)),
        ),
        optax.sgd(0.01),
    )
    step = adaptjax.data_parallel_step(_loss, tx, mesh)
    state = adaptjax.init_state({"w": jnp.ones(D)}, tx, mesh)
    x = np.tile(np.linspace(-1, 1, D, dtype=np.float32), (32, 1))
    for _ in range(30):
        state, m = step(state, {"x": x, "y": np.zeros(32, np.float32)})
        assert np.isfinite(float(m["noise_scale"])) and float(m["noise_scale"]) >= 0.0
        assert float(m["noise_scale"]) < 1e-2  # B_simple = 0 up to rounding
        assert np.isfinite(float(m["grad_snr"])) and float(m["grad_snr"]) >= 0.0


def test_no_gradient_signal_gives_finite_noise_scale():
    # δ = 0: ‖G‖² = 0, only noise. The estimate must stay finite and non-negative.
    mon = adaptjax.GradientNoiseScale(decay=0.9)
    values, _ = _run(
        (mon,), devices=8, microbatches=1, batch=32, steps=20, delta=np.zeros(D, np.float32)
    )
    assert np.isfinite(values["noise_scale"]) and values["noise_scale"] >= 0.0


def test_snr_and_variance_against_direct_per_example_computation():
    # A finite population of P examples; batches are drawn iid from it, so the
    # population's per-example gradients define G and Σ exactly.
    rng = np.random.default_rng(1)
    pop = 512
    x = rng.normal(size=(pop, D)).astype(np.float32)
    y = (x @ rng.normal(size=D) + rng.normal(size=pop)).astype(np.float32)
    w = jnp.asarray(rng.normal(size=D).astype(np.float32) * 0.3)
    per_example = jax.vmap(
        jax.grad(lambda w, xi, yi: 0.5 * (xi @ w - yi) ** 2), in_axes=(None, 0, 0)
    )(w, x, y)
    per_example = np.asarray(per_example, np.float64)
    g = per_example.mean(0)
    trace = float(((per_example - g) ** 2).sum(1).mean())
    batch = 64
    snr_true = float(g @ g) * batch / trace

    mesh = adaptjax.make_mesh(8)
    mons = (
        adaptjax.GradientNoiseScale(decay=0.99),
        adaptjax.GradientSNR(decay=0.99),
        adaptjax.GradientNorm(),
    )
    tx = optax.chain(adaptjax.sync_gradients("data", monitors=mons), optax.sgd(0.0))
    step = adaptjax.data_parallel_step(_loss, tx, mesh)
    state = adaptjax.init_state({"w": w}, tx, mesh)
    for _ in range(400):
        idx = rng.integers(0, pop, size=batch)
        state, m = step(state, {"x": x[idx], "y": y[idx]})
    values = adaptjax.read_metrics(state.opt_state)
    assert values["grad_variance"] == pytest.approx(trace, rel=0.10)
    assert values["grad_snr"] == pytest.approx(snr_true, rel=0.10)
    # grad_norm is exact for the last batch: the norm of its mean gradient.
    last = per_example[idx].mean(0)
    assert values["grad_norm"] == pytest.approx(float(np.linalg.norm(last)), rel=1e-4)


def test_preconditioned_noise_scale_equals_plain_when_preconditioner_is_uniform():
    # δ with equal coordinates and isotropic noise: E[ḡ_j²] is the same for every
    # j, so √v̂ is (nearly) a constant and B_simple is scale-invariant.
    delta = _delta()
    b_simple, _, _ = _analytic(delta)
    mon = adaptjax.GradientNoiseScale(decay=0.99, preconditioned=True, b2=0.99)
    values, _ = _run((mon,), devices=8, microbatches=1, batch=64, steps=400, delta=delta)
    assert values["precond_noise_scale"] == pytest.approx(b_simple, rel=0.15)


def test_update_norm_records_the_applied_update():
    tx = optax.chain(optax.sgd(0.5), adaptjax.update_norm())
    grads = {"a": jnp.array([6.0, 8.0])}
    updates, state = tx.update(grads, tx.init(grads))
    assert adaptjax.read_metrics(state)["update_norm"] == pytest.approx(5.0)
    assert float(jnp.linalg.norm(updates["a"])) == pytest.approx(5.0)
