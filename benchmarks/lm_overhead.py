"""adaptjax's step with monitors vs a hand-written flax + optax step, on the byte-level LM.

Same model (``examples/lm.py``'s ``ByteLM``, ``--size``, dropout off so both
steps do identical arithmetic), same mesh (``--devices`` simulated CPU
devices), same global batch and optimizer (Adam):

* ``adaptjax``: :func:`adaptjax.data_parallel_step` with
  ``optax.chain(adaptjax.sync_gradients("data", monitors=(GradientNoiseScale(),
  GradientSNR(), GradientNorm())), optax.adam(lr))`` on
  :func:`adaptjax.init_state` (non-finite guard and metrics included);
* ``hand-written``: ``nnx.split`` the model, a ``jax.shard_map`` step that
  takes ``jax.value_and_grad`` of the same loss, ``lax.pmean``s the gradients
  and applies ``optax.adam``; jitted with donated buffers;
* ``hand-written again``: an identical second copy, whose ratio to the first
  is the noise floor of the measurement;
* ``adaptjax no monitors`` (``monitors=()``) and ``adaptjax no guard``
  (``skip_nonfinite=False``): where adaptjax's extra time goes.

The variants run interleaved in a fresh random order each round, in blocks of
``--block`` steps, over the same batches; tokens per second are global batch x
context / the median block's seconds per step.

Usage:
  python benchmarks/lm_overhead.py [--size small] [--devices 8] [--rounds 30]

The last line is ``lm_overhead_ratio=<x> lm_overhead_ratio_paired=<y>
lm_overhead_cpu_ratio=<z>``: the hand-written step's tokens/s over adaptjax's
(adaptjax's step time over the hand-written one), as the ratio of the two
medians and as the median of each round's ratio (steadier: it cancels the
machine's drift between rounds); and the median of each round's ratio of the
process's CPU time per step (the simulated devices share the cores, so this is
the work a step costs, without the thread scheduling that moves wall time).
Target <= 1.03.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import adaptjax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import lm_data  # noqa: E402
from lm import SIZES, ByteLM, loss_fn  # noqa: E402


def hand_written_step(graphdef, rest, tx, mesh):
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``: grads, pmean, optax."""

    def local(params, opt_state, batch):
        def loss_of(p):
            return loss_fn(nnx.merge(graphdef, p, rest), batch)

        loss, grads = jax.value_and_grad(loss_of)(params)
        grads = jax.lax.pmean(grads, "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    fn = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()),
        check_vma=False,
    )
    return jax.jit(fn, donate_argnums=(0, 1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--per-device-batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--block", type=int, default=3, help="steps per timed block")
    args = parser.parse_args()

    cfg = dataclasses.replace(SIZES[args.size], dropout=0.0)
    mesh = adaptjax.make_mesh(args.devices)
    global_batch = args.per_device_batch * args.devices
    train, _, _ = lm_data.load_corpus(context=cfg.context, max_train_bytes=1_000_000)
    sharding = NamedSharding(mesh, P("data"))
    batches = [jax.device_put({"tokens": train[i * global_batch:(i + 1) * global_batch]},
                              sharding) for i in range(8)]

    monitors = (adaptjax.GradientNoiseScale(), adaptjax.GradientSNR(), adaptjax.GradientNorm())
    n_params = sum(int(np.prod(p.shape)) for p in
                   jax.tree.leaves(nnx.state(ByteLM(cfg, nnx.Rngs(0)), nnx.Param)))
    # The measured one first; the others split its overhead into monitors and the guard.
    variants = {
        "adaptjax": (monitors, True),
        "adaptjax no monitors": ((), True),
        "adaptjax no guard": (monitors, False),
    }
    states, steps = {}, {}
    for name, (mons, guard) in variants.items():
        tx = optax.chain(adaptjax.sync_gradients("data", monitors=mons), optax.adam(1e-3))
        fn = adaptjax.data_parallel_step(loss_fn, tx, mesh, skip_nonfinite=guard)
        states[name] = adaptjax.init_state(ByteLM(cfg, nnx.Rngs(0)), tx, mesh)

        def run_ours(state, batch, fn=fn):
            return fn(state, batch)[0]

        steps[name] = run_ours
    for name in ("hand-written", "hand-written again"):
        graphdef, params, rest = nnx.split(ByteLM(cfg, nnx.Rngs(0)), nnx.Param, ...)
        adam = optax.adam(1e-3)
        fn = hand_written_step(graphdef, rest, adam, mesh)
        host = jax.tree.map(np.array, (params, adam.init(params)))
        states[name] = jax.device_put(host, NamedSharding(mesh, P()))

        def run(state, batch, fn=fn):
            params, opt_state, _ = fn(*state, batch)
            return params, opt_state

        steps[name] = run
    for name in steps:  # compile and warm up
        for i in range(3):
            states[name] = steps[name](states[name], batches[i])
        jax.block_until_ready(states[name])

    times = {name: [] for name in steps}
    cpu = {name: [] for name in steps}  # CPU seconds of every thread of the process
    order = np.random.default_rng(0)
    for r in range(args.rounds):
        for name in order.permutation(list(steps)):
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(args.block):
                states[name] = steps[name](states[name], batches[(r + i) % len(batches)])
            jax.block_until_ready(states[name])
            times[name].append((time.perf_counter() - t0) / args.block)
            cpu[name].append((time.process_time() - c0) / args.block)
    med = {name: float(np.median(t)) for name, t in times.items()}
    # Each round's blocks run back to back, so a round's ratio cancels the machine's
    # drift between rounds; its median is the steadier estimate of the two.
    base = np.asarray(times["hand-written"])
    paired = {name: float(np.median(np.asarray(t) / base)) for name, t in times.items()}
    # The devices share the cores, so CPU time is the work a step costs, without the
    # scheduling that moves its wall time.
    cpu_base = np.asarray(cpu["hand-written"])
    cpu_paired = {name: float(np.median(np.asarray(c) / cpu_base)) for name, c in cpu.items()}
    tokens = global_batch * cfg.context
    print(
        f"model {dataclasses.asdict(cfg)} ({n_params} parameters), devices={args.devices}, "
        f"global batch {global_batch} x {cfg.context} tokens, {args.rounds} rounds of "
        f"{args.block} steps ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})"
    )
    for name in steps:
        print(f"{name:>20}: median {med[name] * 1e3:8.2f} ms/step  {tokens / med[name]:9.0f} "
              f"tokens/s  time ratio to hand-written {med[name] / med['hand-written']:.4f} "
              f"(median of rounds' ratios {paired[name]:.4f}; CPU time {cpu_paired[name]:.4f})")
    print(f"noise floor (identical hand-written steps): "
          f"{med['hand-written again'] / med['hand-written']:.4f} "
          f"(median of rounds' ratios {paired['hand-written again']:.4f}; "
          f"CPU time {cpu_paired['hand-written again']:.4f})")
    print(f"lm_overhead_ratio={med['adaptjax'] / med['hand-written']:.4f} "
          f"lm_overhead_ratio_paired={paired['adaptjax']:.4f} "
          f"lm_overhead_cpu_ratio={cpu_paired['adaptjax']:.4f}")


if __name__ == "__main__":
    main()
