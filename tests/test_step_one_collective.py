"""A monitored step moves one gradient-sized collective (counted from the compiled HLO)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax

D_IN, D_HID = 64, 256  # 64*256 + 256 + 256*4 floats of gradient


def _loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] - b["y"]) ** 2)


def _params():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(D_IN, D_HID)), jnp.float32),
        "b1": jnp.zeros(D_HID),
        "w2": jnp.asarray(rng.normal(size=(D_HID, 4)), jnp.float32),
    }


def _grad_bytes():
    return 4 * sum(x.size for x in _params().values())


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("norm_chunks", [1, 4])
def test_monitored_step_has_exactly_one_gradient_sized_collective(microbatches, norm_chunks):
    mesh = adaptjax.make_mesh(8)
    monitors = (adaptjax.GradientNoiseScale(), adaptjax.GradientSNR(), adaptjax.GradientNorm())
    tx = optax.chain(
        adaptjax.sync_gradients("data", monitors=monitors, norm_chunks=norm_chunks),
        optax.adam(1e-3),
        adaptjax.update_norm(),
    )
    step = adaptjax.data_parallel_step(_loss, tx, mesh, microbatches=microbatches)
    state = adaptjax.init_state(_params(), tx, mesh)
    batch = {"x": np.zeros((64, D_IN), np.float32), "y": np.zeros((64, 4), np.float32)}
    report = adaptjax.wire_bytes(step.jitted, state, batch)
    n = 8
    full = 2 * (n - 1) / n * _grad_bytes()
    big = [c for c in report.collectives if c.bytes >= 0.5 * full]
    assert len(big) == 1, str(report)
    # The gradient all-reduce, plus at most the monitors' few scalars folded into it.
    assert big[0].kind == "all-reduce"
    assert full <= big[0].bytes <= full + 2 * (n - 1) / n * 4 * 8
    # Everything else is scalar-sized (the loss pmean): far below one gradient.
    assert report.total - big[0].bytes <= 2 * (n - 1) / n * 4 * 8


def test_bf16_wire_halves_the_gradient_collective():
    mesh = adaptjax.make_mesh(8)
    out = {}
    for name, dt in (("f32", None), ("bf16", jnp.bfloat16)):
        tx = optax.chain(adaptjax.sync_gradients("data", wire_dtype=dt), optax.sgd(0.1))
        step = adaptjax.data_parallel_step(_loss, tx, mesh)
        state = adaptjax.init_state(_params(), tx, mesh)
        batch = {"x": np.zeros((64, D_IN), np.float32), "y": np.zeros((64, 4), np.float32)}
        out[name] = adaptjax.wire_bytes(step.jitted, state, batch).largest()
    scalars = 2 * 7 / 8 * 4 * 2  # XLA may fold the (loss, guard |g|^2) pmean into it
    assert abs(out["f32"].bytes - 2 * 7 / 8 * _grad_bytes()) <= scalars
    assert abs(out["bf16"].bytes - 2 * 7 / 8 * _grad_bytes() / 2) <= scalars
    assert "bf16" in out["bf16"].dtype


def test_monitors_with_a_codec_add_no_gradient_sized_collective():
    from adaptjax import compression as ajc

    mesh = adaptjax.make_mesh(8)
    monitors = (adaptjax.GradientNoiseScale(), adaptjax.GradientSNR())
    out = {}
    for name, mons in (("bare", ()), ("monitored", monitors)):
        tx = optax.chain(adaptjax.sync_gradients("data", codec=ajc.onebit(), monitors=mons),
                         optax.sgd(0.1))
        step = adaptjax.data_parallel_step(_loss, tx, mesh)
        state = adaptjax.init_state(_params(), tx, mesh)
        batch = {"x": np.zeros((64, D_IN), np.float32), "y": np.zeros((64, 4), np.float32)}
        out[name] = adaptjax.wire_bytes(step.jitted, state, batch)
    dense = 2 * 7 / 8 * _grad_bytes()
    assert all(c.bytes < 0.2 * dense for c in out["monitored"].collectives), str(out["monitored"])
    # The monitors' extra: exact values at 1% of coordinates (>= 1024 per leaf, whole
    # leaves below that) and a few scalars, in one fp32 all-reduce.
    sizes = [x.size for x in _params().values()]
    sampled = sum(min(s, max(1024, int(np.ceil(0.01 * s)))) for s in sizes)
    extra = out["monitored"].total - out["bare"].total
    assert 2 * 7 / 8 * 4 * sampled <= extra <= 2 * 7 / 8 * 4 * (sampled + 16)
