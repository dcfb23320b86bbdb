"""The codec base class: a GradientCodec, an optax transformation, and a plan.

Every codec of :mod:`adaptjax.compression` is a frozen dataclass (hashable, so
a policy can hold it and a compiled step can be cached on it) that works two
ways:

* as ``codec=`` of :func:`adaptjax.sync_gradients` (it follows
  :class:`adaptjax.GradientCodec`: ``init(params)`` and
  ``sync(grads, state, *, axis_name, step)``), and
* as an optax transformation on its own: ``init(params)`` and
  ``update(grads, state, params=None)`` inside ``shard_map`` with
  ``axis_name`` bound (``optax.chain(adaptjax.compression.topk(0.01), optax.sgd(0.1))``).

Per leaf, the codec decides at trace time (see :func:`adaptjax.compression.plan`):
leaves under ``min_size`` elements travel in one float32 psum; leaves the codec
cannot compress (a 1-D leaf for PowerSGD) or where it would send more bytes than
a bf16 psum at this replica count go as bf16 through the owner-compute pattern;
the rest go through the codec.

Error feedback (``error_feedback=``):

* ``"ef14"`` (Seide et al. 2014; Karimireddy et al. 2019): each replica sends
  ``C(g + e)`` and keeps ``e ← g + e − C(g + e)``. Over ``T`` steps the sum of
  what was applied plus the residual equals the sum of the gradients:
  ``Σ_t out_t + mean_i(e_i,T) + e_server,T = Σ_t mean_i(g_i,t)``.
* ``"ef21"`` (Richtárik et al. 2021): each replica keeps ``g_i``, sends
  ``C(∇_i − g_i)`` and sets ``g_i ← g_i + C(∇_i − g_i)``; the output is the
  replicated estimate ``ĝ ← ĝ + mean(C(∇_i − g_i))``, and
  ``ĝ + e_server = mean_i(g_i)`` holds at every step.

Per-replica state lives in :class:`adaptjax.PerReplica` (the worker buffers
with merge rule ``"mean"``, which keeps the debt ``mean_i(e_i)`` owed to the
averaged gradient when the replica count changes) inside the optax state, so it
is checkpointed with everything else and never reset on a restore.
Owner-compute codecs fold the owner's re-encoding error into its own worker
residual (``N`` times it, on the chunk it owns), so ``mean_i(e_i)`` is the whole
debt and ``e_server`` is 0 (:class:`SumToAll` remains the merge rule for a codec
that keeps a separate server buffer, ``has_server_buffer = True``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from adaptjax.compression._bits import mix_seed
from adaptjax.compression._collectives import (
    BF16,
    axis_tuple,
    bound_size,
    owner_compute_leaves,
    psum_mean_leaves,
    replica_index,
)
from adaptjax.compression._feedback import NoFeedback, feedback_for
from adaptjax.compression._layout import bf16_bytes, prod
from adaptjax.compression._plan import Plan, plan

from adaptjax import PerReplica

_EF_MODES = (None, "ef14", "ef21")


class CompressionState(NamedTuple):
    """State of a codec (the local view, as ``update``/``sync`` see it).

    Attributes:
      count: int32 number of updates so far (keys and warm-ups of the optax form).
      worker: :class:`adaptjax.PerReplica` (merge ``"mean"``) of a dict of
        per-leaf buffers shaped like the parameters (``None`` for leaves without
        state): ``"ef"`` (EF14 residual), ``"g"`` (EF21 estimate) or DGC's ``"u"``
        and ``"v"``; ``()`` when the codec keeps none.
      server: :class:`adaptjax.PerReplica` (merge :class:`SumToAll`) of
        ``{"ef": ...}``, the server-side residual of the chunk this replica
        owns (owner-compute codecs with error feedback), else ``()``.
      shared: replicated per-leaf buffers (PowerSGD's ``"p"``/``"q"`` factors,
        EF21's ``"ghat"``), else ``()``.
    """

    count: jax.Array
    worker: Any
    server: Any
    shared: Any


@dataclasses.dataclass(frozen=True)
class SumToAll:
    """Merge rule of server-side error buffers: every new replica gets the sum.

    A server buffer is non-zero only on the chunk its replica owns, so the sum
    over old replicas is the whole server debt; each new replica reads the
    chunk it owns under the new replica count and zeroes the rest on its next
    step. The total debt is kept exactly.

    Example:
      >>> import numpy as np
      >>> SumToAll()(np.array([[1.0, 0.0], [0.0, 2.0]]), 3).tolist()
      [[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]
    """

    def __call__(self, old: np.ndarray, m: int) -> np.ndarray:
        total = np.asarray(old).sum(axis=0, dtype=np.float64).astype(old.dtype)
        return np.ascontiguousarray(np.broadcast_to(total, (m, *total.shape)))


def _ef_mode(value) -> str | None:
    if value is True:
        return "ef14"
    if value is False or value is None:
        return None
    if value in _EF_MODES:
        return value
    raise ValueError(
        f"error_feedback must be None, 'ef14' or 'ef21' (True means 'ef14'), got {value!r}"
    )


def _check_axis_name(axis_name):
    names = axis_tuple(axis_name)
    if not names or not all(isinstance(a, str) and a for a in names):
        raise ValueError(f"axis_name must be a str or a tuple of str, got {axis_name!r}")
    return axis_name if isinstance(axis_name, str) else tuple(axis_name)


def check_float_leaves(paths, leaves, what="gradients") -> None:
    for path, x in zip(paths, leaves, strict=True):
        dtype = jnp.result_type(x)
        if not jnp.issubdtype(dtype, jnp.floating):
            where = jax.tree_util.keystr(path) or "the root"
            raise ValueError(
                f"compression needs floating-point {what}, got {dtype} at {where}; "
                "cast integer parameters to float32 or keep them out of the optimizer"
            )


def positive_ratio(ratio, what="ratio") -> float:
    try:
        r = float(ratio)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number in (0, 1], got {ratio!r}") from None
    if not 0.0 < r <= 1.0:
        raise ValueError(f"{what} must be in (0, 1], got {ratio}; e.g. 0.01 keeps 1%")
    return r


def k_of(ratio: float, size: int) -> int:
    """Elements kept of ``size`` at ``ratio``: ``max(1, ceil(ratio * size))``."""
    return max(1, int(np.ceil(round(ratio * size, 6))))


@dataclasses.dataclass
class Ctx:
    """What one ``sync`` call knows at trace time (and a few traced scalars)."""

    names: tuple[str, ...]
    n: int
    step: jax.Array
    replica: jax.Array
    residual: bool
    seed: int

    def seed_for(self, stage: int, shared: bool = False):
        if shared:
            return mix_seed(self.seed, self.step, 0x5EED, stage)
        return mix_seed(self.seed, self.step, self.replica, stage)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Codec:
    """Base class of the codecs (see the module docstring).

    Attributes:
      axis_name: the data-parallel axis (or tuple of axes) of the optax form;
        ``sync`` uses the ``axis_name`` it is given.
      error_feedback: ``None``, ``"ef14"`` or ``"ef21"``.
      min_size: leaves with fewer elements go densely in one float32 psum.
      seed: seed of the codec's random numbers (combined with the step and,
        for per-replica randomness, the replica index).

    Class attributes (the flags of the codec protocol):
      name: short name used in plans and benchmarks.
      linear: whether payloads add up (psum-able).
      randomness: ``"none"``, ``"shared"`` (same on every replica, e.g. random-k
        indices) or ``"per_replica"`` (stochastic rounding).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, adaptjax
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from adaptjax import compression as ajc
      >>> codec = ajc.bf16(min_size=4)
      >>> state = codec.init({"w": jnp.zeros(64)})
      >>> mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
      >>> f = jax.shard_map(lambda g: codec.sync({"w": g}, state)[0]["w"], mesh=mesh,
      ...                   in_specs=P("data"), out_specs=P())
      >>> jax.jit(f)(jnp.repeat(jnp.arange(4.0), 64))[:3].tolist()   # mean of 0..3
      [1.5, 1.5, 1.5]
    """

    axis_name: str | tuple[str, ...] = "data"
    error_feedback: str | None = None
    min_size: int = 1024
    seed: int = 0

    name: ClassVar[str] = "codec"
    linear: ClassVar[bool] = False
    randomness: ClassVar[str] = "none"
    has_server_buffer: ClassVar[bool] = False

    def __post_init__(self):
        object.__setattr__(self, "axis_name", _check_axis_name(self.axis_name))
        object.__setattr__(self, "error_feedback", _ef_mode(self.error_feedback))
        if int(self.min_size) != self.min_size or self.min_size < 1:
            raise ValueError(f"min_size must be an integer >= 1, got {self.min_size}")
        object.__setattr__(self, "min_size", int(self.min_size))
        object.__setattr__(self, "seed", int(self.seed))

    # ------------------------------------------------------------------ flags
    @property
    def bits(self) -> float | None:
        """Bits per element on the wire (``None`` when it depends on the shape)."""
        return None

    # --------------------------------------------------------- per-leaf plan
    def can_compress(self, shape) -> bool:
        """Whether the codec can compress a leaf of this shape at all."""
        del shape
        return True

    def check_leaf(self, shape, where: str) -> None:
        """Raises a one-line ValueError when a compressed leaf is invalid for this codec."""
        del shape, where

    def leaf_bytes(self, shape, n: int) -> float:
        """Bytes per device this codec sends for one leaf at ``n`` replicas."""
        raise NotImplementedError

    def method(self, shape, n: int) -> str:
        """``"f32"``, ``"bf16"`` or ``"codec"`` for a leaf of ``shape`` at ``n`` replicas."""
        size = prod(shape)
        if size < self.min_size:
            return "f32"
        if not self.can_compress(shape):
            return "bf16"
        if n > 1 and self.leaf_bytes(shape, n) > bf16_bytes(size, n):
            return "bf16"
        return "codec"

    def stateful(self, shape) -> bool:
        return prod(shape) >= self.min_size

    # ------------------------------------------------------------------ state
    def _shared_init(self, paths, leaves) -> dict:
        """Replicated per-leaf buffers (a dict of lists, ``None`` where unused)."""
        del paths, leaves
        return {}

    def init(self, params) -> CompressionState:
        """The codec state for ``params`` (local view: one replica's buffers)."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        paths = [p for p, _ in flat]
        leaves = [x for _, x in flat]
        check_float_leaves(paths, leaves, "parameters")
        for p, x in zip(paths, leaves, strict=True):
            if self.stateful(jnp.shape(x)) and self.can_compress(jnp.shape(x)):
                self.check_leaf(jnp.shape(x), jax.tree_util.keystr(p) or "the root")
        zeros = [
            jnp.zeros(jnp.shape(x), jnp.float32) if self.stateful(jnp.shape(x)) else None
            for x in leaves
        ]
        unflat = lambda lst: jax.tree_util.tree_unflatten(treedef, lst)
        fb = self.feedback
        worker = {k: unflat(list(zeros)) for k in fb.keys}
        server = ()
        if self.has_server_buffer and self.error_feedback is not None:
            server = PerReplica({"ef": unflat(list(zeros))}, merge=SumToAll())
        shared = {k: unflat(v) for k, v in self._shared_init(paths, leaves).items()}
        for k in fb.shared_keys:
            shared[k] = unflat(list(zeros))
        return CompressionState(
            count=jnp.zeros((), jnp.int32),
            worker=PerReplica(worker) if worker else (),
            server=server,
            shared=shared if shared else (),
        )

    # ------------------------------------------------------------ optax form
    def update(self, updates, state: CompressionState, params=None, **extra):
        """Optax ``update``: the compressed mean of ``updates`` over ``axis_name``."""
        del params, extra
        return self.sync(updates, state, axis_name=self.axis_name, step=state.count)

    def __iter__(self):
        """``init, update = codec`` like an ``optax.GradientTransformation``."""
        return iter((self.init, self.update))

    # ------------------------------------------------------------------ sync
    def sync(self, grads, state: CompressionState, *, axis_name=None, step=None):
        """The compressed all-reduce-mean of ``grads`` (inside ``shard_map``).

        Args:
          grads: this replica's gradients.
          state: the codec state (local view).
          axis_name: the bound axis (or tuple of axes); defaults to ``self.axis_name``.
          step: int32 step counter (keys and warm-ups); defaults to ``state.count``.

        Returns:
          ``(mean, new_state)``; ``mean`` is identical on every replica.
        """
        axis = self.axis_name if axis_name is None else _check_axis_name(axis_name)
        names = axis_tuple(axis)
        n = bound_size(names)
        self._check_axes(names)
        step = state.count if step is None else jnp.asarray(step, jnp.int32)
        flat, treedef = jax.tree_util.tree_flatten_with_path(grads)
        paths = [p for p, _ in flat]
        leaves = [x for _, x in flat]
        check_float_leaves(paths, leaves)
        shapes = [tuple(jnp.shape(x)) for x in leaves]
        for p, s in zip(paths, shapes, strict=True):
            if self.stateful(s) and self.can_compress(s):
                self.check_leaf(s, jax.tree_util.keystr(p) or "the root")
        methods = [self.method(s, n) for s in shapes]
        stateful = [self.stateful(s) for s in shapes]
        ctx = Ctx(names, n, step, replica_index(names, n), self.feedback.residual, self.seed)

        def up_to(tree):
            try:
                return treedef.flatten_up_to(tree)
            except (ValueError, TypeError):
                raise ValueError(
                    "the gradients do not have the structure of the params the codec state was "
                    "built from; call codec.init(params) with params shaped like the gradients"
                ) from None

        worker = {k: up_to(v) for k, v in state.worker.value.items()} if state.worker else {}
        server = up_to(state.server.value["ef"]) if state.server else None
        shared = {k: up_to(v) for k, v in state.shared.items()} if state.shared else {}
        grads32 = [x.astype(jnp.float32) for x in leaves]
        fb = self.feedback

        # what each replica compresses: the feedback rule's input on leaves with state
        prep = fb.prepare([g for g, s in zip(grads32, stateful, strict=True) if s], ctx)
        xs, carry = [], []
        for i, (g, s) in enumerate(zip(grads32, stateful, strict=True)):
            x, c = fb.inputs(g, {k: v[i] for k, v in worker.items()}, prep) if s else (g, None)
            xs.append(x)
            carry.append(c)

        # each lane once, on its leaves
        outs: list = [None] * len(leaves)
        res: list = [None] * len(leaves)
        new_server = list(server) if server is not None else None
        new_shared = {k: list(v) for k, v in shared.items()}
        for lane in ("f32", "bf16", "codec"):
            idx = [i for i, m in enumerate(methods) if m == lane]
            if not idx:
                continue
            o, r, srv, shr = getattr(self, f"_{lane}_lane")(
                [xs[i] for i in idx],
                [shapes[i] for i in idx],
                ctx,
                [server[i] for i in idx] if server is not None else None,
                {k: [v[i] for i in idx] for k, v in shared.items()},
            )
            for j, i in enumerate(idx):
                outs[i] = o[j]
                if r is not None:
                    res[i] = r[j]
                if srv is not None:
                    new_server[i] = srv[j]
                for k, v in shr.items():
                    new_shared[k][i] = v[j]

        # new buffers and outputs: the feedback rule's, on leaves with state
        new_worker = {k: [None] * len(leaves) for k in worker}
        for i, s in enumerate(stateful):
            if not s:
                continue
            bufs, shr, outs[i] = fb.outputs(
                grads32[i],
                xs[i],
                outs[i],
                res[i],
                {k: v[i] for k, v in worker.items()},
                {k: v[i] for k, v in new_shared.items()},
                carry[i],
                methods[i],
            )
            for k, v in bufs.items():
                new_worker[k][i] = v
            for k, v in shr.items():
                new_shared[k][i] = v

        unflat = lambda lst: jax.tree_util.tree_unflatten(treedef, lst)
        mean = unflat([o.astype(x.dtype) for o, x in zip(outs, leaves, strict=True)])
        new_state = CompressionState(
            count=state.count + 1,
            worker=PerReplica({k: unflat(v) for k, v in new_worker.items()}, state.worker.merge)
            if state.worker
            else (),
            server=PerReplica({"ef": unflat(new_server)}, state.server.merge)
            if state.server
            else (),
            shared={k: unflat(v) for k, v in new_shared.items()} if state.shared else (),
        )
        return mean, new_state

    # ---------------------------------------------------------------- lanes
    @property
    def feedback(self) -> NoFeedback:
        """The error-feedback rule (a strategy of :mod:`adaptjax.compression._feedback`)."""
        return feedback_for(self.error_feedback)

    def _f32_lane(self, xs, shapes, ctx, server, shared):
        """Leaves under ``min_size``: one float32 psum, nothing owed."""
        del shapes, server, shared
        return psum_mean_leaves(xs, ctx.names, ctx.n), None, None, {}

    def _bf16_lane(self, xs, shapes, ctx, server, shared):
        """Leaves the codec does not take: bf16 owner-compute (see ``owner_compute_leaves``)."""
        del shapes, server, shared
        o, r = owner_compute_leaves(
            xs,
            BF16,
            names=ctx.names,
            n=ctx.n,
            seed_worker=ctx.seed_for(7),
            seed_server=ctx.seed_for(8),
            residual=ctx.residual,
            fold=ctx.residual,
        )
        return o, (r if ctx.residual else None), None, {}

    def _codec_lane(self, xs, shapes, ctx, server, shared):
        """The codec's own leaves."""
        return self._reduce(xs, shapes, ctx, server, shared)

    # ---------------------------------------------------------------- hooks
    def _check_axes(self, names) -> None:
        del names

    def _reduce(self, xs, shapes, ctx, server, shared):
        """Compressed mean of the codec's leaves.

        Returns ``(outs, residuals or None, new server leaves or None, new shared
        dict of lists)``; residuals are what each replica still owes (see
        :func:`adaptjax.compression._collectives.owner_compute`).
        """
        raise NotImplementedError

    # ------------------------------------------------------------ protocol
    def encode(self, x, *, seed=0):
        """One array to this codec's fixed-size payload pytree (pure, jittable)."""
        raise NotImplementedError

    def decode(self, payload, shape, *, seed=0):
        """Inverse of :meth:`encode` (up to the codec's loss): a float32 array."""
        raise NotImplementedError

    def plan(self, grads, n: int, *, show: bool = False) -> Plan:
        """The per-leaf plan at ``n`` replicas; see :func:`adaptjax.compression.plan`."""
        return plan(grads, self, n, show=show)
