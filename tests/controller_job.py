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
before the state is restored onto the new mesh (``--hold restore=S``: the first
one from a checkpoint of step ``S`` or later); ``--schedule-scale`` stretches it too.
``--data grain`` feeds the job's arrays as records through
``adaptjax.GrainDataset`` (a shuffled ``grain.MapDataset``), ``--data
grain-iter`` through ``GrainDataset.from_iter_dataset`` (a filtered, packed
``grain.IterDataset``, :func:`packed_pipeline`), whose batch cannot change:
that job's schedule keeps the batch and only rescales (:func:`iter_schedule`).
Whatever the data, every batch's element indices are appended to
``RUN_DIR/fed.jsonl`` (``tests/_fed.py``).
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
import _fed  # noqa: E402
from _handshake import hold  # noqa: E402

D = 8


def make_data(seed=0, n=640):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)).astype(np.float32)
    w = rng.normal(size=(D, 2)).astype(np.float32)
    y = (x @ w + 0.1 * rng.normal(size=(n, 2))).astype(np.float32)
    return {"x": x, "y": y, "idx": np.arange(n, dtype=np.int32)}


def records(arrays):
    """The job's arrays as records: one dict of a sample's leaves per sample."""
    return [{k: v[i] for k, v in arrays.items()} for i in range(len(arrays["idx"]))]


def document(record):
    """Record ``i`` as an element of ``i % 4 + 1`` tokens (the record, repeated), to be packed."""
    k = int(record["idx"]) % 4 + 1
    return {key: np.repeat(np.asarray(v)[None], k, axis=0) for key, v in record.items()}


def packed_pipeline(seed=3):
    """The job's records shuffled, repeated, every third dropped (``idx % 3 == 0``), each kept
    one an element of ``idx % 4 + 1`` tokens, packed first-fit into rows of 8 tokens."""
    import grain

    rows = grain.MapDataset.source(records(make_data())).shuffle(seed=seed).repeat()
    # read on the job's thread: grain's default read-ahead costs ~4 ms per packed row here
    reading = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    kept = rows.to_iter_dataset(reading).filter(lambda r: r["idx"] % 3 != 0).map(document)
    return grain.experimental.FirstFitPackIterDataset(
        kept, length_struct={"x": 8, "y": 8, "idx": 8}, num_packing_bins=2
    )


def make_dataset(kind, run_dir, batch_size=64):
    """The job's data: ``"array"`` (ArrayDataset), ``"grain"`` (a shuffled grain MapDataset of
    its records) or ``"grain-iter"`` (:func:`packed_pipeline`), recording what it feeds in
    ``run_dir`` (``tests/_fed.py``)."""
    if kind == "grain":
        import grain

        rows = grain.MapDataset.source(records(make_data())).shuffle(seed=3)
        data = adaptjax.GrainDataset(rows)
    elif kind == "grain-iter":
        data = adaptjax.GrainDataset.from_iter_dataset(packed_pipeline(), batch_size)
    else:
        data = adaptjax.ArrayDataset(make_data(), seed=3)
    return _fed.record(data, run_dir)


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


def iter_schedule(scale=1):
    """:func:`schedule` without its batch changes: 8 -> 4 devices at 20, 4 -> 8 at 40
    (times ``scale``)."""
    return ajp.Schedule({20 * scale: ajp.Rescale(devices=4), 40 * scale: ajp.Rescale(devices=8)})


def sharded_schedule(scale=1):
    return ajp.Schedule(
        {
            10 * scale: ajp.SetBatchSize(32),
            20 * scale: ajp.Rescale(mesh_shape={"data": 1, "fsdp": 4}),
            30 * scale: ajp.SetBatchSize(96),
            40 * scale: ajp.Rescale(mesh_shape={"data": 4, "fsdp": 2}),
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


def hold_in_restore(gate, from_step=0):
    """Stops the job inside its first restore onto a new mesh from a checkpoint of step
    ``from_step`` or later (the test's handshake)."""
    from adaptjax.controller import _controller

    original = _controller.restore_latest

    def held(checkpoints, steps, config):
        if checkpoints.latest_step() < from_step:
            return original(checkpoints, steps, config)
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


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--kill-in-save", type=int, default=None, help="checkpoint step")
    parser.add_argument("--hold", default=None,
                        help="step=N, devices=K or restore[=S]: where to stop")
    parser.add_argument("--hold-in-save", type=int, default=None, help="checkpoint step")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--schedule-scale", type=int, default=1, help="schedule steps x this")
    parser.add_argument("--gate", default=None, help="the handshake directory of --hold")
    parser.add_argument("--sharded", action="store_true", help="a (data 2, fsdp 4) mesh")
    parser.add_argument("--data", choices=["array", "grain", "grain-iter"], default="array")
    args = parser.parse_args()
    if args.sharded and args.data == "grain-iter":
        parser.error("--data grain-iter keeps its batch; the --sharded schedule changes it")
    return args


def kill_in_save(step):
    """Ends the process inside the write of checkpoint ``step``: every byte written, the
    commit (Orbax's rename) never happens."""
    from orbax.checkpoint._src.path import atomicity

    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self, *a, **k):
        if self.get_final().name == str(step):
            os._exit(17)
        return await original(self, *a, **k)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize


def build_kwargs(args, on_step):
    """The job's settings for ``args``: its mesh, data and schedule."""
    common = dict(on_step=on_step, checkpoint_every=args.checkpoint_every,
                  data=make_dataset(args.data, args.run_dir))
    scale = args.schedule_scale
    if args.sharded:
        policies = [LossDrivenPolicy(), Announce(sharded_schedule(scale))]
        return sharded_kwargs(**common, policies=policies)
    plan = iter_schedule(scale) if args.data == "grain-iter" else schedule(scale)
    return job_kwargs(**common, policies=[LossDrivenPolicy(), Announce(plan)])


def main():
    args = parse_args()
    if args.hold and args.hold.startswith("restore"):
        hold_in_restore(args.gate, int(args.hold.partition("=")[2] or 0))
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
        kill_in_save(args.kill_in_save)
    if args.hold_in_save is not None:
        hold_in_save(args.hold_in_save, args.gate)
    kwargs = build_kwargs(args, on_step)
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
