"""The gradient synchronisation transformation: one collective, monitors on top."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adaptjax._codec import GradientCodec
from adaptjax._hash import hash32
from adaptjax._metric_vector import Metrics
from adaptjax._monitors import GradientMonitor, GradientNoiseScale, GradStats
from adaptjax._tree import axis_size, check_float_tree, tree_sq_norm_sampled

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
    return jax.tree.unflatten(treedef, [jax.lax.psum(x, axis_name) for x in leaves])


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
    :func:`adaptjax.data_parallel_step` uses it (through :func:`adaptjax.chain`)
    for the non-finite guard's two scalars, so guarding a step adds no
    collective.

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

    def __new__(cls, init, update, update_with_sums=None):
        self = super().__new__(cls, init, update)
        self.update_with_sums = update_with_sums
        return self


def sync_gradients(
    axis_name: str | tuple[str, ...] = "data",
    *,
    wire_dtype=None,
    codec=None,
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
      codec: a :class:`adaptjax.GradientCodec` (see ``adaptjax.compression``);
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
        :func:`adaptjax.tree_sq_norm_sampled`); 1 reads everything. Those two
        norm passes are where monitoring's time goes: XLA fuses neither into
        the backward pass nor into the all-reduce, so exact norms read every
        gradient twice more (+20–36% of a plain step for a 2M-parameter MLP
        at 32 samples per device on 8 simulated CPU devices). The default 32
        cuts that to about 1/32 of it, within the measurement noise of a
        plain step (``benchmarks/monitor_overhead.py`` shows both settings).
        The variance it adds is small against the estimator's own: there,
        after the EMA (decay 0.95), the chunked noise scale differs from the
        exact one at the same step by about 0.5% (relative std; 0.3–0.5% at
        16 chunks, 1.7–2.4% at 64), while the exact estimate itself moves by
        27–34% from step to step.

    Returns:
      A :class:`SyncGradients` (an ``optax.GradientTransformationExtraArgs``);
      its state is a :class:`SyncState`.

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
    wdt = _wire_dtype(wire_dtype)
    monitors = tuple(monitors)
    if codec is not None and not isinstance(codec, GradientCodec):
        raise ValueError(
            f"codec {codec!r} does not follow adaptjax.GradientCodec (needs init and sync); "
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

    # A monitor that keeps the same EMAs as another (GradientSNR next to a
    # GradientNoiseScale) has no state of its own and reads the other's metrics.
    shared = {}
    for i, m in enumerate(monitors):
        shares = getattr(m, "shares_state_with", None)
        for j, other in enumerate(monitors):
            if shares is not None and j != i and j not in shared and shares(other):
                shared[i] = j
                break

    def init_fn(params):
        return SyncState(
            count=jnp.zeros((), jnp.int32),
            codec_state=codec.init(params) if codec is not None else (),
            monitor_states=tuple(
                () if i in shared else m.init(params) for i, m in enumerate(monitors)
            ),
            metrics=Metrics.pack({k: 0.0 for m in monitors for k in m.metric_names()}),
        )

    def update_with_sums(updates, state, params=None, extra_sums=None, *, deferred=False, **extra):
        check_float_tree(updates)
        _check_per_replica(updates, axis_name)
        n = axis_size(axis_name)
        k = int(extra.get("microbatches", 1) or 1)
        micro_sq = extra.get("micro_sqnorm")
        local_sq = extra.get("local_sqnorm")
        measure_now = state.count % monitor_every == 0

        def local_scalars():
            out = {}
            if micro_sq is not None and k > 1:
                out[_LOCAL_SQ] = jnp.asarray(micro_sq, jnp.float32)
            elif local_sq is not None:
                out[_LOCAL_SQ] = jnp.asarray(local_sq, jnp.float32)
            else:
                out[_LOCAL_SQ] = tree_sq_norm_sampled(updates, state.count, norm_chunks)
            for i, (m, s) in enumerate(zip(monitors, state.monitor_states, strict=True)):
                if i in shared:
                    continue
                for key, v in m.local_scalars(updates, s).items():
                    out[f"{i}/{key}"] = jnp.asarray(v, jnp.float32)
            return out

        if monitors:
            if monitor_every == 1:
                scalars = local_scalars()
            else:
                shapes = jax.eval_shape(local_scalars)
                zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
                scalars = jax.lax.cond(measure_now, local_scalars, zeros)
        else:
            scalars = {}

        samples, sampled_mean_sq = None, None
        if codec is None:
            wire = updates if wdt is None else jax.tree.map(lambda g: g.astype(wdt), updates)
            if dense_lane == "all-reduce":
                summed, (summed_scalars, summed_extra) = _psum_leaves(
                    (wire, (scalars, extra_sums)), axis_name
                )
            else:
                summed = _reduce_scatter_gather(wire, axis_name, n)
                summed_scalars, summed_extra = _psum_leaves((scalars, extra_sums), axis_name)
            out = summed
        else:
            if monitors:
                coords = _sample_coordinates(updates, state.count, codec_sample)
                # Every leaf's sample in one vector: one operand of the all-reduce and
                # one weighted sum of squares (not a reduction per leaf); a leaf taken
                # whole goes as it is, not through a gather.
                local = jnp.concatenate([
                    (x.reshape(-1) if scale == 1.0 else x.reshape(-1)[idx]).astype(jnp.float32)
                    for x, (idx, scale) in zip(jax.tree.leaves(updates), coords, strict=True)
                ])
                summed_scalars, summed_local, summed_extra = jax.lax.psum(
                    (scalars, local, extra_sums), axis_name
                )
                mean_local = summed_local / n
                ends = np.cumsum([idx.shape[0] for idx, _ in coords])
                samples = tuple(
                    (idx, mean_local[end - idx.shape[0] : end], scale)
                    for (idx, scale), end in zip(coords, ends, strict=True)
                )
                weights = jnp.concatenate(
                    [jnp.full(idx.shape, scale, jnp.float32) for idx, scale in coords]
                )
                sampled_mean_sq = jnp.sum(weights * jnp.square(mean_local))
            else:
                summed_scalars = {}
                summed_extra = jax.lax.psum(extra_sums, axis_name)
            out = updates  # the codec runs in `complete`

        def measure(monitor_states, mean):
            stats = GradStats(
                local_grads=updates,
                mean_grads=mean,
                local_sq=summed_scalars[_LOCAL_SQ],
                # Without a codec ‖Ḡ‖² comes from the sums (`out`), scaled: read where
                # the all-reduce left them, the division by n stays fused into the
                # optimizer's one read of the mean.
                mean_sq=(
                    tree_sq_norm_sampled(out, state.count, norm_chunks) / n**2
                    if samples is None
                    else sampled_mean_sq
                ),
                n_replicas=n,
                samples_per_replica=k if (micro_sq is not None and k > 1) else 1,
                local_batch_size=extra.get("local_batch_size"),
                summed={},
                mean_sample=samples,
            )
            new_states, values = list(monitor_states), {}
            for i, (m, s) in enumerate(zip(monitors, monitor_states, strict=True)):
                if i in shared:
                    continue
                own = {
                    key.split("/", 1)[1]: v
                    for key, v in summed_scalars.items()
                    if key.startswith(f"{i}/")
                }
                new_states[i], values[i] = m.update(stats._replace(summed=own), s, params=params)
            for i, j in shared.items():
                values[i] = monitors[i].from_shared(values[j], stats)
            metrics = {k: v for i in range(len(monitors)) for k, v in values[i].items()}
            # in the state's order: the cond's two branches must agree on the structure
            return tuple(new_states), Metrics.pack({k: metrics[k] for k in state.metrics})

        def dense_mean(summed):
            return jax.tree.map(lambda s, g: (s / n).astype(g.dtype), summed, updates)

        def complete(out):
            """``(mean, new state)`` from ``out``: the codec (if any), then the monitors."""
            if codec is None:
                mean = dense_mean(out)  # traced into the monitors only if one reads it
                codec_state = ()
            else:
                mean, codec_state = codec.sync(
                    out, state.codec_state, axis_name=axis_name, step=state.count
                )
            if not monitors:
                return mean, SyncState(state.count + 1, codec_state, (), state.metrics)
            if monitor_every == 1:
                monitor_states, metrics = measure(state.monitor_states, mean)
            else:
                monitor_states, metrics = jax.lax.cond(
                    measure_now,
                    lambda s: measure(s, mean),
                    lambda s: (s, state.metrics),
                    state.monitor_states,
                )
            return mean, SyncState(state.count + 1, codec_state, monitor_states, metrics)

        if deferred:
            return out, complete, state, summed_extra
        mean, new_state = complete(out)
        if codec is None:  # the mean is finished where the caller reads it
            return out, dense_mean, new_state, summed_extra
        return mean, lambda mean: mean, new_state, summed_extra

    def update_fn(updates, state, params=None, **extra):
        out, finish, state, _ = update_with_sums(updates, state, params, **extra)
        return finish(out), state

    return SyncGradients(init_fn, update_fn, update_with_sums)


def noise_scale(
    axis_name: str | tuple[str, ...] = "data", *, wire_dtype=None, codec=None, **monitor_kwargs
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
