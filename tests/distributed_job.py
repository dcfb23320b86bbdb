"""A small controller run for the multi-process tests, as a script under ``adaptjax launch``.

``python tests/distributed_job.py RUN_DIR STEPS [--codec onebit] [--devices N]
[--rescale STEP:DEVICES ...] [--kill RANK:STEP]`` trains a tiny MLP with a
Controller, resuming from ``RUN_DIR``'s checkpoints when it has any. Process 0
writes the final parameters (and the optimizer state's leaves) to
``RUN_DIR/final.npz``. It prints ``STEP <step> <devices>`` per step.
``--mesh data=2,fsdp=4`` trains on that sharded mesh (``adaptjax.FSDP(min_size=16)``:
every leaf of the MLP is split), and a ``--rescale`` target may then be a
shape too (``6:data=4,fsdp=2``).
``--count-all-reduces`` writes the step's all-reduces, as traced and as
compiled, to ``RUN_DIR/all_reduces.json``. ``--kill RANK:STEP`` makes that
rank SIGKILL itself after that step, once per run directory (a marker file
remembers it), once the newest periodic checkpoint before it is complete on
disk. ``--hold STEP --gate DIR`` stops every process in ``on_step`` at that
step until the test has signalled it (``tests/_handshake.py``; the gate's names
are the ranks). Every process appends the sample indices it fed at each step to
``RUN_DIR/fed.jsonl``. ``--data grain`` feeds the same records through a shuffled
``grain.MapDataset`` (:func:`grain_pipeline`) and ``adaptjax.GrainDataset``. Run
without the launcher's environment it is one process on ``XLA_FLAGS``' devices
(the reference run).
"""

import argparse
import json
import os
import signal
import sys
import time

import numpy as np
from _controller_args import make_controller, resume_controller  # noqa: E402

import adaptjax

adaptjax.initialize_distributed()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from adaptjax import policies as ajp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _distributed_data import grain_pipeline, make_data  # noqa: E402
from _handshake import hold  # noqa: E402

D = 8  # features (_distributed_data.make_data)


def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


def init_params():
    rng = np.random.default_rng(1)
    return {
        "w1": jnp.asarray(rng.normal(size=(D, 16)).astype(np.float32) * 0.3),
        "b1": jnp.zeros(16),
        "w2": jnp.asarray(rng.normal(size=(16, 2)).astype(np.float32) * 0.3),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--codec", default=None, choices=[None, "onebit"])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rescale", nargs="*", default=[], help="STEP:DEVICES")
    parser.add_argument("--kill", default=None, help="RANK:STEP")
    parser.add_argument("--hold", type=int, default=None, help="STEP: stop there (--gate)")
    parser.add_argument("--gate", default=None, help="the handshake directory of --hold")
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--data", default="arrays", choices=["arrays", "grain"])
    parser.add_argument("--mesh", default=None, help="a sharded mesh: data=2,fsdp=4")
    parser.add_argument("--count-all-reduces", action="store_true",
                        help="write RUN_DIR/all_reduces.json: the step's all-reduces")
    args = parser.parse_args()

    codec = None
    if args.codec == "onebit":
        import adaptjax.compression as ajc

        codec = ajc.onebit(min_size=16)  # the tiny layers get error-feedback state too
    def shape(text):
        return {a: int(n) for a, n in (p.split("=") for p in text.split(","))}

    pairs = (r.split(":") for r in args.rescale)
    schedule = {int(s): ajp.Rescale(mesh_shape=shape(d)) if "=" in d
                else ajp.Rescale(devices=int(d)) for s, d in pairs}
    mesh = {} if args.mesh is None else {
        "devices": None, "mesh_shape": shape(args.mesh), "sharding": adaptjax.FSDP(min_size=16)}
    kill_rank, kill_step = map(int, args.kill.split(":")) if args.kill else (None, None)
    marker = os.path.join(args.run_dir, f".killed-{kill_rank}-{kill_step}")

    os.makedirs(args.run_dir, exist_ok=True)
    fed = open(os.path.join(args.run_dir, "fed.jsonl"), "a", buffering=1)

    def recorded(base):
        """``base`` (a dataset class) writing down the sample indices this process fed."""

        class Recorded(base):
            def next_rows(self, batch_size, start, stop):
                rows = super().next_rows(batch_size, start, stop)
                self._write(rows)
                return rows

            def next_batch(self, batch_size):
                rows = super().next_batch(batch_size)
                self._write(rows)
                return rows

            def _write(self, rows):
                rank = jax.process_index()
                line = {"cursor": self.cursor, "rank": rank, "idx": rows["idx"].tolist()}
                fed.write(json.dumps(line) + "\n")

        return Recorded

    if args.data == "grain":
        data = recorded(adaptjax.GrainDataset)(grain_pipeline())
    else:
        data = recorded(adaptjax.ArrayDataset)(make_data(), seed=3)

    def on_step(ctrl):
        if jax.process_index() == 0:
            print(f"STEP {ctrl.step} {ctrl.config.devices} {time.time():.3f}", flush=True)
        if ctrl.step == args.hold:
            hold(args.gate, f"step {ctrl.step}", name=str(jax.process_index()))
        if ctrl.step == kill_step and jax.process_index() == kill_rank:
            if not os.path.exists(marker):
                last = kill_step - kill_step % args.checkpoint_every
                done = os.path.join(args.run_dir, "checkpoints", str(last))
                while last and not os.path.isdir(done):  # bounded by --step-timeout
                    time.sleep(0.05)
                open(marker, "w").close()
                print(f"KILL {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    kwargs = dict(
        model=init_params(),
        loss_fn=loss_fn,
        optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
        data=data,
        **({"devices": args.devices} | mesh),
        batch_size=args.batch,
        codec=codec,
        policies=[ajp.Schedule(schedule)] if schedule else [],
        policy_every=1,
        checkpoint_every=args.checkpoint_every,
        progress=False,
        tensorboard=False,
        on_step=on_step,
        run_dir=args.run_dir,
        # What a rescale needs is compiled when it comes, at the training thread's priority:
        # a background compile runs at nice 19, and in the one-process reference runs the
        # tiny steps reach the rescale at once and wait for it, starved on busy cores (over
        # 20 s a run on a loaded 2-core machine). Across processes there is none anyway
        # (background compiles are one process's), so the launched runs are unchanged.
        precompile_upcoming=False,
    )
    ckpts = os.path.join(args.run_dir, "checkpoints")
    if os.path.isdir(ckpts) and any(n.isdigit() for n in os.listdir(ckpts)):
        ctrl = resume_controller(**kwargs)
        if jax.process_index() == 0:
            print(f"RESUMED {ctrl.step}", flush=True)
    else:
        ctrl = make_controller(**kwargs)
    ctrl.run(args.steps)
    from jax.experimental import multihost_utils

    leaves = jax.tree_util.tree_flatten_with_path(ctrl.state.params)[0]
    opt = jax.tree_util.tree_flatten_with_path(ctrl.state.opt_state)[0]
    out = {}
    for prefix, flat in (("params", leaves), ("opt", opt)):
        for path, leaf in flat:
            if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
                leaf = multihost_utils.process_allgather(leaf, tiled=True)
            out[prefix + jax.tree_util.keystr(path)] = np.asarray(leaf)
    counts = None
    if args.count_all_reduces:  # as traced (one per psum) and as compiled (after XLA's passes)
        lowered = ctrl.steps.step(ctrl.config).jitted.lower(
            *ctrl.steps.abstract_args(ctrl.config, ctrl.data)
        )
        counts = {
            "traced": lowered.as_text().count("stablehlo.all_reduce"),
            "compiled": lowered.compile().as_text().count(" all-reduce("),
        }
    ctrl.close()
    if jax.process_index() == 0:
        if counts is not None:
            with open(os.path.join(args.run_dir, "all_reduces.json"), "w") as f:
                json.dump(counts, f)
        np.savez(os.path.join(args.run_dir, "final.npz"), **out)
        print("DONE", flush=True)


if __name__ == "__main__":
    main()
