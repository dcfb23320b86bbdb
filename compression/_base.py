"""The codec base class: a GradientCodec, an optax transformation, and a plan.

Every codec of :mod:`adaptjax.compression` is a frozen dataclass (hashable, so
a policy can hold it and a compiled step can be cached on it) that works two
ways:

* as ``codec=`` of :func:`adaptjax.sync_gradients` (its protocol:
  ``init(params)`` and
  ``sync(grads, state, *, axis_name, step)``), and
* as an optax transformation on its own: ``init(params)`` and
  ``update(grads, state, params=None)`` inside ``shard_map`` with
  ``axis_name`` bound (``optax.chain(adaptjax.compression.topk(0.01), optax.sgd(0.1))``).

Its ``repr`` is the factory call that builds it (``onebit(block=256)``, see
:func:`factory`), which is also its key in a run's configuration.

Per leaf, the codec decides at trace time which lane the leaf takes (a
:class:`Leaf` record per leaf, see :func:`adaptjax.compression.plan` and
:mod:`adaptjax.compression._lanes`): leaves under ``min_size`` elements travel
in one float32 psum; leaves the codec cannot compress (a 1-D leaf for PowerSGD)
or where it would send more bytes than a bf16 psum at this replica count go as
bf16 blocks; the rest go through the codec's :meth:`Codec.reduce`. Each lane's
leaves are grouped into buckets of at most ``bucket_bytes`` bytes of float32
gradient, in reverse leaf order (the order the backward pass produces them),
and each bucket is one exchange that reads only its own gradients, so the
compiler can start it while the backward pass still runs (CaSync); a lane
returns one record per leaf (mean, residual, new buffers). What a leaf's
replicas receive does not depend on its bucket.

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
with the codec's merge rule :attr:`Codec.state_merge`, by default ``"mean"``,
which keeps the debt ``mean_i(e_i)`` owed to the averaged gradient when the
replica count changes) inside the optax state, so it is checkpointed with
everything else and never reset on a restore.
Owner-compute codecs fold the owner's re-encoding error into its own worker
residual (``N`` times it, on the chunk it owns), so ``mean_i(e_i)`` is the whole
debt and ``e_server`` is 0 (:class:`SumToAll` remains the merge rule for a codec
that keeps a separate server buffer, ``has_server_buffer = True``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from adaptjax.compression._bits import mix_seed
from adaptjax.compression._collectives import axis_tuple, bound_size, replica_index, replicated
from adaptjax.compression._feedback import NoFeedback, feedback_for
from adaptjax.compression._lanes import Ctx, Leaf, LeafIn, LeafOut, run_lanes
from adaptjax.compression._layout import bf16_bytes, prod
from adaptjax.compression._pairing import pairing_warning
from adaptjax.compression._plan import Plan, leaf_plan, plan, warn_if_nothing_compressed

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


def check_bucket_bytes(value):
    """``bucket_bytes`` checked: None or a positive multiple of 4 (one-line ValueError)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or (
        value < 4 or int(value) % 4
    ):
        raise ValueError(
            f"bucket_bytes must be None or a positive multiple of 4 (bytes of float32 gradient "
            f"per exchange), got {value!r}; e.g. 4 << 20"
        )
    return int(value)


def k_of(ratio: float, size: int) -> int:
    """Elements kept of ``size`` at ``ratio``: ``max(1, ceil(ratio * size))``."""
    return max(1, int(np.ceil(round(ratio * size, 6))))


class LeafState(NamedTuple):
    """The buffers a :class:`CompressionState` holds for one leaf.

    Attributes:
      worker: per-replica buffers by key (``"ef"``, ``"g"``, ``"u"``, ``"v"``);
        ``None`` values on leaves without state.
      server: the server-side residual, or None.
      shared: replicated buffers by key (``"p"``, ``"q"``, ``"ghat"``).
    """

    worker: dict[str, Any]
    server: Any
    shared: dict[str, Any]


def _leaf_states(state: CompressionState, treedef) -> list[LeafState]:
    """``state``'s buffers, leaf by leaf, for gradients of structure ``treedef``."""

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
    return [
        LeafState(
            {k: v[i] for k, v in worker.items()},
            None if server is None else server[i],
            {k: v[i] for k, v in shared.items()},
        )
        for i in range(treedef.num_leaves)
    ]


def _next_state(state: CompressionState, treedef, leaves: Sequence[LeafState]):
    """The :class:`CompressionState` after ``state`` that holds ``leaves``' buffers."""

    def tree(buffer_of):
        return jax.tree_util.tree_unflatten(treedef, [buffer_of(b) for b in leaves])

    worker, server = state.worker, state.server
    return CompressionState(
        count=state.count + 1,
        worker=PerReplica({k: tree(lambda b, k=k: b.worker[k]) for k in worker.value},
                          worker.merge) if worker else (),
        server=PerReplica({"ef": tree(lambda b: b.server)}, server.merge) if server else (),
        shared={k: tree(lambda b, k=k: b.shared[k]) for k in state.shared} if state.shared else (),
    )


# (codec class, factory name) -> the factory's signature: what a codec's repr prints
_FACTORIES: dict[tuple[type, str], inspect.Signature] = {}

F = TypeVar("F", bound=Callable[..., Any])


def factory(cls: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers the decorated function as a factory of the codec class ``cls``.

    A codec's ``repr`` is the call of the factory named ``codec.name`` that a
    user would type: the leading positional argument, then the keyword
    arguments that differ from the factory's defaults (``onebit(block=256)``,
    ``topk(0.01)``). A codec class without a factory prints as its class call
    (``MyCodec(bits=4)``). Each parameter of the factory must be a field of
    ``cls``, so codecs that differ in any argument print differently and
    ``eval`` of the ``repr`` builds an equal codec.

    Example:
      >>> from adaptjax import compression as ajc
      >>> ajc.onebit(block=256, error_feedback="ef21"), ajc.topk(0.01)
      (onebit(block=256, error_feedback='ef21'), topk(0.01))
    """

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = [name for name in sig.parameters if name not in fields]
        if unknown:
            raise TypeError(f"parameters {unknown} of {fn.__name__} are not fields of {cls}")
        _FACTORIES[(cls, fn.__name__)] = sig
        return fn

    return register


@functools.cache
def _class_signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls)


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # arrays
        return False


def _call_repr(name: str, sig: inspect.Signature, codec) -> str:
    """``name(...)`` with ``codec``'s values of ``sig``'s positional and non-default arguments."""
    args = []
    for p in sig.parameters.values():
        value = getattr(codec, p.name)
        if p.kind is p.POSITIONAL_OR_KEYWORD:
            args.append(repr(value))
        elif p.default is p.empty or not _same(value, p.default):
            args.append(f"{p.name}={value!r}")
    return f"{name}({', '.join(args)})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Codec:
    """Base class of the codecs (see the module docstring).

    Attributes:
      axis_name: the data-parallel axis (or tuple of axes) of the optax form;
        ``sync`` uses the ``axis_name`` it is given.
      error_feedback: ``None``, ``"ef14"`` or ``"ef21"``.
      min_size: leaves with fewer elements go densely in one float32 psum.
      seed: seed of the codec's random numbers (combined with the step,
        the leaf and, for per-replica randomness, the replica index).
      bucket_bytes: ``None`` (each lane in one exchange) or the most bytes of
        float32 gradient (4 per element) one exchange carries: each lane's
        leaves, in reverse leaf order, are fused into buckets of at most this
        size (a larger leaf alone), each its own exchange, so that the first
        can travel while the backward pass computes the rest. The results
        are the same (to float32 rounding) for every ``bucket_bytes``.

    The flags of the codec protocol are class attributes.

    Class attributes:
      name: short name used in plans and benchmarks (and the name of its factory).
      linear: whether payloads add up (psum-able).
      randomness: ``"none"``, ``"shared"`` (same on every replica, e.g. random-k
        indices) or ``"per_replica"`` (stochastic rounding).
      unbiased: whether the codec's estimate of the mean is unbiased
        (``E[out] = mean_i(g_i)`` without error feedback).
      has_server_buffer: whether error feedback keeps a server-side residual.
      shared_keys: the replicated per-leaf buffers :meth:`init_shared` makes.
      state_merge: the merge rule of the per-replica buffers when the replica
        count changes (:class:`adaptjax.PerReplica`): ``"mean"`` keeps the
        error-feedback debt ``mean_i(e_i)``; ``"fold"``, ``"sum"``, ``"first"``,
        ``"zeros"`` or a callable ``rule(old[n, ...], m) -> new[m, ...]``.

    A subclass is a frozen dataclass declared with ``repr=False`` (its ``repr``
    is its factory call, see :func:`factory`) that implements :meth:`reduce`
    and :meth:`leaf_bytes`, and may narrow :meth:`method` and :meth:`can_compress`
    (a codec of fixed-size blocks subclasses
    :class:`adaptjax.compression.BlockCodec` instead and gets all of that).

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
    bucket_bytes: int | None = None

    name: ClassVar[str] = "codec"
    linear: ClassVar[bool] = False
    randomness: ClassVar[str] = "none"
    unbiased: ClassVar[bool] = False
    has_server_buffer: ClassVar[bool] = False
    shared_keys: ClassVar[tuple[str, ...]] = ()
    state_merge: ClassVar[Any] = "mean"

    def __post_init__(self):
        object.__setattr__(self, "axis_name", _check_axis_name(self.axis_name))
        object.__setattr__(self, "error_feedback", _ef_mode(self.error_feedback))
        if int(self.min_size) != self.min_size or self.min_size < 1:
            raise ValueError(f"min_size must be an integer >= 1, got {self.min_size}")
        object.__setattr__(self, "min_size", int(self.min_size))
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "bucket_bytes", check_bucket_bytes(self.bucket_bytes))

    def __repr__(self) -> str:
        """The call that builds this codec: its factory's (see :func:`factory`) or its class's."""
        sig = _FACTORIES.get((type(self), self.name))
        if sig is None:  # the class call, as it is named where it is defined
            name = type(self).__qualname__.rsplit("<locals>.", 1)[-1]
            return _call_repr(name, _class_signature(type(self)), self)
        return _call_repr(self.name, sig, self)

    # ------------------------------------------------------------------ flags
    @property
    def bits(self) -> float | None:
        """Bits per element on the wire (``None`` when it depends on the shape)."""
        return None

    @property
    def feedback(self) -> NoFeedback:
        """The error-feedback rule in force, none, EF14 or EF21 (``error_feedback``)."""
        return feedback_for(self.error_feedback)

    # --------------------------------------------------------- per-leaf plan
    def can_compress(self, shape: Sequence[int]) -> bool:
        """Whether the codec can compress a leaf of this shape at all."""
        del shape
        return True

    def check_leaf(self, shape: Sequence[int], where: str) -> None:
        """Raises a one-line ValueError when a compressed leaf is invalid for this codec."""
        del shape, where

    def leaf_bytes(self, shape: Sequence[int], n: int) -> float:
        """Bytes per device this codec sends for one leaf at ``n`` replicas."""
        raise NotImplementedError

    def method(self, shape: Sequence[int], n: int) -> str:
        """The lane of a leaf of ``shape`` at ``n`` replicas: ``"f32"``, ``"bf16"``, ``"codec"``."""
        size = prod(shape)
        if size < self.min_size:
            return "f32"
        if not self.can_compress(shape):
            return "bf16"
        if n > 1 and self.leaf_bytes(shape, n) > bf16_bytes(size, n):
            return "bf16"
        return "codec"

    def stateful(self, shape: Sequence[int]) -> bool:
        """Whether the codec keeps buffers for a leaf of ``shape`` (of ``min_size`` or more)."""
        return prod(shape) >= self.min_size

    # ------------------------------------------------------------------ state
    def _merge_rule(self):
        """:attr:`state_merge` as declared (a function there is a rule, not a method)."""
        rule = inspect.getattr_static(type(self), "state_merge")
        return rule.__func__ if isinstance(rule, staticmethod) else rule

    def init_shared(self, leaf: Leaf) -> dict[str, jax.Array]:
        """Replicated buffers of one leaf, by key of ``shared_keys`` (none by default)."""
        del leaf
        return {}

    def init(self, params: Any) -> CompressionState:
        """The codec state for ``params`` (local view: one replica's buffers)."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        paths, leaves = [p for p, _ in flat], [x for _, x in flat]
        check_float_leaves(paths, leaves, "parameters")
        # the state does not depend on the replica count: the lanes at one replica are unused
        leaf_records = leaf_plan(self, paths, [jnp.shape(x) for x in leaves], 1)
        zeros = [jnp.zeros(leaf.shape, jnp.float32) if leaf.stateful else None
                 for leaf in leaf_records]
        own = [self.init_shared(leaf) for leaf in leaf_records]

        def tree(leaves):
            return jax.tree_util.tree_unflatten(treedef, list(leaves))

        fb = self.feedback
        worker = {k: tree(zeros) for k in fb.keys}
        server = ()
        if self.has_server_buffer and self.error_feedback is not None:
            server = PerReplica({"ef": tree(zeros)}, merge=SumToAll())
        shared = {k: tree(s.get(k) for s in own) for k in self.shared_keys}
        shared.update({k: tree(zeros) for k in fb.shared_keys})
        return CompressionState(
            count=jnp.zeros((), jnp.int32),
            worker=PerReplica(worker, merge=self._merge_rule()) if worker else (),
            server=server,
            shared=shared if shared else (),
        )

    # ------------------------------------------------------------ optax form
    def update(
        self, updates: Any, state: CompressionState, params: Any = None, **extra: Any
    ) -> tuple[Any, CompressionState]:
        """Optax ``update``: the compressed mean of ``updates`` over ``axis_name``."""
        del params, extra
        return self.sync(updates, state, axis_name=self.axis_name, step=state.count)

    def __iter__(self):
        """``init, update = codec`` like an ``optax.GradientTransformation``."""
        return iter((self.init, self.update))

    # ------------------------------------------------------------------ sync
    def sync(
        self,
        grads: Any,
        state: CompressionState,
        *,
        axis_name: str | tuple[str, ...] | None = None,
        step: int | jax.Array | None = None,
    ) -> tuple[Any, CompressionState]:
        """The compressed all-reduce-mean of ``grads`` (inside ``shard_map``).

        Each leaf gets its ``Leaf`` record (lane, shape, state), and a codec
        whose every leaf is under ``min_size`` warns that it compresses nothing
        (at trace time, once per compiled step); the
        feedback rule turns its gradient into what the replica sends; each lane
        averages its leaves bucket by bucket (``run_lanes``); the feedback
        rule turns each leaf's mean and residual into the output and new buffers.

        Args:
          grads: this replica's gradients.
          state: the codec state (local view).
          axis_name: the bound axis (or tuple of axes); defaults to ``self.axis_name``.
          step: int32 step counter (keys and warm-ups); defaults to ``state.count``.

        Returns:
          ``(mean, new_state)``; ``mean`` is identical on every replica.
        """
        names = axis_tuple(self.axis_name if axis_name is None else _check_axis_name(axis_name))
        n = bound_size(names)
        self._check_axes(names)
        step = state.count if step is None else jnp.asarray(step, jnp.int32)
        flat, treedef = jax.tree_util.tree_flatten_with_path(grads)
        paths, leaves = [p for p, _ in flat], [x for _, x in flat]
        check_float_leaves(paths, leaves)
        records = leaf_plan(self, paths, [jnp.shape(x) for x in leaves], n)
        warn_if_nothing_compressed(self, records)
        fb = self.feedback
        ctx = Ctx(names, n, step, replica_index(names, n), fb.residual, self.seed)
        held = _leaf_states(state, treedef)
        grads32 = [x.astype(jnp.float32) for x in leaves]
        # what each replica sends: the feedback rule's input on leaves with state
        prep = fb.prepare([g for g, r in zip(grads32, records, strict=True) if r.stateful], ctx)
        sends = [_send(fb, r, g, h, prep) for r, g, h in zip(records, grads32, held, strict=True)]
        outs = run_lanes(self, [s.leaf for s in sends], ctx)
        done = [_settle(fb, s, o) for s, o in zip(sends, outs, strict=True)]
        mean = jax.tree_util.tree_unflatten(
            treedef, [out.astype(x.dtype) for (out, _), x in zip(done, leaves, strict=True)]
        )
        new = _next_state(state, treedef, [buffers for _, buffers in done])
        if n == 1:  # nothing crossed the wire: mark the mean and the shared buffers replicated
            mean, new = replicated(mean, names), new._replace(shared=replicated(new.shared, names))
        return mean, new

    # ---------------------------------------------------------------- hooks
    def _check_axes(self, names) -> None:
        del names

    def reduce(self, leaves: Sequence[Any], ctx: Any) -> list[Any]:  # _lanes' private types
        """The compressed mean of one bucket of the codec's leaves (its lane, see ``_lanes``).

        Args:
          leaves: one ``LeafIn`` per leaf of the bucket, in lane order (``ctx.lane``).
          ctx: the sync's context (axes, replica count, seeds, whether residuals are due).

        Returns:
          One ``LeafOut`` per leaf: the mean, and with ``ctx.residual``
          what this replica still owes (see
          ``adaptjax.compression._exchange``).
        """
        raise NotImplementedError

    # ------------------------------------------------------------ protocol
    def encode(self, x: jax.Array, *, seed: int | jax.Array = 0) -> Any:
        """One array to this codec's fixed-size payload pytree (pure, jittable).

        Random draws come from the codec's own ``seed`` and the call's
        ``seed`` together (:meth:`draw_seed`): codecs that differ in either
        draw differently.
        """
        raise NotImplementedError

    def decode(
        self, payload: Any, shape: Sequence[int], *, seed: int | jax.Array = 0
    ) -> jax.Array:
        """Inverse of :meth:`encode` (up to the codec's loss), with the ``seed`` it was given."""
        raise NotImplementedError

    def draw_seed(self, seed: int | jax.Array = 0) -> jax.Array:
        """The uint32 seed of :meth:`encode`'s draws: the codec's ``seed`` mixed with ``seed``."""
        return mix_seed(self.seed, seed)

    def plan(self, grads: Any, n: int, *, show: bool = False) -> Plan:
        """The per-leaf plan at ``n`` replicas; see :func:`adaptjax.compression.plan`."""
        # pyright checks this file as compression/_base.py but sees _plan's Codec through the
        # install's link tree (adaptjax/compression/_base.py): one class, two names to it
        return plan(grads, self, n, show=show)  # pyright: ignore[reportArgumentType]

    def pairing_warning(self, optimizer_state: Any) -> str | None:
        """One line when this codec trains worse than dense sync with that optimizer, else None.

        The codec's :func:`adaptjax.sync_gradients` link asks when
        :func:`adaptjax.data_parallel_step` first traces the step, with the
        chain's state, and warns with the line (see
        ``compression/_pairing.py``: the pairings
        the codec-optimizer benchmark measured more than 1% behind dense).
        """
        return pairing_warning(self, optimizer_state)


class _Sending(NamedTuple):
    """One leaf on its way through a sync (see :meth:`Codec.sync`).

    Attributes:
      leaf: what its lane gets (:class:`LeafIn`).
      g: its float32 gradient.
      held: its buffers before the step.
      carry: what the feedback rule's ``outputs`` needs back from its ``inputs``.
    """

    leaf: LeafIn
    g: jax.Array
    held: LeafState
    carry: Any


def _send(fb: NoFeedback, record: Leaf, g, held: LeafState, prep) -> _Sending:
    """What one leaf sends: the feedback rule's input on a leaf with state, else ``g``."""
    x, carry = fb.inputs(g, held.worker, prep) if record.stateful else (g, None)
    return _Sending(LeafIn(record, x, held.server, held.shared), g, held, carry)


def _settle(fb: NoFeedback, s: _Sending, o: LeafOut):
    """``(output, new LeafState)`` of one leaf: the feedback rule's on a leaf with state."""
    shared = {**s.held.shared, **o.shared}
    server = s.held.server if o.server is None else o.server
    if not s.leaf.leaf.stateful:
        return o.out, LeafState(s.held.worker, server, shared)
    worker, shared, out = fb.outputs(
        s.g, s.leaf.x, o.out, o.residual, s.held.worker, shared, s.carry, s.leaf.leaf.lane
    )
    return out, LeafState(worker, server, shared)
