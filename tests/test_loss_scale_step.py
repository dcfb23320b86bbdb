"""float16 with dynamic loss scaling inside adaptjax.data_parallel_step.

The model is least squares, ``mse(W) = mean_i ‖x_i W − y_i‖²`` with ``W`` of
shape (8, 4), trained by plain gradient descent on the full batch, so each
float16 step can be held against the exact gradient (float64 numpy) by a
bound that follows from float16's rounding:

* float16 rounds each operation to a relative ``u = 2**-11`` (plus an
  absolute ``2**-25`` where a value is subnormal). The local gradient
  ``(2/n) Σ_i x_i r_iᵀ`` passes through at most ``k = d + n_local + 4``
  roundings per term (``W``'s cast, the ``d``-term dot product, the
  subtraction, the factor, the sum over the replica's rows), so each of its
  components errs by at most ``γ_k · A + η`` with ``γ_k = k u / (1 − k u)``,
  ``A = (2/N) |X|ᵀ (|X| |W| + |Y|)`` and ``η = (k + 2) · 2**-24``. The rest
  (unscaling by a power of two, the float32 all-reduce and update) is
  float32: ``2**-23`` of the values it touches.
* gradient descent on a quadratic with step ``lr ≤ 1/λ_max`` contracts
  errors by ``ρ = 1 − lr λ_min`` a step, so after ``T`` steps from 0 the
  parameters are within ``ρ^T ‖W*‖ + Σ_t ρ^(T−1−t) lr ‖δ_t‖`` of the
  optimum ``W*`` (``δ_t`` the step's gradient error, bounded as above).

The loss is weighted ``c = 2**-26`` (as a small auxiliary loss would be):
its cotangent entering the float16 backward pass, ``2**-26``, is below half
float16's smallest subnormal and rounds to zero, so without scaling every
float16 gradient is exactly zero and nothing trains. With
``initial_scale = 2**26`` the scaled cotangent is 1 and the unscaled
gradient is the true one within the bound.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax
from adaptjax import compression as ajc

U16 = 2.0**-11
C = 2.0**-26
RULE = adaptjax.FSDP(min_size=16)  # W (8, 4) lies over "fsdp" on the (2, 4) mesh
RNG = np.random.default_rng(0)
QUARTERS = np.array([-1.0, -0.75, -0.5, -0.25, 0.25, 0.5, 0.75, 1.0], np.float32)
X = RNG.choice(QUARTERS, size=(32, 8))  # exact in float16
W_STAR = RNG.choice(np.array([-1.0, -0.5, 0.5, 1.0], np.float32), size=(8, 4))
Y = X @ W_STAR  # multiples of 1/8 below 8 in magnitude: exact in float16
BATCH = {"x": X, "y": Y}
EIGS = np.linalg.eigvalsh(2.0 / len(X) * X.T.astype(np.float64) @ X)  # mse's Hessian
LR = float(np.float32(1.0 / EIGS[-1] / C)) * C  # the rate sgd(LR / C) applies to mse, exactly
RHO = 1.0 - LR * EIGS[0]
STEPS = 30


def mse(p, b):
    return jnp.mean(jnp.sum((b["x"] @ p["w"] - b["y"]) ** 2, axis=-1))


HALF = adaptjax.with_precision(mse, adaptjax.Precision("float16"))


def weighted_half(p, b):
    return HALF(p, b) * C  # the weight applied in float32, after the float16 model


def _gd_gradient(w):
    return 2.0 / len(X) * X.T.astype(np.float64) @ (X.astype(np.float64) @ w - Y)


def _gamma(k):
    return k * U16 / (1 - k * U16)


def _gradient_bound(w, w_next, n_local, codec_rel):
    """Per component: how far the step's gradient may be from the exact one (docstring)."""
    d = X.shape[1]
    ax, aw = np.abs(X).astype(np.float64), np.abs(w)
    # forward: r = x W - y errs by gamma_(d+2) (|x| |W| + |y|) (W's cast, d products and sums, -y)
    r_err = _gamma(d + 2) * (ax @ aw + np.abs(Y))
    # backward: (2/N) sum_i x_i r_i over the replica's rows: gamma_(n+2) of the terms, and r's error
    terms = 2.0 / len(X) * ax.T @ (np.abs(X @ w - Y) + r_err)
    g16 = 2.0 / len(X) * ax.T @ r_err + _gamma(n_local + 2) * terms
    subnormal = (d + n_local + 6) * 2.0**-24
    # float32: the unscaled gradient, its mean and the update (read back as (w - w_next) / LR)
    f32 = 2.0**-23 * (terms + (aw + np.abs(w_next)) / LR)
    return g16 + codec_rel * terms + subnormal + f32


def test_float16_gradients_of_the_weighted_loss_underflow_to_zero():
    grads = jax.grad(weighted_half)({"w": jnp.asarray(W_STAR) * 0.5}, BATCH)
    assert np.all(np.asarray(grads["w"]) == 0.0)


CASES = {
    "1d": (8, 1, None, False),
    "microbatches": (8, 2, None, False),
    "codec": (8, 1, ajc.bf16(min_size=1), False),
    "whole-tx": (8, 1, None, True),  # tx is the LossScaled itself: the default loss_scale
    "data-x-fsdp": ({"data": 2, "fsdp": 4}, 2, None, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_float16_with_loss_scaling_trains_like_exact_gradient_descent(case):
    shape, microbatches, codec, whole = CASES[case]
    mesh = adaptjax.make_mesh(shape)
    sync = adaptjax.sync_gradients("data", codec=codec)
    ls_args = {"initial_scale": 2.0**26, "period": 10_000}
    if whole:
        tx = adaptjax.dynamic_loss_scale(optax.chain(sync, optax.sgd(LR / C)), **ls_args)
        kwargs = {}
    else:
        ls = adaptjax.dynamic_loss_scale(optax.sgd(LR / C), **ls_args)
        tx, kwargs = optax.chain(sync, ls), {"loss_scale": ls}
    step = adaptjax.data_parallel_step(
        weighted_half, tx, mesh, microbatches=microbatches, sharding=RULE, **kwargs
    )
    state = adaptjax.init_state({"w": jnp.zeros((8, 4))}, tx, mesh, sharding=RULE)
    n_local = len(X) // int(mesh.shape["data"])
    # bf16 codec: each replica's gradient and their mean rounded to 2**-9 (compression.bf16's
    # docstring): at most 2**-8 of A together
    codec_rel = 0.0 if codec is None else 2.0**-8
    w, spread = np.zeros((8, 4)), 0.0
    for _ in range(STEPS):
        state, metrics = step(state, BATCH)
        assert float(metrics["nonfinite"]) == 0.0 and float(metrics["loss_scale"]) == 2.0**26
        w_next = np.asarray(jax.device_get(state.params["w"]), np.float64)
        bound = _gradient_bound(w, w_next, n_local, codec_rel)
        # each step is the exact gradient step within float16's rounding
        assert np.all(np.abs((w - w_next) / LR - _gd_gradient(w)) <= bound)
        spread = RHO * spread + LR * np.linalg.norm(bound)
        w = w_next
    limit = RHO**STEPS * np.linalg.norm(W_STAR) + spread
    assert np.linalg.norm(w - W_STAR) <= limit
    assert limit < 0.25 * np.linalg.norm(W_STAR)  # (without scaling W stays 0: ‖W*‖ away)


def _device_values(x) -> list[np.ndarray]:
    return [np.asarray(s.data) for s in x.addressable_shards]


@pytest.mark.parametrize("shape, microbatches", [(8, 1), ({"data": 2, "fsdp": 4}, 2)])
def test_a_nonfinite_step_is_skipped_everywhere_shrinks_and_period_finite_steps_grow(
    shape, microbatches
):
    mesh = adaptjax.make_mesh(shape)
    ls = adaptjax.dynamic_loss_scale(optax.sgd(0.05), initial_scale=2.0**10, period=2)
    tx = optax.chain(adaptjax.sync_gradients("data"), ls)
    step = adaptjax.data_parallel_step(
        HALF, tx, mesh, microbatches=microbatches, sharding=RULE, loss_scale=ls
    )
    state = adaptjax.init_state({"w": jnp.zeros((8, 4))}, tx, mesh, sharding=RULE)
    state, m = step(state, BATCH)  # finite: counted, the scale kept
    assert float(m["nonfinite"]) == 0.0 and float(m["loss_scale"]) == 2.0**10
    assert int(state.opt_state[1].good_steps) == 1
    before = _device_values(state.params["w"])
    bad = {"x": X.copy(), "y": Y}
    bad["x"][-1, 0] = np.nan  # the last replica's last row only
    state, m = step(state, bad)
    assert float(m["nonfinite"]) == 1.0 and int(state.nonfinite_count) == 1
    assert float(m["loss_scale"]) == 2.0**9 and int(state.opt_state[1].good_steps) == 0
    for old, new in zip(before, _device_values(state.params["w"]), strict=True):
        np.testing.assert_array_equal(new, old)  # on every device: every replica skipped
    state, m = step(state, BATCH)
    assert float(m["loss_scale"]) == 2.0**9 and int(state.opt_state[1].good_steps) == 1
    state, m = step(state, BATCH)  # the period-th finite step in a row: grows
    assert float(m["loss_scale"]) == 2.0**10 and int(state.opt_state[1].good_steps) == 0
    assert float(adaptjax.current_loss_scale(state)) == 2.0**10


def _one_line(info) -> str:
    text = str(info.value)
    assert "\n" not in text
    return text


def test_bad_loss_scale_arguments_say_so_in_one_line_before_compiling():
    mesh = adaptjax.make_mesh(8)
    ls = adaptjax.dynamic_loss_scale(optax.sgd(0.1))
    tx = optax.chain(adaptjax.sync_gradients("data"), ls)
    with pytest.raises(ValueError) as info:
        adaptjax.data_parallel_step(HALF, tx, mesh, loss_scale=ls, skip_nonfinite=False)
    assert _one_line(info).startswith("loss_scale needs skip_nonfinite=True")
    with pytest.raises(ValueError) as info:
        adaptjax.data_parallel_step(HALF, tx, mesh, loss_scale=optax.sgd(0.1))
    assert "loss_scale must be the adaptjax.dynamic_loss_scale(...) inside tx" in _one_line(info)
    with pytest.raises(ValueError) as info:
        adaptjax.data_parallel_step(HALF, tx, mesh)
    assert _one_line(info).startswith(
        "loss_fn computes in float16, whose gradients underflow without loss scaling: pass "
        "loss_scale=adaptjax.dynamic_loss_scale(optimizer)"
    )


def test_loss_scale_and_the_state_must_agree_at_trace_time():
    # raised while tracing (``lower``), before anything compiles
    mesh = adaptjax.make_mesh(8)
    ls = adaptjax.dynamic_loss_scale(optax.sgd(0.1))
    scaled = optax.chain(adaptjax.sync_gradients("data"), ls)
    plain = optax.chain(adaptjax.sync_gradients("data"), optax.sgd(0.1))
    params = {"w": jnp.zeros((8, 4))}
    step = adaptjax.data_parallel_step(mse, scaled, mesh)  # the LossScaled not passed
    with pytest.raises(ValueError) as info:
        step.lower(adaptjax.init_state(params, scaled, mesh), BATCH)
    assert _one_line(info).startswith("tx holds adaptjax.dynamic_loss_scale: pass that")
    step = adaptjax.data_parallel_step(mse, plain, mesh, loss_scale=ls)
    with pytest.raises(ValueError) as info:
        step.lower(adaptjax.init_state(params, plain, mesh), BATCH)
    assert "holds no LossScaleState" in _one_line(info)
