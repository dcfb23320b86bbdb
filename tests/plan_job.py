"""A small training script for ``adaptjax plan SCRIPT``: it knows nothing of planning.

``python tests/plan_job.py --run-dir DIR [--steps N] [--devices N]`` trains the
controller job's MLP with a ``SwitchCompression`` policy holding a 1-bit codec
and writes ``DIR/done.txt`` after ``run``, as an ordinary script would.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402

import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import controller_job as job  # noqa: E402
from _controller_args import make_controller  # noqa: E402

import adaptjax  # noqa: E402
from adaptjax import compression as ajc  # noqa: E402
from adaptjax import policies as ajp  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    ctrl = make_controller(
        model=job.init_params(),
        loss_fn=job.loss_fn,
        optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.05),
        data=adaptjax.ArrayDataset(job.make_data(), seed=0),
        devices=args.devices,
        batch_size=args.batch_size,
        policies=[ajp.SwitchCompression(ajc.onebit(), when_comm_share_above=0.5)],
        link_bandwidth=1e6,
        run_dir=args.run_dir,
        progress=False,
        tensorboard=False,
    )
    ctrl.run(args.steps)
    ctrl.close()
    with open(os.path.join(args.run_dir, "done.txt"), "w") as f:
        f.write(f"{ctrl.step}\n")


if __name__ == "__main__":
    main()
