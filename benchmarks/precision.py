"""Mixed precision and quantized input features: step time, final loss, bytes host -> device.

**Precision, on the LM** (``examples/lm.py``'s ``ByteLM``, ``--size``, dropout
off): the same model, initialisation, batches and optimizer
(``optax.chain(sync_gradients("data"), optax.adam(lr))`` in
:func:`adaptjax.data_parallel_step` on ``--devices``), with the loss function
wrapped by :func:`adaptjax.with_precision` in float32 and in bfloat16 (float32
master weights and Adam state in both; the logits are cast to float32 for the
cross entropy, as ``examples/lm.py`` does). The runs train side by side: in
every round each runs a block of ``--block`` steps, in a fresh random order,
so the machine's drift falls on both. Reported per precision: the median
seconds per step (tokens per second), the mean training loss of the last 10
steps and the validation loss (float32 evaluation of the final parameters).
On CPU bfloat16 matmuls are slower than float32 ones: besides the LM's
ratio, one ``--matmul``-sized square matmul is timed alone in each dtype. On a GPU with bfloat16
tensor cores (``--size gpu``) bfloat16 should give >= 1.5x the tokens per
second.

The adaptive row: the same model, initialisation, batches (the same
``ArrayDataset``, seed 0) and Adam under :class:`adaptjax.Controller` with
``adaptjax.policies.PrecisionPolicy``: it starts in float32 and moves the run
to bfloat16 once it is stable (``warmup`` = steps / 5, ``stable_steps`` =
steps / 10, decisions every steps / 30 steps; back to float32 after a
non-finite step or a loss spike). The controller's chain differs from the
rows above only by what it always holds (the learning rate injected as state,
the update norm; ``monitors=()``), so its losses match float32's until the
switch. It runs after the side-by-side runs, not interleaved with them (a
controller's ``run`` ends with a checkpoint); its step time is the median
interval between consecutive dispatches (the controller reads each step's
metrics one step behind, so dispatch runs at the device's pace), over the
float32 and the bfloat16 stretches. The ``compile`` events' ``input_bytes``
are the bytes a step moves host -> device.

**Input codec, on digits** (``examples/digits.py``'s MLP and data, Adam 1e-3,
batch 64 on 2 replicas): bytes moved host -> device per step (the bytes of the
numpy batch handed to the step, :func:`batch_bytes`) with the float32
features and with ``ArrayDataset(..., features=adaptjax.InputCodec("int8"))``,
and the test accuracy of both runs (the int8 run's test features encoded with
the codec fitted on the training set, decoded inside the step).

Usage:
  python benchmarks/precision.py                 # small LM, 300 steps; digits 400 steps
  python benchmarks/precision.py --quick         # tiny LM, 30 steps; digits 150 steps
  python benchmarks/precision.py --size gpu --devices 1 --per-device-batch 32   # on a GPU

The last line is ``bf16_loss_gap=<x> input_codec_bytes_ratio=<y>
input_codec_accuracy_gap=<z>``: the LM's validation loss in bfloat16 relative to
float32's, ``(L_bf16 - L_f32) / L_f32``; float32 bytes per step over int8 bytes
per step; float32's digits test accuracy minus the int8 run's.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import adaptjax  # noqa: E402
from adaptjax import policies as ajp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import lm_data  # noqa: E402
from lm import SIZES, ByteLM, make_eval  # noqa: E402
from lm import loss_fn as lm_loss  # noqa: E402

from adaptjax._input_codec import batch_bytes

PRECISIONS = ("float32", "bfloat16")


def lm_runs(args) -> dict:
    """Trains the LM in each precision side by side; returns per-precision figures."""
    cfg = dataclasses.replace(SIZES[args.size], dropout=0.0)
    mesh = adaptjax.make_mesh(args.devices)
    batch = args.per_device_batch * args.devices
    train, val, _ = lm_data.load_corpus(context=cfg.context, max_train_bytes=2_000_000)
    data = adaptjax.ArrayDataset({"tokens": train}, seed=0)
    batches = [data.next_batch(batch) for _ in range(args.steps)]
    tx = optax.chain(adaptjax.sync_gradients("data"), optax.adam(args.lr))
    steps, states, losses, times = {}, {}, {}, {}
    for p in PRECISIONS:
        steps[p] = adaptjax.data_parallel_step(adaptjax.with_precision(lm_loss, p), tx, mesh)
        states[p] = adaptjax.init_state(ByteLM(cfg, nnx.Rngs(0)), tx, mesh)
        states[p], m = steps[p](states[p], batches[0])  # compiles
        losses[p], times[p] = [m], []
        jax.block_until_ready(states[p])
    order = np.random.default_rng(0)
    for start in range(1, args.steps, args.block):
        for k in order.permutation(len(PRECISIONS)):
            p = PRECISIONS[k]
            block = batches[start : start + args.block]
            t0 = time.perf_counter()
            for b in block:
                states[p], m = steps[p](states[p], b)
                losses[p].append(m)
            jax.block_until_ready(states[p])
            times[p].append((time.perf_counter() - t0) / len(block))
    evaluate = make_eval(val[: args.val_windows], ByteLM(cfg, nnx.Rngs(1)))
    tokens = batch * cfg.context
    out = {"cfg": cfg, "batch": batch}
    for p in PRECISIONS:
        last = [float(x["loss"]) for x in jax.device_get(losses[p][-10:])]
        step_s = float(np.median(times[p]))
        out[p] = {
            "step_s": step_s,
            "tokens_per_s": tokens / step_s,
            "train_loss": float(np.mean(last)),
            "val_loss": evaluate(states[p].model)["loss"],
        }
    return out


def lm_adaptive(args) -> dict:
    """The LM under the controller with ``PrecisionPolicy``: step times, losses, the switch."""
    cfg = dataclasses.replace(SIZES[args.size], dropout=0.0)
    batch = args.per_device_batch * args.devices
    train, val, _ = lm_data.load_corpus(context=cfg.context, max_train_bytes=2_000_000)
    policy = ajp.PrecisionPolicy("bfloat16", "float32", warmup=args.steps // 5,
                                 stable_steps=max(args.steps // 10, 1),
                                 window=max(args.steps // 3, 1))
    stamps = []  # (step, precision, time after its dispatch)
    run_dir = tempfile.mkdtemp(prefix="adaptjax-precision-bench-")
    spec = adaptjax.RunSpec(
        run_dir=run_dir, devices=args.devices, batch_size=batch, microbatches=1, monitors=(),
        policy_every=max(args.steps // 30, 1), policies=[policy],
        compile=adaptjax.CompileOptions(cache_dir=None))
    stamp = adaptjax.Hook(lambda c: stamps.append((c.step, c.config.precision or "float32",
                                                   time.perf_counter())))
    ctrl = adaptjax.Controller(
        ByteLM(cfg, nnx.Rngs(0)), lm_loss, optax.adam(args.lr),
        adaptjax.ArrayDataset({"tokens": train}, seed=0), spec, hooks=[stamp],
    )
    try:
        ctrl.run(args.steps)
        model = ctrl.model
        events = list(ctrl.log.events)
    finally:
        ctrl.close()
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    shutil.rmtree(run_dir, ignore_errors=True)
    intervals = {p: [] for p in PRECISIONS}
    for (_, _, t0), (_, p, t1) in zip(stamps, stamps[1:], strict=False):
        intervals[p].append(t1 - t0)  # a compile's interval is an outlier the median skips
    step_s = {p: float(np.median(v)) if v else float("nan") for p, v in intervals.items()}
    switches = [(e["step"], e["precision"]) for e in events if e["kind"] == "set_precision"]
    evaluate = make_eval(val[: args.val_windows], ByteLM(cfg, nnx.Rngs(1)))
    return {
        "step_s": float(np.median([t for v in intervals.values() for t in v])),
        "step_s_by_precision": step_s,
        "bf16_steps": sum(p == "bfloat16" for _, p, _ in stamps),
        "switches": switches,
        "train_loss": float(np.mean([r["loss"] for r in rows[-10:]])),
        "val_loss": evaluate(model)["loss"],
        "input_bytes": sorted({e["input_bytes"] for e in events if e["kind"] == "compile"}),
        "tokens": batch * cfg.context,
    }


def matmul_seconds(n: int, dtype, repeats: int = 20) -> float:
    """Median seconds of one ``n x n @ n x n`` matmul in ``dtype`` on the default device."""
    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def digits_run(steps: int, codec=None) -> tuple[float, int]:
    """``(test accuracy, bytes host -> device per step)`` of the digits MLP."""
    from digits import MLP, load
    from digits import loss_fn as digits_loss

    x_train, x_test, y_train, y_test = load()
    data = adaptjax.ArrayDataset({"x": x_train, "y": y_train}, seed=0, features=codec)
    mesh = adaptjax.make_mesh(2)
    tx = optax.chain(adaptjax.sync_gradients("data"), optax.adam(1e-3))
    loss = adaptjax.with_precision(digits_loss, "float32", decode=data.decode)
    step = adaptjax.data_parallel_step(loss, tx, mesh)
    state = adaptjax.init_state(MLP(nnx.Rngs(0)), tx, mesh)
    moved = []
    for _ in range(steps):
        batch = data.next_batch(64)
        moved.append(batch_bytes(batch))  # what the step's call transfers
        state, _ = step(state, batch)
    test = {"x": x_test if codec is None else data.codecs["x"].encode(x_test), "y": y_test}
    logits = state.model(jnp.asarray(data.decode(test)["x"]))
    accuracy = float(np.mean(np.asarray(jnp.argmax(logits, axis=-1)) == y_test))
    assert len(set(moved)) == 1
    return accuracy, moved[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny LM, few steps (a smoke run)")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--devices", type=int, default=min(8, jax.device_count()))
    parser.add_argument("--per-device-batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=5, help="steps per timed block")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--val-windows", type=int, default=256)
    parser.add_argument("--digits-steps", type=int, default=400)
    parser.add_argument("--matmul", type=int, default=1024, help="size of the matmul timed alone")
    args = parser.parse_args()
    if args.quick:
        args.size, args.steps, args.digits_steps, args.val_windows = "tiny", 31, 150, 64
        args.matmul = 512

    platform = jax.devices()[0].platform
    lm = lm_runs(args)
    print(f"LM {dataclasses.asdict(lm['cfg'])}, {args.devices} {platform} device(s), global "
          f"batch {lm['batch']} x {lm['cfg'].context} tokens, {args.steps} steps, timed in "
          f"blocks of {args.block} ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")
    for p in PRECISIONS:
        r = lm[p]
        print(f"{p:>9}: {r['step_s'] * 1e3:8.2f} ms/step {r['tokens_per_s']:10.0f} tokens/s  "
              f"train loss (last 10) {r['train_loss']:.4f}  validation loss {r['val_loss']:.4f}")
    speed = lm["bfloat16"]["tokens_per_s"] / lm["float32"]["tokens_per_s"]
    a = lm_adaptive(args)
    print(f" adaptive: {a['step_s'] * 1e3:8.2f} ms/step {a['tokens'] / a['step_s']:10.0f} "
          f"tokens/s  train loss (last 10) {a['train_loss']:.4f}  validation loss "
          f"{a['val_loss']:.4f}")
    by = a["step_s_by_precision"]
    print(f"           (Controller + PrecisionPolicy, timed after the runs above: "
          f"{a['bf16_steps']} of {args.steps} steps in bfloat16, switches {a['switches']}; "
          f"ms/step float32 {by['float32'] * 1e3:.2f}, bfloat16 {by['bfloat16'] * 1e3:.2f}; "
          f"input bytes per step {a['input_bytes']})")
    target = " (target on a GPU: >= 1.5)" if platform == "gpu" else ""
    print(f"bfloat16 tokens/s over float32: {speed:.3f}{target}")
    m32, m16 = matmul_seconds(args.matmul, jnp.float32), matmul_seconds(args.matmul, jnp.bfloat16)
    print(f"one {args.matmul}^3 matmul on one {platform} device: float32 {m32 * 1e3:.2f} ms, "
          f"bfloat16 {m16 * 1e3:.2f} ms ({'slower' if m16 > m32 else 'faster'} in bfloat16: "
          f"x{m32 / m16:.2f} the float32 speed)")
    gap = (lm["bfloat16"]["val_loss"] - lm["float32"]["val_loss"]) / lm["float32"]["val_loss"]

    acc32, bytes32 = digits_run(args.digits_steps)
    acc8, bytes8 = digits_run(args.digits_steps, adaptjax.InputCodec("int8"))
    print(f"digits, {args.digits_steps} steps of 64: bytes host -> device per step "
          f"float32 {bytes32}, int8 codec {bytes8} (ratio {bytes32 / bytes8:.3f}; the int32 "
          f"labels are not encoded); test accuracy float32 {acc32:.4f}, int8 {acc8:.4f}")
    print(f"bf16_loss_gap={gap:.4f} input_codec_bytes_ratio={bytes32 / bytes8:.3f} "
          f"input_codec_accuracy_gap={acc32 - acc8:.4f}")


if __name__ == "__main__":
    main()
