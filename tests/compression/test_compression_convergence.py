"""Top-k 1% + EF and onebit + EF reach the dense final loss within 1.5x the dense steps.

The problem: sklearn's handwritten digits (1797 real 8x8 images, bundled with
scikit-learn), a 64-128-10 tanh MLP, 8 replicas of 16 examples, plain SGD.
Both weight matrices (8192 and 1280 entries) go through the codec.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax
from adaptjax import compression as ajc

DENSE_STEPS = 100
LR = 0.5


def _data():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int32)


def _loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    logits = h @ p["w2"] + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def _train(codec, steps, x, y, target=None):
    """Full-dataset loss after every step (stopping once it reaches ``target``)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (64, 128)) / 8,
        "b1": jnp.zeros(128),
        "w2": jax.random.normal(k2, (128, 10)) / np.sqrt(128),
        "b2": jnp.zeros(10),
    }
    mesh = adaptjax.make_mesh(8)
    tx = optax.chain(adaptjax.sync_gradients("data", codec=codec), optax.sgd(LR))
    state = adaptjax.init_state(params, tx, mesh)
    step = adaptjax.data_parallel_step(_loss, tx, mesh)
    full = jax.jit(_loss)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        idx = rng.integers(0, len(x), 128)
        state, _ = step(state, {"x": x[idx], "y": y[idx]})
        losses.append(float(full(state.params, {"x": x, "y": y})))
        if target is not None and losses[-1] <= target:
            break
    return np.array(losses)


@pytest.mark.slow
def test_topk_and_onebit_with_error_feedback_reach_the_dense_loss():
    x, y = _data()
    dense = _train(None, DENSE_STEPS, x, y)
    target = dense[-1]
    assert target < 0.2  # the dense run really learned
    budget = int(1.5 * DENSE_STEPS)
    for codec in (ajc.topk(0.01), ajc.onebit()):
        assert codec.error_feedback == "ef14"
        losses = _train(codec, budget, x, y, target)
        reached = np.flatnonzero(losses <= target)
        assert reached.size, f"{codec.name}: best {losses.min():.4f} > dense {target:.4f}"
        assert reached[0] + 1 <= budget
