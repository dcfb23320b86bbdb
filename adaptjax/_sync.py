"""The gradient synchronisation transformation: one collective, monitors on top."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Self

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from adaptjax._codec import GradientCodec
from adaptjax._hash import hash32
from adaptjax._metric_vector import Metrics
from adaptjax._monitors import GradientMonitor, GradientNoiseScale, GradStats
from adaptjax._tree import axis_size, check_float_tree, psum_replicas, tree_sq_norm_sampled

_LOCAL_SQ = "__local_sq__"
# With a codec, monitors see the exact mean at this fraction of coordinates.
_MIN_SAMPLE = 1024


def _sample_coordinates(tree, count, fraction: float):
    """Coordinates shared by every replica (they depend on the step only).

    Leaves of up to ``_MIN_SAMPLE`` elements are taken whole; larger ones give
    ``max(_MIN_SAMPLE, fraction·d)`` coordinates drawn uniformly with
    replacement, each weighted ``d / k`` so that sums of squares stay unbiased.
    The draws are a counter-based hash of (step, slot), fused into the gathers
    that use them (a threefry stream compiles to loops of its own: about 0.3 s
    more of each compile of a step with a codec, on CPU).
    """
    leaves = jax.tree.leaves(tree)
    sizes = [int(np.prod(np.shape(x))) for x in leaves]
    ks = [max(_MIN_SAMPLE, int(np.ceil(fraction * d))) for d in sizes]
    drawn = [(d, k) for d, k in zip(sizes, ks, strict=True) if d > k]
    if drawn:
        # one draw for every sampled leaf; the modulo's bias is below d / 2**32
        # (broadcasts, not a host array: no constant of 1% of the model in the program)
        seed = hash32(hash32(jnp.asarray(count).astype(jnp.uint32)) ^ jnp.uint32(0x5A17))
        bits = hash32(jax.lax.iota(jnp.uint32, sum(k for _, k in drawn)) ^ seed)
        maxval = jnp.concatenate([jnp.full((k,), d, jnp.uint32) for d, k in drawn])
        flat = (bits % maxval).astype(jnp.int32)
        parts = iter(jnp.split(flat, np.cumsum([k for _, k in drawn])[:-1]))
    out = []
    for d, k in zip(sizes, ks, strict=True):
        if d <= k:
            out.append((jnp.arange(d, dtype=jnp.int32), 1.0))
        else:
            out.append((next(parts), d / k))
    return out


_WIRE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _psum_leaves(tree, axis_name):
    """``psum`` leaf by leaf: one all-reduce per leaf in the program.

    XLA:CPU's ``cpu-all-reduce-combiner`` joins them into one tuple all-reduce
    (the same compiled program as one ``psum`` of the whole tree); with that
    pass disabled (``--xla_disable_hlo_passes=cpu-all-reduce-combiner``) each
    gradient's all-reduce can start as soon as the backward pass produced it.
    """
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [psum_replicas(x, axis_name) for x in leaves])


#: The dense lane's collectives (``dense_lane=`` of :func:`sync_gradients`).
DENSE_LANES = ("all-reduce", "reduce-scatter+all-gather")


def _reduce_scatter_gather(tree, axis_name, n: int):
    """The sum over ``axis_name`` of ``tree`` as one reduce-scatter and one all-gather.

    Leaves of one dtype are raveled into one flat buffer, padded with zeros to a
    multiple of ``n``; each replica receives the summed ``1/n`` of it
    (``psum_scatter``) and an all-gather hands every replica every summed
    chunk. Each of the two sends ``(n−1)/n`` of the buffer per device, the
    bytes of one ring all-reduce together. (XLA:CPU joins neither per-leaf
    reduce-scatters nor all-gathers, so one buffer per dtype keeps it at one
    pair.)
    """
    leaves, treedef = jax.tree.flatten(tree)
    out: list = [None] * len(leaves)
    by_dtype: dict = {}
    for i, x in enumerate(leaves):
        by_dtype.setdefault(jnp.result_type(x), []).append(i)
    for idx in by_dtype.values():
        sizes = [int(np.size(leaves[i])) for i in idx]
        flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in idx])
        total = flat.shape[0]
        flat = jnp.pad(flat, (0, -total % n))
        part = jax.lax.psum_scatter(flat, axis_name, tiled=True)
        whole = jax.lax.all_gather(part, axis_name, tiled=True, to="invarying")
        for i, start, size in zip(idx, np.cumsum([0, *sizes[:-1]]), sizes, strict=True):
            out[i] = whole[int(start) : int(start) + size].reshape(np.shape(leaves[i]))
    return jax.tree.unflatten(treedef, out)


def _sq_norm(inputs, tree, chunks: int):
    """``Σ‖x‖²`` of a gradient-shaped tree (sampled in ``chunks``), over its shards if sharded."""
    if inputs.layout is None:
        return tree_sq_norm_sampled(tree, inputs.state.count, chunks)
    return inputs.layout.sq_norm(tree, inputs.state.count, chunks)


def codec_sync(codec, grads, state, *, axis_name, step, layout=None):
    """``codec.sync`` over ``axis_name``; on a sharded mesh, on each device's shards.

    With a ``ShardLayout`` the codec runs inside a ``shard_map``
    manual over the model's axes: each device compresses its own shard of
    every leaf over the data axis (a quantiser's blocks stay inside a shard;
    top-k keeps ``ratio`` of each shard's elements, so ``k`` is per shard),
    and a leaf replicated over those axes is compressed alike on each of its
    devices. The codec plans each shard as a leaf of the shard's shape: a
    shard under the codec's ``min_size`` goes in its exact float32 lane (its
    residual buffer, unused, is kept as it is). The codec's other state must
    be split like the gradients, as error-feedback residuals are. A codec
    whose state is not (PowerSGD's low-rank factors) falls back to the
    bfloat16 lane with a one-line warning at trace time: every shard is
    averaged over the data axis in bfloat16 (as ``sync_gradients(...,
    wire_dtype=jnp.bfloat16)`` does) and the codec's state is kept as it is,
    so the result is a bfloat16 mean, never a wrong one.

    Args:
      codec: a codec (:class:`adaptjax.compression.Codec`).
      grads: this replica's gradients.
      state: the codec's state (local view).
      axis_name: the data axis.
      step: int32 step counter.
      layout: the step's ``ShardLayout``, or ``None``.

    Returns:
      ``(mean, new state)`` as ``codec.sync`` returns them.
    """
    if layout is None:
        return codec.sync(grads, state, axis_name=axis_name, step=step)
    g_specs = layout.specs_for(grads)
    split = _shard_state(codec, grads, state, g_specs, layout)
    if split is None:
        return _bf16_fallback(codec, grads, axis_name, g_specs, layout), state
    kept, unused = split
    s_specs = layout.specs_for(kept)

    def local(g, s, t):
        return codec.sync(g, s, axis_name=axis_name, step=t)

    mean, new = layout.local_map(local, (g_specs, s_specs, P()), (g_specs, s_specs))(
        grads, kept, jnp.asarray(step, jnp.int32)
    )
    return mean, _restore_unused(new, unused)


def _is_none(x) -> bool:
    return x is None


def _bf16_fallback(codec, grads, axis_name, g_specs, layout):
    """Each shard's mean over ``axis_name`` in bfloat16, with a one-line warning."""
    name = getattr(codec, "name", type(codec).__name__)
    warnings.warn(
        f"codec {name!r} cannot run on each shard of a sharded mesh (its state is not split "
        "like the gradients, e.g. low-rank factors): its gradients travel as bfloat16 instead "
        "and its state is kept as it is; use onebit, topk or a quantiser to compress them",
        UserWarning,
        stacklevel=2,
    )

    def mean(g):
        n = jax.lax.axis_size(axis_name)
        # as the dense lane with wire_dtype=bfloat16: summed in bfloat16, divided, cast back
        return jax.tree.map(
            lambda x: (jax.lax.psum(x.astype(jnp.bfloat16), axis_name) / n).astype(x.dtype), g
        )

    return layout.local_map(mean, (g_specs,), g_specs)(grads)


def _shard_state(codec, grads, state, g_specs, layout):
    """``(state the codec expects per shard, the buffers it does not use)``, or ``None``.

    The state was built for whole leaves; per shard the codec wants the state
    ``codec.init`` gives a shard. Buffers of leaves whose shards fall under
    its ``min_size`` are set aside (``None`` there); any other difference
    (state not split like the gradients) gives ``None``.
    """
    s_specs = layout.specs_for(state)
    local = lambda tree, specs: jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(layout.local_shape(jnp.shape(x), s), x.dtype),
        tree,
        specs,
    )
    wanted, w_def = jax.tree.flatten(
        jax.eval_shape(codec.init, local(grads, g_specs)), is_leaf=_is_none
    )
    have, h_def = jax.tree.flatten(local(state, s_specs), is_leaf=_is_none)
    same = w_def == h_def and all(
        w is None or (h is not None and w.shape == h.shape)
        for w, h in zip(wanted, have, strict=True)
    )
    if not same:
        return None
    leaves = jax.tree.leaves(state, is_leaf=_is_none)
    kept = [None if w is None else x for w, x in zip(wanted, leaves, strict=True)]
    unused = [x if w is None else None for w, x in zip(wanted, leaves, strict=True)]
    return h_def.unflatten(kept), (h_def, unused)


def _restore_unused(new_state, unused):
    """``new_state`` with the buffers :func:`_shard_state` set aside put back unchanged."""
    treedef, old = unused
    if all(x is None for x in old):
        return new_state
    new = jax.tree.leaves(new_state, is_leaf=_is_none)
    return treedef.unflatten([o if o is not None else x for x, o in zip(new, old, strict=True)])


def _check_layout(config, layout) -> None:
    """One-line errors for what a sharded mesh does not support yet."""
    if layout is None:
        return
    for m in config.monitors:
        if getattr(m, "differencing", False) or (
            config.codec is not None and getattr(m, "preconditioned", False)
        ):
            raise ValueError(
                f"{type(m).__name__}(differencing=True) and the preconditioned noise scale with a "
                "codec need whole gradients; on a sharded mesh use >= 2 replicas (or "
                "microbatches >= 2) without differencing, and the plain noise scale with a codec"
            )


class SyncState(NamedTuple):
    """State of :func:`sync_gradients`.

    Attributes:
      count: int32 number of updates so far.
      codec_state: the codec's state (``()`` without a codec).
      monitor_states: one state per monitor, in order.
      metrics: the monitors' latest values, an :class:`adaptjax.Metrics` (one
        float32 vector); read it with :func:`adaptjax.read_metrics`.
    """

    count: jax.Array
    codec_state: Any
    monitor_states: tuple
    metrics: Metrics


def _wire_dtype(wire_dtype):
    if wire_dtype is None:
        return None
    key = jnp.dtype(wire_dtype).name
    if key not in _WIRE_DTYPES:
        raise ValueError(
            f"wire_dtype must be float32, bfloat16 or float16, got {wire_dtype}; "
            "use a codec from adaptjax.compression for narrower formats"
        )
    return _WIRE_DTYPES[key]


def _varying_axes(x) -> frozenset:
    """Mesh axes a value varies over inside ``shard_map`` (empty when unchecked)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # jax <= 0.9 spelling
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", frozenset())
    return frozenset(vma)


def check_axes_bound(axis_name, owner: str) -> None:
    """A one-line ``ValueError`` at trace time when an axis of ``axis_name`` is not bound here.

    ``owner`` names the call (``"sync_gradients('batch')"``). The message names
    the mesh axes the current ``shard_map`` (or ``pmap``) is manual over, so a
    transformation built for another axis (``sync_gradients("batch")`` in a
    step over ``"data"``) says what to use instead of JAX's ``unbound axis
    name``.
    """
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    for name in names:
        try:
            jax.lax.axis_size(name)
        except NameError:
            bound = tuple(jax.sharding.get_abstract_mesh().manual_axes)
            if not bound:
                raise ValueError(
                    f"{owner} runs outside any mesh axis: call its update inside jax.shard_map "
                    f"(or adaptjax.data_parallel_step) over a mesh axis named {name!r}"
                ) from None
            use = bound[0] if len(bound) == 1 else bound
            raise ValueError(
                f"{owner}: axis {name!r} is not bound in this step, which is manual over "
                f"{', '.join(map(repr, bound))}; build it with axis_name={use!r} (the step's axis)"
            ) from None


def _check_per_replica(updates, axis_name) -> None:
    """With ``check_vma`` on, gradients must vary over the axis (not be summed already)."""
    names = set(axis_name if isinstance(axis_name, tuple) else (axis_name,))
    if not names & _varying_axes(jax.lax.axis_index(axis_name)):
        return  # shard_map(check_vma=False): nothing to check
    for path, x in jax.tree_util.tree_leaves_with_path(updates):
        if not names <= _varying_axes(x):
            raise ValueError(
                f"gradient at {jax.tree_util.keystr(path) or 'the root'} is already reduced over "
                f"{axis_name!r} (jax.grad of replicated params inside shard_map sums them); "
                "differentiate w.r.t. jax.lax.pcast(params, axis_name, to='varying') or use "
                "jax.shard_map(..., check_vma=False)"
            )


class SyncGradients(optax.GradientTransformationExtraArgs):
    """What :func:`sync_gradients` returns: an optax transformation that can carry more sums.

    Used as any ``optax.GradientTransformationExtraArgs``. Besides, its
    ``update_with_sums(updates, state, params, extra_sums, *, deferred=False,
    **extra)`` returns ``(out, finish, state, psum(extra_sums))``: the caller's
    scalars travel in the gradients' own all-reduce, and ``finish(out)`` is the
    mean (the sums divided by the replicas, or a codec's mean), so a caller can
    finish it where the optimizer reads it and XLA fuses the two. With
    ``deferred=True`` it returns ``(out, complete, state, psum(extra_sums))``
    instead: ``complete(out)`` gives ``(mean, new_state)``, running the codec
    (if any) and the monitors, and ``state`` is the old one; a caller that may
    drop the step (a non-finite guard) calls ``complete`` only in the branch
    that keeps it, so a dropped step runs neither and keeps every state
    exactly.
    :func:`adaptjax.data_parallel_step` uses it (in the chains that
    :func:`adaptjax.sync.sync_chain` and the controller build) for the
    non-finite guard's two scalars, so guarding a step adds no collective.
    ``codec`` is the codec it was built with (``None``: dense). Given the
    extra argument ``chain_state`` (the whole chain's state, which
    :func:`adaptjax.data_parallel_step` passes), ``update`` warns once per
    trace with the codec's ``pairing_warning`` about the optimizer in it.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, adaptjax
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
      >>> tx = adaptjax.sync_gradients("data")
      >>> def f(g, s):
      ...     out, finish, _, total = tx.update_with_sums(g, tx.init(g), extra_sums=s)
      ...     return finish(out), total
      >>> f = jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P())
      >>> mean, total = jax.jit(f)(jnp.arange(4.0), jnp.ones(4))
      >>> mean.tolist(), total.tolist()
      ([1.5], [4.0])
    """

    update_with_sums: Callable[..., tuple[Any, Callable[..., Any], Any, Any]] | None
    codec: GradientCodec | None

    def __new__(
        cls,
        init: optax.TransformInitFn,
        update: optax.TransformUpdateExtraArgsFn,
        update_with_sums: Callable[..., tuple[Any, Callable[..., Any], Any, Any]] | None = None,
        codec: GradientCodec | None = None,
    ) -> Self:
        self = super().__new__(cls, init, update)
        self.update_with_sums = update_with_sums
        self.codec = codec
        return self


def sync_gradients(
    axis_name: str | tuple[str, ...] = "data",
    *,
    wire_dtype: DTypeLike | None = None,
    codec: GradientCodec | None = None,
    monitors: Sequence[Any] = (),
    monitor_every: int = 1,
    norm_chunks: int = 32,
    codec_sample: float = 0.01,
    dense_lane: str = "all-reduce",
) -> SyncGradients:
    """Averages per-replica gradients over ``axis_name`` with one collective.

    Use it inside ``shard_map`` (or ``pmap``) with ``axis_name`` bound, before
    the optimizer in an ``optax.chain``, on *per-replica* gradients: with
    ``check_vma=True`` (shard_map's default) ``jax.grad`` of replicated params
    already sums them, so differentiate with respect to
    ``jax.lax.pcast(params, axis_name, to="varying")`` or pass ``check_vma=False`` (a clear
    error says so otherwise). Monitors see this replica's gradient
    and the averaged one; the scalars they need from every replica travel in
    the same all-reduce as the gradients, so the step still has exactly one
    gradient-sized collective.

    Extra arguments read from ``update`` (the step builder passes them):
    ``local_batch_size`` (examples per replica), ``microbatches`` (``k``),
    ``micro_sqnorm`` (sum over this replica's ``k`` micro-batch gradients of
    ``‖g_j‖²``, so the noise scale gets ``k`` samples per replica) and
    ``local_sqnorm`` (this replica's exact ``‖g‖²`` when the caller has it,
    as the non-finite guard does; then the monitors do not read the local
    gradient for it). Both norms are of the gradients as the step computed
    them, so with monitors keep ``sync_gradients`` first in the chain (a
    transformation before it, such as clipping, would change what it sees but
    not those norms).

    Args:
      axis_name: the data-parallel mesh axis (or a tuple of axes).
      wire_dtype: ``None`` (the gradients' dtype), ``jnp.float32`` or
        ``jnp.bfloat16``/``jnp.float16`` (cast for the all-reduce, cast back).
      codec: a codec (:class:`adaptjax.compression.Codec`) (see ``adaptjax.compression``);
        it then owns the collective.
      monitors: monitors such as :class:`adaptjax.GradientNoiseScale`; any object
        following :class:`adaptjax.GradientMonitor` works.
      monitor_every: measure every this many steps; between measurements the
        monitors' norm passes are skipped (``lax.cond``) and their last values
        are kept.
      codec_sample: with a codec, the monitors must not see the *compressed*
        mean (its error would inflate ‖Ḡ‖²). Each step, every replica also sends
        its exact gradient at this fraction of coordinates (at least 1024 per
        leaf, the same random coordinates on every replica, drawn anew each
        step) in the small all-reduce that carries the monitors' scalars;
        ``‖Ḡ‖²`` is estimated from them without bias. That costs
        ``codec_sample`` of a dense fp32 psum (1% by default).
      dense_lane: how the gradients travel without a codec: ``"all-reduce"``
        (default: one ``psum`` per leaf, which XLA:CPU joins into one tuple
        all-reduce, the monitors' scalars with them) or
        ``"reduce-scatter+all-gather"`` (the leaves of each dtype in one flat
        buffer: a reduce-scatter, then an all-gather; the same bytes and the
        same mean; the monitors' scalars in their own small all-reduce).
        Which is faster depends on the link;
        :func:`adaptjax.costs.choose_dense_lane` predicts it, and a
        :class:`adaptjax.costs.Planner` attached to a controller chooses it.
      norm_chunks: read only one of this many rotating chunks of each gradient
        leaf of 4096 elements or more for ``‖g_i‖²`` and ``‖Ḡ‖²`` (scaled up,
        unbiased, exact over any ``norm_chunks`` consecutive steps; see
        ``tree_sq_norm_sampled``); 1 reads everything. Those two
        norm passes are where monitoring's time goes: XLA fuses neither into
        the backward pass nor into the all-reduce, so exact norms read every
        gradient twice more (+20–36% of a plain step for a 2M-parameter MLP
        at 32 samples per device on 8 simulated CPU devices). The default 32
        cuts that to about 1/32 of it, within the measurement noise of a
        plain step (the docs' benchmarks page shows both settings).
        The variance it adds is small against the estimator's own: there,
        after the EMA (decay 0.95), the chunked noise scale differs from the
        exact one at the same step by about 0.5% (relative std; 0.3–0.5% at
        16 chunks, 1.7–2.4% at 64), while the exact estimate itself moves by
        27–34% from step to step.

    Returns:
      A ``SyncGradients`` (an ``optax.GradientTransformationExtraArgs``);
      its state is a ``SyncState``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, adaptjax
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
      >>> tx = adaptjax.sync_gradients("data")
      >>> f = jax.shard_map(lambda g: tx.update(g, tx.init(g))[0], mesh=mesh,
      ...                   in_specs=P("data"), out_specs=P())
      >>> jax.jit(f)(jnp.arange(4.0)).tolist()   # each replica holds one value
      [1.5]
    """
    config = _sync_config(
        axis_name, wire_dtype, codec, monitors, monitor_every, norm_chunks, codec_sample, dense_lane
    )
    update_with_sums = functools.partial(_update_with_sums, config)
    return SyncGradients(
        functools.partial(_init, config),
        functools.partial(_update, update_with_sums),
        update_with_sums,
        config.codec,
    )


@dataclasses.dataclass(frozen=True)
class _SyncConfig:
    """What :func:`sync_gradients` was built with, checked (see its arguments)."""

    axis_name: str | tuple[str, ...]
    wire_dtype: Any  # None or a jnp floating type
    codec: Any  # None or a GradientCodec
    monitors: tuple
    monitor_every: int
    norm_chunks: int
    codec_sample: float
    dense_lane: str
    # monitor i -> monitor j whose state and metrics it reads (GradientSNR next to a
    # GradientNoiseScale); such a monitor has no state of its own
    shared: Mapping[int, int]


def _sync_config(
    axis_name, wire_dtype, codec, monitors, monitor_every, norm_chunks, codec_sample, dense_lane
) -> _SyncConfig:
    """Checks :func:`sync_gradients`'s arguments (one-line errors) into a :class:`_SyncConfig`."""
    wdt = _wire_dtype(wire_dtype)
    monitors = tuple(monitors)
    if codec is not None and not isinstance(codec, GradientCodec):
        raise ValueError(
            f"codec {codec!r} does not follow adaptjax.compression.Codec's protocol "
            "(needs init and sync); "
            "build one with adaptjax.compression"
        )
    if not 0.0 < float(codec_sample) <= 1.0:
        raise ValueError(f"codec_sample must be in (0, 1], got {codec_sample}")
    if int(norm_chunks) < 1:
        raise ValueError(f"norm_chunks must be >= 1, got {norm_chunks}")
    if int(monitor_every) < 1:
        raise ValueError(f"monitor_every must be >= 1, got {monitor_every}")
    if dense_lane not in DENSE_LANES:
        raise ValueError(f"dense_lane must be one of {DENSE_LANES}, got {dense_lane!r}")
    for m in monitors:
        if not isinstance(m, GradientMonitor):
            raise ValueError(
                f"monitor {m!r} does not follow adaptjax.GradientMonitor (needs metric_names, "
                "init, local_scalars and update); see its docstring for an example"
            )
    names = [n for m in monitors for n in m.metric_names()]
    if len(set(names)) != len(names):
        raise ValueError(f"two monitors report the same metric name: {sorted(names)}")
    return _SyncConfig(
        axis_name, wdt, codec, monitors, monitor_every, norm_chunks, codec_sample, dense_lane,
        _shared_monitors(monitors),
    )


def _shared_monitors(monitors: tuple) -> dict[int, int]:
    """``{i: j}`` for each monitor ``i`` that keeps the same EMAs as monitor ``j``."""
    shared: dict[int, int] = {}
    for i, m in enumerate(monitors):
        shares = getattr(m, "shares_state_with", None)
        for j, other in enumerate(monitors):
            if shares is not None and j != i and j not in shared and shares(other):
                shared[i] = j
                break
    return shared


def _init(config: _SyncConfig, params) -> SyncState:
    """The ``init`` of :func:`sync_gradients`."""
    codec, monitors = config.codec, config.monitors
    return SyncState(
        count=jnp.zeros((), jnp.int32),
        codec_state=codec.init(params) if codec is not None else (),
        monitor_states=tuple(
            () if i in config.shared else m.init(params) for i, m in enumerate(monitors)
        ),
        metrics=Metrics.pack({k: 0.0 for m in monitors for k in m.metric_names()}),
    )


def _update(update_with_sums, updates, state, params=None, **extra):
    """The ``update`` of :func:`sync_gradients`: its ``update_with_sums``, finished."""
    out, finish, state, _ = update_with_sums(updates, state, params, **extra)
    return finish(out), state


class _Inputs(NamedTuple):
    """One update's inputs, as the monitors and the codec read them."""

    updates: Any  # this replica's gradients
    state: SyncState  # the state before this update
    params: Any
    n: int  # replicas on the axis
    k: int | jax.Array  # micro-batches (``microbatches=``); traced under adaptjax.accumulate
    micro_sq: Any  # ``micro_sqnorm=``: Σ_j ‖g_j‖² over this replica's micro-batches, or None
    local_sq: Any  # ``local_sqnorm=``: this replica's exact ‖g‖², or None
    local_batch_size: Any  # ``local_batch_size=``, or None
    measure_now: Any  # bool scalar: the monitors measure at this update
    layout: Any = None  # ``shard_layout=``: a ShardLayout on a sharded mesh, else None


class _Exchanged(NamedTuple):
    """What one update's collectives return."""

    out: Any  # dense: the gradients summed over replicas; with a codec: this replica's own
    scalars: dict  # the monitors' scalars, summed over replicas
    extra: Any  # the caller's ``extra_sums``, summed over replicas
    mean_sample: tuple | None = None  # with a codec and monitors: see GradStats.mean_sample
    sampled_mean_sq: Any = None  # with a codec and monitors: ‖Ḡ‖² estimated from mean_sample


def _update_with_sums(
    config: _SyncConfig, updates, state, params=None, extra_sums=None, *, deferred=False, **extra
):
    """``update_with_sums`` of ``SyncGradients`` (see there for what it returns)."""
    check_axes_bound(config.axis_name, f"sync_gradients({config.axis_name!r})")
    check_float_tree(updates)
    _check_per_replica(updates, config.axis_name)
    if "chain_state" in extra:  # data_parallel_step: the whole chain's state, at trace time
        _warn_pairing(config.codec, extra["chain_state"])
    k = _samples_per_replica(extra.get("microbatches"))
    inputs = _Inputs(
        updates, state, params, axis_size(config.axis_name), k,
        micro_sq=extra.get("micro_sqnorm"),
        local_sq=extra.get("local_sqnorm"),
        local_batch_size=extra.get("local_batch_size"),
        measure_now=state.count % config.monitor_every == 0,
        layout=extra.get("shard_layout"),
    )
    _check_layout(config, inputs.layout)
    scalars = _monitor_scalars(config, inputs)
    if config.codec is None:
        sums = _dense_exchange(config, inputs, scalars, extra_sums)
    else:
        sums = _codec_exchange(config, inputs, scalars, extra_sums)
    complete = functools.partial(_complete, config, inputs, sums)
    if deferred:
        return sums.out, complete, state, sums.extra
    mean, new_state = complete(sums.out)
    if config.codec is None:  # the mean is finished where the caller reads it
        return sums.out, functools.partial(_dense_mean, updates, inputs.n), new_state, sums.extra
    return mean, _identity, new_state, sums.extra


def _warn_pairing(codec, chain_state) -> None:
    """Warns with ``codec.pairing_warning``'s line about the optimizer in ``chain_state``.

    ``chain_state`` is the optimizer state of the chain this link is in (what
    :func:`adaptjax.data_parallel_step` passes): the first place that sees both
    the codec and the optimizer. It is read at trace time, so the line comes
    once per compiled step.
    """
    check = getattr(codec, "pairing_warning", None)
    line = None if check is None else check(chain_state)
    if line is not None:
        warnings.warn(line, UserWarning, stacklevel=2)


def _identity(x):
    return x


def _samples_per_replica(microbatches) -> int | jax.Array:
    """``microbatches=``: a Python int, or an int32 set at run time (``adaptjax.accumulate``)."""
    if microbatches is None or isinstance(microbatches, int | np.integer):
        return int(microbatches or 1)
    return jnp.asarray(microbatches, jnp.int32)


def _micro_samples(inputs: _Inputs) -> bool:
    """Whether the monitors' samples are the micro-batches' gradients (``micro_sqnorm=``)."""
    return inputs.micro_sq is not None and (not isinstance(inputs.k, int) or inputs.k > 1)


def _local_scalars(config: _SyncConfig, inputs: _Inputs) -> dict:
    """This replica's ‖g‖² and every monitor's local scalars, keyed for the all-reduce."""
    out = {}
    if _micro_samples(inputs):
        out[_LOCAL_SQ] = jnp.asarray(inputs.micro_sq, jnp.float32)
    elif inputs.local_sq is not None:
        out[_LOCAL_SQ] = jnp.asarray(inputs.local_sq, jnp.float32)
    else:
        out[_LOCAL_SQ] = _sq_norm(inputs, inputs.updates, config.norm_chunks)
    for i, (m, s) in enumerate(zip(config.monitors, inputs.state.monitor_states, strict=True)):
        if i in config.shared:
            continue
        for key, v in m.local_scalars(inputs.updates, s).items():
            out[f"{i}/{key}"] = jnp.asarray(v, jnp.float32)
    return out


def _monitor_scalars(config: _SyncConfig, inputs: _Inputs) -> dict:
    """:func:`_local_scalars` on a measuring update, zeros between (``monitor_every``)."""
    if not config.monitors:
        return {}
    local_scalars = functools.partial(_local_scalars, config, inputs)
    if config.monitor_every == 1:
        return local_scalars()
    shapes = jax.eval_shape(local_scalars)
    zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.lax.cond(inputs.measure_now, local_scalars, zeros)


def _dense_exchange(config: _SyncConfig, inputs: _Inputs, scalars, extra_sums) -> _Exchanged:
    """The gradients, the monitors' scalars and the caller's sums, summed over replicas.

    On a sharded mesh the collectives run on each device's shards (inside
    ``ShardLayout.local_map``): the same all-reduce over the data axis, of the
    shard each device holds. (XLA:CPU rejects a bf16 all-reduce, and one over
    a data axis of size 1, of an array the compiler shards.)
    """
    axis_name, n = config.axis_name, inputs.n
    wdt = config.wire_dtype
    wire = inputs.updates if wdt is None else jax.tree.map(lambda g: g.astype(wdt), inputs.updates)
    if config.dense_lane == "all-reduce":
        exchange = lambda w, sc, ex: _psum_leaves((w, (sc, ex)), axis_name)
    else:

        def exchange(w, sc, ex):
            return _reduce_scatter_gather(w, axis_name, n), _psum_leaves((sc, ex), axis_name)

    if inputs.layout is not None:
        specs = inputs.layout.specs_for(wire)
        exchange = inputs.layout.local_map(exchange, (specs, P(), P()), (specs, P()))
    summed, (summed_scalars, summed_extra) = exchange(wire, scalars, extra_sums)
    return _Exchanged(summed, summed_scalars, summed_extra)


def _codec_exchange(config: _SyncConfig, inputs: _Inputs, scalars, extra_sums) -> _Exchanged:
    """With a codec: the monitors' scalars and exact sample, and the caller's sums, summed.

    The gradients themselves are left to the codec, which runs in :func:`_complete`.
    On a sharded mesh the sample is drawn from each device's shards (``mean_sample``
    is then ``None``; ``sampled_mean_sq`` is summed over the shards).
    """
    updates, n = inputs.updates, inputs.n
    if not config.monitors:
        return _Exchanged(updates, {}, psum_replicas(extra_sums, config.axis_name))
    sample = functools.partial(_sampled_exchange, config, n)
    layout = inputs.layout
    if layout is None:
        summed_scalars, summed_extra, samples, sampled_mean_sq = sample(
            updates, scalars, extra_sums, inputs.state.count
        )
        return _Exchanged(updates, summed_scalars, summed_extra, samples, sampled_mean_sq)
    specs = layout.specs_for(updates)

    def local(g, sc, ex, count):
        sc, ex, _, part = sample(g, sc, ex, count, first=layout.first_of(specs))
        return sc, ex, jax.lax.psum(part, layout.axes)

    summed_scalars, summed_extra, sampled_mean_sq = layout.local_map(
        local, (specs, P(), P(), P()), (P(), P(), P())
    )(updates, scalars, extra_sums, inputs.state.count)
    return _Exchanged(updates, summed_scalars, summed_extra, None, sampled_mean_sq)


def _sampled_exchange(config: _SyncConfig, n, updates, scalars, extra_sums, count, first=None):
    """``(Σ scalars, Σ extra, samples, ‖Ḡ‖² estimate)``: exact values at shared coordinates.

    ``first`` (sharded meshes) weighs each leaf by whether this device counts it
    (a leaf replicated over a model axis is counted on that axis's first device).
    """
    coords = _sample_coordinates(updates, count, config.codec_sample)
    # Every leaf's sample in one vector: one operand of the all-reduce and
    # one weighted sum of squares (not a reduction per leaf); a leaf taken
    # whole goes as it is, not through a gather.
    local = jnp.concatenate([
        (x.reshape(-1) if scale == 1.0 else x.reshape(-1)[idx]).astype(jnp.float32)
        for x, (idx, scale) in zip(jax.tree.leaves(updates), coords, strict=True)
    ])
    summed_scalars, summed_local, summed_extra = jax.lax.psum(
        (scalars, local, extra_sums), config.axis_name
    )
    mean_local = summed_local / n
    ends = np.cumsum([idx.shape[0] for idx, _ in coords])
    samples = tuple(
        (idx, mean_local[end - idx.shape[0] : end], scale)
        for (idx, scale), end in zip(coords, ends, strict=True)
    )
    scales = [scale for _, scale in coords]
    if first is not None:
        scales = [jnp.where(f, scale, 0.0) for f, scale in zip(first, scales, strict=True)]
    weights = jnp.concatenate([
        jnp.broadcast_to(jnp.asarray(w, jnp.float32), idx.shape)
        for (idx, _), w in zip(coords, scales, strict=True)
    ])
    sampled_mean_sq = jnp.sum(weights * jnp.square(mean_local))
    return summed_scalars, summed_extra, samples, sampled_mean_sq


def _dense_mean(updates, n: int, summed):
    """The mean from the dense sums, in the gradients' dtypes."""
    return jax.tree.map(lambda s, g: (s / n).astype(g.dtype), summed, updates)


def _complete(config: _SyncConfig, inputs: _Inputs, sums: _Exchanged, out):
    """``(mean, new state)`` from ``out``: the codec (if any), then the monitors."""
    state = inputs.state
    if config.codec is None:
        mean = _dense_mean(inputs.updates, inputs.n, out)  # traced only if a monitor reads it
        codec_state = ()
    else:
        mean, codec_state = codec_sync(
            config.codec, out, state.codec_state, axis_name=config.axis_name, step=state.count,
            layout=inputs.layout,
        )
    if not config.monitors:
        return mean, SyncState(state.count + 1, codec_state, (), state.metrics)
    if config.monitor_every == 1:
        monitor_states, metrics = _measure(config, inputs, sums, state.monitor_states, mean)
    else:
        monitor_states, metrics = jax.lax.cond(
            inputs.measure_now,
            lambda s: _measure(config, inputs, sums, s, mean),
            lambda s: (s, state.metrics),
            state.monitor_states,
        )
    return mean, SyncState(state.count + 1, codec_state, monitor_states, metrics)


def _measure(config: _SyncConfig, inputs: _Inputs, sums: _Exchanged, monitor_states, mean):
    """Every monitor's update: ``(new monitor states, metrics)``."""
    n, monitors, shared = inputs.n, config.monitors, config.shared
    stats = GradStats(
        local_grads=inputs.updates,
        mean_grads=mean,
        local_sq=sums.scalars[_LOCAL_SQ],
        # Without a codec ‖Ḡ‖² comes from the sums (`out`), scaled: read where
        # the all-reduce left them, the division by n stays fused into the
        # optimizer's one read of the mean.
        mean_sq=(
            _sq_norm(inputs, sums.out, config.norm_chunks) / n**2
            if sums.sampled_mean_sq is None
            else sums.sampled_mean_sq
        ),
        n_replicas=n,
        samples_per_replica=inputs.k if _micro_samples(inputs) else 1,
        local_batch_size=inputs.local_batch_size,
        summed={},
        mean_sample=sums.mean_sample,
    )
    new_states, values = list(monitor_states), {}
    for i, (m, s) in enumerate(zip(monitors, monitor_states, strict=True)):
        if i in shared:
            continue
        own = {
            key.split("/", 1)[1]: v for key, v in sums.scalars.items() if key.startswith(f"{i}/")
        }
        new_states[i], values[i] = m.update(stats._replace(summed=own), s, params=inputs.params)
    for i, j in shared.items():
        values[i] = monitors[i].from_shared(values[j], stats)
    metrics = {k: v for i in range(len(monitors)) for k, v in values[i].items()}
    # in the state's order: the cond's two branches must agree on the structure
    return tuple(new_states), Metrics.pack({k: metrics[k] for k in inputs.state.metrics})


def noise_scale(
    axis_name: str | tuple[str, ...] = "data",
    *,
    wire_dtype: DTypeLike | None = None,
    codec: GradientCodec | None = None,
    **monitor_kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
    """Sync plus :class:`adaptjax.GradientNoiseScale` in one transformation.

    Args:
      axis_name: the data-parallel mesh axis.
      wire_dtype: see :func:`sync_gradients`.
      codec: see :func:`sync_gradients`.
      **monitor_kwargs: passed to :class:`adaptjax.GradientNoiseScale`.

    Returns:
      The sync transformation with a noise-scale monitor.

    Example:
      >>> import optax, adaptjax
      >>> tx = optax.chain(adaptjax.noise_scale("data", decay=0.9), optax.sgd(0.1))
    """
    return sync_gradients(
        axis_name,
        wire_dtype=wire_dtype,
        codec=codec,
        monitors=(GradientNoiseScale(**monitor_kwargs),),
    )
