"""The data-parallel step builder: ``jit`` + ``shard_map`` over a device mesh."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from adaptjax._chain import guarded_sync
from adaptjax._mesh import check_mesh
from adaptjax._metric_vector import Metrics
from adaptjax._metrics import collect_metrics
from adaptjax._per_replica import to_global, to_local
from adaptjax._state import (
    TrainState,
    fold_replica_into_keys,
    merge_model,
    model_state_after,
    train_state_specs,
)
from adaptjax._tree import tree_sq_norm
from adaptjax._wire import GUARD_SCOPE
from adaptjax._xla_options import step_compiler_options
from adaptjax.sync._registry import resolve_sync
from adaptjax.sync._strategy import find_model_sync, local_params

# On XLA:CPU a multi-device step launches on the client's thread pool, which
# has max(cores, devices) threads; a launch that finds a device's in-flight
# queue full blocks its pool thread, and a collective already queued then
# cannot get one thread per device: the process deadlocks with the CPU idle
# (8 simulated devices on a 2-core machine, the loop dispatching ahead without
# reading anything back). Waiting for the step dispatched this many calls ago
# keeps the queue short; the device stays busy, only the host waits.
CPU_MAX_STEPS_IN_FLIGHT = 4


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

    def __init__(self, fn, *, mesh, axis_name, microbatches, n_replicas, sync=None):
        self.jitted = fn
        self.sync = sync  # the SyncStrategy the step was built for (None: not given)
        self.mesh = mesh
        self.axis_name = axis_name
        self.microbatches = microbatches
        self.n_replicas = n_replicas
        on_cpu = mesh.devices.flat[0].platform == "cpu"
        self._max_in_flight = CPU_MAX_STEPS_IN_FLIGHT if on_cpu else None
        self._in_flight: collections.deque = collections.deque()

    def check_batch(self, batch) -> int:
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

    def __call__(self, state: TrainState, batch):
        self.check_batch(batch)
        if self._max_in_flight is not None:
            while len(self._in_flight) >= self._max_in_flight:
                # the loss of an earlier step: an output, never donated
                jax.block_until_ready(self._in_flight.popleft())
        new_state, metrics = self.jitted(state, batch)
        if self._max_in_flight is not None:
            self._in_flight.append(metrics.values)  # an output, never donated
        return new_state, metrics

    def lower(self, state, batch):
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
    sync=None,
) -> DataParallelStep:
    """Builds ``step(state, batch) -> (state, metrics)``, jitted over ``mesh``.

    The global batch (every leaf's leading axis) is split over ``axis_name``;
    inside ``jax.shard_map`` each replica computes its gradient (accumulated
    over ``microbatches`` micro-batches with ``lax.scan``) and runs ``tx`` with
    the axis bound, so ``tx`` should contain :func:`adaptjax.sync_gradients` (or
    another cross-replica reduction). ``tx.update`` receives the extra
    arguments ``local_batch_size``, ``microbatches`` and ``micro_sqnorm``, and
    with ``skip_nonfinite`` and one micro-batch ``local_sqnorm`` (this replica's
    ``‖g‖²``, which the guard computes anyway).

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

    On CPU with a mesh over several processes (gloo), each gradient leaf keeps
    its own all-reduce (XLA:CPU's all-reduce combiner is off for the step), so
    the transfers overlap the rest of the backward pass.

    ``metrics`` is an :class:`adaptjax.Metrics` mapping (all scalars in one
    float32 vector, one buffer per device): ``loss`` (mean over the global
    batch), ``nonfinite`` (1.0 when this step was skipped), every monitor value
    (see :func:`adaptjax.read_metrics`) and, with ``has_aux``, the aux outputs
    averaged over replicas under ``aux``. Read them with one
    ``jax.device_get(metrics)``.

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
        With ``tx = adaptjax.chain(adaptjax.sync_gradients(...), ...)`` the
        check's two scalars ride in the gradients' all-reduce and only the
        links after the sync are skipped; with any other ``tx`` the check is
        an all-reduce of its own before the whole update.
      sync: the :class:`adaptjax.SyncStrategy` ``tx`` was built with (by
        :func:`adaptjax.sync_chain`), or its name; checked against the mesh
        (e.g. gossip needs two replicas) before anything compiles. Whatever
        it is, a replica differentiates at its local model when ``tx`` keeps
        one (:func:`adaptjax.local_params`) and ``tx.update`` then also
        receives ``local_params``.

    Returns:
      A :class:`DataParallelStep`.

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
    k = microbatches
    if sync is not None:
        resolve_sync(sync).check(n)

    def grad_of(params, model_state, graphdef, batch):
        """Loss, aux, grads and the model state the forward pass left behind."""

        def f(p):
            model = merge_model(graphdef, p, fold_replica_into_keys(model_state, axis_name))
            out = loss_fn(model, batch)
            loss, aux = out if has_aux else (out, ())
            return loss, (aux, model_state_after(model, model_state))

        (loss, (aux, new_model_state)), grads = jax.value_and_grad(f, has_aux=True)(params)
        return loss, aux, grads, new_model_state

    def local_step(state: TrainState, batch):
        state = dataclasses.replace(state, opt_state=to_local(state.opt_state))
        global_params = state.params
        has_local = find_model_sync(state.opt_state) is not None
        # strategies with local models: each replica differentiates at its own model
        params = local_params(global_params, state.opt_state)
        b = jax.tree.leaves(batch)[0].shape[0]
        if k == 1:
            loss, aux, grads, model_state = grad_of(
                params, state.model_state, state.graphdef, batch
            )
            micro_sq = None
        else:
            micro = jax.tree.map(lambda x: x.reshape(k, b // k, *x.shape[1:]), batch)

            def body(carry, mb):
                g_acc, l_acc, sq_acc, a_acc, ms = carry
                loss, aux, g, ms = grad_of(params, ms, state.graphdef, mb)
                g_acc = jax.tree.map(jnp.add, g_acc, g)
                a_acc = jax.tree.map(jnp.add, a_acc, aux)
                return (g_acc, l_acc + loss, sq_acc + tree_sq_norm(g), a_acc, ms), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            aux_shape = jax.eval_shape(
                lambda mb: grad_of(params, state.model_state, state.graphdef, mb)[1],
                jax.tree.map(lambda x: x[0], micro),
            )
            aux0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape)
            init = (
                zeros,
                jnp.zeros((), jnp.float32),
                jnp.zeros((), jnp.float32),
                aux0,
                state.model_state,
            )
            (g_sum, l_sum, micro_sq, a_sum, model_state), _ = jax.lax.scan(body, init, micro)
            grads = jax.tree.map(lambda g: g / k, g_sum)
            loss = l_sum / k
            aux = jax.tree.map(lambda a: a / k, a_sum)
        # replicated like the params: float variables (BatchNorm statistics) are
        # averaged over replicas; counts and keys are the same on every replica
        model_state = jax.tree.map(
            lambda x: jax.lax.pmean(x, axis_name) if jnp.issubdtype(x.dtype, jnp.floating) else x,
            model_state,
        )
        extra = {"local_params": params} if has_local else {}
        extra.update(local_batch_size=b, microbatches=k, micro_sqnorm=micro_sq)
        # With adaptjax.chain(sync_gradients(...), ...) the guard's scalars ride in
        # the gradients' all-reduce and only what follows the sync is skipped.
        in_sync = skip_nonfinite and guarded_sync(tx) and not has_local
        if skip_nonfinite:
            # Checked on the loss and the gradients, before the optimizer runs (as
            # optax.apply_if_finite and PyTorch's GradScaler check gradients), from
            # their sums over replicas, so every replica takes the same branch of
            # the lax.cond below.
            local_sq = tree_sq_norm(grads)
            guard = jnp.stack([loss.astype(jnp.float32), local_sq])
            if k == 1:
                # The guard has read every gradient already: the monitors take its
                # exact norm instead of reading (a chunk of) them again.
                extra["local_sqnorm"] = local_sq
        if in_sync:
            sync_state, rest_state = tx.split_state(state.opt_state)
            # The codec and the monitors run in the update branch below (`complete`),
            # so a skipped step keeps the sync's old state too (monitor EMAs, codec
            # residuals) and runs neither; a kept one writes it in place, the codec's
            # mean fused into the optimizer's read of it.
            summed, complete, sync_state, guard_sum = tx.sync.update_with_sums(
                grads, sync_state, global_params, guard, deferred=True, **extra
            )
            ok = jnp.all(jnp.isfinite(guard_sum))
            loss = guard_sum[0] / n
            rest = tx.rest
        else:
            if skip_nonfinite:
                # A collective of its own before the whole update (a barrier:
                # 2-4% of a small LM's step on 8 simulated CPU devices).
                mean_loss_sq = jax.lax.pmean(guard, axis_name)
                ok = jnp.all(jnp.isfinite(mean_loss_sq))
                loss = mean_loss_sq[0]
            else:
                ok = jnp.bool_(True)
                loss = jax.lax.pmean(loss.astype(jnp.float32), axis_name)
            summed, finish, rest, rest_state = grads, (lambda g: g), tx, state.opt_state
            sync_state = ()

        # In the fast path the mean is finished inside the branch, where XLA fuses
        # it into the optimizer's read of it.
        def update(summed, rest_state, params, model_state, sync_state):
            if in_sync:
                mean, sync_state = complete(summed)
            else:
                mean = finish(summed)
            updates, rest_state = rest.update(mean, rest_state, params, **extra)
            return optax.apply_updates(params, updates), rest_state, model_state, sync_state

        def skip(summed, rest_state, params, model_state, sync_state):
            return params, rest_state, state.model_state, sync_state

        operands = (summed, rest_state, global_params, model_state, sync_state)
        if skip_nonfinite:
            # The update runs inside the taken branch (without adaptjax.chain its
            # collectives too), so a skipped step reads nothing and the kept state
            # passes through in place. Choosing afterwards instead (select(ok, new,
            # old) per leaf) keeps the old optimizer state alive next to the new
            # one: XLA then copies every moment buffer and recomputes the moments
            # in the params update (+10-19% of a small LM's step against +1-2% for
            # this cond).
            with jax.named_scope(GUARD_SCOPE):
                new_params, rest_state, model_state, sync_state = jax.lax.cond(
                    ok, update, skip, *operands
                )
        else:
            new_params, rest_state, model_state, sync_state = update(*operands)
        opt_state = tx.join_state(sync_state, rest_state) if in_sync else rest_state
        aux = jax.lax.pmean(aux, axis_name)
        scalars = {"loss": loss, "nonfinite": (~ok).astype(jnp.float32)}
        scalars.update(collect_metrics(opt_state))
        # one vector: one output buffer per device instead of one per metric
        metrics = Metrics.pack(scalars, {"aux": aux} if has_aux else None)
        new_state = dataclasses.replace(
            state,
            step=state.step + 1,
            params=new_params,
            opt_state=to_global(opt_state),
            nonfinite_count=state.nonfinite_count + (~ok).astype(jnp.int32),
            model_state=model_state,
        )
        return new_state, metrics

    def step(state: TrainState, batch):
        specs = train_state_specs(state, axis_name)
        fn = jax.shard_map(
            local_step,
            mesh=mesh,
            in_specs=(specs, P(axis_name)),
            out_specs=(specs, P()),
            check_vma=False,
        )
        return fn(state, batch)

    jitted = jax.jit(
        step,
        donate_argnums=(0,) if donate else (),
        compiler_options=step_compiler_options(mesh),
    )
    return DataParallelStep(
        jitted,
        mesh=mesh,
        axis_name=axis_name,
        microbatches=k,
        n_replicas=n,
        sync=None if sync is None else resolve_sync(sync),
    )
