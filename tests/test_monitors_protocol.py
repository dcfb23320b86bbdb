"""A monitor written by a user, through the documented adaptjax.GradientMonitor protocol."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax
from adaptjax._tree import tree_sq_norm


class ReplicaSpread:
    """Mean over replicas of ‖g_i‖² and of ‖g_i − Ḡ‖², plus a step counter in its state."""

    def metric_names(self):
        return ("replica_sq", "replica_spread", "spread_steps")

    def init(self, params):
        del params
        return jnp.zeros((), jnp.int32)

    def local_scalars(self, local_grads, state):
        del state
        return {"sq": tree_sq_norm(local_grads)}

    def update(self, stats, state, **extra):
        mean_sq_local = stats.summed["sq"] / stats.n_replicas
        # Σ_i ‖g_i − Ḡ‖² / n = mean ‖g_i‖² − ‖Ḡ‖² (an identity, no extra collective).
        spread = mean_sq_local - tree_sq_norm(stats.mean_grads)
        state = state + 1
        return state, {
            "replica_sq": mean_sq_local,
            "replica_spread": spread,
            "spread_steps": state.astype(jnp.float32),
        }


def _loss(p, b):
    return 0.5 * jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def test_user_monitor_values_match_a_direct_computation():
    assert isinstance(ReplicaSpread(), adaptjax.GradientMonitor)
    n, d, local = 8, 5, 4
    mesh = adaptjax.make_mesh(n)
    tx = optax.chain(adaptjax.sync_gradients("data", monitors=(ReplicaSpread(),)), optax.sgd(0.0))
    step = adaptjax.data_parallel_step(_loss, tx, mesh)
    rng = np.random.default_rng(0)
    w = rng.normal(size=d).astype(np.float32)
    state = adaptjax.init_state({"w": jnp.asarray(w)}, tx, mesh)
    for _ in range(3):
        x = rng.normal(size=(n * local, d)).astype(np.float32)
        y = rng.normal(size=n * local).astype(np.float32)
        state, metrics = step(state, {"x": x, "y": y})
    # Replica i holds rows [i*local, (i+1)*local); its gradient is the mean over them.
    per_example = x * (x @ w - y)[:, None]
    g = per_example.reshape(n, local, d).mean(1).astype(np.float64)
    values = adaptjax.read_metrics(state.opt_state)
    assert values["replica_sq"] == pytest.approx(float((g**2).sum(1).mean()), rel=1e-4)
    spread = float(((g - g.mean(0)) ** 2).sum(1).mean())
    assert values["replica_spread"] == pytest.approx(spread, rel=1e-3)
    assert values["spread_steps"] == 3.0
    assert float(metrics["replica_spread"]) == values["replica_spread"]


def test_user_monitor_scalars_ride_the_one_gradient_all_reduce():
    mesh = adaptjax.make_mesh(8)
    tx = optax.chain(adaptjax.sync_gradients("data", monitors=(ReplicaSpread(),)), optax.sgd(0.1))
    step = adaptjax.data_parallel_step(_loss, tx, mesh)
    params = {"w": jnp.zeros(4096)}
    state = adaptjax.init_state(params, tx, mesh)
    batch = {"x": np.zeros((16, 4096), np.float32), "y": np.zeros(16, np.float32)}
    report = adaptjax.wire_bytes(step.jitted, state, batch)
    full = 2 * 7 / 8 * 4 * 4096
    big = [c for c in report.collectives if c.bytes >= 0.5 * full]
    assert len(big) == 1 and big[0].kind == "all-reduce", str(report)
    assert report.total - full <= 2 * 7 / 8 * 4 * 8  # a few scalars, not a second gradient


def test_an_object_that_is_not_a_monitor_is_a_clear_error():
    class NoLocalScalars:
        def metric_names(self):
            return ("x",)

        def init(self, params):
            return ()

        def update(self, stats, state, **extra):
            return state, {"x": jnp.zeros(())}

    with pytest.raises(ValueError, match="does not follow adaptjax.GradientMonitor"):
        adaptjax.sync_gradients("data", monitors=(NoLocalScalars(),))
    with pytest.raises(ValueError, match="does not follow adaptjax.GradientMonitor"):
        adaptjax.sync_gradients("data", monitors=(jax.numpy.sum,))
