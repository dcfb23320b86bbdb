"""Real-network benchmark: 2 processes x 1 CPU device over a veth pair capped at 1 Gbit/s.

Two network namespaces (``ajnetA``, ``ajnetB``) joined by a veth pair
(10.77.0.1 <-> 10.77.0.2) with ``tc ... tbf rate 1gbit`` on both ends; the
script creates and removes them and needs root (it says so when it isn't).
Gloo binds the address its hostname resolves to, so each namespace gets an
``/etc/netns/NAME/hosts`` mapping the hostname to its veth address; torch
gets ``GLOO_SOCKET_IFNAME``. Traffic stays inside the namespaces.

Workload (issue 9): an MLP 1024-2048-2048-1024-10 (8.4M parameters), batch 64
per process, SGD with momentum, one ``adaptjax.data_parallel_step`` per step
with ``sync_gradients(codec)``: no codec, ``bf16``, ``onebit``,
``powersgd(4)``; and PyTorch DDP plain and with its fp16 compression hook
(torch CPU is a benchmark-only extra: ``pip install torch``; without it those
rows read ``n/a``). Also the time to a target training loss, dense vs onebit.

Usage::

    sudo python benchmarks/network.py [--steps 10] [--uncapped] [--rate 1gbit]

The last line is ``network_dense_vs_ddp=<ratio> network_bf16_vs_ddp_fp16=<ratio>
network_onebit_vs_ddp=<ratio>`` (seconds per step, adaptjax / DDP; ``nan``
without torch). Run side by side in one run; on a shared machine the absolute
times are noisy, the ratios less so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time

NS = ("ajnetA", "ajnetB")
ADDR = ("10.77.0.1", "10.77.0.2")
VETH = ("ajvethA", "ajvethB")
SIZES = (1024, 2048, 2048, 1024, 10)
BATCH = 64
VARIANTS = ("dense", "bf16", "onebit", "powersgd4", "ddp", "ddp_fp16")


# ---------------------------------------------------------------------- the network
def _sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def setup(rate: str | None) -> None:
    teardown()
    for ns in NS:
        _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    host = socket.gethostname()
    for ns, veth, addr in zip(NS, VETH, ADDR, strict=True):
        _sh("ip", "link", "set", veth, "netns", ns)
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
        _sh("ip", "-n", ns, "link", "set", veth, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        if rate:
            _sh(
                "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth, "root", "tbf",
                "rate", rate, "burst", "256kb", "latency", "50ms",
            )  # fmt: skip
        os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
        with open(f"/etc/netns/{ns}/hosts", "w") as f:
            f.write(f"127.0.0.1 localhost\n{addr} {host}\n")


def teardown() -> None:
    for ns in NS:
        _sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    _sh("ip", "link", "del", VETH[0], check=False)


# ---------------------------------------------------------------------- the workers
def _data(rank: int, steps: int):
    import numpy as np

    rng = np.random.default_rng(0)
    teacher = rng.normal(size=(SIZES[0], SIZES[-1])).astype(np.float32) / 32
    rng = np.random.default_rng(100 + rank)
    for _ in range(steps):
        x = rng.normal(size=(BATCH, SIZES[0])).astype(np.float32)
        yield x, np.argmax(x @ teacher, axis=1).astype(np.int32)


def jax_worker(variant: str, rank: int, coordinator: str, steps: int, warmup: int) -> dict:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=2, process_id=rank)
    import adaptjax.compression as ajc
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import adaptjax

    codec = {
        "dense": None,
        "bf16": lambda: ajc.bf16(),
        "onebit": lambda: ajc.onebit(),
        "powersgd4": lambda: ajc.powersgd(4),
    }[variant]
    codec = codec() if codec else None
    keys = jax.random.split(jax.random.key(0), len(SIZES) - 1)
    params = [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, SIZES[:-1], SIZES[1:], strict=True)
    ]

    def loss_fn(p, batch):
        h = batch["x"]
        for layer in p[:-1]:
            h = jax.nn.relu(h @ layer["w"] + layer["b"])
        logits = h @ p[-1]["w"] + p[-1]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    mesh = adaptjax.make_mesh(2)  # one device per process, in process order
    tx = optax.chain(adaptjax.sync_gradients("data", codec=codec), optax.sgd(0.05, momentum=0.9))
    state = adaptjax.init_state(params, tx, mesh)
    step = adaptjax.data_parallel_step(loss_fn, tx, mesh)
    times, losses = [], []
    for x, y in _data(rank, warmup + steps):
        batch = {
            k: jax.make_array_from_process_local_data(
                NamedSharding(mesh, P("data")), v, (2 * BATCH, *v.shape[1:])
            )
            for k, v in {"x": x, "y": y}.items()
        }
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        loss = float(metrics["loss"])  # waits for the step
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    wire = adaptjax.wire_bytes(step.jitted, state, batch).total
    return {"s_per_step": float(np.median(times[warmup:])), "losses": losses, "wire": wire}


def torch_worker(variant: str, rank: int, coordinator: str, steps: int, warmup: int) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    host, port = coordinator.split(":")
    os.environ["GLOO_SOCKET_IFNAME"] = VETH[rank]
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    layers = []
    for a, b in zip(SIZES[:-1], SIZES[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*layers[:-1]))
    if variant == "ddp_fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    times, losses = [], []
    for x, y in _data(rank, warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    dist.destroy_process_group()
    return {"s_per_step": float(np.median(times[warmup:])), "losses": losses, "wire": None}


def run_variant(variant: str, steps: int, warmup: int) -> dict | None:
    if variant.startswith("ddp"):
        try:
            import torch  # noqa: F401
        except ImportError:
            return None
    port = 29000 + VARIANTS.index(variant) + int(time.time()) % 500 * 8
    coordinator = f"{ADDR[0]}:{port}"
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", NS[rank], sys.executable, os.path.abspath(__file__),
             "--worker", variant, "--rank", str(rank), "--coordinator", coordinator,
             "--steps", str(steps), "--warmup", str(warmup)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=1800) for p in procs]
    if any(p.returncode for p in procs):
        err = next(o[1] for p, o in zip(procs, outs, strict=True) if p.returncode)
        raise RuntimeError(f"{variant} failed: {err.strip().splitlines()[-1:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def time_to_loss(result: dict, target: float, warmup: int) -> float:
    losses = result["losses"][warmup:]
    hits = [i for i, v in enumerate(losses) if v <= target]
    return (hits[0] + 1) * result["s_per_step"] if hits else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--uncapped", action="store_true")
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--coordinator")
    args = parser.parse_args()
    if args.worker:
        fn = torch_worker if args.worker.startswith("ddp") else jax_worker
        print(json.dumps(fn(args.worker, args.rank, args.coordinator, args.steps, args.warmup)))
        return 0
    if os.geteuid() != 0:
        print("benchmarks/network.py needs root (it creates network namespaces and a tc qdisc)")
        return 1
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            print(f"benchmarks/network.py needs the {tool!r} command (iproute2)")
            return 1
    setup(None if args.uncapped else args.rate)
    try:
        results = {v: run_variant(v, args.steps, args.warmup) for v in VARIANTS}
    finally:
        teardown()
    link = "uncapped" if args.uncapped else args.rate
    print(f"link: veth between two namespaces, {link}; 2 processes x 1 CPU device; batch 64/proc")
    print(f"{'variant':<12}{'s/step':>10}{'wire B/dev':>14}{'final loss':>12}")
    for v, r in results.items():
        if r is None:
            print(f"{v:<12}{'n/a (no torch)':>36}")
            continue
        wire = "" if r["wire"] is None else f"{r['wire']:.3g}"
        print(f"{v:<12}{r['s_per_step']:>10.3f}{wire:>14}{r['losses'][-1]:>12.4f}")
    dense, onebit = results["dense"], results["onebit"]
    target = dense["losses"][-1] * 1.05
    print(
        f"time to loss {target:.4f}: dense {time_to_loss(dense, target, args.warmup):.2f} s, "
        f"onebit {time_to_loss(onebit, target, args.warmup):.2f} s"
    )

    def ratio(a, b):
        ra, rb = results[a], results[b]
        return float("nan") if ra is None or rb is None else ra["s_per_step"] / rb["s_per_step"]

    print(
        f"network_dense_vs_ddp={ratio('dense', 'ddp'):.3f} "
        f"network_bf16_vs_ddp_fp16={ratio('bf16', 'ddp_fp16'):.3f} "
        f"network_onebit_vs_ddp={ratio('onebit', 'ddp'):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
