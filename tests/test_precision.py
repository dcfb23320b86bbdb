"""Precision, with_precision (pytrees and flax NNX) and check_precision's one-line errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import adaptjax
from adaptjax._precision import check_precision


def test_names_aliases_and_dtypes_normalise_to_one_value():
    a = adaptjax.Precision("bf16")
    b = adaptjax.Precision(compute=jnp.bfloat16, params=np.float32, output="FLOAT32")
    assert a == b and hash(a) == hash(b) and a.compute == "bfloat16"
    assert adaptjax.Precision().is_full and not a.is_full
    assert adaptjax.Precision("fp16").needs_loss_scale and not a.needs_loss_scale


@pytest.mark.parametrize(
    "precision", [adaptjax.Precision(), adaptjax.Precision("bfloat16"),
                  adaptjax.Precision("float16", output="float16")]
)
def test_key_round_trips(precision):
    assert adaptjax.Precision.of(precision.key) == precision
    assert adaptjax.Precision.of(precision) is precision


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: adaptjax.Precision("int8"),
         "Precision: unknown compute dtype 'int8'; use one of 'float32', 'bfloat16', 'float16'"),
        (lambda: adaptjax.Precision(output="float64"),
         "Precision: unknown output dtype 'float64'; use one of 'float32', 'bfloat16', 'float16'"),
        (lambda: adaptjax.Precision(params="bfloat16"),
         "Precision: params='bfloat16', but master weights and optimizer state stay float32; "
         "use params='float32' and compute='bfloat16'"),
        (lambda: adaptjax.Precision.of("bfloat16,dtype=x"),
         "Precision: cannot read 'bfloat16,dtype=x'; use a key such as 'bfloat16'"),
        (lambda: adaptjax.with_precision(lambda p, b: 0.0, "bfloat16", decode=3),
         "with_precision: decode must be callable(batch), got 3"),
    ],
)
def test_bad_precisions_one_line(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def _loss(p, b):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def test_pytree_loss_computes_in_bfloat16_and_differentiates_the_float32_master():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype(np.float32)
    params = {"w": jnp.asarray(rng.normal(size=8), jnp.float32)}
    batch = {"x": x, "y": x @ np.ones(8, np.float32), "ids": np.arange(32)}
    seen = {}

    def spy(p, b):
        seen.update(w=p["w"].dtype, x=b["x"].dtype, ids=b["ids"].dtype)
        return _loss(p, b)

    wrapped = adaptjax.with_precision(spy, "bfloat16")
    value, grads = jax.value_and_grad(wrapped)(params, batch)
    assert seen == {"w": jnp.bfloat16, "x": jnp.bfloat16, "ids": np.dtype(np.int64)}
    assert value.dtype == jnp.float32 and grads["w"].dtype == jnp.float32
    exact_value, exact = jax.value_and_grad(_loss)(params, batch)
    # bfloat16 keeps 8 significant bits: relative rounding <= 2**-8 per operation
    np.testing.assert_allclose(value, exact_value, rtol=0.05)
    np.testing.assert_allclose(grads["w"], exact["w"], rtol=0.05, atol=0.05 * float(
        jnp.max(jnp.abs(exact["w"]))))


def test_float32_without_decode_is_the_loss_itself_and_output_dtype_is_applied():
    assert adaptjax.with_precision(_loss, None) is _loss
    half_out = adaptjax.with_precision(_loss, adaptjax.Precision("bfloat16", output="bfloat16"))
    batch = {"x": np.ones((2, 3), np.float32), "y": np.zeros(2, np.float32)}
    assert half_out({"w": jnp.ones(3)}, batch).dtype == jnp.bfloat16


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 3, rngs=rngs)
        self.norm = nnx.BatchNorm(3, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.linear(x))


def test_nnx_module_is_cast_during_the_call_and_restored_after():
    model = _Net(nnx.Rngs(0))
    seen = []

    def loss(m, b):
        seen.append((m.linear.kernel[...].dtype, m.norm.mean[...].dtype))
        return jnp.mean(m(b["x"]) ** 2)

    wrapped = adaptjax.with_precision(loss, "bfloat16")
    out = wrapped(model, {"x": np.ones((5, 4), np.float32)})
    # parameters in bfloat16 inside; statistics stay float32; the module is float32 again
    assert seen == [(jnp.bfloat16, jnp.float32)] and out.dtype == jnp.float32
    assert model.linear.kernel[...].dtype == jnp.float32


def test_nnx_batch_statistics_still_update_in_the_data_parallel_step():
    model = _Net(nnx.Rngs(0))
    model.train()
    tx = optax.chain(adaptjax.sync_gradients("data"), optax.sgd(0.1))
    mesh = adaptjax.make_mesh(2)

    def loss(m, b):
        return jnp.mean(m(b["x"]) ** 2)

    step = adaptjax.data_parallel_step(adaptjax.with_precision(loss, "bfloat16"), tx, mesh)
    state = adaptjax.init_state(model, tx, mesh)
    x = np.random.default_rng(0).normal(loc=3.0, size=(8, 4)).astype(np.float32)
    state, metrics = step(state, {"x": x})
    assert np.isfinite(float(metrics["loss"]))
    means = state.model.norm.mean[...]
    assert means.dtype == jnp.float32 and float(jnp.max(jnp.abs(means))) > 0  # moved off 0
    kernel = state.params["linear"]["kernel"][...]
    assert kernel.dtype == jnp.float32


@pytest.mark.parametrize(
    "precision, params, tx, message",
    [
        ("float16", {"w": jnp.ones(3)}, optax.sgd(0.1),
         "compute='float16' needs dynamic loss scaling: wrap the optimizer in "
         "adaptjax.dynamic_loss_scale(tx), or use compute='bfloat16'"),
        ("float16", {"w": jnp.array([1.0, 7e4])},
         adaptjax.dynamic_loss_scale(optax.sgd(0.1)),
         "parameter ['w'] reaches |x| = 7e+04, beyond float16's largest finite value 65504 "
         "(it would be inf); use compute='bfloat16'"),
    ],
)
def test_check_precision_refuses_float16_that_cannot_work(precision, params, tx, message):
    with pytest.raises(ValueError) as info:
        check_precision(precision, params, tx)
    assert str(info.value) == message


def test_check_precision_accepts_what_can_work():
    big = {"w": jnp.array([1.0, 7e4])}
    assert check_precision("bfloat16", big, optax.sgd(0.1)).compute == "bfloat16"
    tx = optax.chain(optax.clip(1.0), adaptjax.dynamic_loss_scale(optax.sgd(0.1)))
    model = _Net(nnx.Rngs(0))
    assert check_precision("float16", model, tx).needs_loss_scale
