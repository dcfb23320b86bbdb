"""A byte-level transformer language model, trained adaptively on real text.

A decoder-only transformer in flax NNX (pre-norm blocks, causal self-attention,
dropout, a byte vocabulary of 256) trained on the ``.py`` sources of this
Python's standard library (``--data DIR``: any folder of text), split into train
and validation by file (a hash of each relative path: see ``lm_data.py``).
8 simulated CPU devices and the adaptjax controller with:

* ``AdaptiveBatchSize``: Pollux goodput from the in-step noise scale and the
  measured step times, a new batch size counted with the compile it waits
  for; the learning rate follows AdaScale (Adam: sqrt).
* ``ElasticScale``: 8 -> 4 devices at 40% of the steps, back to 8 at 70%, each
  through an Orbax checkpoint and a restore onto the new mesh.
* ``SwitchCompression``: ``natural()`` (8-bit codes, safe under AdamW, where
  1-bit signs with error feedback spoil Adam's second moment) switches on when
  communication's modelled share of the step passes 50% (the link is modelled
  at ``--link-mbit`` Mbit/s; simulated devices have no real link).

Sizes (``--size``): ``tiny`` (tests), ``small`` (the default: 2 layers, width
128, context 64, a few minutes on 2 CPU cores), ``base`` (4 layers, width 256,
context 128) and ``gpu`` (8 layers, width 512, context 256); ``--layers``,
``--width`` and ``--context`` override them.

Sharded (``--mesh data=2,fsdp=4``, or ``data=2,fsdp=2,model=2``): parameters
and AdamW's moments are split over ``fsdp`` (and the attention and MLP weights
over ``model``, Megatron-style: see :func:`lm_sharding`), the noise scale
measured over ``data``; the script prints ``params+optimizer bytes per device:
<n>`` before training, through the same controller and policies, with
``ElasticScale`` moving between mesh shapes (the data axis halved at 40% of
the steps, back at 70%; from one replica, the fsdp axis instead).
``--loader grain`` reads the same windows through a grain pipeline
(``grain.MapDataset.source(windows).shuffle(seed)`` in an
``adaptjax.GrainDataset``, read ahead on host threads; ``pip install
"adaptjax[grain]"``) instead of an ``adaptjax.ArrayDataset``.

On GPUs or TPUs the same flag shards a larger model over real devices: put
``fsdp``/``model`` last so they stay inside a node, and leave the
``XLA_FLAGS`` device count unset.

Usage:
  python examples/lm.py [--steps 300] [--size small] [--run-dir runs/lm] [--data DIR]
  python examples/lm.py --mesh data=2,fsdp=4 --size base --steps 50
  python examples/lm.py --loader grain
  adaptjax report runs/lm        # report.png and summary.md of the run

Prints ``validation bits per byte: <x>`` as its last line; ``RUN_DIR`` holds
metrics.jsonl, events.jsonl, tensorboard/ and checkpoints/.
"""

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lm_data  # noqa: E402

import adaptjax  # noqa: E402
from adaptjax import compression as ajc  # noqa: E402
from adaptjax import policies as ajp  # noqa: E402


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """The model's shape."""

    layers: int = 2
    width: int = 128
    heads: int = 4
    context: int = 64
    dropout: float = 0.1
    vocab: int = lm_data.VOCAB


SIZES = {
    "tiny": LMConfig(layers=1, width=32, heads=2, context=16),
    "small": LMConfig(),
    "base": LMConfig(layers=4, width=256, heads=4, context=128),
    "gpu": LMConfig(layers=8, width=512, heads=8, context=256),
}


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LMConfig, rngs: nnx.Rngs):
        self.heads = cfg.heads
        self.norm1 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.qkv = nnx.Linear(cfg.width, 3 * cfg.width, use_bias=False, rngs=rngs)
        self.proj = nnx.Linear(cfg.width, cfg.width, rngs=rngs)
        self.norm2 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.up = nnx.Linear(cfg.width, 4 * cfg.width, rngs=rngs)
        self.down = nnx.Linear(4 * cfg.width, cfg.width, rngs=rngs)
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (a.reshape(shape) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        x = x + self.drop(self.proj(attn.reshape(b, t, d)))
        return x + self.drop(self.down(jax.nn.gelu(self.up(self.norm2(x)))))


class ByteLM(nnx.Module):
    """Decoder-only transformer over bytes: embeddings, blocks, final norm, tied-free head."""

    def __init__(self, cfg: LMConfig, rngs: nnx.Rngs):
        if cfg.width % cfg.heads:
            raise ValueError(f"width={cfg.width} must be divisible by heads={cfg.heads}")
        self.embed = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (cfg.context, cfg.width)) * 0.02)
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.norm = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.head = nnx.Linear(cfg.width, cfg.vocab, rngs=rngs)

    def __call__(self, tokens):
        t = tokens.shape[1]
        x = self.drop(self.embed(tokens.astype(jnp.int32)) + self.pos[...][:t])
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(model, batch):
    """Mean next-byte cross entropy (nats) of a batch of windows ``[B, context + 1]``."""
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:].astype(jnp.int32)
    ).mean()


def param_count(model) -> int:
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))


def make_eval(val_windows: np.ndarray, template: ByteLM, batch: int = 64):
    """``evaluate(model) -> {"loss": nats, "bpb": bits per byte}`` on ``val_windows``, no dropout.

    ``template`` is a model of the same shape; its structure (in eval mode)
    receives the trained parameters, read from the controller's model.
    """
    template.eval()
    graphdef, _, rest = nnx.split(template, nnx.Param, ...)

    @jax.jit
    def total(params, tokens):
        m = nnx.merge(graphdef, params, rest)
        return loss_fn(m, {"tokens": tokens}) * tokens.shape[0]

    def evaluate(model):
        # The whole parameters: gathered when sharded, this process's copy when
        # replicated over processes.
        params = jax.tree.map(
            lambda x: np.asarray(x if x.is_fully_addressable else x.addressable_data(0)),
            nnx.state(model, nnx.Param),
        )
        losses, count = 0.0, 0
        for i in range(0, len(val_windows), batch):
            chunk = val_windows[i : i + batch]
            losses += float(total(params, jnp.asarray(chunk)))
            count += len(chunk)
        loss = losses / count
        return {"loss": loss, "bpb": loss / math.log(2)}

    return evaluate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--context", type=int, default=None)
    parser.add_argument("--data", default=None, help="folder of text (default: stdlib .py files)")
    parser.add_argument("--max-train-bytes", type=int, default=4_000_000)
    parser.add_argument("--val-windows", type=int, default=256, help="validation windows used")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--link-mbit", type=float, default=100.0, help="modelled link, Mbit/s")
    parser.add_argument("--policy-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=None, help="default: steps // 6")
    parser.add_argument("--run-dir", default="runs/lm")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loader", choices=("array", "grain"), default="array",
                        help="feed the windows from an ArrayDataset or a grain pipeline")
    parser.add_argument(
        "--mesh", default=None, help="a sharded mesh, e.g. data=2,fsdp=4 or data=2,fsdp=2,model=2"
    )
    return parser


def train_data(windows: np.ndarray, loader: str, seed: int):
    """The training windows as ``{"tokens": window}`` batches: an ArrayDataset or grain."""
    if loader == "array":
        return adaptjax.ArrayDataset({"tokens": windows}, seed=seed)
    try:
        import grain
    except ImportError:
        raise SystemExit(
            "lm.py: --loader grain needs grain: pip install 'adaptjax[grain]'"
        ) from None
    pipeline = grain.MapDataset.source(windows).shuffle(seed=seed).map(lambda w: {"tokens": w})
    return adaptjax.GrainDataset(pipeline)


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,fsdp=4"`` -> ``{"data": 2, "fsdp": 4}`` (one-line SystemExit on a typo)."""
    shape = {}
    for part in text.split(","):
        name, eq, size = part.partition("=")
        if not eq or not size.strip().isdigit():
            raise SystemExit(f"lm.py: --mesh wants axis=size pairs (data=2,fsdp=4), got {text!r}")
        shape[name.strip()] = int(size)
    return shape


# Megatron-style tensor parallelism for ByteLM's blocks: the first matmul of
# attention and of the MLP split by columns, the second by rows (one
# all-reduce of activations each), over "model".
_TENSOR_PARALLEL = {
    "qkv": P(None, "model"),
    "up": P(None, "model"),
    "proj": P("model"),
    "down": P("model"),
}


def lm_sharding(path, leaf, mesh):
    """A leaf's ``PartitionSpec`` on ``mesh``: tensor parallel over ``model`` if the mesh has it,
    then :class:`adaptjax.FSDP` over ``fsdp`` on every leaf of 4096 elements or more.

    The rule takes the mesh (a third parameter), so it serves every mesh a
    rescale moves the run to.
    """
    names = [getattr(k, "key", None) for k in path]
    layer = next((n for n in names if n in _TENSOR_PARALLEL), None)
    base = P()
    if "model" in mesh.axis_names and layer is not None and names[-2] == "kernel":
        base = _TENSOR_PARALLEL[layer]
    elif "model" in mesh.axis_names and layer == "up" and names[-2] == "bias":
        base = P("model")
    return adaptjax.FSDP().spec(np.shape(leaf), mesh, base)


def bytes_per_device(state) -> int:
    """Bytes of the parameters and optimizer state on the mesh's first device."""
    device = jax.tree.leaves(state.params)[0].sharding.mesh.devices.flat[0]
    return sum(
        shard.data.nbytes
        for x in jax.tree.leaves((state.params, state.opt_state))
        for shard in x.addressable_shards
        if shard.device == device
    )


def mesh_arguments(args, steps: int) -> tuple[dict, ajp.ElasticScale]:
    """The controller's mesh arguments and its ``ElasticScale``: 1-D over ``--devices``, or
    the ``--mesh`` shape with :func:`lm_sharding` (the data axis halved at 40% of the steps,
    or from one replica the fsdp axis, and back at 70%)."""
    early, late = int(steps * 0.4), int(steps * 0.7)
    if args.mesh is None:
        elastic = ajp.ElasticScale({early: max(args.devices // 2, 1), late: args.devices})
        return {"devices": args.devices}, elastic
    shape = parse_mesh(args.mesh)
    try:
        adaptjax.make_mesh(shape)
    except ValueError as error:
        raise SystemExit(f"lm.py: --mesh {args.mesh}: {error}") from None
    axis = "data" if shape.get("data", 1) > 1 else "fsdp"
    smaller = {**shape, axis: max(shape.get(axis, 1) // 2, 1)}
    elastic = ajp.ElasticScale({early: smaller, late: shape})
    return {"mesh_shape": shape, "sharding": lm_sharding}, elastic


def model_config(args) -> LMConfig:
    cfg = SIZES[args.size]
    overrides = {k: getattr(args, k) for k in ("layers", "width", "context")}
    return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


def main(argv=None):
    args = build_parser().parse_args(argv)
    cfg = model_config(args)
    try:
        train, val, info = lm_data.load_corpus(
            args.data, context=cfg.context, max_train_bytes=args.max_train_bytes,
        )
    except ValueError as error:
        raise SystemExit(f"lm.py: {error}") from None
    val = lm_data.evenly_spaced(val, args.val_windows)
    print(f"corpus: {info['root']}  files: {info['train_files']} train / {info['val_files']} "
          f"validation  bytes: {info['train_bytes']} train, {len(val) * cfg.context} validation")
    model = ByteLM(cfg, nnx.Rngs(params=args.seed, dropout=args.seed + 1))
    print(f"model: {cfg}  parameters: {param_count(model)}")
    evaluate = make_eval(val, ByteLM(cfg, nnx.Rngs(0)))
    steps = args.steps
    mesh, elastic = mesh_arguments(args, steps)
    if os.path.exists(args.run_dir):
        shutil.rmtree(args.run_dir)  # a new run starts fresh
    model.train()  # dropout on while training (evaluation builds its own model)
    spec = adaptjax.RunSpec(
        run_dir=args.run_dir,
        **mesh,
        batch_size=args.batch_size,
        learning_rate=args.lr,  # the rate AdaptiveBatchSize scales
        policies=[
            ajp.cooldown(
                ajp.AdaptiveBatchSize(max_batch_size=args.max_batch_size, min_batch_size=8,
                                      lr_rule="adascale",
                                      optimizer_kind="adam", multiple_of=8),
                steps=max(steps // 10, 1),
            ),
            elastic,
            ajp.SwitchCompression(ajc.natural(), when_comm_share_above=0.5),
        ],
        policy_every=args.policy_every,
        checkpoint=adaptjax.CheckpointOptions(every=max(steps // 3, 1)),
        link_bandwidth=args.link_mbit * 1e6 / 8,
    )
    hooks = [adaptjax.Evaluate(evaluate, every=args.eval_every or max(steps // 6, 1)),
             adaptjax.TensorBoard(), *([] if args.no_progress else [adaptjax.ProgressBar()])]
    data = train_data(train, args.loader, args.seed)
    ctrl = adaptjax.Controller(
        model,
        loss_fn,
        optax.adamw(args.lr, weight_decay=0.01),
        data,
        spec,
        hooks=hooks,
    )
    if args.mesh is not None:
        print(f"mesh: {ctrl.config.axes}  params+optimizer bytes per device: "
              f"{bytes_per_device(ctrl.state)}")
    t0 = time.perf_counter()
    ctrl.run(steps)
    seconds = time.perf_counter() - t0
    result = evaluate(ctrl.model)
    events = ctrl.log.events
    batches = sorted({e["config"]["batch_size"] for e in events if e["kind"] == "compile"})
    rescales = [(e.get("mesh_from", e["devices_from"]), e.get("mesh_to", e["devices_to"]))
                for e in events if e["kind"] == "rescale"]
    codecs = [(e["step"], e["codec"]) for e in events if e["kind"] == "set_codec"]
    tokens = ctrl.samples_seen * cfg.context
    print(f"steps: {ctrl.step}  tokens: {tokens}  wall: {seconds:.1f}s  "
          f"({tokens / seconds:.0f} tokens/s)  compilations: {ctrl.compilations}")
    print(f"batch sizes used: {batches}  rescales: {rescales}  codec switches: {codecs}")
    print(f"final train loss: {ctrl.latest_metrics.get('loss', float('nan')):.4f}  "
          f"noise scale: {ctrl.latest_metrics.get('noise_scale', float('nan')):.1f}")
    print(f"run directory: {ctrl.run_dir} (adaptjax report {ctrl.run_dir})")
    ctrl.close()
    getattr(data, "close", lambda: None)()  # GrainDataset's reading threads
    print(f"validation loss: {result['loss']:.4f} nats/byte")
    print(f"validation bits per byte: {result['bpb']:.4f}")
    return result


if __name__ == "__main__":
    main()
