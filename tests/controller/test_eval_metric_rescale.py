"""An evaluation that keeps an nnx.MultiMetric made once works before and after rescales.

The flax tutorial's pattern: one ``nnx.MultiMetric`` at module level, updated
by an ``nnx.jit`` eval step. Its arrays live where its first update ran; the
Evaluate hook hands the model on the first local device, which every mesh
keeps, so 8 -> 4 -> 8 devices leaves them usable and the accuracy is the one
of the model itself.
"""

import numpy as np
import optax
from flax import nnx

import adaptjax
from adaptjax import policies as ajp

RNG = np.random.default_rng(0)
X = RNG.normal(size=(512, 6)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32)  # the first feature's sign
TEST = {"x": X[:64], "y": Y[:64]}

metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@nnx.jit
def eval_step(model, metrics, batch):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    metrics.update(loss=loss, logits=logits, labels=batch["y"])


def evaluate(model):
    metrics.reset()
    eval_step(model, metrics, TEST)
    return metrics.compute()


def test_a_multimetric_made_once_evaluates_across_two_rescales(tmp_path):
    model = nnx.Linear(6, 2, rngs=nnx.Rngs(0))
    schedule = ajp.Schedule({10: ajp.Rescale(devices=4), 20: ajp.Rescale(devices=8)})
    spec = adaptjax.RunSpec(run_dir=tmp_path / "run", devices=8, batch_size=32,
                            policies=[schedule])
    ctrl = adaptjax.Controller(model, loss_fn, optax.adam(0.05), adaptjax.ArrayDataset(
        {"x": X, "y": Y}, seed=0), spec, hooks=[adaptjax.Evaluate(evaluate, every=5)])
    ctrl.run(steps=30)
    devices = [e.get("devices_to") for e in ctrl.log.events if e["kind"] == "rescale"]
    evals = [e for e in ctrl.log.events if e["kind"] == "eval"]
    final = nnx.merge(*nnx.split(ctrl.model))
    ctrl.close()
    assert devices == [4, 8]
    assert [e["step"] for e in evals] == [5, 10, 15, 20, 25, 30]
    # the last evaluation is the model's own accuracy on the test rows
    logits = np.asarray(final(TEST["x"]))
    assert evals[-1]["eval_accuracy"] == float(np.mean(logits.argmax(1) == TEST["y"]))
    assert evals[-1]["eval_accuracy"] > 0.9
