"""Dynamic loss scaling: the state machine against its rules, skips, replicas, float16, checkpoints.

The rules (adaptjax/_loss_scale.py, as jmp.DynamicLossScale): a non-finite step
is skipped and the scale becomes max(S / factor, min_scale), the count 0; a
finite step counts one, and the ``period``-th in a row multiplies the scale by
``factor`` (when that is finite) and starts the count again.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import adaptjax


def _rules(scale, count, finite, *, period, factor, min_scale):
    """The documented rules, in plain Python floats."""
    if not finite:
        return max(scale / factor, min_scale), 0
    if count + 1 >= period:
        bigger = np.float32(scale) * np.float32(factor)
        return (float(bigger) if np.isfinite(bigger) else scale), 0
    return scale, count + 1


@pytest.mark.parametrize(
    "period, factor, min_scale, initial",
    [(3, 2.0, 1.0, 8.0), (1, 4.0, 2.0, 2.0), (5, 2.0, 0.5, 1.0)],
)
def test_state_machine_follows_its_rules(period, factor, min_scale, initial):
    tx = adaptjax.dynamic_loss_scale(
        optax.sgd(1.0), initial_scale=initial, period=period, factor=factor, min_scale=min_scale
    )
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    scale, count = initial, 0
    pattern = [1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]
    update = jax.jit(tx.update)
    for finite in pattern:
        g = jnp.array([1.0, 2.0]) if finite else jnp.array([1.0, jnp.nan])
        _, state = update({"w": g}, state, params)
        scale, count = _rules(scale, count, bool(finite), period=period, factor=factor,
                              min_scale=min_scale)
        assert float(state.scale) == scale and int(state.good_steps) == count


def test_growth_stops_where_float32_overflows():
    big = float(np.finfo(np.float32).max) / 1.5
    tx = adaptjax.dynamic_loss_scale(optax.sgd(1.0), initial_scale=big, period=1)
    params = {"w": jnp.ones(1)}
    _, state = tx.update({"w": jnp.ones(1)}, tx.init(params), params)
    assert float(state.scale) == np.float32(big) and int(state.good_steps) == 0


def test_finite_step_runs_inner_on_unscaled_gradients():
    inner = optax.adam(0.1)
    tx = adaptjax.dynamic_loss_scale(inner, initial_scale=2.0**10)
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    g = {"w": jnp.array([0.5, 0.25, -1.0])}
    scaled = jax.tree.map(lambda x: x * 2.0**10, g)
    updates, state = tx.update(scaled, tx.init(params), params)
    expected, inner_state = inner.update(g, inner.init(params), params)
    # a power-of-two scale divides exactly: the same updates and state bit for bit
    np.testing.assert_array_equal(updates["w"], expected["w"])
    jax.tree.map(np.testing.assert_array_equal, state.inner_state, inner_state)


def test_skipped_step_moves_nothing_and_keeps_the_inner_state():
    tx = adaptjax.dynamic_loss_scale(optax.adam(0.1), initial_scale=4.0)
    params = {"w": jnp.array([1.0, 2.0])}
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.array([1.0, 1.0])}, state, params)
    params = optax.apply_updates(params, updates)
    before = state
    updates, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
    np.testing.assert_array_equal(updates["w"], np.zeros(2))
    jax.tree.map(np.testing.assert_array_equal, state.inner_state, before.inner_state)
    assert float(state.scale) == 2.0 and int(state.good_steps) == 0


def test_one_replica_overflowing_skips_the_step_on_every_replica():
    """Own shard_map step on 8 devices: the loss is scaled with current_loss_scale."""
    mesh = adaptjax.make_mesh(8)
    inner = optax.chain(adaptjax.sync_gradients("data"), optax.sgd(0.5))
    tx = adaptjax.dynamic_loss_scale(inner, axis_name="data", initial_scale=2.0**8, period=2)

    def local(params, opt_state, batch):
        scale = adaptjax.current_loss_scale(opt_state)

        def scaled_loss(p):
            return scale * jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)

        grads = jax.grad(scaled_loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        # each replica's view, stacked: they must agree
        return optax.apply_updates(params, updates), jax.tree.map(lambda x: x[None], opt_state)

    step = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P("data")),
        check_vma=False,
    ))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    y = x @ np.array([1.0, -1.0, 2.0], np.float32)
    params = {"w": jnp.zeros(3)}
    state = tx.init(params)
    new_params, stacked = step(params, state, {"x": x, "y": y})
    # finite: the mean gradient over the whole batch, unscaled
    expected = -0.5 * jax.grad(lambda p: jnp.mean((x @ p["w"] - y) ** 2))(params)["w"]
    np.testing.assert_allclose(new_params["w"], expected, rtol=1e-6)
    assert stacked.scale.tolist() == [256.0] * 8 and stacked.good_steps.tolist() == [1] * 8
    state = jax.tree.map(lambda s: s[0], stacked)
    bad = x.copy()
    bad[5, 0] = np.inf  # replica 2's shard only
    after, stacked = step(new_params, state, {"x": bad, "y": y})
    np.testing.assert_array_equal(after["w"], new_params["w"])
    assert stacked.scale.tolist() == [128.0] * 8 and stacked.good_steps.tolist() == [0] * 8


def test_float16_gradients_underflow_without_scaling_and_match_float32_with_it():
    """A loss times 2**-27 (in float32, after the float16 model): its cotangent entering the
    float16 backward pass, 2**-27, is below float16's smallest subnormal 2**-24 and rounds to
    0. Scaled by 2**15 it is 2**-12, and with inputs in multiples of 1/4 every float16 product
    and partial sum of this linear model is exact, so the unscaled gradient equals float32's."""
    rng = np.random.default_rng(0)
    x = rng.choice(np.array([-1.0, -0.5, -0.25, 0.25, 0.5, 1.0], np.float32), size=(16, 2))
    params = {"w": jnp.array([0.3, 0.1])}
    batch = {"x": x}

    def model(p, b):
        return jnp.mean(b["x"] @ p["w"])

    def loss(p, b):
        return model(p, b) * 2.0**-27

    exact = jax.grad(loss)(params, batch)["w"]
    np.testing.assert_array_equal(exact, 2.0**-27 * x.mean(axis=0))
    half = adaptjax.with_precision(model, adaptjax.Precision("float16"))

    def half_loss(p, b):
        return half(p, b) * 2.0**-27

    assert np.all(np.asarray(jax.grad(half_loss)(params, batch)["w"]) == 0.0)
    tx = adaptjax.dynamic_loss_scale(optax.sgd(1.0), initial_scale=2.0**15)
    state = tx.init(params)
    scale = adaptjax.current_loss_scale(state)
    grads = jax.grad(lambda p: scale * half_loss(p, batch))(params)
    updates, state = tx.update(grads, state, params)
    np.testing.assert_array_equal(-updates["w"], exact)
    assert int(state.good_steps) == 1


def test_scale_and_count_are_checkpointed_with_the_train_state(tmp_path):
    mesh = adaptjax.make_mesh(8)
    tx = adaptjax.dynamic_loss_scale(
        optax.chain(adaptjax.sync_gradients("data"), optax.adam(0.1)), axis_name="data"
    )
    state = adaptjax.init_state({"w": jnp.ones(4)}, tx, mesh)
    state.opt_state = state.opt_state._replace(
        scale=jnp.float32(64.0), good_steps=jnp.int32(7)
    )
    state = jax.device_put(state, adaptjax.train_state_shardings(state, mesh))
    with adaptjax.RunCheckpoints(tmp_path / "ckpt") as ckpt:
        ckpt.save(3, state, {"cursor": 0})
        target = adaptjax.abstract_state({"w": jnp.ones(4)}, tx, adaptjax.make_mesh(4))
        restored, _ = ckpt.restore(target_state=target, mesh=adaptjax.make_mesh(4))
    assert float(adaptjax.current_loss_scale(restored)) == 64.0
    assert int(restored.opt_state.good_steps) == 7


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"initial_scale": 0.0}, "initial_scale must be finite and > 0"),
        ({"initial_scale": float("inf")}, "initial_scale must be finite and > 0"),
        ({"factor": 1.0}, "factor must be > 1"),
        ({"min_scale": 10.0, "initial_scale": 2.0}, "use min_scale <= initial_scale"),
        ({"period": 0}, "period must be a positive integer"),
        ({"period": 2.5}, "period must be a positive integer"),
        ({"factor": "2"}, "factor must be a number"),
    ],
)
def test_bad_arguments_one_line(kwargs, message):
    with pytest.raises(ValueError) as info:
        adaptjax.dynamic_loss_scale(optax.sgd(0.1), **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_current_loss_scale_refuses_two_scales():
    tx = optax.chain(
        adaptjax.dynamic_loss_scale(optax.sgd(0.1)), adaptjax.dynamic_loss_scale(optax.sgd(0.1))
    )
    with pytest.raises(ValueError, match="holds 2 loss scales"):
        adaptjax.current_loss_scale(tx.init({"w": jnp.ones(1)}))


def test_wrap_state_carries_an_existing_optimizer_state_into_float16_and_back():
    inner = optax.adam(0.1)
    params = {"w": jnp.ones(2)}
    _, inner_state = inner.update({"w": jnp.ones(2)}, inner.init(params), params)
    tx = adaptjax.dynamic_loss_scale(inner, initial_scale=128.0)
    wrapped = tx.wrap_state(inner_state)
    assert jax.tree.structure(wrapped) == jax.tree.structure(tx.init(params))
    assert float(wrapped.scale) == 128.0 and int(wrapped.good_steps) == 0
    assert wrapped.inner_state is inner_state


def test_loss_scaled_extra_runs_only_the_inner_transformation():
    """What data_parallel_step passes: the gradients are unscaled and checked already."""
    inner = optax.adam(0.1)
    tx = adaptjax.dynamic_loss_scale(inner, initial_scale=2.0**10, period=1)
    params = {"w": jnp.array([1.0, -2.0])}
    g = {"w": jnp.array([0.5, -0.25])}
    updates, state = tx.update(g, tx.init(params), params, loss_scaled=True)
    expected, inner_state = inner.update(g, inner.init(params), params)
    np.testing.assert_array_equal(updates["w"], expected["w"])  # not divided by the scale
    jax.tree.map(np.testing.assert_array_equal, state.inner_state, inner_state)
    # the scale and the count are the caller's to move (period=1 would have grown it)
    assert float(state.scale) == 2.0**10 and int(state.good_steps) == 0
    assert float(tx.adjust(state, True).scale) == 2.0**11


def test_an_unbound_axis_names_the_bound_one():
    mesh = adaptjax.make_mesh(8)
    tx = adaptjax.dynamic_loss_scale(optax.sgd(0.1), axis_name="batch")
    params = {"w": jnp.ones(2)}
    f = jax.shard_map(
        lambda g: tx.update(g, tx.init(params), params)[0], mesh=mesh, in_specs=P("data"),
        out_specs=P(), check_vma=False,
    )
    with pytest.raises(ValueError) as info:
        jax.jit(f).lower({"w": jnp.ones(16)})
    assert str(info.value) == (
        "dynamic_loss_scale(axis_name='batch'): axis 'batch' is not bound in this step, which "
        "is manual over 'data'; build it with axis_name='data' (the step's axis)"
    )
