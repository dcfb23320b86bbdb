"""Noise scale, tr(Σ), SNR and norms against math you can state.

Linear regression with Gaussian inputs x ~ N(0, I_d), targets y = x·w* + ε,
ε ~ N(0, σ²), per-example loss ½(x·w − y)². At fixed w with δ = w − w*, the
per-example gradient x(xᵀδ − ε) has mean G = δ and covariance
Σ = ‖δ‖²I + δδᵀ + σ²I (Isserlis), so tr(Σ) = (d+1)‖δ‖² + dσ² and
B_simple = tr(Σ)/‖G‖².
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _controller_args import make_controller  # noqa: E402

import adaptjax
from adaptjax._metrics import collect_metrics
from adaptjax._monitors import GradStats
from adaptjax._tree import tree_sq_norm

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


@pytest.mark.parametrize("microbatches,expected", [(None, 2), (1, 1)],
                         ids=["default-two-half-batches", "differencing"])
def test_controller_on_one_device_measures_the_noise_scale(tmp_path, microbatches, expected):
    # One device gives one gradient sample per step. By default the Controller then
    # splits the batch in two micro-batches; with microbatches=1 its noise scale
    # differences consecutive steps (a learning rate of 1e-7 keeps w ≈ w* + δ).
    delta = _delta()
    b_simple, _, _ = _analytic(delta)
    rng = np.random.default_rng(0)
    n = 64 * 400
    x = rng.normal(size=(n, D)).astype(np.float32)
    y = (SIGMA * rng.normal(size=n)).astype(np.float32)  # w* = 0
    ctrl = make_controller(
        model={"w": jnp.asarray(delta)}, loss_fn=_loss,
        optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=1e-7),
        data=adaptjax.ArrayDataset({"x": x, "y": y}),
        devices=1, batch_size=64, microbatches=microbatches, run_dir=tmp_path / "run",
        progress=False, tensorboard=False, compilation_cache_dir=None,
    )
    ctrl.run(400)
    ctrl.close()
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    rows = [r for r in rows if r["step"] > 200 and r["noise_scale_valid"] > 0]
    assert ctrl.config.microbatches == expected
    # the mean of the EMA over its last 200 steps: about 5 EMA lengths (decay 0.95)
    assert len(rows) == 200
    assert np.mean([r["noise_scale"] for r in rows]) == pytest.approx(b_simple, rel=0.2)


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


# --- Whole runs inside one jit: many seeds and 1000 steps in seconds -----------------------
#
# Inputs x ~ N(0, S), S = diag(s²), w* = 0, so the per-example gradient x(xᵀδ − ε) has
# mean G = Sδ and covariance Σ = (δᵀSδ + σ²)S + GGᵀ (Isserlis). The preconditioned noise
# scale (Pollux) weights coordinate j by P_j² = 1/E[ḡ_j²], ḡ the global-batch mean
# gradient, E[ḡ_j²] = G_j² + Σ_jj/B: B_pre = Σ_j P_j² Σ_jj / Σ_j P_j² G_j².


def _truth(scales, delta, sigma, global_batch):
    s2 = np.asarray(scales, np.float64) ** 2
    g = s2 * delta
    diag = (float(np.sum(s2 * delta**2)) + sigma**2) * s2 + g**2
    p2 = 1.0 / (g**2 + diag / global_batch)
    return float(diag.sum() / (g @ g)), float((p2 * diag).sum() / (p2 * g**2).sum())


def _scan_run(monitor, *, scales, delta, sigma, steps, seeds, local_batch=16, devices=8):
    """Every step's metrics, shape (seeds, steps), for ``seeds`` independent runs."""
    from jax.sharding import PartitionSpec as P

    mesh = adaptjax.make_mesh(devices)
    tx = optax.chain(adaptjax.sync_gradients("data", monitors=(monitor,)), optax.adam(0.0))
    params = {"w": jnp.asarray(delta, jnp.float32)}
    sc = jnp.asarray(scales, jnp.float32)

    def one(params, key):
        me = jax.lax.axis_index("data")

        def body(state, t):
            kx, ky = jax.random.split(jax.random.fold_in(jax.random.fold_in(key, t), me))
            x = jax.random.normal(kx, (local_batch, len(scales))) * sc
            y = sigma * jax.random.normal(ky, (local_batch,))
            g = jax.grad(_loss)(params, {"x": x, "y": y})
            _, state = tx.update(g, state, params, local_batch_size=local_batch)
            return state, collect_metrics(state)

        return jax.lax.scan(body, tx.init(params), jnp.arange(steps))[1]

    fn = jax.shard_map(
        lambda p, k: jax.vmap(one, in_axes=(None, 0))(p, k),
        mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False,
    )
    keys = jax.random.split(jax.random.key(0), seeds)
    return jax.tree.map(np.asarray, jax.jit(fn)(params, keys))


@pytest.mark.parametrize("decay,steps", [(0.99, 1000), (0.95, 300)])
def test_preconditioned_noise_scale_is_right_from_the_first_steps_the_averages_cover(
    decay, steps
):
    # Anisotropic inputs (scales 0.1..10) so preconditioning matters: B_pre = 167.5 while
    # B_simple = 4.7. An eps-only preconditioner at step 1 once made the first sample
    # ~1e16 and held the estimate at the unpreconditioned value for hundreds of steps.
    scales, delta, sigma = np.logspace(-1, 1, D), np.full(D, 0.2), 1.0
    plain, truth = _truth(scales, delta, sigma, 8 * 16)
    assert truth > 10 * plain
    mon = adaptjax.GradientNoiseScale(decay, preconditioned=True)
    m = _scan_run(mon, scales=scales, delta=delta, sigma=sigma, steps=steps, seeds=8)
    for t in (200, steps):
        err = m["precond_noise_scale"][:, t - 1] / truth - 1.0
        assert abs(err.mean()) < 0.12, (t, err)
        assert np.all(np.abs(err) < 0.5), (t, err)
        assert np.all(m["precond_noise_scale_valid"][:, t - 1] == 1.0)


def test_noise_dominated_readings_are_held_and_flagged_never_huge():
    # B_simple = 1018 against a global batch of 128: the smoothed ‖G‖² (decay 0.95)
    # sometimes dips to <= 0 or just above it; once read as ~1e31.
    delta, sigma = np.full(D, np.sqrt(1 / 1001)), 1.0
    truth, _ = _truth(np.ones(D), delta, sigma, 128)
    assert truth == pytest.approx(1018.0)
    mon = adaptjax.GradientNoiseScale(0.95)
    m = _scan_run(mon, scales=np.ones(D), delta=delta, sigma=sigma, steps=400, seeds=8)
    ns, valid = m["noise_scale"], m["noise_scale_valid"]
    assert set(np.unique(valid)) <= {0.0, 1.0}
    assert np.all(np.isfinite(ns)) and np.all(ns >= 0.0)
    assert ns.max() < 10 * truth  # never a number a policy would act on
    invalid = valid[:, 1:] == 0.0
    assert invalid[:, 20:].any()  # the case occurs here: the check below is not vacuous
    # An invalid step reports the previous step's value (held), with its companions.
    for key in ("noise_scale", "grad_sqnorm", "grad_variance"):
        assert np.array_equal(m[key][:, 1:][invalid], m[key][:, :-1][invalid]), key
    assert np.all(m["grad_sqnorm"][valid == 1.0] > 0.0)
    # Held values keep the estimate where it was: the median over steps is the truth
    # (within the spread of 8 runs of 300 strongly autocorrelated readings each).
    assert np.median(ns[:, 100:]) == pytest.approx(truth, rel=0.25)
    # SNR follows the same rule.
    snr = adaptjax.GradientSNR(0.95)
    m = _scan_run(snr, scales=np.ones(D), delta=delta, sigma=sigma, steps=100, seeds=2)
    assert np.all(np.isfinite(m["grad_snr"])) and np.all(m["grad_snr"] >= 0.0)
    assert set(np.unique(m["grad_snr_valid"])) == {0.0, 1.0}


@pytest.mark.parametrize("guard", [True, False])
def test_guard_hands_its_exact_local_norm_to_the_monitors(guard):
    # After one step the debiased EMAs are that step's estimates, and they invert to
    # s̄ = mean over replicas of ‖g_i‖²: mean_sq = g2 + var/(n·b), s̄ = mean_sq + var(n−1)/(n·b).
    # With the guard on, s̄ is exact although norm_chunks samples 1/32 of each big leaf;
    # without it, the monitors read one chunk and s̄ is only an estimate.
    n, b, d = 4, 8, 8192
    mesh = adaptjax.make_mesh(n)
    mon = adaptjax.GradientNoiseScale(significance=0.0)  # report the first estimate
    tx = optax.chain(adaptjax.sync_gradients("data", monitors=(mon,), norm_chunks=32),
                     optax.sgd(0.0))
    step = adaptjax.data_parallel_step(_loss_wide, tx, mesh, skip_nonfinite=guard)
    rng = np.random.default_rng(1)
    w = rng.normal(size=d).astype(np.float32)
    x = rng.normal(size=(n * b, d)).astype(np.float32)
    y = rng.normal(size=n * b).astype(np.float32)
    state = adaptjax.init_state({"w": jnp.asarray(w)}, tx, mesh)
    state, _ = step(state, {"x": x, "y": y})
    m = adaptjax.read_metrics(state.opt_state)
    mean_sq = m["grad_sqnorm"] + m["grad_variance"] / (n * b)
    s_bar = mean_sq + m["grad_variance"] * (n - 1) / (n * b)
    xs, ys = x.reshape(n, b, d).astype(np.float64), y.reshape(n, b).astype(np.float64)
    local = [xs[i].T @ (xs[i] @ w - ys[i]) / b + _PULL for i in range(n)]
    exact = np.mean([np.sum(g**2) for g in local])
    if guard:
        assert s_bar == pytest.approx(exact, rel=1e-4)
    else:
        assert abs(s_bar / exact - 1) > 1e-3


_PULL = 100.0  # a common gradient far above the noise, so the estimate is valid


def _loss_wide(p, b):
    return 0.5 * jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2) + _PULL * jnp.sum(p["w"])


def test_snr_next_to_an_identical_noise_scale_shares_its_state_and_values():
    # GradientSNR keeps a GradientNoiseScale's EMAs of its own. Next to an identical
    # noise-scale monitor it keeps none and derives the SNR from that monitor's metrics,
    # which must give exactly the standalone SNR, step by step (valid flag included).
    mesh = adaptjax.make_mesh(4)
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=D).astype(np.float32))
    batches = []
    for _ in range(12):
        x = rng.normal(size=(32, D)).astype(np.float32)
        batches.append({"x": x, "y": (x @ np.ones(D) + rng.normal(size=32)).astype(np.float32)})
    runs = {
        "shared": (adaptjax.GradientNoiseScale(decay=0.8), adaptjax.GradientSNR(decay=0.8)),
        "alone": (adaptjax.GradientSNR(decay=0.8),),
        "other decay": (adaptjax.GradientNoiseScale(decay=0.5), adaptjax.GradientSNR(decay=0.8)),
    }
    snr = {}
    for name, mons in runs.items():
        tx = optax.chain(adaptjax.sync_gradients("data", monitors=mons), optax.sgd(0.05))
        step = adaptjax.data_parallel_step(_loss, tx, mesh)
        state = adaptjax.init_state({"w": w}, tx, mesh)
        snr_state = state.opt_state[0].monitor_states[-1]
        assert (snr_state == ()) == (name == "shared")
        rows = []
        for b in batches:
            state, m = step(state, b)
            rows.append((float(m["grad_snr"]), float(m["grad_snr_valid"])))
        snr[name] = np.array(rows)
    assert snr["alone"][:, 1].max() == 1.0 and snr["alone"][-1, 0] > 0  # not vacuous
    np.testing.assert_allclose(snr["shared"], snr["alone"], rtol=1e-6)
    np.testing.assert_allclose(snr["other decay"], snr["alone"], rtol=1e-6)


def test_differencing_over_several_leaves_is_the_two_step_estimate():
    # One sample per step: after steps g1, g2 the first estimate is ‖G‖² = g2·g1 and
    # tr Σ = b‖g2 − g1‖²/2, over every leaf (the state keeps g1 as one flat vector).
    rng = np.random.default_rng(3)
    shapes = {"a": (3, 4), "b": (5,), "c": (2, 2, 2)}
    g1, g2 = ({k: jnp.asarray(rng.normal(size=s) + 1.0, jnp.float32) for k, s in shapes.items()}
              for _ in range(2))
    mon = adaptjax.GradientNoiseScale(differencing=True, significance=0.0, local_batch_size=8)
    state = mon.init(g1)
    assert state.prev_grads.shape == (12 + 5 + 8,)
    for g in (g1, g2):
        stats = GradStats(
            local_grads=g, mean_grads=g, local_sq=tree_sq_norm(g),
            mean_sq=tree_sq_norm(g), n_replicas=1, samples_per_replica=1,
            local_batch_size=8, summed={}, mean_sample=None,
        )
        state, metrics = mon.update(stats, state)
    flat = lambda t: np.concatenate([np.ravel(t[k]) for k in shapes])
    dot = float(flat(g2) @ flat(g1))
    var = 8 * float(np.sum((flat(g2) - flat(g1)) ** 2)) / 2
    assert float(metrics["grad_sqnorm"]) == pytest.approx(dot, rel=1e-5)
    assert float(metrics["grad_variance"]) == pytest.approx(var, rel=1e-5)
    assert float(metrics["noise_scale"]) == pytest.approx(var / dot, rel=1e-5)
    assert float(metrics["noise_scale_valid"]) == 1.0
