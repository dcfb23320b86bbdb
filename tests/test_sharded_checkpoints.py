"""Checkpoints between mesh shapes: written on (2, 4), restored on (4, 2), (8,), (1,) and back.

A checkpoint holds global arrays; a restore onto another mesh reads each
device's shard of them onto the target's shardings. Nothing is computed on
the way, so every value comes back bit for bit (this optimizer state has no
per-replica leaves: those follow their merge rule when the data axis changes,
see tests/controller/test_controller_sharded.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import adaptjax

RULE = adaptjax.FSDP(min_size=64)
TX = optax.chain(adaptjax.sync_gradients("data"), optax.adam(0.05))


def mlp():
    k = jax.random.split(jax.random.key(0), 2)
    return {"w1": jax.random.normal(k[0], (16, 64)) * 0.3, "b1": jnp.zeros(64),
            "w2": jax.random.normal(k[1], (64, 4)) * 0.3}


def loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] - b["y"]) ** 2)


def batch(i):
    rng = np.random.default_rng(i)
    return {"x": rng.normal(size=(16, 16)).astype(np.float32),
            "y": rng.normal(size=(16, 4)).astype(np.float32)}


def host(state):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]


def assert_placed_like(state, target):
    for x, t in zip(jax.tree.leaves(state), jax.tree.leaves(target), strict=True):
        assert x.sharding == t.sharding
        split = int(np.prod([x.sharding.mesh.shape[a] for e in x.sharding.spec if e
                             for a in (e if isinstance(e, tuple) else (e,))]))
        assert all(s.data.size * split == x.size for s in x.addressable_shards)


def test_a_checkpoint_of_a_2x4_mesh_restores_on_4x2_8_1_and_back(tmp_path):
    mesh24 = adaptjax.make_mesh({"data": 2, "fsdp": 4})
    step = adaptjax.data_parallel_step(loss, TX, mesh24, sharding=RULE)
    state = adaptjax.init_state(mlp(), TX, mesh24, sharding=RULE)
    for i in range(3):
        state, _ = step(state, batch(i))
    assert state.params["w1"].sharding.spec == P(None, "fsdp")
    saved = host(state)
    with adaptjax.RunCheckpoints(tmp_path / "ckpt") as ckpt:
        ckpt.save(3, state, {"shape": [2, 4]})
        meshes = {
            "(4, 2)": adaptjax.make_mesh({"data": 4, "fsdp": 2}),
            "(8,)": adaptjax.make_mesh(8),
            "(1,)": adaptjax.make_mesh(1),
        }
        restored = {}
        for name, mesh in meshes.items():
            target = adaptjax.abstract_state(mlp(), TX, mesh, sharding=RULE)
            restored[name], meta = ckpt.restore(3, target_state=target, mesh=mesh)
            assert meta == {"shape": [2, 4]}
            for got, want in zip(host(restored[name]), saved, strict=True):
                np.testing.assert_array_equal(got, want, err_msg=name)
            assert_placed_like(restored[name], target)
        # (4, 2) trains on from there: its w1 lies over 2 devices of fsdp
        on42 = restored["(4, 2)"]
        assert on42.params["w1"].sharding.spec == P(None, "fsdp")
        assert on42.params["w1"].addressable_shards[0].data.shape == (16, 32)
        step42 = adaptjax.data_parallel_step(loss, TX, meshes["(4, 2)"], sharding=RULE)
        _, metrics = step42(on42, batch(3))
        assert np.isfinite(float(metrics["loss"]))
        # and back: written from one device, read onto (2, 4)
        ckpt.save(4, restored["(1,)"], {"shape": [1]})
        target = adaptjax.abstract_state(mlp(), TX, mesh24, sharding=RULE)
        back, _ = ckpt.restore(4, target_state=target, mesh=mesh24)
    for got, want in zip(host(back), saved, strict=True):
        np.testing.assert_array_equal(got, want)
    assert_placed_like(back, target)
    assert back.params["w1"].addressable_shards[0].data.shape == (16, 16)  # 1/4 of 64 columns
