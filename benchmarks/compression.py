"""Gradient compression benchmark: wire bytes, codec throughput, steps to the dense loss.

For each codec of ``adaptjax.compression``, on an MLP of about 8M parameters
(784-2048-2048-1024-10) and N = 8, 16 and 32 simulated CPU devices:

* bytes each device sends per step, read by ``adaptjax.wire_bytes`` from the
  compiled HLO of the codec's sync (inside ``shard_map``), and the ratio of a
  float32 psum's and a bf16 psum's bytes to it (``ratio_vs_fp32``,
  ``ratio_vs_bf16``; bf16 is counted at its program dtype, XLA widens it on CPU).
  PowerSGD's alternating form (``alternate=True``, ``powersgd(r=4,alt)``) holds
  its P and Q all-reduces in the two branches of a ``lax.cond``; its per-step
  bytes are the average of the two branches, and ``bytes per branch`` shows
  what a Q step and a P step send.
* step time of a training step with each codec over the dense step
  (``step time/dense``) on 2 simulated CPU devices, where the wire is free
  (see :func:`step_time_rows`); printed beside the N = 8 bytes.
* encode + decode throughput on the model's 7.9M gradient elements as a fraction
  of a same-size float32 copy (``throughput_vs_copy``: copy time / (encode time +
  decode time), each timed on its own since the wire sits between them; best
  wall time of each over calls interleaved with the copy's, as the shared
  2-core machine's speed drifts). For TernGrad, QSGD and natural compression
  also ``floor_vs_copy``: the same ratio for the passes they cannot avoid (the
  block statistic read before any code is drawn, a bare read pass writing one
  uint8 per element, and the decode), i.e. the most they could reach if drawing
  and packing the codes were free.
* steps to reach the dense run's final loss (``steps_ratio``, codec steps / dense
  steps), on a small real problem (sklearn digits, 64-128-10 MLP, 8 replicas,
  SGD), since training the 8M model for every codec takes too long on 2 cores;
  plus the error of the noise-scale monitor with a codec on (the exact mean at
  1% shared coordinates rides the monitors' scalar all-reduce) and without, at
  fixed parameters, against a long dense
  measurement.

Usage::

    python benchmarks/compression.py [--json FILE] [--quick]

This file's name is also that of Python 3.14's standard-library ``compression``
package, and every script run from this folder has the folder first on
``sys.path``; jax, urllib3 and fsspec all try ``from compression import zstd``.
So when it is imported under that name instead of run, it hands the import over
to the real package (or fails as a missing one does, before Python 3.14) and
defines nothing else; ``tests/test_benchmark_names.py`` checks both.

Wire bytes (N = 8, 16, 32) run in a subprocess with ``XLA_FLAGS`` set to 32
devices before jax is imported, the step times in one set to 2 devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import time


def _hand_over(name: str) -> None:
    """Imports the package this file shadows and puts it in its place."""
    here = os.path.dirname(os.path.abspath(__file__))
    del sys.modules[name]
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if os.path.abspath(p or os.curdir) != here]
    try:
        sys.modules[name] = importlib.import_module(name)
    finally:
        sys.path[:] = saved


if __name__ == "compression":  # found on sys.path by someone importing the stdlib package
    _hand_over(__name__)
else:
    if __name__ == "__main__" and "--_wire" not in sys.argv:
        _FLAG = "--xla_force_host_platform_device_count=8"
        if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from adaptjax.compression._blocks import decode_rows, encode_rows  # what a transport calls
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import adaptjax
    from adaptjax import compression as ajc
    from adaptjax._per_replica import stack_replicas, state_partition_specs

MODEL = {
    "w1": (784, 2048), "b1": (2048,),
    "w2": (2048, 2048), "b2": (2048,),
    "w3": (2048, 1024), "b3": (1024,),
    "w4": (1024, 10), "b4": (10,),
}

CODECS = {
    "bf16": "ajc.bf16()",
    "fp16": "ajc.fp16()",
    "onebit": "ajc.onebit()",
    "terngrad": "ajc.terngrad()",
    "qsgd(s=7)": "ajc.qsgd(7)",
    "qsgd(s=1)": "ajc.qsgd(1)",
    "natural": "ajc.natural()",
    "topk(1%)": "ajc.topk(0.01)",
    "topk(1%,sampled)": "ajc.topk(0.01, variant='sampled')",
    "randomk(1%)": "ajc.randomk(0.01)",
    "randomk(1%,EF)": "ajc.randomk(0.01, error_feedback='ef14')",
    "dgc(1%)": "ajc.dgc(0.01)",
    "powersgd(r=4)": "ajc.powersgd(4)",
    "powersgd(r=4,alt)": "ajc.powersgd(4, alternate=True)",
}
ELEMENTWISE = ("bf16", "fp16", "onebit", "terngrad", "qsgd(s=7)", "qsgd(s=1)", "natural")


def _size(shape):
    return int(np.prod(shape, dtype=np.int64))


# ------------------------------------------------------------------------ wire bytes


def _sync_report(codec, mesh, axis):
    n = mesh.size
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in MODEL.items()}
    state = jax.eval_shape(lambda: stack_replicas(codec.init(
        {k: jnp.zeros(s) for k, s in MODEL.items()}), n))
    specs = state_partition_specs(state, axis)

    def f(g, s):
        g = jax.tree.map(lambda x: x[0], g)
        out, s = codec.sync(g, adaptjax.sync.to_local(s), axis_name=axis, step=jnp.int32(0))
        return out, adaptjax.sync.to_global(s)

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(axis), specs),
                               out_specs=(P(), specs), check_vma=False))
    grads = {k: jax.ShapeDtypeStruct((n, *v.shape), v.dtype) for k, v in params.items()}
    return adaptjax.wire_bytes(fn, grads, state)


def _psum_report(mesh, dtype):
    n = mesh.size
    f = jax.shard_map(lambda g: jax.tree.map(lambda x: jax.lax.psum(x[0], "data"), g),
                      mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False)
    grads = {k: jax.ShapeDtypeStruct((n, *s), dtype) for k, s in MODEL.items()}
    return adaptjax.wire_bytes(jax.jit(f), grads)


def _per_step(name, codec, report, n):
    """Bytes per step: ``report.total`` averages the branches of a ``lax.cond``
    (PowerSGD with ``alternate=True`` sends the P or the Q all-reduce, one per step)."""
    del name, codec, n
    return report.total


def wire_rows(n):
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    fp32 = _psum_report(mesh, jnp.float32).total
    bf16 = _psum_report(mesh, jnp.bfloat16).total
    rows = []
    for name, src in CODECS.items():
        codec = eval(src)
        rep = _sync_report(codec, mesh, "data")
        sent = _per_step(name, codec, rep, n)
        widened = sum(c.compiled_bytes - c.bytes for c in rep.collectives)
        branches = list(rep.branch_totals()) if len(rep.conditionals) == 1 else []
        rows.append({
            "codec": name, "n": n, "bytes": sent, "hlo_static_bytes": rep.static_total,
            "branch_bytes": branches, "max_bytes": rep.max_total,
            "fp32_psum_bytes": fp32, "bf16_psum_bytes": bf16,
            "ratio_vs_fp32": fp32 / sent, "ratio_vs_bf16": bf16 / sent,
            "collectives": len(rep.collectives), "widened_bytes": widened,
        })
    # two-level onebit on a 2-D mesh: bf16 over the 'fast' axis (4 or 8), onebit over 'slow'
    fast = n // 2
    mesh2 = Mesh(np.array(jax.devices()[:n]).reshape(2, fast), ("slow", "fast"))
    rep = _sync_report(ajc.onebit(fast_axis="fast"), mesh2, ("slow", "fast"))
    slow = sum(c.bytes for c in rep.collectives if c.group_size == 2)
    rows.append({
        "codec": "onebit(2-level)", "n": n, "bytes": rep.total, "hlo_static_bytes": rep.total,
        "fp32_psum_bytes": fp32, "bf16_psum_bytes": bf16,
        "ratio_vs_fp32": fp32 / rep.total, "ratio_vs_bf16": bf16 / rep.total,
        "collectives": len(rep.collectives), "widened_bytes": 0.0, "slow_axis_bytes": slow,
    })
    return rows


# ------------------------------------------------------------------------ step time

STEP_MODEL = (1024, 2048, 2048, 1024, 10)


def step_time_rows(names, repeats):
    """Seconds per training step of each codec against the dense step, side by side.

    One process, 2 simulated CPU devices (the wire is free, so this is the
    codec path's compute), the MLP 1024-2048-2048-1024-10 (8.4M parameters),
    64 examples per device, SGD with momentum 0.9 after ``sync_gradients``.
    Best wall time of 2 steps, each codec in turn, ``repeats`` rounds after
    one untimed round. On this 2-core VM the first rounds after compiling run
    3-10x slow for every codec (fresh pages), and any step can spike to 3-5x
    its time, so a best of few rounds can leave one codec, often the dense
    step, at a spike and every ratio wrong by that factor.
    """
    n = 2
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    rng = np.random.default_rng(0)
    params = {}
    for i, (a, b) in enumerate(zip(STEP_MODEL[:-1], STEP_MODEL[1:], strict=True)):
        params[f"w{i}"] = jnp.asarray(rng.normal(size=(a, b)).astype(np.float32) / np.sqrt(a))
        params[f"b{i}"] = jnp.zeros(b)
    x = jnp.asarray(rng.normal(size=(64 * n, STEP_MODEL[0])).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 10, 64 * n))

    def loss(p, x, y):
        h = x
        for i in range(len(STEP_MODEL) - 1):
            h = h @ p[f"w{i}"] + p[f"b{i}"]
            h = jax.nn.relu(h) if i < len(STEP_MODEL) - 2 else h
        return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    def make(codec):
        tx = optax.chain(adaptjax.sync_gradients("data", codec=codec),
                         optax.sgd(0.01, momentum=0.9))
        state = stack_replicas(tx.init(params), n)
        specs = state_partition_specs(state, "data")

        def step(p, s, x, y):
            u, s = tx.update(jax.grad(loss)(p, x, y), adaptjax.sync.to_local(s), p)
            return optax.apply_updates(p, u), adaptjax.sync.to_global(s)

        fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                                   out_specs=(P(), specs), check_vma=False),
                     donate_argnums=(0, 1))
        p, s = fn(jax.tree.map(jnp.copy, params), state, x, y)
        jax.block_until_ready(p)
        return [fn, p, s]

    runs = {"dense": make(None)}
    for name in names:
        runs[name] = make(eval(CODECS[name]))
    best = dict.fromkeys(runs, float("inf"))
    for round_ in range(repeats + 1):
        for name, run in runs.items():
            fn, p, s = run
            t = time.perf_counter()
            for _ in range(2):
                p, s = fn(p, s, x, y)
            jax.block_until_ready(p)
            if round_:
                best[name] = min(best[name], (time.perf_counter() - t) / 2)
            run[1:] = [p, s]
    return {name: (best[name], best[name] / best["dense"]) for name in best}


# ------------------------------------------------------------------------ throughput


def _interleaved_best(calls, repeats):
    """Best wall time of each ``(fn, arg)`` in ``calls``, timed in turn ``repeats`` times.

    One call of each in turn, so that all of them see the same spells of a
    shared machine's speed (a copy's time here drifts between 1.3 and 3.5 ms
    over seconds). Wall time, not process CPU time: XLA runs a fusion on both
    cores, and the CPU time of the other thread is not always accounted when the
    call returns, so the best CPU time of a short call can read far too low
    (0.12 ms for a reduction over 32 MB, whose wall time is 0.7 ms).
    """
    for fn, arg in calls:
        jax.block_until_ready(fn(arg))
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for i, (fn, arg) in enumerate(calls):
            t = time.perf_counter()
            jax.block_until_ready(fn(arg))
            best[i] = min(best[i], time.perf_counter() - t)
    return best


# Block statistic a stochastic quantiser reads before it can draw any code.
_BLOCK_STAT = {
    "terngrad": lambda x: jnp.max(jnp.abs(x), axis=-1),
    "qsgd": lambda x: jnp.sqrt(jnp.sum(x * x, axis=-1)),
    "natural": lambda x: jnp.max(jnp.abs(x), axis=-1),
}


def throughput_rows(repeats):
    """encode+decode time vs a copy of the same float32 elements (one device).

    Returns ``{codec: (throughput_vs_copy, floor_vs_copy)}``. The floor, for the
    block-scaled stochastic quantisers, is what their unavoidable passes alone
    allow: ``copy / (block statistic + a bare read pass writing uint8 + decode)``,
    as if drawing and packing the codes cost nothing (None for other codecs).
    """
    d = sum(_size(s) for s in MODEL.values())
    rng = np.random.default_rng(0)
    flat = jax.device_put(jnp.asarray(rng.normal(size=d).astype(np.float32)), jax.devices()[0])
    leaves = {k: jax.device_put(jnp.asarray(rng.normal(size=s).astype(np.float32)),
                                jax.devices()[0]) for k, s in MODEL.items()}
    copy = jax.jit(jnp.copy)
    bare = jax.jit(lambda x: (x > 0).astype(jnp.uint8))
    out = {}
    for name, src in CODECS.items():
        codec = eval(src)
        stat = None
        if name in ELEMENTWISE:
            # the block codec protocol on blocks, as the transports call it (packed rows)
            nb = -(-d // codec.block)
            arg = jnp.pad(flat, (0, nb * codec.block - d)).reshape(1, nb, codec.block)
            blocks = ajc.Blocks.of(jnp.uint32(1), nb, codec.block)
            enc = jax.jit(lambda x, c=codec, b=blocks: encode_rows(c, x, b)[0])
            dec = jax.jit(lambda r, c=codec, nb=nb: decode_rows(c, r, nb))
            if codec.name in _BLOCK_STAT:
                stat = jax.jit(_BLOCK_STAT[codec.name])
        else:
            arg = leaves
            keep = [k for k, s in MODEL.items() if codec.method(s, 8) == "codec"]
            enc = jax.jit(lambda t, c=codec, keep=keep: {k: c.encode(t[k], seed=1) for k in keep})
            dec = jax.jit(lambda p, c=codec: {k: c.decode(v, MODEL[k], seed=1)
                                              for k, v in p.items()})
        payload = jax.block_until_ready(enc(arg))
        calls = [(copy, flat), (enc, arg), (dec, payload)]
        if stat is not None:
            calls += [(stat, arg), (bare, arg)]
        t = _interleaved_best(calls, repeats=repeats)
        floor = t[0] / (t[3] + t[4] + t[2]) if stat is not None else None
        out[name] = (t[0] / (t[1] + t[2]), floor)
    return out


# ------------------------------------------------------------------------ training


def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int32)


def _mlp_loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    logits = h @ p["w2"] + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def _train(codec, steps, x, y, target=None, monitors=(), monitor_every=1, lr=0.5):
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (64, 128)) / 8, "b1": jnp.zeros(128),
              "w2": jax.random.normal(k2, (128, 10)) / np.sqrt(128), "b2": jnp.zeros(10)}
    mesh = adaptjax.make_mesh(8)
    sync = adaptjax.sync_gradients("data", codec=codec, monitors=monitors,
                                   monitor_every=monitor_every)
    tx = optax.chain(sync, optax.sgd(lr))
    state = adaptjax.init_state(params, tx, mesh)
    step = adaptjax.data_parallel_step(_mlp_loss, tx, mesh)
    full = jax.jit(_mlp_loss)
    rng = np.random.default_rng(0)
    losses, noise = [], []
    for _ in range(steps):
        idx = rng.integers(0, len(x), 128)
        state, metrics = step(state, {"x": x[idx], "y": y[idx]})
        losses.append(float(full(state.params, {"x": x, "y": y})))
        if monitors:
            noise.append(float(jax.device_get(metrics)["noise_scale"]))
        if target is not None and losses[-1] <= target:
            break
    return np.array(losses), np.array(noise), state.params


def convergence_rows(dense_steps):
    x, y = _digits()
    dense, _, _ = _train(None, dense_steps, x, y)
    target = dense[-1]
    out = {}
    for name, src in CODECS.items():
        codec = eval(src)
        # small model: let the 1280-entry output matrix be compressed too
        codec = dataclasses.replace(codec, min_size=1024)
        lr = 0.05 if name.startswith("dgc") else 0.5  # DGC carries momentum 0.9 itself
        losses, _, _ = _train(codec, 3 * dense_steps, x, y, target, lr=lr)
        hit = np.flatnonzero(losses <= target)
        out[name] = (hit[0] + 1) / dense_steps if hit.size else float("inf")
    return out, target


def _measure_noise_scale(params, x, y, steps, codec=None, every=1, decay=0.95, seed=1):
    """Runs ``steps`` steps at lr = 0 from ``params``; returns the final noise_scale."""
    mesh = adaptjax.make_mesh(8)
    mon = adaptjax.GradientNoiseScale(decay=decay)
    sync = adaptjax.sync_gradients("data", codec=codec, monitors=(mon,), monitor_every=every)
    tx = optax.chain(sync, optax.sgd(0.0))
    state = adaptjax.init_state(params, tx, mesh)
    step = adaptjax.data_parallel_step(_mlp_loss, tx, mesh)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.integers(0, len(x), 128)
        state, metrics = step(state, {"x": x[idx], "y": y[idx]})
        jax.block_until_ready(metrics)  # few steps in flight (see the tests' note)
    return float(jax.device_get(metrics)["noise_scale"])


def noise_scale_error(steps):
    """Relative error of the noise_scale monitor with and without a codec.

    At fixed parameters (a dense run's after 60 steps; lr = 0, so the codec
    cannot move them), ``steps`` steps of the monitor (EMA decay 0.95 per
    measurement) are compared with a reference: 1024 dense steps at decay
    0.998. Both measure every step; with a codec, ‖Ḡ‖² comes from the exact
    mean at 1% of the coordinates (``codec_sample``), shared by all replicas.
    """
    x, y = _digits()
    _, _, params = _train(None, 60, x, y)
    ref = _measure_noise_scale(params, x, y, 1024, decay=0.998, seed=7)
    err, est = {}, {}
    for name, codec, every in (("dense", None, 1), ("onebit", ajc.onebit(), 1),
                               ("topk", ajc.topk(0.01), 1)):
        val = _measure_noise_scale(params, x, y, steps, codec=codec, every=every)
        est[name] = (val, ref)
        err[name] = abs(val - ref) / ref
    return err, est


# ------------------------------------------------------------------------ main


def _table(rows):
    head = ("codec", "N", "bytes/dev/step", "vs fp32", "vs bf16", "enc+dec/copy", "steps/dense",
            "step time/dense", "bytes per branch")
    lines = [head]
    for r in rows:
        steps = r.get("steps_ratio")
        step_t = r.get("step_time_ratio")
        lines.append((
            r["codec"], str(r["n"]), f"{r['bytes']:,.0f}", f"{r['ratio_vs_fp32']:.1f}x",
            f"{r['ratio_vs_bf16']:.1f}x",
            "-" if r.get("throughput_vs_copy") is None else f"{r['throughput_vs_copy']:.0%}",
            "-" if steps is None else ("never" if steps == float("inf") else f"{steps:.2f}"),
            "-" if step_t is None else f"{step_t:.2f}",
            " / ".join(f"{b:,.0f}" for b in r.get("branch_bytes", [])) or "-",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join([line[0].ljust(widths[0])] + [line[i].rjust(widths[i]) for i in range(1, 8)]
                  + [line[8].ljust(widths[8])]).rstrip()
        for line in lines
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows as a JSON list to this file")
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    ap.add_argument("--_wire", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_steps", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._wire:
        print(json.dumps([r for n in (8, 16, 32) if n <= args._wire for r in wire_rows(n)]))
        return
    if args._steps:
        names = [k for k in CODECS if k in args._steps.split(",")]
        print(json.dumps(step_time_rows(names, repeats=10 if args.quick else 20)))
        return

    t0 = time.time()
    rows = _subprocess(["--_wire", "32"], devices=32)  # N = 8, 16 and 32
    print(f"# wire bytes from the compiled HLO: {time.time() - t0:.0f}s", file=sys.stderr)

    t0 = time.time()
    names = ELEMENTWISE if args.quick else tuple(CODECS)
    steps = _subprocess(["--_steps", ",".join(names)] + (["--quick"] if args.quick else []),
                        devices=2)
    print(f"# step time: {time.time() - t0:.0f}s", file=sys.stderr)

    t0 = time.time()
    thr = throughput_rows(repeats=40 if args.quick else 60)
    print(f"# throughput: {time.time() - t0:.0f}s", file=sys.stderr)
    t0 = time.time()
    conv, target = convergence_rows(60 if args.quick else 100)
    print(f"# convergence: {time.time() - t0:.0f}s", file=sys.stderr)
    t0 = time.time()
    ns_err, ns = noise_scale_error(128 if args.quick else 256)
    print(f"# noise scale: {time.time() - t0:.0f}s", file=sys.stderr)

    for r in rows:
        r["throughput_vs_copy"], r["floor_vs_copy"] = thr.get(r["codec"], (None, None))
        r["steps_ratio"] = conv.get(r["codec"])
        if r["n"] == 8 and r["codec"] in steps:
            r["step_time_s"], r["step_time_ratio"] = steps[r["codec"]]
    d = sum(_size(s) for s in MODEL.values())
    print(f"model: MLP 784-2048-2048-1024-10, {d:,} parameters; "
          f"steps/dense on sklearn digits (dense loss {target:.4f})")
    print(_table(rows))
    steps_ns = 128 if args.quick else 256
    print(f"noise_scale monitor error after {steps_ns} steps at fixed params (codecs: exact "
          f"mean at 1% shared coordinates) vs a 1024-step dense reference "
          f"({ns['dense'][1]:.0f}): "
          + ", ".join(f"{k} {v:.1%} ({ns[k][0]:.0f})" for k, v in ns_err.items()))
    print("stochastic quantisers, their passes alone (statistic, bare read, decode) vs a copy: "
          + ", ".join(f"{k} {v[1]:.0%} (codec {v[0]:.0%})"
                      for k, v in thr.items() if v[1] is not None))
    two = [r for r in rows if r["codec"] == "onebit(2-level)"]
    print("onebit(2-level) on a 2 x N/2 mesh: bytes on the slow axis "
          + ", ".join(f"N={r['n']}: {r['slow_axis_bytes']:,.0f} "
                      f"({r['fp32_psum_bytes'] / r['slow_axis_bytes']:.1f}x less than an fp32 psum)"
                      for r in two))
    print(f"step time on 2 simulated CPU devices (MLP {'-'.join(map(str, STEP_MODEL))}, "
          f"batch 64 per device, SGD momentum): dense {steps['dense'][0] * 1e3:.0f} ms; "
          "the ratio per codec is the 'step time/dense' column of the N=8 rows")
    if args.json:
        for r in rows:
            r["noise_scale_error"] = ns_err.get(r["codec"].split("(")[0])
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {len(rows)} rows to {args.json}")
    fp32 = {r["n"]: r for r in rows}
    print("vs fp32 at N=" + "/".join(str(n) for n in sorted(fp32)) + ": " + ", ".join(
        f"{name} " + "/".join(f"{r['ratio_vs_fp32']:.1f}x" for r in rows if r["codec"] == name)
        for name in dict.fromkeys(r["codec"] for r in rows)))
    print("step time vs dense: " + ", ".join(
        f"{k} {v[1]:.2f}" for k, v in steps.items() if k != "dense"))


def _subprocess(args, devices):
    """Runs this script with ``args`` on ``devices`` simulated devices; its last line's JSON."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args],
                          env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
