"""Gradient accumulation over steps, with the number of micro-steps set at run time.

``optax.MultiSteps`` accumulates gradients for ``k`` calls and applies the inner
optimizer on the ``k``-th, with ``k`` from a schedule of the step count.
:func:`accumulate` does the same for a chain that synchronises gradients
(``optax.chain(adaptjax.sync_gradients(...), ...)``) inside a data-parallel
step, with two differences that matter there:

* it accumulates each replica's *own* gradients (per-replica state) and runs
  the inner chain, and with it the collective, only on the last micro-step, so
  a batch of ``k`` micro-steps costs one exchange;
* ``k`` is a number in the state (:func:`set_micro_steps`), so a controller can
  grow the batch without compiling: the step's shapes never change, and the
  memory per device stays that of one micro-batch however large the batch.

The monitors see the micro-steps as gradient samples: the inner update
receives ``microbatches=k`` (times the step's own micro-batches) and the sum of
the micro-steps' squared gradient norms, so the noise scale measures at the
batch the optimizer steps with.

A micro-step that :func:`adaptjax.data_parallel_step` skips (its loss or
gradients not finite) still counts (:func:`skip_micro_step`), and the
optimizer step it belongs to is skipped whole: the inner chain does not run
on its ``k``-th micro-step, and the step's metric ``nonfinite`` is 1 on the
micro-steps from the skipped one to the ``k``-th. So
every ``k`` calls are one optimizer step, taken or skipped, whatever the
data: a caller that dispatches ``k`` calls per step stays in step with the
state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from adaptjax._per_replica import PerReplica
from adaptjax._tree import tree_sq_norm


class AccumulateState(NamedTuple):
    """State of :func:`accumulate`.

    Attributes:
      micro_step: int32, micro-steps accumulated since the last update.
      micro_steps: int32, micro-steps per optimizer step (``k``).
      skipped: int32, 1 when a micro-step since the last update was skipped
        (non-finite): the optimizer step they make up is skipped whole.
      grads: this replica's sum of the accumulated gradients (:class:`PerReplica`).
      sqnorm: float32, this replica's sum of their squared norms (:class:`PerReplica`).
      loss: float32, this replica's sum of its losses (``replica_loss=``, when the
        step passes it; :class:`PerReplica`).
      inner_state: the inner transformation's state.
    """

    micro_step: jax.Array
    micro_steps: jax.Array
    skipped: jax.Array
    grads: PerReplica
    sqnorm: PerReplica
    loss: PerReplica
    inner_state: Any


def accumulate(
    inner: optax.GradientTransformation, micro_steps: int = 1
) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner`` once every ``micro_steps`` calls, on the mean of their gradients.

    Args:
      inner: the transformation to run on the accumulated gradients, usually
        ``optax.chain(adaptjax.sync_gradients(...), optimizer)``; it receives
        this replica's mean gradient over the micro-steps.
      micro_steps: micro-steps per optimizer step at the start; change it in
        the state with :func:`set_micro_steps` (no compile).

    Returns:
      A transformation whose updates are zero on the micro-steps between.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> tx = adaptjax.accumulate(optax.sgd(1.0), micro_steps=2)
      >>> state = tx.init({"w": jnp.zeros(())})
      >>> u1, state = tx.update({"w": jnp.float32(1.0)}, state)
      >>> u2, state = tx.update({"w": jnp.float32(3.0)}, state)
      >>> float(u1["w"]), float(u2["w"])
      (0.0, -2.0)
    """
    if int(micro_steps) < 1:
        raise ValueError(f"micro_steps must be >= 1, got {micro_steps}")

    def init(params) -> Any:
        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        return AccumulateState(
            micro_step=jnp.zeros((), jnp.int32),
            micro_steps=jnp.asarray(micro_steps, jnp.int32),
            skipped=jnp.zeros((), jnp.int32),
            grads=PerReplica(zeros),
            sqnorm=PerReplica(jnp.zeros((), jnp.float32)),
            loss=PerReplica(jnp.zeros((), jnp.float32)),
            inner_state=inner.init(params),
        )

    def update(updates, state, params=None, **extra):
        k_in = int(extra.get("microbatches", 1) or 1)
        if k_in > 1 and extra.get("micro_sqnorm") is not None:
            sq = extra["micro_sqnorm"]
        elif extra.get("local_sqnorm") is not None:
            sq = extra["local_sqnorm"]
        else:
            sq = tree_sq_norm(updates)
        grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), state.grads.value, updates)
        sqnorm = state.sqnorm.value + jnp.asarray(sq, jnp.float32)
        loss = state.loss.value
        if extra.get("replica_loss") is not None:
            loss = loss + jnp.asarray(extra["replica_loss"], jnp.float32)
        step = state.micro_step + 1

        def fresh(inner_state):  # the next optimizer step's first micro-step comes next
            zero = jax.tree.map(jnp.zeros_like, grads)
            scalar = PerReplica(jnp.zeros((), jnp.float32))
            return AccumulateState(jnp.zeros_like(step), state.micro_steps,
                                   jnp.zeros_like(state.skipped), PerReplica(zero), scalar,
                                   scalar, inner_state)

        def run(_):
            k = state.micro_steps
            mean = jax.tree.map(lambda a, g: (a / k).astype(g.dtype), grads, updates)
            inner_extra = {key: v for key, v in extra.items() if key != "local_sqnorm"}
            inner_extra.update(microbatches=k * k_in, micro_sqnorm=sqnorm)
            if extra.get("local_batch_size") is not None:
                inner_extra["local_batch_size"] = extra["local_batch_size"] * k
            if extra.get("replica_loss") is not None:  # the mean over the micro-steps
                inner_extra["replica_loss"] = loss / k
            out, inner_state = inner.update(mean, state.inner_state, params, **inner_extra)
            return out, fresh(inner_state)

        def drop(_):  # a micro-step of this optimizer step was skipped: it is skipped whole
            return jax.tree.map(jnp.zeros_like, updates), fresh(state.inner_state)

        def last(_):
            return jax.lax.cond(state.skipped > 0, drop, run, None)

        def between(_):
            zero = jax.tree.map(jnp.zeros_like, updates)
            return zero, state._replace(micro_step=step, grads=PerReplica(grads),
                                        sqnorm=PerReplica(sqnorm), loss=PerReplica(loss))

        return jax.lax.cond(step >= state.micro_steps, last, between, None)

    return optax.GradientTransformationExtraArgs(init, update)


def skip_micro_step(opt_state: Any) -> Any:
    """``opt_state`` after a micro-step that was skipped (non-finite), for each ``AccumulateState``.

    The micro-step counts: on the ``k``-th the optimizer step ends, skipped
    (nothing runs, the accumulator starts afresh); before it, the optimizer
    step goes on, marked ``skipped`` so that its last micro-step drops it.
    :func:`adaptjax.data_parallel_step` calls this in place of the update of
    a step it skips; without an ``AccumulateState`` it returns ``opt_state``.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> from adaptjax._accumulation import skip_micro_step
      >>> state = adaptjax.accumulate(optax.sgd(1.0), micro_steps=2).init({"w": jnp.zeros(())})
      >>> state = skip_micro_step(state)
      >>> int(state.micro_step), int(state.skipped)
      (1, 1)
      >>> u, state = adaptjax.accumulate(optax.sgd(1.0), 2).update({"w": jnp.float32(1.0)}, state)
      >>> float(u["w"]), int(state.micro_step), int(state.skipped)  # the step is dropped
      (0.0, 0, 0)
    """

    def one(x):
        if not isinstance(x, AccumulateState):
            return x
        step = x.micro_step + 1
        done = step >= x.micro_steps
        zero = lambda p: PerReplica(jax.tree.map(jnp.zeros_like, p.value), p.merge)  # noqa: E731
        return x._replace(micro_step=jnp.where(done, 0, step).astype(x.micro_step.dtype),
                          skipped=jnp.where(done, 0, 1).astype(x.skipped.dtype),
                          grads=zero(x.grads), sqnorm=zero(x.sqnorm), loss=zero(x.loss))

    return jax.tree.map(one, opt_state, is_leaf=lambda x: isinstance(x, AccumulateState))


def skipped_before(opt_state: Any) -> jax.Array | None:
    """Whether an optimizer step in progress in ``opt_state`` already skipped a micro-step
    (``None`` when ``opt_state`` holds no ``AccumulateState``)."""
    flags = [x.skipped > 0 for x in jax.tree.leaves(
        opt_state, is_leaf=lambda x: isinstance(x, AccumulateState))
        if isinstance(x, AccumulateState)]
    if not flags:
        return None
    return jnp.any(jnp.stack(flags))


def set_micro_steps(opt_state: Any, micro_steps: int) -> Any:
    """``opt_state`` with every ``AccumulateState``'s ``k`` set to ``micro_steps``.

    Takes effect from the micro-step in progress: set it between two
    optimizer steps (``micro_step`` 0) to change the batch there.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> state = adaptjax.accumulate(optax.sgd(0.1)).init({"w": jnp.zeros(2)})
      >>> int(adaptjax.set_micro_steps(state, 4).micro_steps)
      4
    """
    if int(micro_steps) < 1:
        raise ValueError(f"micro_steps must be >= 1, got {micro_steps}")
    found = []

    def one(x):
        if isinstance(x, AccumulateState):
            found.append(x)
            return x._replace(micro_steps=jnp.full_like(x.micro_steps, micro_steps))
        return x

    out = jax.tree.map(one, opt_state, is_leaf=lambda x: isinstance(x, AccumulateState))
    if not found:
        raise ValueError("the optimizer state holds no adaptjax.accumulate(...) state; build "
                         "the optimizer with adaptjax.accumulate(tx) to set micro-steps")
    return out
