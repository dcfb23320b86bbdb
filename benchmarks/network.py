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
``powersgd(4)``; the synchronisation strategies ``sma``, ``localsgd32``,
``diloco32`` and ``gossip`` (ring) with the same SGD inside (issue 12: their
mean step time over 64 steps, so two outer syncs of H = 32 are amortised);
and PyTorch DDP plain and with its fp16 compression hook
(torch CPU is a benchmark-only extra, ``pip install adaptjax[benchmarks]``;
without it those rows read ``n/a``).

The codecs run bucketed (issue 36, CaSync): ``bucket_bytes`` (``--bucket-bytes``,
4 MiB by default) of float32 gradient per exchange, leaves last to first, so
each bucket's encode, collective and decode can run while the backward pass
computes the rest. Their steps run without the finiteness guard
(``skip_nonfinite=False``, as DDP has none): ``data_parallel_step``'s guard
runs a codec inside the update's ``lax.cond``, whose predicate needs every
gradient, so no bucket could start early (``onebit_guarded`` is that step).
Side by side: ``*_unbucketed`` (one exchange per lane, after the backward
pass), ``dense_combined`` (XLA:CPU's ``cpu-all-reduce-combiner`` back on: the
gradients' all-reduces fused into one, after the whole backward pass;
adaptjax's step across processes keeps one per leaf, so transfers overlap the
backward pass), ``dense_noskip`` (``skip_nonfinite=False``: no finiteness check
and no ``lax.cond`` around the update) and ``bf16_owner``/``onebit_owner``
(the owner-compute transport, all-to-all + all-gather, pinned; at 2 processes
each bucket takes one all-gather by default).

Where XLA:CPU's collectives are the limit, the same run shows it: ``compute``
is the dense step on each process's own device (no collective), and
``bare <codec>`` runs exactly the collectives of that codec's compiled step
(kinds, types, shapes) and nothing else. For each codec the summary gives the
step's gap to ``compute`` unbucketed and bucketed, how much of the gap overlap
recovered, ``(unbucketed − bucketed) / (unbucketed − compute)``, and the bare
collectives' time.

All variants run in ONE pair of processes, one step of each in turn, so that
load from other programs hits every variant alike; ``s/step`` is the median
and ``min`` the fastest of the timed steps, ``coll`` the collectives of the
compiled step, ``loss@K`` the 5-step mean training loss at step ``K`` (the
same data for every variant). dense and onebit run ``--loss-steps`` steps for
the time to a target loss (dense's final 5-step mean). ``--breakdown`` also
times bare collectives of the shapes the steps move (own pair of processes).

Usage::

    sudo python benchmarks/network.py [--steps 10] [--loss-steps 30] [--breakdown]
        [--uncapped] [--rate 1gbit] [--bucket-bytes 4194304] [--only dense,onebit,...]

The last line is ``network_dense_vs_ddp=<ratio> network_bf16_vs_ddp_fp16=<ratio>
network_onebit_vs_ddp=<ratio> network_onebit_vs_compute=<ratio>`` (median
seconds per step, adaptjax / DDP, and onebit / the compute-only step; ``nan``
without torch or a variant). On a shared machine the absolute times are noisy,
the ratios less so.
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
from typing import NamedTuple

NS = ("ajnetA", "ajnetB")
ADDR = ("10.77.0.1", "10.77.0.2")
VETH = ("ajvethA", "ajvethB")
SIZES = (1024, 2048, 2048, 1024, 10)
BATCH = 64
VARIANTS = ("dense", "bf16", "onebit", "powersgd4", "ddp", "ddp_fp16")
# side by side: each codec in one exchange per lane (after the backward pass), the dense
# all-reduces fused into one (XLA:CPU's combiner on), the owner-compute transport pinned,
# and onebit under the step's finiteness guard (its sync inside the update's lax.cond)
UNBUCKETED = ("bf16_unbucketed", "onebit_unbucketed", "powersgd4_unbucketed")
# issue 12: the synchronisation strategies on the same link (dense, SGD momentum inside)
SYNC_VARIANTS = ("sma", "localsgd32", "diloco32", "gossip")
ALL = (*VARIANTS, *UNBUCKETED, "dense_combined", "dense_noskip", "bf16_owner", "onebit_owner",
       "onebit_guarded", *SYNC_VARIANTS)
SYNC_STEPS = 64  # timed steps of a strategy variant: two outer syncs at H = 32
BUCKET_BYTES = 4 << 20  # float32 gradient bytes per exchange of a bucketed codec
COMPUTE = "compute"  # the dense step on each process's own device: no collective


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


def _jax_start(rank: int, coordinator: str | None):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if coordinator is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=2, process_id=rank
        )
    return jax


class Jax(NamedTuple):
    """How a variant's step is built."""

    codec: tuple | None = None  # factory name and positional arguments
    bucketed: bool = True  # bucket_bytes (the run's) or one exchange per lane
    codec_kw: tuple = ()  # more keyword arguments of the factory
    options: tuple = ()  # XLA compile options
    guard: bool = True  # data_parallel_step(skip_nonfinite=...)


JAX_CODECS = {  # variant -> how its step is built
    "dense": Jax(),
    # an empty list of disabled passes: the combiner that the step turns off runs again
    "dense_combined": Jax(options=(("xla_disable_hlo_passes", ""),)),
    "dense_noskip": Jax(guard=False),
    "bf16": Jax(("bf16",), guard=False),
    "bf16_unbucketed": Jax(("bf16",), bucketed=False, guard=False),
    "bf16_owner": Jax(("bf16",), codec_kw=(("transport", "owner"),), guard=False),
    "onebit": Jax(("onebit",), guard=False),
    "onebit_unbucketed": Jax(("onebit",), bucketed=False, guard=False),
    "onebit_owner": Jax(("onebit",), codec_kw=(("transport", "owner"),), guard=False),
    "onebit_guarded": Jax(("onebit",)),
    "powersgd4": Jax(("powersgd", 4), guard=False),
    "powersgd4_unbucketed": Jax(("powersgd", 4), bucketed=False, guard=False),
}
JAX_SYNCS = {  # variant -> the adaptjax.sync.SyncStrategy the step runs (no codec)
    "sma": ("ModelAveraging",),
    "localsgd32": ("LocalSGD", 32),
    "diloco32": ("DiLoCo", 32),
    "gossip": ("Gossip", "ring"),
}


def _jax_model(jax):
    import numpy as np
    import optax

    keys = jax.random.split(jax.random.key(0), len(SIZES) - 1)
    params = [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jax.numpy.zeros(b)}
        for k, a, b in zip(keys, SIZES[:-1], SIZES[1:], strict=True)
    ]

    def loss_fn(p, batch):
        h = batch["x"]
        for layer in p[:-1]:
            h = jax.nn.relu(h @ layer["w"] + layer["b"])
        logits = h @ p[-1]["w"] + p[-1]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return params, loss_fn


def _jax_step(jax, variant: str, mesh, bucket_bytes: int):
    """(compiled step, state, collectives, wire bytes, the step's collectives) of one variant."""
    import adaptjax.compression as ajc
    import optax

    import adaptjax
    from adaptjax._wire import parse_collectives

    spec = JAX_CODECS.get(variant, Jax())
    codec = None
    if spec.codec is not None:
        kw = dict(spec.codec_kw, bucket_bytes=bucket_bytes if spec.bucketed else None)
        codec = getattr(ajc, spec.codec[0])(*spec.codec[1:], **kw)
    params, loss_fn = _jax_model(jax)
    inner = optax.sgd(0.05, momentum=0.9)
    sync = None
    if variant in JAX_SYNCS:
        name, *args = JAX_SYNCS[variant]
        sync = getattr(adaptjax, name)(*args)
        tx = adaptjax.sync.sync_chain(inner, sync)
    else:
        tx = optax.chain(adaptjax.sync_gradients("data", codec=codec), inner)
    state = adaptjax.init_state(params, tx, mesh)
    step = adaptjax.data_parallel_step(loss_fn, tx, mesh, skip_nonfinite=spec.guard, sync=sync)
    batch = _jax_batch(jax, mesh, *next(_data(0, 1)))
    lowered = step.jitted.lower(state, batch)
    report = adaptjax.wire_bytes(step.jitted, state, batch)
    wire = sync.amortised_bytes(report) if sync is not None else report.total
    options = dict(spec.options)
    compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
    # collectives of the program that runs (the combiner joins the all-reduces; same bytes)
    count = len(parse_collectives(compiled.as_text(), mesh.devices.size))
    return compiled, state, count, wire, report.collectives


def _bare(jax, mesh, collectives):
    """A program of exactly ``collectives`` (kind, type, shape), on zeros, nothing else.

    Returns ``(jitted function, its arguments)``.
    """
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    types = {"f32": np.float32, "bf16": jax.numpy.bfloat16, "f16": np.float16,
             "u32": np.uint32, "s32": np.int32, "u16": np.uint16, "u8": np.uint8}
    shapes = []
    for c in collectives:
        if c.kind == "all-to-all":  # XLA:CPU may split it into one operand per peer: join them
            shapes.append((c.kind, (2, c.elements // 2), types[c.operand_dtypes[0]]))
            continue
        operands = c.shape if c.num_operands > 1 else (c.shape,)
        for shape, dtype in zip(operands, c.operand_dtypes, strict=True):
            shapes.append((c.kind, tuple(shape), types[dtype]))

    def body(*xs):
        outs = []
        for (kind, _, _), x in zip(shapes, xs, strict=True):
            x = x[0]
            if kind == "all-gather":
                outs.append(jax.lax.all_gather(x, "data", to="invarying"))
            elif kind == "all-to-all":
                outs.append(jax.lax.all_to_all(x, "data", 0, 0))
            else:
                outs.append(jax.lax.psum(x, "data"))
        return outs

    args = [jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")), np.zeros((1, *shape), dtype), (2, *shape))
        for _, shape, dtype in shapes]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(),
                              check_vma=False))
    jax.block_until_ready(f(*args))
    return f, args


def _jax_batch(jax, mesh, x, y):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size
    return {
        k: jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("data")), v, (n * BATCH, *v.shape[1:])
        )
        for k, v in {"x": x, "y": y}.items()
    }


def _ddp_models(rank: int, coordinator: str, variants):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    host, port = coordinator.split(":")
    os.environ["GLOO_SOCKET_IFNAME"] = VETH[rank]
    dist.init_process_group(
        "gloo", init_method=f"tcp://{host}:{int(port) + 1}", rank=rank, world_size=2
    )
    out = {}
    for v in variants:
        torch.manual_seed(0)
        layers = []
        for a, b in zip(SIZES[:-1], SIZES[1:], strict=True):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        model = DDP(torch.nn.Sequential(*layers[:-1]))
        if v == "ddp_fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        out[v] = (model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    return out


def _build(jax, variants, mesh, bucket_bytes: int) -> dict:
    """``{name: [run, state, collectives, wire bytes]}``: the steps, ``compute`` and the bares.

    ``run(state, batch) -> (state, loss or None)``; ``compute`` is the dense step on this
    process's own device, ``bare <v>`` the collectives of codec variant ``v``'s step alone.
    """
    import numpy as np
    from jax.sharding import Mesh

    built = {}
    for v in variants:
        if v in JAX_CODECS or v in JAX_SYNCS:
            compiled, state, count, wire, colls = _jax_step(jax, v, mesh, bucket_bytes)
            built[v] = [_stepper(jax, compiled, mesh), state, count, wire]
            if JAX_CODECS.get(v, Jax()).codec is not None:
                f, args = _bare(jax, mesh, colls)
                built[f"bare {v}"] = [lambda s, b, f=f, args=args: (jax.block_until_ready(
                    f(*args)), None), None, len(colls), wire]
    if any(JAX_CODECS.get(v, Jax()).codec is not None for v in variants):
        local = Mesh(np.array(jax.local_devices()[:1]), ("data",))
        compiled, state, count, wire, _ = _jax_step(jax, "dense", local, bucket_bytes)
        built[COMPUTE] = [_stepper(jax, compiled, local), state, count, wire]
    return built


def _stepper(jax, compiled, mesh):
    def run(state, xy):
        state, metrics = compiled(state, _jax_batch(jax, mesh, *xy))
        return state, float(jax.device_get(metrics)["loss"])  # waits for the step

    return run


def worker(variants, rank: int, coordinator: str, steps: int, warmup: int, extra: dict,
           bucket_bytes: int = BUCKET_BYTES) -> dict:
    """All variants in one pair of processes, one step of each in turn (round robin).

    Load from other programs on the machine then hits every variant alike; the
    variants in ``extra`` run that many more rounds (time to a training loss).
    """
    jax = _jax_start(rank, coordinator)
    import numpy as np

    import adaptjax

    mesh = adaptjax.make_mesh(2)  # one device per process, in process order
    built = _build(jax, variants, mesh, bucket_bytes)
    torch_steps = {}
    ddp = [v for v in variants if v.startswith("ddp")]
    if ddp:
        import torch

        torch_steps = _ddp_models(rank, coordinator, ddp)
    names = [*variants, *(k for k in built if k not in variants)]
    data = {v: _data(rank, warmup + steps + extra.get(v, 0)) for v in names}
    times = {v: [] for v in names}
    losses = {v: [] for v in names}

    def one(v):
        x, y = next(data[v])
        t0 = time.perf_counter()
        if v in built:
            built[v][1], loss = built[v][0](built[v][1], (x, y))
        else:
            model, opt = torch_steps[v]
            opt.zero_grad()
            out = model(torch.from_numpy(x))
            lt = torch.nn.functional.cross_entropy(out, torch.from_numpy(y).long())
            lt.backward()
            opt.step()
            loss = float(lt)
        times[v].append(time.perf_counter() - t0)
        if loss is not None:
            losses[v].append(loss)

    for r in range(warmup + steps + max(extra.values(), default=0)):
        for v in names:
            if r < warmup + steps + extra.get(v, 0):
                one(v)
    if ddp:
        torch.distributed.destroy_process_group()
    return {
        v: {  # the rounds every variant ran; the extra ones only extend the loss curve
            "s_per_step": float(np.median(times[v][warmup : warmup + steps])),
            "s_min": float(np.min(times[v][warmup : warmup + steps])),
            # every timed step, extra rounds included: a strategy's outer syncs amortised
            "s_mean": float(np.mean(times[v][warmup:])),
            "losses": losses[v],
            "wire": built[v][3] if v in built else None,
            "collectives": built[v][2] if v in built else None,
        }
        for v in names
    }


def bare_worker(rank: int, coordinator: str, reps: int) -> dict:
    """Seconds of bare collectives of the shapes the variants' steps move."""
    jax = _jax_start(rank, coordinator)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("d",))
    shapes = [s for a, b in zip(SIZES[:-1], SIZES[1:], strict=True) for s in ((a, b), (b,))]
    total = sum(int(np.prod(s)) for s in shapes)
    onebit_words = 2 * 139_519  # one encoded copy (u32 words), as the onebit step's HLO shows

    def timed(fn, *specs):  # compiled and run once; timed below, round robin
        args = [
            jax.make_array_from_process_local_data(
                NamedSharding(mesh, P("d")), np.ones((1, *s), dt), (2, *s)
            )
            for s, dt in specs
        ]
        body = lambda *a: fn(*[x[0] for x in a])
        f = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P(), check_vma=False)
        )
        jax.block_until_ready(f(*args))
        return f, args

    psum = lambda *x: jax.lax.psum(x, "d")
    gather = lambda x: jax.lax.all_gather(x, "d")
    owner = lambda x: jax.lax.all_gather(jax.lax.all_to_all(x, "d", 0, 0)[0], "d")
    cases = {
        "psum f32 [8.4M], one buffer": timed(psum, ((total,), np.float32)),
        "psum f32, 8 leaves in one tuple": timed(psum, *[(s, np.float32) for s in shapes]),
        "psum bf16 [8.4M]": timed(psum, ((total,), jnp.bfloat16)),
        "all_gather u16 [8.4M] (bf16 bits)": timed(gather, ((total,), np.uint16)),
        "all_to_all+all_gather u16 (bf16 owner)": timed(owner, ((2, total // 2), np.uint16)),
        "all_gather u32 (onebit bits)": timed(gather, ((onebit_words,), np.uint32)),
        "all_to_all+all_gather u32 (onebit owner)": timed(
            owner, ((2, onebit_words // 2), np.uint32)
        ),
        "psum f32 [16] (latency)": timed(psum, ((16,), np.float32)),
        "all_gather u32 [16] (latency)": timed(gather, ((16,), np.uint32)),
        "all_to_all u32 [2,8] (latency)": timed(
            lambda x: jax.lax.all_to_all(x, "d", 0, 0), ((2, 8), np.uint32)
        ),
    }
    times: dict = {k: [] for k in cases}
    for _ in range(reps):  # round robin, so that load changes hit every case alike
        for k, (f, args) in cases.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[k].append(time.perf_counter() - t0)
    return {k: (float(np.median(v)), float(np.min(v))) for k, v in times.items()}


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def run_pair(script: str, args: list[str], coordinator: str, label: str) -> dict:
    """``script ARGS --rank R --coordinator C`` in each namespace; rank 0's last JSON line."""
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", NS[rank], sys.executable, script, *args,
             "--rank", str(rank), "--coordinator", coordinator],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=3600) for p in procs]
    if any(p.returncode for p in procs):
        err = next(o[1] for p, o in zip(procs, outs, strict=True) if p.returncode)
        raise RuntimeError(f"{label} failed: {err.strip().splitlines()[-3:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def run_worker(kind: str, args: list[str]) -> dict:
    port = 29000 + (sum(map(ord, kind)) % 4) * 2 + int(time.time()) % 500 * 8
    return run_pair(os.path.abspath(__file__), ["--worker", kind, *args],
                    f"{ADDR[0]}:{port}", kind)


def smoothed(losses: list[float], window: int = 5) -> list[float]:
    return [sum(losses[max(0, i - window + 1) : i + 1]) / min(i + 1, window)
            for i in range(len(losses))]  # fmt: skip


def time_to_loss(result: dict, target: float) -> float:
    """Steps until the smoothed loss first reaches ``target``, times the measured s/step."""
    hits = [i for i, v in enumerate(smoothed(result["losses"])) if v <= target]
    return (hits[0] + 1) * result["s_per_step"] if hits else float("nan")


def _row(v: str, r: dict | None, common: int) -> str:
    if r is None:
        return f"{v:<22}{'n/a (pip install adaptjax[benchmarks])':>50}"
    wire = "" if r["wire"] is None else f"{r['wire']:.3g}"
    coll = "" if r.get("collectives") is None else str(r["collectives"])
    loss = f"{smoothed(r['losses'][:common])[-1]:>12.4f}" if r["losses"] else ""
    steps = str(len(r["losses"])) if r["losses"] else ""
    return (f"{v:<22}{r['s_per_step']:>9.3f}{r['s_min']:>8.3f}{wire:>12}{coll:>6}"
            f"{steps:>7}{loss}")


def overlap_recovered(unbucketed: float, bucketed: float, compute: float) -> float:
    """The share of the unbucketed step's gap to the compute-only step that buckets removed.

    ``(unbucketed − bucketed) / (unbucketed − compute)``: 1 when the bucketed
    step costs no more than its computation, 0 when it is no faster than one
    exchange after the backward pass (``nan`` without a gap).
    """
    gap = unbucketed - compute
    return (unbucketed - bucketed) / gap if gap > 0 else float("nan")


def overlap_lines(results: dict) -> list[str]:
    """Per codec: its gaps to ``compute``, the bare collectives' time, what overlap recovered."""
    if COMPUTE not in results:
        return []
    t_c = results[COMPUTE]["s_per_step"]
    out = [f"compute only (dense step on each process's own device, no collective): "
           f"{t_c * 1e3:.1f} ms"]
    for v in VARIANTS:
        u = f"{v}_unbucketed"
        if v not in results or u not in results:
            continue
        t_b, t_u = results[v]["s_per_step"], results[u]["s_per_step"]
        bare = results.get(f"bare {v}")
        bare_ms = "" if bare is None else (
            f"; its {bare['collectives']} collectives alone {bare['s_per_step'] * 1e3:.1f} ms")
        out.append(
            f"{v}: step - compute {(t_u - t_c) * 1e3:.1f} ms unbucketed, "
            f"{(t_b - t_c) * 1e3:.1f} ms bucketed{bare_ms}; overlap recovered "
            f"{100 * overlap_recovered(t_u, t_b, t_c):.0f}% of the gap")
    return out


def ratios_line(results: dict) -> str:
    """The last line: the three ratios against DDP and onebit against the compute-only step."""

    def ratio(a, b):
        ra, rb = results.get(a), results.get(b)
        return float("nan") if ra is None or rb is None else ra["s_per_step"] / rb["s_per_step"]

    return (
        f"network_dense_vs_ddp={ratio('dense', 'ddp'):.3f} "
        f"network_bf16_vs_ddp_fp16={ratio('bf16', 'ddp_fp16'):.3f} "
        f"network_onebit_vs_ddp={ratio('onebit', 'ddp'):.3f} "
        f"network_onebit_vs_compute={ratio('onebit', COMPUTE):.3f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--loss-steps", type=int, default=30, help="timed steps of dense and onebit (time to loss)"
    )
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--uncapped", action="store_true")
    parser.add_argument("--bucket-bytes", type=int, default=BUCKET_BYTES,
                        help="float32 gradient bytes per exchange of the bucketed codecs")
    parser.add_argument(
        "--breakdown", action="store_true", help="also time bare collectives of fixed shapes"
    )
    parser.add_argument(
        "--only", help=f"comma-separated variants (default: all of {', '.join(ALL)})"
    )
    parser.add_argument("--worker", choices=("all", "bare"))
    parser.add_argument("--variants")
    parser.add_argument("--extra", default="{}")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--coordinator")
    args = parser.parse_args()
    if args.worker == "bare":
        out = bare_worker(args.rank, args.coordinator, args.steps)
    elif args.worker == "all":
        out = worker(
            args.variants.split(","), args.rank, args.coordinator, args.steps, args.warmup,
            json.loads(args.extra), args.bucket_bytes,
        )  # fmt: skip
    if args.worker:
        print(json.dumps(out))
        return 0
    if os.geteuid() != 0:
        print("benchmarks/network.py needs root (it creates network namespaces and a tc qdisc)")
        return 1
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            print(f"benchmarks/network.py needs the {tool!r} command (iproute2)")
            return 1
    variants = ALL if not args.only else tuple(args.only.split(","))
    unknown = sorted(set(variants) - set(ALL))
    if unknown:
        print(f"unknown variants {unknown}; choose from {', '.join(ALL)}")
        return 2
    has_torch = _has_torch()
    run = [v for v in variants if has_torch or not v.startswith("ddp")]
    link = "uncapped" if args.uncapped else args.rate
    print(
        f"link: veth between two namespaces, {link}; 2 processes x 1 CPU device, gloo; "
        f"batch {BATCH}/process; MLP {'-'.join(map(str, SIZES))}; SGD momentum 0.9; "
        f"codecs in buckets of {args.bucket_bytes:,} float32 bytes, without the finiteness "
        f"guard (as DDP); variants interleaved step by step in one pair of processes",
        flush=True,
    )
    # --loss-steps under --steps adds nothing (it used to cut the timed steps to none)
    extra = {v: max(0, args.loss_steps - args.steps) for v in ("dense", "onebit") if v in run}
    extra.update({v: max(0, SYNC_STEPS - args.steps) for v in SYNC_VARIANTS if v in run})
    setup(None if args.uncapped else args.rate)
    try:
        results = run_worker(
            "all",
            ["--variants", ",".join(run), "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--extra", json.dumps(extra),
             "--bucket-bytes", str(args.bucket_bytes)],
        )  # fmt: skip
        print(
            f"{'variant':<22}{'s/step':>9}{'min':>8}{'wire B/dev':>12}{'coll':>6}{'steps':>7}"
            f"{'loss@' + str(args.warmup + args.steps):>12}"
        )
        for v in [*variants, *(k for k in results if k not in variants)]:
            print(_row(v, results.get(v), args.warmup + args.steps), flush=True)
        for line in overlap_lines(results):
            print(line, flush=True)
        if args.breakdown:
            print(f"{'(median / min ms)':<52}")
            for name, (med, low) in run_worker("bare", ["--steps", str(args.steps)]).items():
                print(f"{'bare ' + name:<52}{med * 1e3:8.1f} {low * 1e3:8.1f}", flush=True)
    finally:
        teardown()
    if "dense" in results and "onebit" in results:
        dense, onebit = results["dense"], results["onebit"]
        target = smoothed(dense["losses"])[-1]
        t_dense, t_onebit = time_to_loss(dense, target), time_to_loss(onebit, target)
        print(
            f"time to smoothed training loss {target:.4f} (dense's after "
            f"{len(dense['losses'])} steps, 5-step mean): dense {t_dense:.2f} s, onebit "
            + (f"{t_onebit:.2f} s" if t_onebit == t_onebit else
               f"not reached in {len(onebit['losses'])} steps "
               f"(its smoothed loss: {smoothed(onebit['losses'])[-1]:.4f})")
        )  # fmt: skip

    ran = [v for v in SYNC_VARIANTS if v in results]
    if ran and "dense" in results:
        rows = ", ".join(
            f"{v} {results[v]['s_mean']:.3f}" for v in ("dense", *ran)
        )
        print(f"mean s/step over every timed step (a strategy's outer syncs amortised; "
              f"{args.steps + extra.get(ran[0], 0)} steps each for the strategies): {rows}")
    print(ratios_line(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
