"""adaptjax.Metrics: named scalars as one vector leaf, and the step's metrics built on it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax
from adaptjax import Metrics


def test_scalars_pack_into_one_float32_leaf_and_read_back_by_name():
    m = Metrics.pack({"loss": jnp.float32(0.25), "count": jnp.int32(3), "ok": True, "x": 1.5})
    (leaf,) = jax.tree.leaves(m)
    assert leaf.shape == (4,) and leaf.dtype == jnp.float32
    assert list(m) == ["loss", "count", "ok", "x"] and len(m) == 4
    host = jax.device_get(m)
    assert isinstance(host, Metrics) and isinstance(host.values, np.ndarray)
    values = {k: float(v) for k, v in host.items()}
    assert values == {"loss": 0.25, "count": 3.0, "ok": 1.0, "x": 1.5}
    with pytest.raises(KeyError):
        m["missing"]


def test_names_are_structure_so_jit_and_tree_map_keep_them():
    m = Metrics.pack({"a": 1.0, "b": 2.0}, {"aux": {"acc": jnp.ones(2)}})
    doubled = jax.jit(lambda t: jax.tree.map(lambda v: 2 * v, t))(m)
    assert isinstance(doubled, Metrics) and list(doubled) == ["a", "b", "aux"]
    assert float(doubled["b"]) == 4.0 and doubled["aux"]["acc"].tolist() == [2.0, 2.0]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(m)]
    assert paths == [".values", ".extras['aux']['acc']"]  # Orbax's keys
    # different names are a different structure (a cond's branches must agree)
    assert jax.tree.structure(m) != jax.tree.structure(Metrics.pack({"b": 1.0, "a": 2.0}))


def test_no_names_no_leaf():
    empty = Metrics.pack({})
    assert jax.tree.leaves(empty) == [] and len(empty) == 0
    assert list(jax.tree.unflatten(jax.tree.structure(empty), [])) == []


def test_a_repeated_name_is_a_one_line_error():
    with pytest.raises(ValueError) as e:
        Metrics(("loss", "loss"), np.zeros(2, np.float32))
    assert str(e.value) == "metric names repeat: ['loss', 'loss'] []"
    with pytest.raises(ValueError) as e:
        Metrics.pack({"aux": 1.0}, {"aux": 2.0})
    assert "\n" not in str(e.value) and "repeat" in str(e.value)


def _loss(p, b):
    pred = b["x"] @ p["w"]
    return jnp.mean((pred - b["y"]) ** 2), {"mean_pred": jnp.mean(pred)}


def test_a_steps_metrics_and_the_syncs_state_are_one_buffer_each():
    mesh = adaptjax.make_mesh(4)
    monitors = (adaptjax.GradientNoiseScale(), adaptjax.GradientSNR(), adaptjax.GradientNorm())
    tx = optax.chain(adaptjax.sync_gradients("data", monitors=monitors), optax.sgd(0.1))
    step = adaptjax.data_parallel_step(_loss, tx, mesh, has_aux=True)
    params = {"w": jnp.asarray(np.linspace(-1.0, 1.0, 3), jnp.float32)}
    state = adaptjax.init_state(params, tx, mesh)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    y = rng.normal(size=16).astype(np.float32)
    new, metrics = step(state, {"x": x, "y": y})
    assert isinstance(metrics, Metrics)
    assert len(jax.tree.leaves(metrics)) == 2  # the scalars, and aux's one leaf
    assert isinstance(new.opt_state[0].metrics, Metrics)
    assert len(jax.tree.leaves(new.opt_state[0].metrics)) == 1
    host = jax.device_get(metrics)
    # the loss and aux are the global batch's; the monitors' values are the state's
    pred = x @ np.asarray(params["w"])
    np.testing.assert_allclose(host["loss"], np.mean((pred - y) ** 2), rtol=1e-5)
    np.testing.assert_allclose(host["aux"]["mean_pred"], pred.mean(), rtol=1e-5, atol=1e-6)
    from_state = adaptjax.read_metrics(new.opt_state)
    assert set(host) == {"loss", "nonfinite", "aux", *from_state}
    for name, value in from_state.items():
        assert float(host[name]) == value
    # ‖Ḡ‖ of the full batch's gradient: the mean over the four replicas' equal shares
    grad = 2 * x.T @ (pred - y) / len(y)
    np.testing.assert_allclose(host["grad_norm"], np.linalg.norm(grad), rtol=1e-5)
