"""The user's optax optimizer under the controller: a policy's learning rate on any of them.

Each run halves the learning rate a policy sees at its decision on step 10.
The rate a step used is logged as ``learning_rate``: the schedule's value at
the step's update count times the factor (1, then 1/2); the parameters equal
a plain optax loop whose updates carry the same factor (the updates of these
optimizers are linear in their rate, so the factor on the updates and the
rate halved in an ``inject_hyperparams`` state are the same step).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _controller_args import make_controller, resume_controller  # noqa: E402

import adaptjax
from adaptjax import policies as ajp

SCHEDULE = optax.linear_schedule(0.05, 0.01, 30)
STEPS, BATCH = 24, 32


class HalveAt(ajp.Policy):
    """Halves the learning rate it sees, on the metrics of ``step``."""

    def __init__(self, step):
        self.step = step

    def decide(self, metrics, ctx):
        if ctx.step != self.step:
            return []
        return [ajp.SetHyperparams({"learning_rate": ctx.hyperparams["learning_rate"] / 2})]


def _data():
    x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    return adaptjax.ArrayDataset({"x": x, "y": y}, shuffle=False)


def _loss(p, b):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def _controller(tmp_path, optimizer, **kw):
    return make_controller(
        model={"w": jnp.zeros(4)}, loss_fn=_loss, optimizer=optimizer, data=_data(),
        devices=8, batch_size=BATCH, policies=[HalveAt(10)], run_dir=tmp_path,
        progress=False, tensorboard=False, **kw)


def _reference(optimizer, factors):
    """A plain optax loop over the same batches, each update times its step's factor."""
    data, params = _data(), {"w": jnp.zeros(4)}
    state = optimizer.init(params)
    for f in factors:
        grads = jax.grad(_loss)(params, data.next_batch(BATCH))
        updates, state = optimizer.update(grads, state, params)
        updates = optax.scale(np.float32(f)).update(updates, optax.ScaleState())[0]
        params = optax.apply_updates(params, updates)
    return params


def _factors(tmp_path):
    """The factor of each step 1..STEPS: 1/2 after the step the set_hyperparams event names."""
    events = [json.loads(x) for x in open(tmp_path / "events.jsonl")]
    (at,) = [e["step"] for e in events if e["kind"] == "set_hyperparams"]
    return [1.0 if t <= at else 0.5 for t in range(1, STEPS + 1)]


CASES = {
    "adam": (lambda: optax.adam(1e-3), {}, lambda count: 1e-3),
    "chain_schedule": (
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(SCHEDULE)),
        {"learning_rate": SCHEDULE}, SCHEDULE),
    "inject": (
        lambda: optax.inject_hyperparams(optax.adamw, hyperparam_dtype=jnp.float32)(
            learning_rate=0.02, weight_decay=0.1),
        {}, lambda count: 0.02),
    "inject_schedule": (  # a scheduled injected rate: set as the factor, as a chain's is
        lambda: optax.inject_hyperparams(optax.adamw, hyperparam_dtype=jnp.float32)(
            learning_rate=SCHEDULE), {}, SCHEDULE),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_halved_rate_is_logged_and_trained(tmp_path, name):
    make, kw, rate = CASES[name]
    if name == "adam":
        kw = {"learning_rate": 1e-3}
    ctrl = _controller(tmp_path, make(), **kw)
    ctrl.run(steps=STEPS)
    ctrl.close()
    factors = _factors(tmp_path)
    assert factors.count(0.5) > 0 and factors.count(1.0) >= 10
    rows = {r["step"]: r for r in map(json.loads, open(tmp_path / "metrics.jsonl"))}
    for t, f in zip(range(1, STEPS + 1), factors, strict=True):
        expected = float(np.float32(rate(t - 1))) * f  # step t's update count is t - 1
        np.testing.assert_allclose(rows[t]["learning_rate"], expected, rtol=1e-6, err_msg=t)
    want = _reference(make(), factors)
    np.testing.assert_allclose(np.asarray(ctrl.state.params["w"]), np.asarray(want["w"]),
                               rtol=2e-5, atol=1e-6)


def test_injected_rate_is_set_in_its_state(tmp_path):
    make, kw, _ = CASES["inject"]
    with _controller(tmp_path, make(), **kw) as ctrl:
        ctrl.run(steps=STEPS)
        inner = ctrl.state.opt_state["optimizer"]
        assert float(inner.factor) == 1.0
        assert float(inner.inner_state.hyperparams["learning_rate"]) == pytest.approx(0.01)
        seen = {k: ctrl.hyperparams[k] for k in ("learning_rate", "weight_decay", "b1")}
        assert seen == pytest.approx({"learning_rate": 0.01, "weight_decay": 0.1, "b1": 0.9})


def test_resume_keeps_the_factor(tmp_path):
    ctrl = _controller(tmp_path, optax.adam(1e-3), learning_rate=1e-3)
    ctrl.run(steps=STEPS)
    ctrl.save_checkpoint()
    factor, w = float(ctrl.state.opt_state["optimizer"].factor), np.asarray(ctrl.state.params["w"])
    ctrl.close()
    assert factor == 0.5
    again = resume_controller(
        tmp_path, model={"w": jnp.zeros(4)}, loss_fn=_loss, optimizer=optax.adam(1e-3),
        learning_rate=1e-3, data=_data(), devices=8, batch_size=BATCH, policies=[HalveAt(10)],
        progress=False, tensorboard=False)
    with again:
        assert float(again.state.opt_state["optimizer"].factor) == 0.5
        assert again.hyperparams["learning_rate"] == pytest.approx(5e-4, rel=1e-6)
        np.testing.assert_array_equal(np.asarray(again.state.params["w"]), w)


def test_a_hyperparameter_not_exposed_is_named(tmp_path):
    with _controller(tmp_path, optax.adam(1e-3)) as ctrl:
        assert ctrl.hyperparams == {}
        with pytest.raises(ValueError, match=r"^the optimizer does not expose the hyperparameter "
                           r"'learning_rate'; it exposes \[\] \(build it with "
                           r"optax.inject_hyperparams"):
            ctrl.apply([ajp.SetHyperparams({"learning_rate": 1e-4})])


def test_an_optimizer_factory_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^optimizer must be an optax.GradientTransformation "
                       r"such as optax.adam\(1e-3\), got adam; build it"):
        _controller(tmp_path, optax.adam)


@pytest.mark.parametrize("rate, said", [(0.0, "> 0 and finite, got 0.0"),
                                        ("0.1", "or its optax schedule, got str")])
def test_a_bad_learning_rate_is_refused(tmp_path, rate, said):
    with pytest.raises(ValueError, match=f"^learning_rate must be .*{said}"):
        _controller(tmp_path, optax.adam(1e-3), learning_rate=rate)
