"""A codec that trains worse than dense with the optimizer after it says so once.

Issue 45 item 2: the default ``onebit()`` under AdamW reached 0.534 test
accuracy where dense sync reached 0.977, and nothing warned. The step is the
first place that sees both the codec and the optimizer: ``data_parallel_step``
passes the chain's state to the codec's ``sync_gradients`` link, which asks
``codec.pairing_warning(optimizer_state)`` when the step is traced and warns
with the line.
"""

import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax
from adaptjax import compression as ajc
from adaptjax import policies as ajp

PARAMS = {"w": jnp.zeros((64, 40)), "b": jnp.zeros(40)}  # w (2560 elements) is compressed

ADAM = "{} with an Adam-family optimizer trains worse than dense sync ({}): " + (
    "use natural() (8-bit codes), or adaptjax.compression.onebit_adam(learning_rate, "
    "freeze_step=...) in place of sync_gradients and the Adam optimizer")
MOMENTUM = ("{} with SGD with momentum trains worse than dense sync ({}): "
            "use qsgd() instead")
NOISE = "coarse stochastic codes feed their variance into Adam's second moment"
SCALED = "each sent coordinate is scaled by 1/ratio, a variance far above the gradient's"
ONEBIT_ADAM = ADAM.format("onebit()", "signs with error feedback spoil Adam's second moment")
SGDM = optax.sgd(0.1, momentum=0.9)

BAD = [
    (ajc.onebit(), optax.adamw(1e-3), ONEBIT_ADAM),
    (ajc.onebit(error_feedback="ef21"), optax.adam(1e-3), ADAM.format(
        "onebit(error_feedback='ef21')", "signs with error feedback spoil Adam's second moment")),
    (ajc.terngrad(), optax.adamw(1e-3), ADAM.format("terngrad()", NOISE)),
    (ajc.qsgd(), optax.adamw(1e-3), ADAM.format("qsgd(7)", NOISE)),
    (ajc.topk(), optax.adamw(1e-3), ADAM.format(
        "topk(0.01)", "error feedback's delayed bursts spoil Adam's second moment")),
    (ajc.randomk(), optax.adamw(1e-3), ADAM.format("randomk(0.01)", SCALED)),
    (ajc.dgc(), optax.adamw(1e-3), ADAM.format(
        "dgc(0.001)", "dgc() applies momentum itself, before Adam's own")),
    (ajc.powersgd(), optax.adamw(1e-3), ADAM.format(
        "powersgd(4)", "low-rank error feedback spoils Adam's second moment")),
    (ajc.onebit(), SGDM, MOMENTUM.format(
        "onebit()", "the 1-bit codes' error feedback lags the momentum")),
    (ajc.topk(), SGDM, MOMENTUM.format(
        "topk(0.01)", "error feedback at ratio 0.01 lags the momentum")),
    (ajc.terngrad(), SGDM, MOMENTUM.format(
        "terngrad()", "three levels add more variance than the momentum averages out")),
    (ajc.powersgd(), SGDM, MOMENTUM.format(
        "powersgd(4)", "rank 4 leaves too much to error feedback")),
    (ajc.randomk(), SGDM, MOMENTUM.format("randomk(0.01)", SCALED)),
    (ajc.dgc(), SGDM, "dgc(0.001) with SGD with momentum trains worse than dense sync (dgc() "
     "applies momentum itself, on top of the optimizer's): use optax.sgd without momentum "
     "with dgc()"),
]


def _loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def _two_steps(tx):
    """``init_state`` and two steps of ``data_parallel_step`` on 8 replicas."""
    mesh = adaptjax.make_mesh(8)
    state = adaptjax.init_state(PARAMS, tx, mesh)
    step = adaptjax.data_parallel_step(_loss, tx, mesh)
    rng = np.random.default_rng(0)
    for _ in range(2):
        batch = {"x": rng.normal(size=(16, 64)).astype(np.float32),
                 "y": rng.normal(size=(16, 40)).astype(np.float32)}
        state, _ = step(state, batch)


@pytest.mark.parametrize("codec, optimizer, line", BAD, ids=[
    f"{c!r}+{'sgdm' if o is SGDM else 'adam'}" for c, o, _ in BAD])
def test_a_bad_default_pairing_warns_once_in_one_line(codec, optimizer, line):
    tx = optax.chain(adaptjax.sync_gradients("data", codec=codec), optimizer)
    with pytest.warns(UserWarning) as record:
        _two_steps(tx)  # the second step runs the compiled program: nothing more
    assert [str(w.message) for w in record] == [line]
    assert "\n" not in line


def test_sync_chain_named_chain_and_injected_hyperparameters_warn_too():
    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)
    for tx in (
        adaptjax.sync.sync_chain(adamw, codec=ajc.onebit()),
        optax.named_chain(("sync", adaptjax.sync_gradients("data", codec=ajc.onebit())),
                          ("optimizer", optax.chain(optax.clip_by_global_norm(1.0), adamw))),
        adaptjax.accumulate(optax.chain(adaptjax.sync_gradients("data", codec=ajc.onebit()),
                                        adamw), micro_steps=2),
    ):
        with pytest.warns(UserWarning) as record:
            _two_steps(tx)
        assert [str(w.message) for w in record] == [ONEBIT_ADAM]


@pytest.mark.parametrize("optimizer", [optax.nadam(1e-3), optax.amsgrad(1e-3),
                                       optax.adabelief(1e-3), optax.lamb(1e-3)],
                         ids=["nadam", "amsgrad", "adabelief", "lamb"])
def test_every_adam_family_optimizer_is_recognised(optimizer):
    assert ajc.onebit().pairing_warning(optimizer.init(PARAMS)) == ONEBIT_ADAM


@pytest.mark.parametrize("codec, optimizer", [
    (ajc.natural(), optax.adamw(1e-3)),
    (ajc.bf16(), optax.adamw(1e-3)),
    (ajc.natural(), SGDM),
    (ajc.qsgd(), SGDM),
    (ajc.powersgd(8), SGDM),  # the advice holds for rank 4 and below
    (ajc.topk(0.1), optax.adamw(1e-3)),  # the advice holds for ratio 0.01 and below
    (ajc.onebit(), optax.sgd(0.1)),  # plain SGD: not measured, no advice
    (ajc.dgc(momentum=0.0), SGDM),  # dgc's own momentum off
])
def test_a_safe_pairing_does_not_warn(codec, optimizer):
    tx = optax.chain(adaptjax.sync_gradients("data", codec=codec), optimizer)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _two_steps(tx)
    assert [str(w.message) for w in said] == []


def test_one_bit_adam_is_the_advice_and_does_not_warn():
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _two_steps(ajc.onebit_adam(1e-3, freeze_step=1))
    assert [str(w.message) for w in said] == []



def test_the_controller_warns_once_when_a_policy_switches_to_a_bad_pairing(tmp_path):
    rng = np.random.default_rng(0)
    data = adaptjax.ArrayDataset({"x": rng.normal(size=(256, 64)).astype(np.float32),
                                  "y": rng.normal(size=(256, 40)).astype(np.float32)})
    spec = adaptjax.RunSpec(run_dir=tmp_path / "run", devices=8, batch_size=16, policy_every=1,
                            policies=[ajp.Schedule({2: ajp.SetCodec(ajc.onebit())})])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ctrl = adaptjax.Controller(dict(PARAMS), _loss, optax.adamw(1e-3), data, spec)
        ctrl.run(1)
        before = [str(w.message) for w in said if issubclass(w.category, UserWarning)]
        ctrl.run(5)
        ctrl.close()
    after = [str(w.message) for w in said if issubclass(w.category, UserWarning)]
    assert before == [] and ctrl.config.codec == "onebit()"
    assert after == [ONEBIT_ADAM]
