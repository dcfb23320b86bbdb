"""The step's "checked first" errors (issue 37, item 7): one line, at trace time, naming the fix.

``sync_gradients`` built for an axis the step does not bind, and a ``loss_fn``
whose return does not match ``has_aux``, used to reach JAX's raw ``unbound axis
name`` and ``iteration over a 0-d array``. Each is raised while the step is
traced (``lower``), before anything compiles.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import adaptjax
from adaptjax._chain import chain as guarded_chain  # sync_chain's (and the controller's) chain

BATCH = {"x": np.ones((16, 3), np.float32), "y": np.zeros(16, np.float32)}
PARAMS = {"w": jnp.zeros(3)}


def _mse(p, b):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def _lower_error(loss_fn, tx, mesh=None, **kwargs) -> str:
    mesh = mesh or adaptjax.make_mesh(8)
    step = adaptjax.data_parallel_step(loss_fn, tx, mesh, **kwargs)
    state = adaptjax.init_state(PARAMS, tx, mesh)
    with pytest.raises(ValueError) as info:
        step.lower(state, BATCH)
    text = str(info.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("chain", [guarded_chain, optax.chain])
def test_sync_over_an_axis_the_step_does_not_bind_names_the_steps_axis(chain):
    tx = chain(adaptjax.sync_gradients("batch"), optax.sgd(0.1))
    assert _lower_error(_mse, tx) == (
        "sync_gradients('batch'): axis 'batch' is not bound in this step, which is manual "
        "over 'data'; build it with axis_name='data' (the step's axis)"
    )


def test_on_a_sharded_mesh_the_step_binds_only_its_data_axis():
    tx = optax.chain(adaptjax.sync_gradients("fsdp"), optax.sgd(0.1))
    text = _lower_error(_mse, tx, adaptjax.make_mesh({"data": 2, "fsdp": 4}))
    assert text.startswith("sync_gradients('fsdp'): axis 'fsdp' is not bound in this step, ")
    assert "manual over 'data'; build it with axis_name='data'" in text


def test_sync_outside_any_mesh_axis_says_where_to_call_it():
    tx = adaptjax.sync_gradients("data")
    with pytest.raises(ValueError) as info:
        tx.update(PARAMS, tx.init(PARAMS))
    assert str(info.value) == (
        "sync_gradients('data') runs outside any mesh axis: call its update inside "
        "jax.shard_map (or adaptjax.data_parallel_step) over a mesh axis named 'data'"
    )


def test_in_shard_map_over_the_right_axis_nothing_is_raised():
    tx = adaptjax.sync_gradients("data")
    f = jax.shard_map(
        lambda g: tx.update(g, tx.init(g))[0], mesh=adaptjax.make_mesh(4), in_specs=P("data"),
        out_specs=P(),
    )
    assert jax.jit(f)(jnp.arange(4.0)).tolist() == [1.5]


SYNC = optax.chain(adaptjax.sync_gradients("data"), optax.sgd(0.1))


def test_has_aux_with_a_scalar_loss_names_what_loss_fn_returned():
    assert _lower_error(_mse, SYNC, has_aux=True) == (
        "has_aux=True, but loss_fn returned a float32 scalar; return (loss, aux), or build "
        "the step with has_aux=False"
    )


def test_has_aux_with_a_triple_names_its_length():
    text = _lower_error(lambda p, b: (_mse(p, b), 1.0, 2.0), SYNC, has_aux=True)
    assert text.startswith("has_aux=True, but loss_fn returned a tuple of 3; return (loss, aux)")


def test_a_pair_without_has_aux_asks_for_it():
    assert _lower_error(lambda p, b: (_mse(p, b), {"n": 1.0}), SYNC) == (
        "loss_fn returned a tuple of 2; build the step with has_aux=True if it returns "
        "(loss, aux)"
    )


def test_a_loss_that_is_not_a_scalar_asks_for_a_reduction():
    assert _lower_error(lambda p, b: (b["x"] @ p["w"] - b["y"]) ** 2, SYNC) == (
        "loss_fn's loss is a float32 array of shape (2,), not a scalar; reduce it over the "
        "batch (e.g. jnp.mean)"
    )


def test_microbatches_raise_the_same_message():
    text = _lower_error(_mse, SYNC, has_aux=True, microbatches=2)
    assert text.startswith("has_aux=True, but loss_fn returned a float32 scalar")
