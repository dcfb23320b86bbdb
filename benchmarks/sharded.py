"""Sharded LM steps: memory per device, step time and wire bytes per mesh axis.

``examples/lm.py``'s ``ByteLM`` (``--size base`` by default, dropout off),
AdamW, the same global batch on every mesh of 8 simulated CPU devices:
``(8,)`` (today's replicated data parallelism) and the (data, fsdp) meshes
``(4, 2)``, ``(2, 4)`` and ``(1, 8)``, each step built by
:func:`adaptjax.data_parallel_step` with the default :class:`adaptjax.FSDP`
rule. For each mesh:

* ``bytes/device``: parameters + optimizer state on one device (its shards,
  read from ``addressable_shards``);
* ``peak``: the compiled step's ``memory_analysis()`` (arguments + outputs +
  temporaries - aliased donations), and its temporaries alone;
* ``time``: seconds per step relative to ``(8,)`` (median over rounds of
  each round's ratio; every mesh runs in each round, in a fresh random order);
* wire bytes per device by mesh axis, from the compiled HLO
  (:attr:`WireReport.axis_totals`): ``data`` is the sync, ``fsdp`` the
  all-gathers of weights and the reductions of gradients the compiler inserted.

The steps compared across meshes carry no monitors (one replica, at (1, 8),
has no second gradient sample); then ``(2, 4)`` runs with
``GradientNoiseScale``, ``GradientSNR`` and ``GradientNorm`` against the same
step without them: the monitors' overhead on a sharded step.

On a GPU host the script also times the sharded code path on a ``(1, 1)``
mesh against today's replicated step on one device (``--size gpu``):
``sharded_path_ratio=<x>`` (target <= 1.02).

Usage:
  python benchmarks/sharded.py [--size base] [--rounds 20] [--block 2]
  python benchmarks/sharded.py --quick          # two rounds: checks it runs

The last line is ``sharded_memory_ratio=<bytes per device at (2,4) x 4 /
bytes at (8,)> sharded_monitor_overhead=<time with monitors / without, (2,4)>``.
Targets: <= 1.1 and <= 1.03.
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

import adaptjax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import lm_data  # noqa: E402
from lm import SIZES, ByteLM, bytes_per_device, loss_fn  # noqa: E402

MESHES = {"(8,)": 8, "(4,2)": {"data": 4, "fsdp": 2}, "(2,4)": {"data": 2, "fsdp": 4},
          "(1,8)": {"data": 1, "fsdp": 8}}
MONITORS = (adaptjax.GradientNoiseScale(), adaptjax.GradientSNR(), adaptjax.GradientNorm())


@dataclasses.dataclass
class Variant:
    """One compiled step and what was measured of it."""

    name: str
    compiled: object
    state: object
    bytes_per_device: int
    peak: int
    temp: int
    wire: dict


def build(name, shape, cfg, batch, lr, monitors=(), devices=None) -> Variant:
    """Compiles the LM step on ``shape`` (once: the timing calls that executable)."""
    mesh = adaptjax.make_mesh(shape, device_list=devices)
    tx = optax.chain(adaptjax.sync_gradients("data", monitors=monitors),
                     optax.adamw(lr, weight_decay=0.01))
    state = adaptjax.init_state(ByteLM(cfg, nnx.Rngs(0)), tx, mesh)
    step = adaptjax.data_parallel_step(loss_fn, tx, mesh)
    compiled = step.lower(state, batch).compile()
    ma = compiled.memory_analysis()
    peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
            - ma.alias_size_in_bytes)
    wire = adaptjax.wire_bytes(compiled).axis_totals
    return Variant(name, compiled, state, bytes_per_device(state), int(peak),
                   int(ma.temp_size_in_bytes), wire)


def time_rounds(variants, batches, rounds, block) -> dict[str, np.ndarray]:
    """Seconds per step of each variant in each round (interleaved, random order)."""
    for v in variants:  # warm up
        for b in batches[:2]:
            v.state, _ = v.compiled(v.state, b)
        jax.block_until_ready(v.state)
    times = {v.name: [] for v in variants}
    order = np.random.default_rng(0)
    for r in range(rounds):
        for k in order.permutation(len(variants)):
            v = variants[k]
            t0 = time.perf_counter()
            for i in range(block):
                v.state, _ = v.compiled(v.state, batches[(r + i) % len(batches)])
            jax.block_until_ready(v.state)
            times[v.name].append((time.perf_counter() - t0) / block)
    return {k: np.asarray(t) for k, t in times.items()}


def gpu_path_ratio(args, batches) -> float:
    """One device: the sharded code path on a (1, 1) mesh over today's replicated step."""
    cfg = dataclasses.replace(SIZES["gpu"], dropout=0.0)
    gpu = jax.devices()[:1]
    one = [build("(1,)", 1, cfg, batches[0], args.lr, devices=gpu),
           build("(1,1)", {"data": 1, "fsdp": 1}, cfg, batches[0], args.lr, devices=gpu)]
    times = time_rounds(one, batches, args.rounds, args.block)
    return float(np.median(times["(1,1)"] / times["(1,)"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--batch", type=int, default=32, help="global batch (windows)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=2, help="steps per timed block")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--quick", action="store_true", help="two rounds of one step")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.block = 2, 1

    cfg = dataclasses.replace(SIZES[args.size], dropout=0.0)
    train, _, _ = lm_data.load_corpus(context=cfg.context, max_train_bytes=1_000_000)
    batches = [{"tokens": train[i * args.batch:(i + 1) * args.batch]} for i in range(4)]
    cpus = jax.devices("cpu")[:8]  # simulated devices, also on a GPU host
    variants = [
        build(name, shape, cfg, batches[0], args.lr, devices=cpus) for name, shape in MESHES.items()
    ]
    monitored = build(
        "(2,4)+monitors", MESHES["(2,4)"], cfg, batches[0], args.lr, MONITORS, devices=cpus
    )
    times = time_rounds([*variants, monitored], batches, args.rounds, args.block)

    n_params = sum(int(np.prod(p.shape)) for p in
                   jax.tree.leaves(nnx.state(ByteLM(cfg, nnx.Rngs(0)), nnx.Param)))
    print(f"model {dataclasses.asdict(cfg)} ({n_params} parameters), AdamW, global batch "
          f"{args.batch} x {cfg.context} tokens, 8 devices, {args.rounds} rounds of {args.block} "
          f"steps ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})")
    base = variants[0]
    for v in [*variants, monitored]:
        rel = float(np.median(times[v.name] / times[base.name]))
        wire = "  ".join(f"{axis} {b / 1e6:.2f} MB" for axis, b in v.wire.items())
        print(f"{v.name:>15}: bytes/device {v.bytes_per_device:>10,}  peak {v.peak:>12,}  "
              f"temp {v.temp:>12,}  {np.median(times[v.name]) * 1e3:8.1f} ms/step  time x{rel:.3f}"
              f"  wire/device: {wire}")
    sharded = variants[2]
    ratio = sharded.bytes_per_device * 4 / base.bytes_per_device
    overhead = float(np.median(times[monitored.name] / times[sharded.name]))
    print(f"(2,4) bytes per device x 4 / (8,): {ratio:.4f} (target <= 1.1); monitors on (2,4): "
          f"x{overhead:.4f} (target <= 1.03)")
    if jax.default_backend() == "gpu":
        print(f"sharded_path_ratio={gpu_path_ratio(args, batches):.4f} (target <= 1.02)")
    print(f"sharded_memory_ratio={ratio:.4f} sharded_monitor_overhead={overhead:.4f}")


if __name__ == "__main__":
    main()
