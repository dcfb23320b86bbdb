"""adaptjax.accumulate: k micro-steps are one step of their concatenated batch.

Replica r's gradient over k micro-steps of B/n rows each is the mean of its k
micro-gradients, which is its gradient over the kB/n rows it saw, so the
accumulated update equals one step on the batch that gives replica r exactly
those rows (float32 rounding: a sum in another order). The number of
micro-steps lives in the state, so changing it compiles nothing.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax
from adaptjax import compression as ajc

D, N = 8, 8


def _loss(p, b):
    h = jnp.tanh(b["x"] @ p["w"] + p["b"])
    return 0.5 * jnp.mean((h @ p["v"] - b["y"]) ** 2)


def _params():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.normal(size=(D, 64)).astype(np.float32) * 0.3),
            "b": jnp.zeros(64),
            "v": jnp.asarray(rng.normal(size=(64,)).astype(np.float32) * 0.3)}


def _micro_batches(k, rows, seed):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(rows, D)).astype(np.float32),
             "y": rng.normal(size=rows).astype(np.float32)} for _ in range(k)]


def _concatenated(micro):
    """The batch whose replica r holds replica r's rows of every micro-batch, in order."""
    rows = micro[0]["x"].shape[0] // N
    return {key: np.concatenate([m[key][r * rows:(r + 1) * rows] for r in range(N)
                                 for m in micro]) for key in micro[0]}


# the inner chains: dense S-SGD, a codec with error feedback, DiLoCo's inner steps
CHAINS = {
    "dense": lambda: optax.chain(adaptjax.sync_gradients("data"), optax.adam(1e-2)),
    "onebit+ef": lambda: optax.chain(
        adaptjax.sync_gradients("data", codec=ajc.onebit(min_size=64)), optax.adam(1e-2)),
    "diloco": lambda: adaptjax.sync.sync_chain(optax.adam(1e-2), adaptjax.sync.DiLoCo(H=2)),
}


@pytest.mark.filterwarnings("ignore:onebit.*trains worse than dense sync:UserWarning")
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_k_micro_steps_equal_one_step_of_their_batch(chain):
    k, steps = 3, 3  # DiLoCo: an outer step after two inner ones
    mesh = adaptjax.make_mesh(N)
    inner = CHAINS[chain]()
    big_step = adaptjax.data_parallel_step(_loss, inner, mesh)
    big = adaptjax.init_state(_params(), inner, mesh)
    tx = adaptjax.accumulate(CHAINS[chain](), micro_steps=k)
    step = adaptjax.data_parallel_step(_loss, tx, mesh)
    acc = adaptjax.init_state(_params(), tx, mesh)
    for t in range(steps):
        micro = _micro_batches(k, 4 * N, seed=t)
        big, _ = big_step(big, _concatenated(micro))
        before = {key: np.asarray(v) for key, v in acc.params.items()}
        for j, mb in enumerate(micro):
            acc, _ = step(acc, mb)
            if j < k - 1:  # nothing moves between
                for key, v in acc.params.items():
                    np.testing.assert_array_equal(np.asarray(v), before[key])
        # the params, and every buffer of the inner state (moments, residuals, local models)
        pairs = zip(jax.tree.leaves((acc.params, acc.opt_state.inner_state)),
                    jax.tree.leaves((big.params, big.opt_state)), strict=True)
        for a, b in pairs:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


def test_changing_the_micro_steps_compiles_nothing():
    mesh = adaptjax.make_mesh(N)
    tx = adaptjax.accumulate(optax.chain(adaptjax.sync_gradients("data"), optax.sgd(0.1)))
    step = adaptjax.data_parallel_step(_loss, tx, mesh)
    state = adaptjax.init_state(_params(), tx, mesh)
    moved = []
    for k in (1, 2, 4, 3):
        state = dataclasses.replace(state, opt_state=adaptjax.set_micro_steps(state.opt_state, k))
        before = {key: np.asarray(v) for key, v in state.params.items()}
        for j, mb in enumerate(_micro_batches(k, 2 * N, seed=k)):
            state, _ = step(state, mb)
            changed = any(not np.array_equal(np.asarray(v), before[key])
                          for key, v in state.params.items())
            moved.append(changed)
            assert changed == (j == k - 1)
    assert step.jitted._cache_size() == 1
    assert sum(moved) == 4


def test_the_noise_scale_reads_the_micro_steps_as_samples():
    """One replica, 8 micro-steps: the analytic B_simple of test_noise_scale_analytic."""
    d, sigma = 16, 1.0
    delta = np.full(d, 0.25, np.float32)  # ‖δ‖² = 1
    trace = (d + 1) * float(delta @ delta) + d * sigma**2
    mesh = adaptjax.make_mesh(1)
    mon = adaptjax.GradientNoiseScale(decay=0.99)
    tx = adaptjax.accumulate(
        optax.chain(adaptjax.sync_gradients("data", monitors=(mon,)), optax.sgd(0.0)),
        micro_steps=8)
    step = adaptjax.data_parallel_step(
        lambda p, b: 0.5 * jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), tx, mesh)
    state = adaptjax.init_state({"w": jnp.asarray(delta)}, tx, mesh)
    rng = np.random.default_rng(0)
    for _ in range(400 * 8):
        x = rng.normal(size=(8, d)).astype(np.float32)
        state, _ = step(state, {"x": x, "y": (sigma * rng.normal(size=8)).astype(np.float32)})
    values = adaptjax.read_metrics(state.opt_state)
    assert values["noise_scale"] == pytest.approx(trace / float(delta @ delta), rel=0.10)
    assert values["grad_variance"] == pytest.approx(trace, rel=0.10)


@pytest.mark.parametrize("bad", [0, -2])
def test_micro_steps_below_one_is_one_line(bad):
    with pytest.raises(ValueError, match=f"^micro_steps must be >= 1, got {bad}$"):
        adaptjax.accumulate(optax.sgd(0.1), micro_steps=bad)
    state = adaptjax.accumulate(optax.sgd(0.1)).init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match=f"^micro_steps must be >= 1, got {bad}$"):
        adaptjax.set_micro_steps(state, bad)


def test_set_micro_steps_without_accumulate_is_one_line():
    with pytest.raises(ValueError) as e:
        adaptjax.set_micro_steps(optax.sgd(0.1).init({"w": jnp.zeros(2)}), 2)
    assert str(e.value) == (
        "the optimizer state holds no adaptjax.accumulate(...) state; build the optimizer "
        "with adaptjax.accumulate(tx) to set micro-steps")
