"""Per-replica optimizer state: derived shardings, moving meshes, merge rules."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import adaptjax


def replica_residual():
    """A toy transformation whose state differs per replica: it accumulates
    (replica index + 1) * grads into a PerReplica residual, and syncs with a pmean."""

    def init(params):
        return {"ef": adaptjax.PerReplica(jax.tree.map(jnp.zeros_like, params)),
                "count": jnp.zeros((), jnp.int32)}

    def update(grads, state, params=None, **_):
        r = (jax.lax.axis_index("data") + 1).astype(jnp.float32)
        ef = jax.tree.map(lambda e, g: e + r * g, state["ef"].value, grads)
        mean = jax.lax.pmean(grads, "data")
        return mean, {"ef": adaptjax.PerReplica(ef), "count": state["count"] + 1}

    return optax.GradientTransformationExtraArgs(init, update)


def _loss(p, b):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def _setup(devices):
    mesh = Mesh(np.array(devices), ("data",))
    tx = optax.chain(replica_residual(), optax.sgd(0.1))
    state = adaptjax.init_state({"w": jnp.ones(3)}, tx, mesh)
    step = adaptjax.data_parallel_step(_loss, tx, mesh, donate=False)
    return mesh, tx, state, step


def _batch(n=32):
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(n, 3)).astype(np.float32),
            "y": rng.normal(size=n).astype(np.float32)}


def test_shardings_are_derived_from_the_marker():
    mesh, _, state, step = _setup(jax.devices())
    ef = state.opt_state[0]["ef"].value["w"]
    assert ef.shape == (8, 3) and ef.sharding.spec == jax.P("data")
    assert state.opt_state[0]["count"].sharding.spec == jax.P()
    assert state.params["w"].sharding.spec == jax.P()
    new, _ = step(state, _batch())
    ef = np.asarray(new.opt_state[0]["ef"].value["w"])
    # Replica r added (r + 1) * g_r: rows differ, as the marker promised.
    assert len({tuple(row) for row in ef.round(6)}) == 8


def test_state_moves_to_another_mesh_with_device_put():
    _, _, state, step = _setup(jax.devices()[:4])
    state, _ = step(state, _batch())
    mesh_b = Mesh(np.array(jax.devices()[4:]), ("data",))
    moved = jax.device_put(state, adaptjax.train_state_shardings(state, mesh_b))
    assert moved.opt_state[0]["ef"].value["w"].sharding.device_set == set(jax.devices()[4:])
    np.testing.assert_array_equal(np.asarray(moved.opt_state[0]["ef"].value["w"]),
                                  np.asarray(state.opt_state[0]["ef"].value["w"]))
    step_b = adaptjax.data_parallel_step(_loss, optax.chain(replica_residual(), optax.sgd(0.1)),
                                         mesh_b, donate=False)
    after, _ = step_b(moved, _batch())
    assert int(after.step) == 2


@pytest.mark.parametrize("m", [2, 4, 16])
def test_merge_rules(m):
    old = np.arange(24, dtype=np.float32).reshape(8, 3)
    tree = {"mean": adaptjax.PerReplica(old, merge="mean"),
            "sum": adaptjax.PerReplica(old, merge="sum"),
            "first": adaptjax.PerReplica(old, merge="first"),
            "zeros": adaptjax.PerReplica(old, merge="zeros"),
            "custom": adaptjax.PerReplica(old, merge=lambda o, m: np.repeat(o[-1:], m, 0)),
            "shared": old}
    new = adaptjax.sync.merge_replicas(tree, m)
    assert new["shared"] is old  # replicated leaves are untouched
    np.testing.assert_allclose(new["mean"].value.mean(0), old.mean(0))  # EF debt preserved
    np.testing.assert_allclose(new["sum"].value.sum(0), old.sum(0))
    np.testing.assert_array_equal(new["first"].value, np.repeat(old[:1], m, 0))
    assert not new["zeros"].value.any()
    np.testing.assert_array_equal(new["custom"].value, np.repeat(old[-1:], m, 0))
    for leaf in jax.tree.leaves(new):
        assert leaf.shape[0] in (m, 8)


def test_merge_errors():
    with pytest.raises(ValueError, match="unknown"):
        adaptjax.PerReplica(0.0, merge="median")
    bad = {"e": adaptjax.PerReplica(np.zeros((8, 2)), merge=lambda o, m: o)}
    with pytest.raises(ValueError, match="must return"):
        adaptjax.sync.merge_replicas(bad, 4)
    with pytest.raises(ValueError, match=">= 1"):
        adaptjax.sync.merge_replicas(bad, 0)


def test_the_struct_of_a_batch_has_the_dtype_jax_gives_the_array():
    # Ahead-of-time compiles lower on these structs; an int64 struct would ask for a
    # dtype that does not exist without x64 (jax 0.11 warns) and miss the real call.
    from adaptjax._state import shape_struct

    for x in (np.arange(3), np.arange(3.0), np.zeros((2, 2), np.uint8), [1, 2], 3.0, True):
        struct = shape_struct(x)
        assert (struct.shape, struct.dtype) == (np.shape(x), jnp.asarray(x).dtype)
