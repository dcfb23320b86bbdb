"""Bytes each strategy sends per device per step, from the compiled HLO, against its formula."""

import os
import textwrap

import jax
import jax.numpy as jnp
import optax
import pytest

import adaptjax

STRATEGIES = (
    "adaptjax.sync.SSGD()",
    "adaptjax.sync.ModelAveraging()",
    "adaptjax.sync.LocalSGD(H=8)",
    "adaptjax.sync.DiLoCo(H=32)",
    "adaptjax.sync.Gossip('ring')",
    "adaptjax.sync.Gossip('exponential')",
)
PARAMS = {"w": jnp.zeros((1000,)), "b": jnp.zeros((24,))}
PARAM_BYTES = 4 * 1024
# The step's one scalar pmean: the loss and the non-finite guard's |g|^2 (two float32).
LOSS_BYTES = 8


def loss(p, b):
    return jnp.mean((b["x"] @ p["w"][:8] + p["b"][0] - b["y"]) ** 2)


def measured(strategy, n) -> float:
    """Amortised bytes per device per step of the data-parallel step on ``n`` devices."""
    tx = adaptjax.sync.sync_chain(optax.sgd(0.1), strategy)
    mesh = adaptjax.make_mesh(n)
    state = adaptjax.abstract_state(PARAMS, tx, mesh)
    sds = jax.ShapeDtypeStruct
    batch = {"x": sds((n, 8), jnp.float32), "y": sds((n,), jnp.float32)}
    step = adaptjax.data_parallel_step(loss, tx, mesh, sync=strategy)
    return strategy.amortised_bytes(adaptjax.wire_bytes(step.jitted, state, batch))


def expected(strategy, n) -> float:
    loss_bytes = 2 * (n - 1) / n * LOSS_BYTES
    return strategy.wire_formula(PARAM_BYTES, n) + loss_bytes


@pytest.mark.parametrize(
    "src",
    [pytest.param(s, marks=pytest.mark.slow) if "Gossip('ring')" in s or "ModelAveraging" in s
     else s for s in STRATEGIES],
)
def test_wire_bytes_match_formula_on_8_devices(src):
    strategy = eval(src)
    assert measured(strategy, 8) == pytest.approx(expected(strategy, 8), rel=1e-9)


def test_formulas_state_the_savings():
    ssgd = adaptjax.sync.SSGD().wire_formula(PARAM_BYTES, 8)
    # DiLoCo sends the deltas once per 32 steps, and 12 bytes of measurements per replica
    diloco = adaptjax.sync.DiLoCo(H=32).wire_formula(PARAM_BYTES, 8)
    assert diloco == (ssgd + 7 * 12) / 32
    assert adaptjax.sync.Gossip().wire_formula(PARAM_BYTES, 16) == PARAM_BYTES  # not 2(N-1)/N
    assert adaptjax.sync.ModelAveraging().wire_formula(PARAM_BYTES, 8) == ssgd


_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {here!r})
    import adaptjax, jax
    import test_sync_wire as t
    assert jax.device_count() == 16
    out = {{src: [t.measured(eval(src), 16), t.expected(eval(src), 16)] for src in t.STRATEGIES}}
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_wire_bytes_match_formula_on_16_devices(json_from_python_on_devices):
    here = os.path.dirname(os.path.abspath(__file__))
    for src, (got, want) in json_from_python_on_devices(_SCRIPT.format(here=here), 16).items():
        assert got == pytest.approx(want, rel=1e-9), src
