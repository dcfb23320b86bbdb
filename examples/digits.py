"""The main job: adaptive data-parallel training on scikit-learn's digits.

A flax NNX MLP on the 8x8 digits data set (bundled with scikit-learn, no
download), 8 simulated CPU devices, and the adaptjax controller with:

* ``AdaptiveBatchSize``: Pollux-style goodput from the in-step noise scale and
  the measured step times; the learning rate follows AdaScale (Adam: sqrt).
  It counts the compile a new batch size waits for against the run's age, and
  announces half and double its batch, which the controller compiles in the
  background: once compiled (``Context.compiled_batch_sizes``) a move waits
  for no compile and is not discounted. With a one-size step-time model the
  move to 128 pays (> +5% goodput) once the noise scale passes ~175; in one
  cold-cache run on a loaded 2-core machine the batch went 64 -> 128 at step
  321 (noise scale 201, predicted +7%), test accuracy 0.967. (Before the
  background compiles counted, the compile discount held the batch at 64.)
* ``ElasticScale``: 8 -> 4 devices at step 150 and back to 8 at step 300, each
  through an Orbax checkpoint and a restore with the new shardings.
* ``SwitchCompression``: natural compression (8 bits, safe with Adam:
  ``benchmarks/codec_optimizers.py``) switches on
  when communication's modelled share of the step passes 50% (the link is
  modelled at 10 Mbit/s; simulated devices have no real link).

Usage:
  python examples/digits.py [--steps 400] [--run-dir runs/digits] [--resume]
  adaptjax launch -n 2 --devices-per-process 4 -- python examples/digits.py

It starts a new run (removing ``RUN_DIR``) unless ``--resume`` is given or it runs
under ``adaptjax launch`` after a restart, when it continues from ``RUN_DIR``'s
latest checkpoint. Under the launcher the same script runs on every process.

Prints ``test accuracy: <x>`` at the end; ``RUN_DIR`` holds metrics.jsonl,
events.jsonl, tensorboard/ and checkpoints/.
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import shutil  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import adaptjax  # noqa: E402
from adaptjax import compression as ajc  # noqa: E402
from adaptjax import policies as ajp  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, hidden: int = 256):
        self.l1 = nnx.Linear(64, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.l3 = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.l1(x))
        x = nnx.relu(self.l2(x))
        return self.l3(x)


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def load(seed=0):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def host_copy(model):
    """The model on this process's default device (across processes its arrays are global)."""
    graphdef, state = nnx.split(model)
    local = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), state)
    return nnx.merge(graphdef, local)


def make_eval(x_test, y_test):
    def evaluate(model):
        model = host_copy(model)
        pred = np.asarray(jnp.argmax(model(jnp.asarray(x_test)), axis=-1))
        return {"accuracy": float(np.mean(pred == y_test))}

    return evaluate


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--run-dir", default="runs/digits")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--resume", action="store_true", help="continue RUN_DIR's run")
    args = parser.parse_args()

    process, processes = adaptjax.initialize_distributed()  # no-op in one plain process
    x_train, x_test, y_train, y_test = load()
    ckpts = os.path.join(args.run_dir, "checkpoints")
    restarted = int(os.environ.get("ADAPTJAX_ATTEMPT", "0")) > 0  # adaptjax launch restarted us
    resume = (args.resume or restarted) and os.path.isdir(ckpts) and any(
        n.isdigit() for n in os.listdir(ckpts)
    )
    if not resume and process == 0 and os.path.exists(args.run_dir):
        shutil.rmtree(args.run_dir)  # a new run starts fresh
    if processes > 1:
        multihost_utils.sync_global_devices("digits: run_dir ready")
    spec = adaptjax.RunSpec(
        run_dir=args.run_dir,
        devices=8,
        batch_size=64,
        learning_rate=1e-3,  # the rate AdaptiveBatchSize scales (a factor on adam's updates)
        policy_every=10,
        checkpoint=adaptjax.CheckpointOptions(every=100),
        link_bandwidth=10e6 / 8,
        policies=[
            ajp.cooldown(
                ajp.AdaptiveBatchSize(max_batch_size=512, lr_rule="adascale",
                                      optimizer_kind="adam", multiple_of=8),
                steps=50,
            ),
            ajp.ElasticScale({150: 4, 300: 8}),
            ajp.SwitchCompression(ajc.natural(), when_comm_share_above=0.5),
        ],
    )
    hooks = [adaptjax.Evaluate(make_eval(x_test, y_test), every=100), adaptjax.TensorBoard()]
    if not args.no_progress:
        hooks.append(adaptjax.ProgressBar())
    # On resume the configuration, data cursor and policy states come from the checkpoint;
    # the spec is passed again for its policies (code, which spec.json names only).
    make = adaptjax.Controller.resume if resume else adaptjax.Controller

    ctrl = make(
        model=MLP(nnx.Rngs(0)),
        loss_fn=loss_fn,
        optimizer=optax.adam(1e-3),
        data=adaptjax.ArrayDataset({"x": x_train, "y": y_train}, seed=0),
        spec=spec,
        hooks=hooks,
    )
    t0 = time.perf_counter()
    ctrl.run(args.steps)
    seconds = time.perf_counter() - t0
    accuracy = make_eval(x_test, y_test)(ctrl.model)["accuracy"]
    kinds = [e["kind"] for e in ctrl.log.events]
    rescales = [(e["devices_from"], e["devices_to"], round(e["latency_s"], 2))
                for e in ctrl.log.events if e["kind"] == "rescale"]
    batches = sorted({e["config"]["batch_size"] for e in ctrl.log.events if e["kind"] == "compile"})
    codecs = [(e["step"], e["codec"]) for e in ctrl.log.events if e["kind"] == "set_codec"]
    print(f"steps: {ctrl.step}  samples: {ctrl.samples_seen}  wall: {seconds:.1f}s  "
          f"compilations: {ctrl.compilations}")
    print(f"batch sizes used: {batches}  rescales (from, to, s): {rescales}")
    print(f"codec switches: {codecs}")
    print(f"checkpoints: {kinds.count('checkpoint')}  decisions: {kinds.count('decision')}")
    print(f"final metrics: noise_scale={ctrl.latest_metrics.get('noise_scale', float('nan')):.1f} "
          f"loss={ctrl.latest_metrics.get('loss', float('nan')):.4f}")
    ctrl.close()
    print(f"test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
