"""A small controller run used by the controller tests, in-process or as a subprocess.

As a script: ``python tests/controller_job.py RUN_DIR STEPS [--kill-in-save S]`` runs
the job, resuming from ``RUN_DIR``'s checkpoints when it has any, and on completion
writes the final parameters to ``RUN_DIR/final_params.npz``. It prints one line per
step (``STEP <step> <devices>``) and ``RESCALE <from> <to>`` as a policy decides a
rescale, flushed. ``--hold step=N`` (the first step >= N) or ``--hold devices=K``
(the first step on K devices) stops the job in ``on_step`` there until the test
has signalled it (``--gate DIR``, the handshake of ``tests/_handshake.py``), so
a test can kill it from outside at a chosen moment without racing it.
``--kill-in-save S`` ends the process inside the write of the checkpoint of
step S, after every byte is written but before Orbax's commit (the rename).
``--checkpoint-every N`` and ``--schedule-scale K`` (the policy's steps times K)
stretch the job (``benchmarks/fault_trials.py``: 20 and 2).
``--hold-in-save S`` stops the job inside Orbax's save of step S, once its
temporary directory exists and its writes were launched (still in the main
thread, before the save returns), until the test has signalled it (``--gate``).
``--sharded`` runs the job on a ``{"data": 2, "fsdp": 4}`` mesh whose schedule
rescales over both axes (:func:`sharded_schedule`); ``--hold restore`` then
stops the job inside the first rescale, after its checkpoint is committed and
before the state is restored onto the new mesh.
"""

import os

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _controller_args import make_controller, resume_controller  # noqa: E402

import adaptjax  # noqa: E402
from adaptjax import policies as ajp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _handshake import hold  # noqa: E402

D = 8


def make_data(seed=0, n=640):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)).astype(np.float32)
    w = rng.normal(size=(D, 2)).astype(np.float32)
    y = (x @ w + 0.1 * rng.normal(size=(n, 2))).astype(np.float32)
    return {"x": x, "y": y, "idx": np.arange(n, dtype=np.int32)}


def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


def init_params(seed=0):
    rng = np.random.default_rng(seed + 1)
    return {
        "w1": jnp.asarray(rng.normal(size=(D, 16)).astype(np.float32) * 0.3),
        "b1": jnp.zeros(16),
        "w2": jnp.asarray(rng.normal(size=(16, 2)).astype(np.float32) * 0.3),
    }


class LossDrivenPolicy(ajp.Policy):
    """A deterministic policy with state: halve the learning rate every 3rd call."""

    def __init__(self):
        self.calls = 0

    def decide(self, metrics, ctx):
        self.calls += 1
        if self.calls % 3 == 0 and "loss" in metrics:
            return [ajp.SetHyperparams({"learning_rate": ctx.hyperparams["learning_rate"] * 0.5})]
        return []

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = int(state["calls"])


class Announce(ajp.Policy):
    """Wraps a policy and prints ``RESCALE from to`` (flushed) when it decides one."""

    def __init__(self, inner):
        self.inner = inner

    def decide(self, metrics, ctx):
        actions = self.inner.decide(metrics, ctx)
        for a in actions:
            if isinstance(a, ajp.Rescale):
                print(f"RESCALE {ctx.devices} {a.devices}", flush=True)
        return actions

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


def schedule(scale=1):
    """Batch 32, 4 devices, batch 96, 8 devices: at steps 10, 20, 30, 40 (times ``scale``)."""
    return ajp.Schedule(
        {
            10 * scale: ajp.SetBatchSize(32),
            20 * scale: ajp.Rescale(devices=4),
            30 * scale: ajp.SetBatchSize(96),
            40 * scale: ajp.Rescale(devices=8),
        }
    )


def sharded_schedule():
    return ajp.Schedule(
        {
            10: ajp.SetBatchSize(32),
            20: ajp.Rescale(mesh_shape={"data": 1, "fsdp": 4}),
            30: ajp.SetBatchSize(96),
            40: ajp.Rescale(mesh_shape={"data": 4, "fsdp": 2}),
        }
    )


def sharded_kwargs(**overrides):
    """:func:`job_kwargs` on a (data 2, fsdp 4) mesh, rescaled by :func:`sharded_schedule`."""
    kwargs = dict(
        devices=None,
        mesh_shape={"data": 2, "fsdp": 4},
        sharding=adaptjax.FSDP(min_size=16),  # the MLP is tiny: shard its leaves of >= 16
        policies=[LossDrivenPolicy(), Announce(sharded_schedule())],
    )
    kwargs.update(overrides)
    return job_kwargs(**kwargs)


def hold_in_restore(gate):
    """Stops the job inside its first restore onto a new mesh (the test's handshake)."""
    from adaptjax.controller import _controller

    original = _controller.restore_latest

    def held(checkpoints, steps, config):
        _controller.restore_latest = original  # once
        print(f"RESTORING {checkpoints.latest_step()}", flush=True)
        hold(gate, f"restore {checkpoints.latest_step()} mesh {config.axes}")
        return original(checkpoints, steps, config)

    _controller.restore_latest = held


def job_kwargs(**overrides):
    kwargs = dict(
        model=init_params(),
        loss_fn=loss_fn,
        optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
        data=adaptjax.ArrayDataset(make_data(), seed=3),
        devices=8,
        batch_size=64,
        policies=[LossDrivenPolicy(), Announce(schedule())],
        policy_every=5,
        checkpoint_every=10,
        progress=False,
        tensorboard=False,
    )
    kwargs.update(overrides)
    return kwargs


def hold_in_save(step, gate):
    """Makes the save of checkpoint ``step`` hold (``tests/_handshake.py``) once its writes
    were launched: the moment a signal tears a save apart if anything can."""
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    original = async_checkpointer.AsyncCheckpointer._save
    held = []

    async def _save(self, tmpdir, *a, **k):
        ops = await original(self, tmpdir, *a, **k)
        if tmpdir.get_final().name == str(step) and not held:
            held.append(step)
            released = hold(gate, f"save {step}")
            print(f"RELEASED {released}", flush=True)
        return ops

    async_checkpointer.AsyncCheckpointer._save = _save


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--kill-in-save", type=int, default=None, help="checkpoint step")
    parser.add_argument("--hold", default=None, help="step=N or devices=K: where to stop")
    parser.add_argument("--hold-in-save", type=int, default=None, help="checkpoint step")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--schedule-scale", type=int, default=1, help="schedule steps x this")
    parser.add_argument("--gate", default=None, help="the handshake directory of --hold")
    parser.add_argument("--sharded", action="store_true", help="a (data 2, fsdp 4) mesh")
    args = parser.parse_args()
    if args.hold == "restore":
        hold_in_restore(args.gate)
        args.hold = None
    kind, value = args.hold.split("=") if args.hold else (None, 0)
    held = []

    def on_step(ctrl):
        print(f"STEP {ctrl.step} {ctrl.config.devices}", flush=True)
        here = {"step": ctrl.step >= int(value), "devices": ctrl.config.devices == int(value)}
        if kind and not held and here[kind]:
            held.append(ctrl.step)
            released = hold(args.gate, f"step {ctrl.step} devices {ctrl.config.devices}")
            print(f"RELEASED {released}", flush=True)

    if args.kill_in_save is not None:
        from orbax.checkpoint._src.path import atomicity

        original = atomicity.AtomicRenameTemporaryPath.finalize

        async def finalize(self, *a, **k):
            if self.get_final().name == str(args.kill_in_save):
                os._exit(17)  # every byte written, the commit (rename) never happens
            return await original(self, *a, **k)

        atomicity.AtomicRenameTemporaryPath.finalize = finalize
    if args.hold_in_save is not None:
        hold_in_save(args.hold_in_save, args.gate)
    common = dict(on_step=on_step, checkpoint_every=args.checkpoint_every)
    if args.sharded:
        kwargs = sharded_kwargs(**common)
    else:
        kwargs = job_kwargs(
            **common, policies=[LossDrivenPolicy(), Announce(schedule(args.schedule_scale))],
        )
    ckpts = os.path.join(args.run_dir, "checkpoints")
    if os.path.isdir(ckpts) and any(n.isdigit() for n in os.listdir(ckpts)):
        ctrl = resume_controller(args.run_dir, **kwargs)
        print(f"RESUMED {ctrl.step}", flush=True)
    else:
        ctrl = make_controller(run_dir=args.run_dir, **kwargs)
    ctrl.run(args.steps)
    params = {k: np.asarray(v) for k, v in jax.device_get(ctrl.state.params).items()}
    ctrl.close()
    np.savez(os.path.join(args.run_dir, "final_params.npz"), **params)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
