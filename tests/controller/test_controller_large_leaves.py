"""Codecs on leaves of realistic sizes under the Controller, on a 1-D and a sharded mesh.

``tests/compression/test_compression_large_leaves.py`` checks each codec on a
GPT-2-small shape (768×3072, beside a second leaf over a million elements)
through ``data_parallel_step``. Here the same model goes through the
Controller (its chain: ``sync_gradients`` with the codec, the user's
``optax.sgd``, the monitors): with ``loss = Σ_k <c_k, p_k>·mean(batch)`` from
zero parameters, one step's parameters are ``-lr`` times the codec's mean of
the replicas' gradients ``c_k·m_r``, so the Controller's first step must equal
the step of ``data_parallel_step`` with the same codec on the same mesh
(float32 rounding: the monitors ride the same all-reduce).
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax
from adaptjax import compression as ajc

pytestmark = pytest.mark.slow

SHAPES = {"fc": (768, 3072), "odd": (1031, 1031), "b_fc": (3072,), "b_proj": (768,)}
LR, BATCH = 0.5, 32


def _problem():
    rng = np.random.default_rng(1)
    c = {k: jnp.asarray(rng.normal(size=s).astype(np.float32)) for k, s in SHAPES.items()}
    batch = rng.normal(size=(BATCH,)).astype(np.float32)

    def loss(p, b):
        return sum(jnp.vdot(c[k], p[k]) for k in SHAPES) * jnp.mean(b["m"])

    return loss, batch


@pytest.mark.parametrize(
    ("codec", "mesh_shape"),
    [(ajc.onebit(), None), (ajc.topk(0.01), None), (ajc.onebit(), {"data": 2, "fsdp": 4})],
    ids=["onebit", "topk", "onebit-fsdp"],
)
def test_the_controllers_first_step_is_the_codecs_step(tmp_path, codec, mesh_shape):
    loss, batch = _problem()
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    where = {"devices": 8} if mesh_shape is None else {"mesh_shape": mesh_shape}
    spec = adaptjax.RunSpec(run_dir=tmp_path / "run", batch_size=BATCH, codec=codec,
                            checkpoint=adaptjax.CheckpointOptions(every=None), **where)
    ctrl = adaptjax.Controller(params, loss, optax.sgd(LR),
                               adaptjax.ArrayDataset({"m": batch}, shuffle=False), spec)
    ctrl.run(1)
    got = {k: np.asarray(v) for k, v in ctrl.state.params.items()}
    ctrl.close()

    tx = optax.chain(adaptjax.sync_gradients("data", codec=codec), optax.sgd(LR))
    mesh = adaptjax.make_mesh(8 if mesh_shape is None else mesh_shape)
    step = adaptjax.data_parallel_step(loss, tx, mesh)
    state, _ = step(adaptjax.init_state(params, tx, mesh), {"m": batch})
    for k in SHAPES:
        want = np.asarray(state.params[k])
        assert np.abs(want).max() > 0
        np.testing.assert_allclose(got[k], want, rtol=0,
                                   atol=4 * np.finfo(np.float32).eps * np.abs(want).max(),
                                   err_msg=k)
