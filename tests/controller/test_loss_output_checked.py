"""Issue 48 items 1 and 4: the loss function's output structure is checked on the first
batch's shapes before the run directory exists, and a resumed 2-D job is not warned of
settings nobody passed."""

import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax
from adaptjax import policies as ajp

X = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)


def _controller(run_dir, loss_fn, **spec):
    spec = adaptjax.RunSpec(run_dir=run_dir, **{"devices": 2, "batch_size": 8, **spec},
                            compile=adaptjax.CompileOptions(cache_dir=None))
    return adaptjax.Controller({"w": jnp.zeros(3)}, loss_fn, optax.sgd(0.1),
                               adaptjax.ArrayDataset({"x": X, "y": X.sum(1)}, seed=0), spec,
                               hooks=[])


def _residual(p, b):
    return b["x"] @ p["w"] - b["y"]


@pytest.mark.parametrize("loss_fn, has_aux, message", [
    (lambda p, b: jnp.mean(_residual(p, b) ** 2), True,
     "RunSpec(has_aux=True) but loss_fn returned a single value, not (loss, aux); pass "
     "has_aux=False or return (loss, aux)"),
    (lambda p, b: (jnp.mean(_residual(p, b) ** 2), _residual(p, b)), False,
     "loss_fn returned a 2-tuple but RunSpec.has_aux is False; pass RunSpec(has_aux=True) if "
     "it returns (loss, aux)"),
    (lambda p, b: _residual(p, b) ** 2, False,
     "loss_fn must return a scalar loss, got shape (4,); reduce it over the batch (e.g. "
     "jnp.mean)"),
    (lambda p, b: (_residual(p, b) ** 2, 0.0), True,
     "loss_fn must return a scalar loss, got shape (4,); reduce it over the batch (e.g. "
     "jnp.mean)"),
    # optax's getting-started loss(params, batch, labels): its signature, not the data
    (lambda p, x, y: jnp.mean((x @ p["w"] - y) ** 2), False,
     "loss_fn is called as loss_fn(model_or_params, batch), but <lambda>(p, x, y) cannot be "
     "(missing a required argument: 'y'); take the batch as one pytree, e.g. "
     "lambda params, batch: loss(params, *batch) for (inputs, labels) batches"),
])
def test_a_loss_of_the_wrong_structure_is_refused_before_the_run_dir_exists(
        tmp_path, loss_fn, has_aux, message):
    with pytest.raises(ValueError) as e:
        _controller(tmp_path / "run", loss_fn, has_aux=has_aux)
    assert str(e.value) == message  # one line, the per-replica rows: 8 / 2 devices = 4
    assert not (tmp_path / "run").exists()


def test_a_loss_of_the_right_structure_runs(tmp_path):
    loss = lambda p, b: (jnp.mean(_residual(p, b) ** 2), {"n": jnp.float32(1)})  # noqa: E731
    ctrl = _controller(tmp_path, loss, has_aux=True)
    ctrl.run(2)
    ctrl.close()
    assert ctrl.step == 2


def test_a_loss_with_per_example_aux_runs_and_logs_its_scalars(tmp_path):
    # the tutorial's loss_fn returns (loss, logits): the first step's metrics used to
    # fail in the reader ("only 0-dimensional arrays can be converted to Python scalars")
    def loss(p, b):
        r = _residual(p, b)
        return jnp.mean(r ** 2), {"residual": r, "max": jnp.max(jnp.abs(r))}

    ctrl = _controller(tmp_path, loss, has_aux=True)
    ctrl.run(2)
    ctrl.close()
    assert ctrl.step == 2
    aux = {k for k in ctrl.latest_metrics if k.startswith("aux")}
    assert aux == {"aux['max']"}  # the per-example residual is no metric
    assert ctrl.latest_metrics["aux['max']"] > 0


def test_a_resumed_2d_job_warns_of_nothing_it_was_not_passed(tmp_path):
    # 2x4 -> 1x4: one replica then needs two micro-batches (the noise scale's two samples),
    # which the checkpoint keeps; the spec never named microbatches.
    loss = lambda p, b: jnp.mean(_residual(p, b) ** 2)  # noqa: E731
    spec = adaptjax.RunSpec(run_dir=tmp_path, mesh_shape={"data": 2, "fsdp": 4}, batch_size=8,
                            policy_every=1, policies=[ajp.Schedule({2: ajp.Rescale(
                                mesh_shape={"data": 1, "fsdp": 4})})],
                            compile=adaptjax.CompileOptions(cache_dir=None))
    ctrl = adaptjax.Controller(
        {"w": jnp.zeros(3)}, loss, optax.sgd(0.1),
        adaptjax.ArrayDataset({"x": X, "y": X.sum(1)}, seed=0), spec, hooks=[])
    ctrl.run(4)
    ctrl.close()
    assert ctrl.config.microbatches == 2 and ctrl.config.devices == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = adaptjax.Controller.resume(
            tmp_path, model={"w": jnp.zeros(3)}, loss_fn=loss, optimizer=optax.sgd(0.1),
            data=adaptjax.ArrayDataset({"x": X, "y": X.sum(1)}, seed=0), spec=spec, hooks=[])
    assert (resumed.step, resumed.config) == (4, ctrl.config)
    resumed.close()
