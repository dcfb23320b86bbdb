"""1-bit Adam (Tang et al. 2021): a dense Adam warm-up, then 1-bit momentum.

The factory :func:`onebit_adam` is the optimizer and the sync in one optax
transformation: it takes each replica's gradient inside ``shard_map`` and
replaces ``adaptjax.sync_gradients(...)`` + ``optax.adam(...)`` in a chain.

* **Warm-up** (``count < freeze_step``): one dense all-reduce of the
  gradients, then :func:`optax.scale_by_adam` on their mean, exactly as
  ``optax.adam`` (``optax.adamw`` with ``weight_decay``) computes it.
* **Compressed** (from ``freeze_step`` on): the second moment ``nu`` stays as
  the warm-up left it; each replica updates the momentum with its own
  gradient, ``m_i = b1·m + (1 − b1)·g_i``, and the momentum codec (default
  :func:`adaptjax.compression.onebit`, EF14) averages the ``m_i`` in its
  two-stage owner-compute exchange (all-to-all of the replicas' 1-bit codes,
  each owner averages and re-encodes its chunk, all-gather); the compressed
  mean replaces ``m`` on every replica.

Differences from DeepSpeed's ``OnebitAdam`` (``deepspeed/runtime/fp16/onebit/adam.py``
and ``NcclBackend.compressed_allreduce``), each chosen for a reason:

* Bias correction: ``optax.adam`` corrects both moments, so the warm-up does
  too (it must equal ``optax.adam``); after the freeze ``m`` keeps its
  correction ``1/(1 − b1^t)`` and the frozen ``nu`` keeps the one of its last
  update, ``1/(1 − b2^freeze_step)``, so the step is continuous at the freeze
  (the state counts ``nu``'s updates, so a ``freeze_step`` set below the step
  count, as a controller's ``SetHyperparams`` lands a step late, freezes at
  once and stays continuous).
  DeepSpeed corrects neither moment in either phase.
* Scale: the project's sign format sends ``mean |x|`` per block of ``block``
  elements (the scale minimising ``‖x − s·sign(x)‖²``); DeepSpeed sends one
  ``‖x‖₂/√d`` per tensor (worker) or per chunk (server).
* Two safeguards of the frozen variance (DeepSpeed has neither built in):
  where ``nu`` is exactly 0 (every warm-up gradient there was 0: a dead
  unit, a byte never seen) the momentum is set to 0 after each exchange,
  DeepSpeed's ``exp_avg_mask`` found automatically (signs cannot send a 0,
  and ``m/(0 + eps)`` is ``1e8·m``); and each element's step ``m̂/(√ν̂ + eps)``
  is clipped to Adam's own bound (``adam_step_bound``, 3.16 at the
  defaults). Without them a frozen ``nu`` of 1e-18 (a nearly dead ReLU unit
  after a short warm-up) turns the block-wide magnitude of the 1-bit momentum
  into steps of 1e5·lr, and the flax MNIST-tutorial CNN diverged on the
  first compressed step.
* Server error: the owner's re-encoding error joins its own worker residual
  (``N`` times it, on the chunk it owns) instead of a separate server buffer,
  so ``mean_i(e_i)`` is the whole debt (see :mod:`adaptjax.compression._base`).
"""

from __future__ import annotations

from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import optax
from adaptjax.compression._base import Codec, CompressionState
from adaptjax.compression._collectives import axis_arg, axis_tuple, bound_size
from adaptjax.compression._quantizers import onebit

from adaptjax._sync import codec_sync


class OnebitAdamState(NamedTuple):
    """State of :func:`onebit_adam` (the local view, as ``update`` sees it).

    Attributes:
      count: int32 number of updates so far (the warm-up ends at ``freeze_step``).
      mu: the momentum, the same on every replica (after the freeze, the
        compressed mean of the replicas' momenta).
      nu: the second moment; constant from ``freeze_step`` on.
      nu_count: int32 updates ``nu`` has taken (the warm-up's steps): the frozen
        ``nu``'s bias correction, right even when ``freeze_step`` is set below
        ``count`` (a freeze that lands late freezes at once).
      feedback: the momentum codec's state (a
        ``CompressionState``): its error-feedback
        residuals are :class:`adaptjax.PerReplica` (merge ``"mean"``), zero
        until the freeze.
    """

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    nu_count: jax.Array
    feedback: CompressionState
    # It all-reduces the gradients itself: the controller's chain must not (adaptjax._codec).
    _syncs_gradients = True


def _check_freeze_step(freeze_step) -> None:
    if isinstance(freeze_step, jax.Array):  # injected by optax.inject_hyperparams
        return
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
        raise ValueError(
            f"freeze_step must be an integer >= 1 (dense Adam steps before the variance "
            f"freezes), got {freeze_step!r}; e.g. freeze_step=1000"
        )


def adam_step_bound(b1, b2) -> jax.Array:
    """Adam's bound on ``|m̂/√v̂|``: ``(1 − b1)/√(1 − b2)`` where that exceeds 1, else 1.

    Kingma & Ba 2015, section 2.1 (3.16 at the defaults). Adam's own ``v``
    grows with the gradient and keeps its step under it; a frozen ``v`` does
    not, so 1-bit Adam clips its compressed-phase step to it.
    """
    return jnp.maximum(1.0, (1 - b1) / jnp.sqrt(1 - b2))  # arrays under inject_hyperparams


def onebit_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    freeze_step: int = 1000,
    axis_name: str | tuple[str, ...] = "data",
    codec: Codec | None = None,
) -> optax.GradientTransformationExtraArgs:
    """1-bit Adam: Adam whose momentum crosses the wire at 1 bit per element.

    For ``freeze_step`` steps it is ``optax.adam`` (``optax.adamw`` when
    ``weight_decay`` is not 0) on the mean gradient, after one dense
    all-reduce, bit for bit. Then the second moment is frozen and each replica
    sends its momentum ``b1·m + (1 − b1)·g_i`` through ``codec`` (error
    feedback keeps what the signs lost and sends it later); the mean is the
    new momentum (0 where ``ν`` is 0), and the update is ``m̂ / (√ν̂ + eps)``
    with ``ν̂`` frozen, clipped elementwise to Adam's bound ``(1 − b1)/√(1 − b2)``
    (module docstring: bias correction, the safeguards, the differences from
    DeepSpeed).

    Give it each replica's gradient inside ``jax.shard_map`` over
    ``axis_name`` (or :func:`adaptjax.data_parallel_step`): it syncs them
    itself, so it replaces ``sync_gradients`` and ``optax.adam`` in a chain.
    As :class:`adaptjax.Controller`'s ``optimizer=`` it gets each replica's gradient
    too (the controller finds this state in the optimizer's), and a policy's
    ``SetHyperparams({"freeze_step": k})`` turns a run started as Adam
    (``freeze_step=2**30``) into 1-bit Adam without a compile, keeping ``mu`` and ``nu``.
    The step switches phase with a ``lax.cond`` on ``count``, so the program
    holds both phases' collectives (``adaptjax.wire_bytes(...).branch_totals()``
    gives each). Its error-feedback residuals are per replica
    (:class:`adaptjax.PerReplica`), so :func:`adaptjax.init_state` shards
    them and a rescale keeps their mean (the debt owed to the momentum).

    On a sharded mesh (``adaptjax.make_mesh({"data": 2, "fsdp": 4})``) the
    step passes its ``shard_layout`` and the codec compresses each device's
    shard of the momentum over the data axis, as ``sync_gradients`` runs a codec.

    Args:
      learning_rate: a step size or a schedule of the step count
        (``optax.inject_hyperparams`` can set it).
      b1: decay of the momentum.
      b2: decay of the second moment (during the warm-up).
      eps: added to ``√ν̂`` in the denominator.
      weight_decay: decoupled weight decay (AdamW); needs ``params`` unless it
        is the number 0 (``optax.inject_hyperparams`` makes it an array).
      freeze_step: dense Adam steps before the variance freezes (>= 1); a
        hyperparameter of ``optax.inject_hyperparams`` too (an int32 in its state).
      axis_name: the data-parallel axis (or tuple of axes) bound by ``shard_map``.
      codec: the momentum's codec; default ``adaptjax.compression.onebit()``
        (1 bit and one float32 scale per 512 elements, EF14; leaves under
        1024 elements go in a float32 psum).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with an
      ``OnebitAdamState``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, adaptjax
      >>> from adaptjax import compression as ajc
      >>> tx = optax.inject_hyperparams(ajc.onebit_adam, hyperparam_dtype=jnp.float32)(
      ...     1e-3, freeze_step=100)
      >>> mesh = adaptjax.make_mesh(8)
      >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
      >>> state = adaptjax.init_state({"w": jnp.zeros((4096, 2))}, tx, mesh)
      >>> step = adaptjax.data_parallel_step(loss, tx, mesh)
      >>> batch = {"x": np.ones((16, 4096), np.float32), "y": np.ones((16, 2), np.float32)}
      >>> state, metrics = step(state, batch)
      >>> int(state.opt_state.inner_state.count)
      1

    References:
      Tang et al., "1-bit Adam: Communication efficient large-scale training
      with Adam's convergence speed", ICML 2021.
    """
    _check_freeze_step(freeze_step)
    if codec is None:
        codec = onebit(axis_name=axis_name)
    elif not isinstance(codec, Codec):
        raise ValueError(
            f"codec must be an adaptjax.compression codec, got {codec!r}; e.g. "
            "adaptjax.compression.onebit(block=256)"
        )
    bound = adam_step_bound(b1, b2)
    decay = not (isinstance(weight_decay, int | float) and weight_decay == 0)
    adam = optax.scale_by_adam(b1, b2, eps)
    scale = optax.scale_by_learning_rate(learning_rate)

    def init_fn(params):
        return OnebitAdamState(
            count=jnp.zeros((), jnp.int32),
            mu=optax.tree.zeros_like(params),
            nu=optax.tree.zeros_like(params),
            nu_count=jnp.zeros((), jnp.int32),
            feedback=codec.init(params),
        )

    def update_fn(updates, state, params=None, *, shard_layout=None, **extra):
        del extra
        if decay and params is None:
            raise ValueError(
                "onebit_adam with weight_decay needs params: call update(grads, state, params) "
                "(under optax.inject_hyperparams a weight_decay of 0 is a hyperparameter too: "
                "pass static_args=('weight_decay',) to leave it out)")
        names = axis_tuple(axis_name)
        n = bound_size(names)

        def warm_up():
            mean = updates if n == 1 else jax.tree.map(
                lambda s: s / n, jax.lax.psum(updates, axis_arg(names)))
            out, s = adam.update(mean, optax.ScaleByAdamState(state.count, state.mu, state.nu))
            s = cast(optax.ScaleByAdamState, s)
            return out, s.mu, s.nu, jnp.asarray(s.count), state.feedback

        def compressed():
            local = optax.tree.update_moment(updates, state.mu, b1, 1)
            mu, feedback = codec_sync(codec, local, state.feedback, axis_name=axis_name,
                                      step=state.count, layout=shard_layout)
            mu = jax.tree.map(lambda m, v: jnp.where(v == 0, jnp.zeros_like(m), m), mu, state.nu)
            count_inc = optax.safe_increment(state.count)
            mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
            nu_hat = optax.tree.bias_correction(state.nu, b2, state.nu_count)
            out = jax.tree.map(lambda m, v: jnp.clip(m / (jnp.sqrt(v) + eps), -bound, bound),
                               mu_hat, nu_hat)
            return out, mu, state.nu, state.nu_count, feedback

        out, mu, nu, nu_count, feedback = jax.lax.cond(
            state.count < freeze_step, warm_up, compressed)
        if decay:
            out, _ = optax.add_decayed_weights(weight_decay).update(out, optax.EmptyState(), params)
        lr_state = (optax.ScaleByScheduleState(count=state.count) if callable(learning_rate)
                    else optax.EmptyState())
        out, _ = scale.update(out, lr_state)
        return out, OnebitAdamState(jnp.asarray(optax.safe_increment(state.count)), mu, nu,
                                    nu_count, feedback)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

