"""Plain data-parallel training on scikit-learn's digits, no controller.

The smallest commitment to adaptjax: an optax chain with the sync
transformation and its monitors, the step builder on an 8-device mesh (4
micro-batches per replica), and the monitors read back every 50 steps. The
NNX model carries state: BatchNorm statistics (updated at every forward pass,
averaged over replicas) and a Dropout RNG stream (a different mask on every
replica, micro-batch and step, replayed exactly from a checkpoint).

Coming from ``nnx.Optimizer``::

    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        grads = nnx.grad(loss_fn)(model, batch)
        optimizer.update(model, grads)

becomes the same model, loss and optax transformation with the sync first::

    tx = optax.chain(adaptjax.sync_gradients("data"), optax.adam(1e-3))
    step = adaptjax.data_parallel_step(loss_fn, tx, adaptjax.make_mesh(8))
    state = adaptjax.init_state(model, tx, mesh)   # model.train() first
    state, metrics = step(state, batch)            # a functional state, returned
    model = state.model                            # nnx.merge(...): the trained module

Usage:
  python examples/digits_data_parallel.py [--steps 300]
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import adaptjax  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(64, 128, rngs=rngs)
        self.norm = nnx.BatchNorm(128, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.l2 = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.norm(self.l1(x)))))


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target.astype(np.int32), test_size=0.2, random_state=0, stratify=digits.target
    )
    mesh = adaptjax.make_mesh(8)
    tx = optax.chain(  # sync and measure, then adam
        adaptjax.sync_gradients(
            "data",
            monitors=(adaptjax.GradientNoiseScale(), adaptjax.GradientSNR(),
                      adaptjax.GradientNorm()),
        ),
        optax.adam(1e-3),
        adaptjax.update_norm(),
    )
    step = adaptjax.data_parallel_step(loss_fn, tx, mesh, microbatches=4)
    model = MLP(nnx.Rngs(0))
    model.train()  # batch statistics and dropout on while training
    state = adaptjax.init_state(model, tx, mesh)
    data = adaptjax.ArrayDataset({"x": x_train, "y": y_train}, seed=0)
    for i in range(1, args.steps + 1):
        state, metrics = step(state, data.next_batch(128))
        if i % 50 == 0:
            m = adaptjax.read_metrics(state.opt_state)
            print(f"step {i:4d} loss {float(metrics['loss']):.4f} "
                  f"noise_scale {m['noise_scale']:7.1f} snr {m['grad_snr']:.2f}")
    model = state.model  # the trained module: nnx.merge(graphdef, params, model_state)
    model.eval()  # running averages, no dropout
    accuracy = float(np.mean(np.argmax(model(jnp.asarray(x_test)), -1) == y_test))
    print(f"test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
