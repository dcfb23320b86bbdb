"""Compile time of the main job's step, per configuration, split into trace+lower and XLA.

Builds the step the controller of ``examples/digits.py`` builds (the NNX MLP,
``sync_gradients`` with the default monitors, injected Adam, ``update_norm``)
for the configurations the job runs in, and variants that isolate one cost
each: 1 device vs 8 (the shard_map), no monitors, a codec (1-bit; and 1-bit with
each leaf encoded on its own, as before its lane became one flat bucket). Each is
built fresh (no cache hits) ``--repeats`` times; medians are printed.

Usage:
  python benchmarks/compile_time.py [--repeats 3] [--configs "job 8 dev b128,..."]

The last line is ``compile_seconds_main_configs=<sum of the job's configurations>``.
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from adaptjax.compression import _quantizers  # noqa: E402
from flax import nnx  # noqa: E402

import adaptjax  # noqa: E402
from adaptjax import compression as ajc  # noqa: E402


class MLP(nnx.Module):  # examples/digits.py's model
    def __init__(self, rngs, hidden=256):
        self.l1 = nnx.Linear(64, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.l3 = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x):
        return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_tx(codec, monitors=True, devices=8):
    one = devices == 1  # one replica: the noise scale differences successive steps
    mons = (
        (
            adaptjax.GradientNoiseScale(differencing=one),
            adaptjax.GradientSNR(differencing=one),
            adaptjax.GradientNorm(),
        )
        if monitors
        else ()
    )
    opt = optax.inject_hyperparams(optax.adam, hyperparam_dtype=np.float32)(learning_rate=1e-3)
    return optax.chain(
        adaptjax.sync_gradients("data", codec=codec, monitors=mons), opt, adaptjax.update_norm()
    )


def measure(devices, batch_size, codec=None, monitors=True, microbatches=1):
    """Seconds to trace+lower and to XLA-compile a fresh step of this configuration."""
    mesh = adaptjax.make_mesh(devices)
    tx = make_tx(codec, monitors, devices)
    model = MLP(nnx.Rngs(0))
    state = adaptjax.abstract_state(model, tx, mesh)
    batch = {
        "x": jax.ShapeDtypeStruct((batch_size, 64), np.float32),
        "y": jax.ShapeDtypeStruct((batch_size,), np.int32),
    }
    step = adaptjax.data_parallel_step(loss_fn, tx, mesh, microbatches=microbatches)
    t0 = time.perf_counter()
    lowered = step.jitted.lower(state, batch)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


CONFIGS = {  # name: (devices, batch, codec, monitors); the first four are the job's
    "job 8 dev b64": (8, 64, None, True),
    "job 8 dev b128": (8, 128, None, True),
    "job 4 dev b128": (4, 128, None, True),
    "job 8 dev b128 onebit": (8, 128, "onebit", True),
    # the same with each leaf encoded on its own (before the lane became one bucket)
    "8 dev b128 onebit per-leaf": (8, 128, "onebit-per-leaf", True),
    "1 dev b128": (1, 128, None, True),
    "8 dev b128 no monitors": (8, 128, None, False),
    "1 dev b128 no monitors": (1, 128, None, False),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default=None,
                        help="comma-separated names of CONFIGS to run (default: all)")
    args = parser.parse_args()
    bucket_max = _quantizers.BUCKET_MAX
    measure(8, 64)  # warm the tracing machinery (first-use imports, jax caches of primitives)
    main_total = 0.0
    names = args.configs.split(",") if args.configs else list(CONFIGS)
    for name in names:
        devices, batch, codec, monitors = CONFIGS[name]
        runs = []
        # A codec lane of up to BUCKET_MAX elements goes as one flat bucket; 0 turns that off.
        _quantizers.BUCKET_MAX = 0 if codec == "onebit-per-leaf" else bucket_max
        for _ in range(args.repeats):
            jax.clear_caches()
            runs.append(measure(devices, batch, ajc.onebit() if codec else None, monitors))
        _quantizers.BUCKET_MAX = bucket_max
        lower = statistics.median(r[0] for r in runs)
        xla = statistics.median(r[1] for r in runs)
        if name.startswith("job"):
            main_total += lower + xla
        print(f"{name:26s} trace+lower {lower:6.2f} s   xla compile {xla:6.2f} s", flush=True)
    print(f"compile_seconds_main_configs={main_total:.2f}")


if __name__ == "__main__":
    main()
