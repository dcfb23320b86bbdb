"""A gradient codec written in a page: stochastic rounding to 4 bits with a per-block scale.

The codec states what one block becomes on the wire (``payload``), how to
encode and decode blocks, and that it is unbiased; adaptjax gives it the
owner-compute and all-gather transports, buckets, error feedback, the plan,
``wire_bytes``, checkpoints and rescale merges (see docs/guide/custom-codec.md).
Then it trains the digits MLP of ``digits_data_parallel.py`` on 8 replicas.

Usage:
  python examples/custom_codec.py [--steps 300] [--error-feedback ef14]
"""

import argparse
import dataclasses
import os
from typing import ClassVar

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import adaptjax  # noqa: E402
from adaptjax import compression as ajc  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class StochasticRound4(ajc.BlockCodec):
    """Each block of ``block`` values as 4-bit codes of 15 levels in ``[-s, s]``, ``s = max|x|``."""

    name: ClassVar[str] = "sr4"
    randomness: ClassVar[str] = "per_replica"
    unbiased: ClassVar[bool] = True

    def payload(self):  # per block: 4 bits per value, packed in bytes, and one scale
        return {"codes": (jnp.uint8, self.block // 2), "scales": (jnp.float32, 1)}

    def encode_blocks(self, x, blocks):  # x: (rows, blocks, block) float32
        s = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        level = jnp.where(s > 0, x / s, 0.0) * 7 + 7  # in [0, 14]
        code = jnp.floor(level + blocks.uniform())  # up with probability frac(level)
        return {"codes": ajc.pack_bits(code.astype(jnp.uint8), 4), "scales": s}

    def decode_blocks(self, payload):
        code = ajc.unpack_bits(payload["codes"], 4).astype(jnp.float32)
        return (code - 7) / 7 * payload["scales"]


@ajc.factory(StochasticRound4)
def sr4(*, block: int = 64, error_feedback: str | None = None, axis_name: str = "data",
        min_size: int = 1024, seed: int = 0, bucket_bytes: int | None = None) -> ajc.Codec:
    """Stochastic rounding to 4 bits per value, one float32 scale per ``block`` values."""
    return StochasticRound4(**locals())


def main(argv=None):
    # the data and the model need the examples extra (scikit-learn); the codec does not
    from digits_data_parallel import MLP, loss_fn
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--error-feedback", default=None, choices=(None, "ef14", "ef21"))
    args = parser.parse_args(argv)
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target.astype(np.int32), test_size=0.2, random_state=0, stratify=digits.target
    )
    mesh = adaptjax.make_mesh(8)
    codec = sr4(error_feedback=args.error_feedback)
    tx = optax.chain(adaptjax.sync_gradients("data", codec=codec), optax.adam(1e-3))
    step = adaptjax.data_parallel_step(loss_fn, tx, mesh)
    model = MLP(nnx.Rngs(0))
    model.train()
    state = adaptjax.init_state(model, tx, mesh)
    ajc.plan(state.params, codec, 8)  # which leaves sr4 takes, and its bytes
    data = adaptjax.ArrayDataset({"x": x_train, "y": y_train}, seed=0)
    report = adaptjax.wire_bytes(step.jitted, state, data.next_batch(128))
    print(f"{codec!r} sends {report.total:,.0f} bytes per device per step")
    for i in range(1, args.steps + 1):
        state, metrics = step(state, data.next_batch(128))
        if i % 50 == 0:
            print(f"step {i:4d} loss {float(metrics['loss']):.4f}")
    model = state.model
    model.eval()
    accuracy = float(np.mean(np.argmax(model(jnp.asarray(x_test)), -1) == y_test))
    print(f"test accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
