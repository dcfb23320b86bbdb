"""The data-parallel step builder: ``jit`` + ``shard_map`` over a device mesh."""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.errors
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from adaptjax._accumulation import skip_micro_step, skipped_before
from adaptjax._chain import SyncChain, guarded_sync
from adaptjax._loss_scale import LossScaled, adjust_in, current_loss_scale, has_loss_scale
from adaptjax._mesh import check_mesh, is_sharded
from adaptjax._metric_vector import Metrics
from adaptjax._metrics import collect_metrics
from adaptjax._per_replica import to_global, to_local
from adaptjax._state import (
    TrainState,
    fold_replica_into_keys,
    merge_model,
    model_state_after,
    train_state_shardings,
    train_state_specs,
)
from adaptjax._tree import ShardLayout, all_gather_replicas, pmean_replicas, tree_sq_norm
from adaptjax._wire import GUARD_SCOPE
from adaptjax._xla_options import step_compiler_options
from adaptjax.sync._registry import resolve_sync
from adaptjax.sync._strategy import SyncStrategy, find_model_sync, local_params

# On XLA:CPU a multi-device step launches on the client's thread pool, which
# has max(cores, devices) threads; a launch that finds a device's in-flight
# queue full blocks its pool thread, and a collective already queued then
# cannot get one thread per device: the process deadlocks with the CPU idle
# (8 simulated devices on a 2-core machine, the loop dispatching ahead without
# reading anything back). Waiting for the step dispatched this many calls ago
# keeps the queue short; the device stays busy, only the host waits.
CPU_MAX_STEPS_IN_FLIGHT = 4

#: The mesh axis over which a sharded step also splits each replica's rows.
FSDP_AXIS = "fsdp"


class DataParallelStep:
    """A compiled data-parallel training step; see :func:`data_parallel_step`.

    Calling it checks the batch before anything is compiled, then runs the
    jitted function. ``lower`` and ``jitted`` expose the underlying
    ``jax.jit`` object (for :func:`adaptjax.wire_bytes`, AOT compilation and
    compilation counting).

    On CPU meshes a call first waits for the step dispatched
    ``CPU_MAX_STEPS_IN_FLIGHT`` (4) calls earlier, so a loop that never reads a
    result back cannot run far ahead of the devices (which deadlocks XLA:CPU's
    thread pool when there are fewer cores than simulated devices). Calling
    ``jitted`` directly skips both the batch check and this bound.
    """

    def __init__(
        self,
        fn: Any,
        *,
        mesh: Mesh,
        axis_name: str | tuple[str, ...],
        microbatches: int,
        n_replicas: int,
        sync: SyncStrategy | None = None,
    ) -> None:
        self.jitted = fn  # a jax.jit-wrapped function (jax has no public type for it)
        self.sync = sync  # the SyncStrategy the step was built for (None: not given)
        self.mesh = mesh
        self.axis_name = axis_name
        self.microbatches = microbatches
        self.n_replicas = n_replicas
        on_cpu = mesh.devices.flat[0].platform == "cpu"
        self._max_in_flight = CPU_MAX_STEPS_IN_FLIGHT if on_cpu else None
        self._in_flight: collections.deque = collections.deque()

    def check_batch(self, batch: Any) -> int:
        """Validates the batch's leading dimension; returns the global batch size."""
        sizes = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in jax.tree.leaves(batch)}
        if not sizes or -1 in sizes:
            raise ValueError("every batch leaf needs a leading batch dimension")
        if len(sizes) != 1:
            raise ValueError(f"batch leaves disagree on the batch size: {sorted(sizes)}")
        size = sizes.pop()
        div = self.n_replicas * self.microbatches
        if size % div:
            raise ValueError(
                f"global batch {size} is not divisible by replicas x microbatches = "
                f"{self.n_replicas} x {self.microbatches}; use a multiple of {div}"
            )
        return size

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, Metrics]:
        self.check_batch(batch)
        if self._max_in_flight is not None:
            while len(self._in_flight) >= self._max_in_flight:
                # the loss of an earlier step: an output, never donated
                jax.block_until_ready(self._in_flight.popleft())
        new_state, metrics = self.jitted(state, batch)
        if self._max_in_flight is not None:
            self._in_flight.append(metrics.values)  # an output, never donated
        return new_state, metrics

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        """``jitted.lower(state, batch)`` after checking the batch (for AOT and HLO inspection)."""
        self.check_batch(batch)
        return self.jitted.lower(state, batch)


def data_parallel_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    microbatches: int = 1,
    has_aux: bool = False,
    axis_name: str | tuple[str, ...] = "data",
    donate: bool = True,
    skip_nonfinite: bool = True,
    sync: SyncStrategy | str | None = None,
    sharding: Any = None,
    loss_scale: LossScaled | None = None,
) -> DataParallelStep:
    """Builds ``step(state, batch) -> (state, metrics)``, jitted over ``mesh``.

    The global batch (every leaf's leading axis) is split over ``axis_name``;
    inside ``jax.shard_map`` each replica computes its gradient (accumulated
    over ``microbatches`` micro-batches with ``lax.scan``) and runs ``tx`` with
    the axis bound, so ``tx`` should contain :func:`adaptjax.sync_gradients` (or
    another cross-replica reduction): ``optax.chain(adaptjax.sync_gradients(
    "data"), optimizer)``. ``tx.update`` receives the extra arguments
    ``local_batch_size``, ``microbatches``, ``micro_sqnorm`` and ``chain_state``
    (``tx``'s whole state: a codec's ``sync_gradients`` warns with its
    ``pairing_warning`` about the optimizer in it), and with ``skip_nonfinite``
    and one micro-batch ``local_sqnorm`` (this replica's ``‖g‖²``, which the
    guard computes anyway).

    A non-finite loss or gradient (on any replica) skips the update when
    ``skip_nonfinite``: params, optimizer and model state stay as they were and
    ``state.nonfinite_count`` grows. Like ``optax.apply_if_finite`` and
    PyTorch's ``GradScaler``, the check reads the gradients, before ``tx``
    runs; one scalar all-reduce makes it global, and the update (``tx`` with
    its collectives, and ``optax.apply_updates``) then runs inside
    ``lax.cond``: a skipped step sends no gradient and passes the (donated)
    state through in place, and a finite step computes exactly what it would
    without the guard. A ``tx`` that turns finite gradients into non-finite
    updates is not caught (wrap it in ``optax.apply_if_finite``).

    **float16** (``loss_fn = adaptjax.with_precision(loss, "float16")``) needs
    dynamic loss scaling: put ``ls = adaptjax.dynamic_loss_scale(optimizer)``
    in ``tx`` (``optax.chain(adaptjax.sync_gradients("data"), ls)``) and
    pass ``loss_scale=ls``. The step differentiates the loss times the
    state's current scale (:func:`adaptjax.current_loss_scale`), divides each
    micro-batch's gradients by it in float32, so the guard, ``micro_sqnorm``
    and the monitors see true-scale values, and an overflow (``inf``/``NaN``
    in the scaled backward pass) is a non-finite step that every replica
    skips; after the skip-or-apply branch the scale moves by ``ls``'s rules
    (shrink on a skipped step, grow after ``period`` finite ones). ``tx``'s
    ``update`` receives ``loss_scaled=True``, so ``ls`` runs only the
    optimizer it wraps. The scale is part of the optimizer state, so it is
    checkpointed with the rest.

    Flax NNX models with state (call ``model.train()`` before
    :func:`adaptjax.init_state`): the step merges the module inside the
    gradient, runs ``loss_fn`` on it and carries what the call changed.

    * ``nnx.BatchNorm``: each replica normalises with its own batch statistics
      (as in PyTorch DDP without ``SyncBatchNorm``); every forward pass (each
      micro-batch) updates the running statistics, which are then averaged
      over replicas, so they stay replicated. The running mean is therefore
      exactly the EMA of the global batch mean, as ``SyncBatchNorm`` would
      keep it; the running variance is the EMA of the replicas' mean
      within-replica variance (it leaves out the spread between replicas'
      means). Every floating-point non-parameter variable is averaged so.
    * ``nnx.Dropout`` and other RNG streams: the replica index is folded into
      each stream's key, so every replica draws its own masks; the stream's
      count advances with every draw and is carried (and checkpointed) with
      the state, so every step and micro-batch draws new masks and a run
      restored from a checkpoint draws the same ones again.

    ``state.model`` is the trained module (``nnx.merge``).

    **Sharded meshes** (``adaptjax.make_mesh({"data": 2, "fsdp": 4})``, with
    ``"model"`` too): the ``shard_map`` is manual over the data axis only
    (``axis_names={"data"}``); the model's axes stay ``Auto``, so the
    compiler runs ``loss_fn`` on parameters sharded as
    :func:`adaptjax.train_state_specs` says (``sharding=`` as in
    :func:`adaptjax.param_specs`; pass the same to
    :func:`adaptjax.init_state`), gathering each weight where a layer uses it.
    Each replica's rows are split over ``"fsdp"`` too (FSDP is data parallel
    inside a replica) when ``fsdp × microbatches`` divides them, else
    replicated over it. Gradients come out sharded like the parameters, the
    sync's all-reduce over ``"data"`` moves each device's shard, the
    optimizer updates shards, and the new state is constrained to the same
    shardings (donation keeps working). ``tx.update`` also receives
    ``shard_layout`` (an ``ShardLayout``): the monitors' norms
    are summed over each replica's shards in one scalar all-reduce, and a
    codec compresses each device's shard over ``"data"``.

    Why this route. On the LM of ``examples/lm.py`` at ``--size base``
    (3.35M parameters) on a (2, 4) mesh with 8 simulated CPU devices, global
    batch 64: every variant holds the same 3.36 MB of parameters per device.
    This route compiles to 21 all-gathers over ``"fsdp"`` and the gradients'
    reduction over ``"fsdp"`` as one all-reduce (19.5 MB per device: XLA:CPU
    has no pass that turns an all-reduce and a slice into a reduce-scatter;
    GPU and TPU pipelines do), temporaries 135.9 MB. A fully manual FSDP
    (all-gather each weight, ``psum_scatter`` its gradient) sends 9.8 MB of
    reduce-scatters instead, but needs 144.7 MB of temporaries (the gathered
    weights live on as residuals), runs ``loss_fn`` on a slice of the
    replica's rows (batch statistics, token-normalised losses change), and
    cannot leave ``"model"`` to the compiler: a tensor-parallel model would
    need its collectives written by hand. ``Explicit`` axis types reject an
    unmodified flax model (``nnx.Embed``'s lookup of fsdp-sharded rows by
    fsdp-sharded tokens asks for an ``out_sharding``), so every axis is
    ``Auto``. (:func:`adaptjax.wire_bytes` counts the per-axis bytes.)

    On CPU with a mesh over several processes (gloo), each gradient leaf keeps
    its own all-reduce (XLA:CPU's all-reduce combiner is off for the step), so
    the transfers overlap the rest of the backward pass.

    ``metrics`` is an :class:`adaptjax.Metrics` mapping (all scalars in one
    float32 vector, one buffer per device): ``loss`` (mean over the global
    batch), ``nonfinite`` (1.0 when this step was skipped), with ``loss_scale``
    the scale the next step uses (``loss_scale``), every monitor value
    (see :func:`adaptjax.read_metrics`) and, with ``has_aux``, the aux outputs
    under ``aux``: scalars averaged over replicas, per-example arrays (leading
    axis the replica's rows, e.g. logits) gathered over the replicas in global
    batch order, so they line up with the batch the step was given; any other
    shape is a one-line error. Read them with one ``jax.device_get(metrics)``.

    Args:
      loss_fn: ``loss_fn(params_or_model, batch) -> loss`` (or ``(loss, aux)``
        with ``has_aux``); for an NNX model it receives the merged module.
      tx: the optax transformation.
      mesh: a mesh with ``axis_name``; it may cover any subset of devices.
      microbatches: gradient accumulation steps per replica.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      axis_name: the data-parallel axis (or tuple of axes).
      donate: donate the state buffers to the step.
      skip_nonfinite: skip updates whose loss or gradients are not finite.
        The check is an all-reduce of two scalars before the whole update (a
        barrier; its cost is on the docs' benchmarks page); in the chain
        :func:`adaptjax.sync.sync_chain` builds (``sync_chain(optimizer,
        SSGD(codec=...))``) they ride in the gradients' all-reduce instead
        and only the links after the sync are skipped.
      sync: the :class:`adaptjax.sync.SyncStrategy` ``tx`` was built with (by
        :func:`adaptjax.sync.sync_chain`), or its name; checked against the mesh
        (e.g. gossip needs two replicas) before anything compiles. Whatever
        it is, a replica differentiates at its local model when ``tx`` keeps
        one (:func:`adaptjax.sync.local_params`) and ``tx.update`` then also
        receives ``local_params``.
      sharding: how parameters lie on a sharded mesh: ``None`` (the
        :class:`adaptjax.FSDP` rule), an :class:`adaptjax.FSDP`, a tree of
        ``PartitionSpec`` objects or a function; see :func:`adaptjax.param_specs`.
        Ignored on a mesh of data axes only.
      loss_scale: the :func:`adaptjax.dynamic_loss_scale` inside ``tx``
        (``tx`` itself when ``tx`` is one; that is the default then): the
        step scales the loss by it and moves the scale (see above). Needs
        ``skip_nonfinite``; the optimizer state must hold exactly one
        ``LossScaleState``.

    Returns:
      A ``DataParallelStep``.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> mesh = adaptjax.make_mesh(8)
      >>> tx = optax.chain(adaptjax.sync_gradients("data"), optax.sgd(0.1))
      >>> loss = lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2)
      >>> step = adaptjax.data_parallel_step(loss, tx, mesh)
      >>> state = adaptjax.init_state({"w": jnp.zeros(())}, tx, mesh)
      >>> batch = {"x": jnp.ones(16), "y": 2 * jnp.ones(16)}
      >>> state, metrics = step(state, batch)
      >>> round(float(state.params["w"]), 4), float(metrics["loss"])
      (0.4, 4.0)
    """
    n = check_mesh(mesh, axis_name)
    microbatches = int(microbatches)
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    if sync is not None:
        resolve_sync(sync).check(n)
    loss_scale = _check_loss_scale(loss_fn, tx, loss_scale, skip_nonfinite)
    config = _StepConfig(
        loss_fn, tx, mesh, axis_name, n, microbatches, has_aux, skip_nonfinite, sharding,
        loss_scale,
    )
    jitted = jax.jit(
        config.step,
        donate_argnums=(0,) if donate else (),
        compiler_options=step_compiler_options(mesh),
    )
    return DataParallelStep(
        jitted,
        mesh=mesh,
        axis_name=axis_name,
        microbatches=microbatches,
        n_replicas=n,
        sync=None if sync is None else resolve_sync(sync),
    )


def _check_loss_scale(loss_fn, tx, loss_scale, skip_nonfinite: bool) -> LossScaled | None:
    """``loss_scale`` checked (``tx`` itself when it is a ``LossScaled``)."""
    if loss_scale is None and isinstance(tx, LossScaled):
        loss_scale = tx
    if loss_scale is not None and not isinstance(loss_scale, LossScaled):
        raise ValueError(
            f"loss_scale must be the adaptjax.dynamic_loss_scale(...) inside tx, got {loss_scale!r}"
        )
    if loss_scale is not None and not skip_nonfinite:
        raise ValueError(
            "loss_scale needs skip_nonfinite=True (a step whose scaled gradients overflow is "
            "skipped and the scale shrinks); drop skip_nonfinite=False"
        )
    precision = getattr(loss_fn, "precision", None)  # adaptjax.with_precision's
    needs_loss_scale = getattr(precision, "needs_loss_scale", False)
    if loss_scale is None and precision is not None and needs_loss_scale:
        raise ValueError(
            f"loss_fn computes in {precision.compute}, whose gradients underflow without loss "
            "scaling: pass loss_scale=adaptjax.dynamic_loss_scale(optimizer) (that link of tx), "
            "or use compute='bfloat16'"
        )
    return loss_scale


def _check_scaled_state(loss_scale: LossScaled | None, opt_state) -> None:
    """Trace time: ``opt_state`` holds one loss scale exactly when the step was given one."""
    if loss_scale is None and has_loss_scale(opt_state):
        raise ValueError(
            "tx holds adaptjax.dynamic_loss_scale: pass that transformation to "
            "data_parallel_step(..., loss_scale=...) so the step scales the loss it differentiates"
        )
    if loss_scale is not None and not has_loss_scale(opt_state):
        raise ValueError(
            "loss_scale= was given, but the state's optimizer state holds no LossScaleState; "
            "put that adaptjax.dynamic_loss_scale(...) in tx and build the state with it"
        )


def _unscale(grads, scale):
    """Gradients of the loss times ``scale``, back at true scale (divided in float32)."""
    return jax.tree.map(lambda g: (g.astype(jnp.float32) / scale).astype(g.dtype), grads)


@dataclasses.dataclass(frozen=True, eq=False)
class _StepConfig:
    """What :func:`data_parallel_step` was built with (checked there); see its arguments."""

    loss_fn: Callable[..., Any]
    tx: optax.GradientTransformation
    mesh: Mesh
    axis_name: str | tuple[str, ...]
    n_replicas: int
    microbatches: int
    has_aux: bool
    skip_nonfinite: bool

    sharding: Any = None
    loss_scale: LossScaled | None = None

    def step(self, state: TrainState, batch):
        """The jitted function (``jit(step)`` in profiles and compile logs).

        Runs :func:`_local_step` on every replica: the state's leaves split as
        :func:`adaptjax.train_state_specs` says, the batch over the data axis.
        """
        _check_scaled_state(self.loss_scale, state.opt_state)
        specs = train_state_specs(state, self.axis_name)
        if not is_sharded(self.mesh, self.axis_name):
            fn = jax.shard_map(
                functools.partial(_local_step, self, None),
                mesh=self.mesh,
                in_specs=(specs, P(self.axis_name)),
                out_specs=(specs, P()),
                check_vma=False,
            )
            return fn(state, batch)
        return self._sharded_step(specs, state, batch)

    def _sharded_step(self, specs, state: TrainState, batch):
        """The step on a sharded mesh: manual over the data axes, the model's axes ``Auto``."""
        full = train_state_shardings(state, self.mesh, self.axis_name, sharding=self.sharding)
        layout = ShardLayout.of(
            state.params, self.mesh, sharding=self.sharding, axis_name=self.axis_name
        )
        state = jax.lax.with_sharding_constraint(state, full)
        batch = jax.lax.with_sharding_constraint(batch, self.batch_shardings(batch))
        fn = jax.shard_map(
            functools.partial(_local_step, self, layout),
            mesh=self.mesh,
            in_specs=(specs, P(self.axis_name)),
            out_specs=(specs, P()),
            axis_names=frozenset(_data_axes(self.axis_name)),
            check_vma=False,
        )
        new_state, metrics = fn(state, batch)
        return jax.lax.with_sharding_constraint(new_state, full), metrics

    def rows_axis(self, local_rows: int) -> str | None:
        """``"fsdp"`` when each micro-batch of ``local_rows`` rows splits evenly over it."""
        if FSDP_AXIS not in self.mesh.axis_names or FSDP_AXIS in _data_axes(self.axis_name):
            return None
        size = int(self.mesh.shape[FSDP_AXIS])
        return FSDP_AXIS if local_rows % (size * self.microbatches) == 0 else None

    def batch_shardings(self, batch):
        """The batch's shardings on a sharded mesh: rows over the data axes (and ``"fsdp"``)."""
        data = _data_axes(self.axis_name)
        rows = jax.tree.leaves(batch)[0].shape[0] // self.n_replicas
        fsdp = self.rows_axis(rows)
        lead = (*data, fsdp) if fsdp else data
        spec = P(lead[0] if len(lead) == 1 else lead)
        return jax.tree.map(lambda _: NamedSharding(self.mesh, spec), batch)


def _data_axes(axis_name: str | tuple[str, ...]) -> tuple[str, ...]:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


class _Synced(NamedTuple):
    """A replica's gradients after the step's collective, and what the update still runs."""

    summed: Any  # the sync link's sums (guarded chain), else this replica's gradients
    complete: Callable | None  # summed -> (mean, sync state); None: tx runs whole on `summed`
    rest: optax.GradientTransformation  # what runs in the update: the chain's rest, or tx
    rest_state: Any  # its state
    sync_state: Any  # the sync link's state before this step (guarded chain), else ()
    ok: jax.Array  # every replica's loss and gradients are finite (or no guard)
    loss: jax.Array  # the loss averaged over replicas, float32


def _local_step(config: _StepConfig, layout: ShardLayout | None, state: TrainState, batch):
    """One replica's step inside ``shard_map``: gradients, guard, sync, update, metrics.

    ``layout`` is ``None`` on a mesh of data axes only; on a sharded mesh it
    says how the replica's leaves lie over the model's axes.
    """
    state = dataclasses.replace(state, opt_state=to_local(state.opt_state))
    global_params = state.params
    has_local = find_model_sync(state.opt_state) is not None
    # strategies with local models: each replica differentiates at its own model
    params = local_params(global_params, state.opt_state)
    b = jax.tree.leaves(batch)[0].shape[0]
    loss, aux, grads, model_state, micro_sq = _replica_grads(config, layout, state, params, batch)
    # replicated like the params: float variables (BatchNorm statistics) are
    # averaged over replicas; counts and keys are the same on every replica
    model_state = jax.tree.map(
        lambda x: (
            pmean_replicas(x, config.axis_name) if jnp.issubdtype(x.dtype, jnp.floating) else x
        ),
        model_state,
    )
    extra = {"local_params": params} if has_local else {}
    extra.update(local_batch_size=b, microbatches=config.microbatches, micro_sqnorm=micro_sq,
                 replica_loss=loss)  # this replica's own loss (local SGD's measurements)
    if config.loss_scale is not None:
        extra["loss_scaled"] = True  # unscaled already: the LossScaled link runs only its inner
    if layout is not None:
        extra["shard_layout"] = layout
    extra["chain_state"] = state.opt_state  # for a codec's pairing_warning (see sync_gradients)
    # In sync_chain's chain (a SyncChain) the guard's scalars ride in the
    # gradients' all-reduce and only what follows the sync is skipped.
    in_sync = config.skip_nonfinite and guarded_sync(config.tx) and not has_local
    guard = None
    if config.skip_nonfinite:
        # Checked on the loss and the gradients, before the optimizer runs (as
        # optax.apply_if_finite and PyTorch's GradScaler check gradients), from
        # their sums over replicas, so every replica takes the same branch of
        # the lax.cond in _apply_update.
        local_sq = tree_sq_norm(grads) if layout is None else layout.sq_norm(grads)
        guard = jnp.stack([loss.astype(jnp.float32), local_sq])
        if config.microbatches == 1:
            # The guard has read every gradient already: the monitors take its
            # exact norm instead of reading (a chunk of) them again.
            extra["local_sqnorm"] = local_sq
    if in_sync:
        synced = _sync_with_guard(config, state, grads, guard, global_params, extra)
    else:
        synced = _sync_in_update(config, state, grads, guard, loss)
    updated = _apply_update(config, synced, state.model_state, global_params, model_state, extra)
    return _step_outputs(config, state, synced, updated, aux, in_sync)


def _grad_of(config: _StepConfig, params, model_state, graphdef, batch, scale=None):
    """Loss, aux, grads and the model state the forward pass left behind.

    With a loss ``scale`` the loss times ``scale`` is differentiated and the
    gradients are unscaled here, in float32: what follows sees true-scale
    values (an overflow stays ``inf``/``NaN``, for the guard).
    """
    f = functools.partial(_loss_and_model_state, config, model_state, graphdef, batch, scale)
    (_, (loss, aux, new_model_state)), grads = jax.value_and_grad(f, has_aux=True)(params)
    if scale is not None:
        grads = _unscale(grads, scale)
    return loss, aux, grads, new_model_state


def _loss_and_model_state(config: _StepConfig, model_state, graphdef, batch, scale, params):
    """``(loss × scale, (loss, aux, model state after))`` of ``loss_fn`` at ``params``.

    The first item is what is differentiated (the loss itself without a ``scale``).
    """
    model = merge_model(graphdef, params, fold_replica_into_keys(model_state, config.axis_name))
    loss, aux = _loss_and_aux(config.has_aux, _call_loss(config.loss_fn, model, batch))
    _check_aux(aux, jax.tree.leaves(batch)[0].shape[0])
    scaled = loss if scale is None else loss.astype(jnp.float32) * scale
    return scaled, (loss, aux, model_state_after(model, model_state))


def _call_loss(loss_fn, model, batch):
    """``loss_fn(model, batch)``; an NNX object from outside the step is a one-line error."""
    try:
        return loss_fn(model, batch)
    except flax.errors.TraceContextError as e:
        raise ValueError(
            f"loss_fn changes an NNX object made outside the step ({str(e).split(' (')[0]}): "
            "the step carries only the model's own state; give each nnx.Dropout its stream "
            "(nnx.Dropout(rate, rngs=rngs)) and call the model without rngs"
        ) from e


def _loss_and_aux(has_aux: bool, out: Any) -> tuple[Any, Any]:
    """``(loss, aux)`` from what ``loss_fn`` returned; one-line errors at trace time."""
    pair = isinstance(out, tuple | list)
    if has_aux and not (pair and len(out) == 2):
        raise ValueError(
            f"has_aux=True, but loss_fn returned {_described(out)}; return (loss, aux), or "
            "build the step with has_aux=False"
        )
    if not has_aux and pair:
        raise ValueError(
            f"loss_fn returned {_described(out)}; build the step with has_aux=True if it "
            "returns (loss, aux)"
        )
    loss: Any  # a scalar array, checked below
    aux: Any
    loss, aux = out if has_aux else (out, ())
    if jnp.shape(loss) != ():
        raise ValueError(
            f"loss_fn's loss is {_described(loss)}, not a scalar; reduce it over the batch "
            "(e.g. jnp.mean)"
        )
    return loss, aux


def _check_aux(aux, rows: int) -> None:
    """One-line error for an aux leaf that is neither a scalar nor per-example (``rows``)."""
    for path, x in jax.tree_util.tree_leaves_with_path(aux):
        shape = jnp.shape(x)
        if shape != () and shape[0] != rows:
            raise ValueError(
                f"aux{jax.tree_util.keystr(path)} has shape {tuple(shape)}, but a replica's "
                f"batch has {rows} rows: aux may hold scalars (averaged over replicas) and "
                "per-example arrays with the batch's leading axis (gathered in batch order)"
            )


def _gather_aux(aux, axis_name):
    """Scalars averaged over replicas; per-example arrays gathered over them in batch order."""
    return jax.tree.map(
        lambda x: pmean_replicas(x, axis_name) if x.ndim == 0
        else all_gather_replicas(x, axis_name), aux)


def _described(out) -> str:
    """What ``loss_fn`` returned, in a few words (``a float32 scalar``, ``a tuple of 3``)."""
    if isinstance(out, tuple | list):
        return f"a {type(out).__name__} of {len(out)}"
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape is None or dtype is None:
        return f"a {type(out).__name__}"
    return f"a {dtype} scalar" if shape == () else f"a {dtype} array of shape {tuple(shape)}"


def _replica_grads(config: _StepConfig, layout, state: TrainState, params, batch):
    """``(loss, aux, grads, model state, Σ_j ‖g_j‖²)`` of this replica's batch.

    With micro-batches, ``lax.scan`` accumulates them: the loss, aux and
    gradients are their means, the last item the sum of their squared norms
    (``None`` with one micro-batch).
    """
    k = config.microbatches
    scale = None if config.loss_scale is None else current_loss_scale(state.opt_state)
    if k == 1:
        loss, aux, grads, model_state = _grad_of(
            config, params, state.model_state, state.graphdef, batch, scale
        )
        return loss, aux, grads, model_state, None
    b = jax.tree.leaves(batch)[0].shape[0]
    micro = jax.tree.map(lambda x: x.reshape(k, b // k, *x.shape[1:]), batch)
    if layout is not None and config.rows_axis(b) is not None:
        # each micro-batch over the fsdp axis, as the whole batch was
        micro = jax.lax.with_sharding_constraint(micro, P(None, config.rows_axis(b)))
    zeros = jax.tree.map(jnp.zeros_like, params)
    # On a sharded mesh each device sums its shards' squares; one all-reduce after the scan.
    sq0 = jnp.zeros(() if layout is None else (layout.devices,), jnp.float32)
    init = (zeros, jnp.zeros((), jnp.float32), sq0, state.model_state)
    body = functools.partial(
        _accumulate_microbatch, config, layout, params, state.graphdef, scale
    )
    (g_sum, l_sum, micro_sq, model_state), auxes = jax.lax.scan(body, init, micro)
    if layout is not None:
        micro_sq = layout.total(micro_sq)
    grads = jax.tree.map(lambda g: g / k, g_sum)
    loss = l_sum / k
    # scalars: their mean; per-example outputs: the micro-batches' rows in batch order
    aux = jax.tree.map(lambda a: a.mean(0) if a.ndim == 1 else a.reshape(-1, *a.shape[2:]),
                       auxes)
    return loss, aux, grads, model_state, micro_sq


def _accumulate_microbatch(config: _StepConfig, layout, params, graphdef, scale, carry, mb):
    """The ``lax.scan`` body of :func:`_replica_grads`: adds one micro-batch's gradient.

    Returns the carry and the micro-batch's aux, which the scan stacks.
    """
    g_acc, l_acc, sq_acc, ms = carry
    loss, aux, g, ms = _grad_of(config, params, ms, graphdef, mb, scale)
    g_acc = jax.tree.map(jnp.add, g_acc, g)
    sq = tree_sq_norm(g) if layout is None else layout.sq_partials(g)
    return (g_acc, l_acc + loss, sq_acc + sq, ms), aux


def _sync_with_guard(config: _StepConfig, state, grads, guard, global_params, extra) -> _Synced:
    """The guard's scalars ride in the sync link's all-reduce (a ``SyncChain``)."""
    tx = config.tx
    assert isinstance(tx, SyncChain) and tx.sync and tx.rest  # the caller checked guarded_sync
    update_with_sums = tx.sync.update_with_sums
    assert update_with_sums is not None  # sync_gradients always gives it
    sync_state, rest_state = tx.split_state(state.opt_state)
    # The codec and the monitors run in the update branch (`complete`), so a
    # skipped step keeps the sync's old state too (monitor EMAs, codec
    # residuals) and runs neither; a kept one writes it in place, the codec's
    # mean fused into the optimizer's read of it.
    summed, complete, sync_state, guard_sum = update_with_sums(
        grads, sync_state, global_params, guard, deferred=True, **extra
    )
    ok = jnp.all(jnp.isfinite(guard_sum))
    loss = guard_sum[0] / config.n_replicas
    return _Synced(summed, complete, tx.rest, rest_state, sync_state, ok, loss)


def _sync_in_update(config: _StepConfig, state, grads, guard, loss) -> _Synced:
    """``tx`` runs whole in the update, its collectives with it; the guard (if any) apart."""
    axis_name = config.axis_name
    if config.skip_nonfinite:
        # A collective of its own before the whole update (a barrier:
        # 2-4% of a small LM's step on 8 simulated CPU devices).
        mean_loss_sq = pmean_replicas(guard, axis_name)
        ok = jnp.all(jnp.isfinite(mean_loss_sq))
        loss = mean_loss_sq[0]
    else:
        ok = jnp.bool_(True)
        loss = pmean_replicas(loss.astype(jnp.float32), axis_name)
    return _Synced(grads, None, config.tx, state.opt_state, (), ok, loss)


def _apply_update(
    config: _StepConfig, synced: _Synced, old_model_state, params, model_state, extra
):
    """``(params, rest state, model state, sync state)`` after the update, or as they were."""
    update = functools.partial(_update_branch, synced.complete, synced.rest, extra)
    operands = (synced.summed, synced.rest_state, params, model_state, synced.sync_state)
    if not config.skip_nonfinite:
        return update(*operands)
    # The update runs inside the taken branch (outside a SyncChain its
    # collectives too), so a skipped step reads nothing and the kept state
    # passes through in place. Choosing afterwards instead (select(ok, new,
    # old) per leaf) keeps the old optimizer state alive next to the new
    # one: XLA then copies every moment buffer and recomputes the moments
    # in the params update (+10-19% of a small LM's step against +1-2% for
    # this cond).
    skip = functools.partial(_skip_branch, old_model_state)
    with jax.named_scope(GUARD_SCOPE):
        return jax.lax.cond(synced.ok, update, skip, *operands)


def _update_branch(complete, rest, extra, summed, rest_state, params, model_state, sync_state):
    """The update: the mean (the sync link's ``complete``), ``rest``, the new params.

    In the guarded chain the mean is finished here, where XLA fuses it into
    the optimizer's read of it.
    """
    if complete is not None:
        mean, sync_state = complete(summed)
    else:
        mean = summed
    updates, rest_state = rest.update(mean, rest_state, params, **extra)
    return optax.apply_updates(params, updates), rest_state, model_state, sync_state


def _skip_branch(old_model_state, summed, rest_state, params, model_state, sync_state):
    """A skipped step: everything as it was before the step, but that an accumulation
    (:func:`adaptjax.accumulate`) counts it as a micro-step (``skip_micro_step``)."""
    return params, skip_micro_step(rest_state), old_model_state, sync_state


def _step_outputs(config: _StepConfig, state, synced: _Synced, updated, aux, in_sync: bool):
    """``(new state, metrics)`` of the step from the updated parts."""
    new_params, rest_state, model_state, sync_state = updated
    opt_state = rest_state
    if in_sync:  # guarded_sync(config.tx): a SyncChain
        tx = config.tx
        assert isinstance(tx, SyncChain)
        opt_state = tx.join_state(sync_state, rest_state)
    aux = _gather_aux(aux, config.axis_name)
    skipped = ~synced.ok
    before = skipped_before(state.opt_state)  # accumulating: a micro-step of it was skipped
    if before is not None:  # on its last micro-step: the optimizer step was skipped
        skipped = skipped | before
    scalars = {"loss": synced.loss, "nonfinite": skipped.astype(jnp.float32)}
    if config.loss_scale is not None:  # skipped: shrink; `period` finite in a row: grow
        opt_state = adjust_in(opt_state, config.loss_scale, synced.ok)
        scalars["loss_scale"] = current_loss_scale(opt_state)
    scalars.update(collect_metrics(opt_state))
    # one vector: one output buffer per device instead of one per metric
    metrics = Metrics.pack(scalars, {"aux": aux} if config.has_aux else None)
    new_state = dataclasses.replace(
        state,
        step=state.step + 1,
        params=new_params,
        opt_state=to_global(opt_state),
        nonfinite_count=state.nonfinite_count + (~synced.ok).astype(jnp.int32),
        model_state=model_state,
    )
    return new_state, metrics
