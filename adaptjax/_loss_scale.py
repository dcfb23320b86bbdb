"""Dynamic loss scaling for float16 compute, as an optax transformation.

float16 has 10 mantissa bits and a smallest normal value of about 6e-5:
gradients of a float16 backward pass underflow to zero. Multiplying the loss
by a large scale ``S`` before differentiating lifts them into float16's range;
dividing the gradients by ``S`` afterwards (in float32) gives the true
gradient. ``S`` is chosen on line (Micikevicius et al., 2018; the state
machine of ``jmp.DynamicLossScale`` and PyTorch's ``GradScaler``):

* a step whose scaled gradients hold an ``inf`` or ``NaN`` (on any replica)
  is skipped: no parameter moves, the wrapped optimizer's state is kept, and
  ``S`` shrinks to ``max(S / factor, min_scale)``;
* after ``period`` consecutive finite steps ``S`` grows to ``S * factor``
  (unless that is not finite in float32) and the count starts again.

The scale and the count live in ``LossScaleState``, part of the optimizer
state and so of :class:`adaptjax.TrainState`: checkpoints save and restore them
with everything else.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Self

import jax
import jax.numpy as jnp
import optax

from adaptjax._data import check_count
from adaptjax._sync import check_axes_bound


class LossScaleState(NamedTuple):
    """State of :func:`dynamic_loss_scale`.

    Attributes:
      scale: float32, the factor the loss is multiplied by before differentiation.
      good_steps: int32, consecutive finite steps since the scale last changed.
      inner_state: the wrapped transformation's state.
    """

    scale: jax.Array
    good_steps: jax.Array
    inner_state: Any


def _is_state(node) -> bool:
    return isinstance(node, LossScaleState)


def _states(opt_state) -> list[LossScaleState]:
    return [n for n in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(n)]


def has_loss_scale(opt_state) -> bool:
    """Whether ``opt_state`` (or a train state) holds a ``LossScaleState``."""
    return bool(_states(opt_state))


def current_loss_scale(opt_state: Any) -> jax.Array:
    """The loss scale in ``opt_state`` (float32); ``1.0`` when it holds none.

    Multiply the loss by it before differentiating; :func:`dynamic_loss_scale`
    divides the gradients by it again. Works inside ``jit`` and ``shard_map``
    (read the state the step received) and on a whole :class:`adaptjax.TrainState`.

    Args:
      opt_state: an optimizer state, or a train state.

    Returns:
      A float32 scalar.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> tx = adaptjax.dynamic_loss_scale(optax.sgd(0.1), initial_scale=1024.0)
      >>> float(adaptjax.current_loss_scale(tx.init({"w": jnp.zeros(2)})))
      1024.0
      >>> float(adaptjax.current_loss_scale(optax.sgd(0.1).init({"w": jnp.zeros(2)})))
      1.0
    """
    found = _states(opt_state)
    if len(found) > 1:
        raise ValueError(
            f"the optimizer state holds {len(found)} loss scales; wrap the optimizer in "
            "adaptjax.dynamic_loss_scale once"
        )
    if not found:
        return jnp.ones((), jnp.float32)
    return found[0].scale


def split_loss_scale(opt_state) -> tuple[Any, LossScaleState | None]:
    """``(inner state, the LossScaleState)`` of a wrapped state; ``(opt_state, None)`` else.

    Looks through one :func:`dynamic_loss_scale` around a chain's link, as
    the :class:`adaptjax.Controller` puts it around its ``"optimizer"`` link
    under float16: readers of the optimizer's own state (its injected
    hyperparameters, its per-replica marks) read ``inner``.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> from adaptjax._loss_scale import split_loss_scale
      >>> sgd = optax.sgd(0.1)
      >>> inner, scaled = split_loss_scale(adaptjax.dynamic_loss_scale(sgd).init(jnp.zeros(2)))
      >>> type(inner).__name__, float(scaled.scale)
      ('tuple', 32768.0)
      >>> split_loss_scale(sgd.init(jnp.zeros(2)))[1] is None
      True
    """
    if _is_state(opt_state):
        return opt_state.inner_state, opt_state
    return opt_state, None


def adjust_in(opt_state, loss_scale: LossScaled, finite):
    """``opt_state`` with each ``LossScaleState`` in it moved by ``loss_scale.adjust``."""
    return jax.tree.map(
        lambda n: loss_scale.adjust(n, finite) if _is_state(n) else n, opt_state, is_leaf=_is_state
    )


class LossScaled(optax.GradientTransformationExtraArgs):
    """What :func:`dynamic_loss_scale` returns: the transformation, plus its parts.

    ``inner`` is the wrapped transformation and :meth:`adjust` the state
    machine alone, so a step that checks finiteness itself (e.g.
    :func:`adaptjax.data_parallel_step`'s guard, given ``loss_scale=``) can
    run ``inner`` on the unscaled gradients and then move the scale with the
    same rules: ``update(..., loss_scaled=True)`` (an extra argument) runs
    only ``inner``, on gradients the caller has unscaled already, and leaves
    the scale and the count to the caller's :meth:`adjust`.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> tx = adaptjax.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0, period=1)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> float(tx.adjust(state, True).scale), float(tx.adjust(state, False).scale)
      (8.0, 2.0)
    """

    inner: optax.GradientTransformation
    initial_scale: float
    _adjust: Callable[[LossScaleState, Any], LossScaleState]

    def __new__(
        cls,
        init: optax.TransformInitFn,
        update: Callable[..., Any],
        inner: optax.GradientTransformation,
        adjust: Callable[[LossScaleState, Any], LossScaleState],
        initial_scale: float,
    ) -> Self:
        self = super().__new__(cls, init, update)
        self.inner = inner
        self._adjust = adjust
        self.initial_scale = initial_scale
        return self

    def adjust(self, state: LossScaleState, finite: jax.typing.ArrayLike) -> LossScaleState:
        """``state`` after a step whose gradients were ``finite`` (a bool scalar)."""
        return self._adjust(state, finite)

    def wrap_state(self, inner_state: Any) -> LossScaleState:
        """This transformation's state around an existing ``inner`` state (a fresh scale).

        For a run that moves to float16 mid-way: its optimizer state carries
        on inside; ``state.inner_state`` is the way back.
        """
        return LossScaleState(
            scale=jnp.asarray(self.initial_scale, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            inner_state=inner_state,
        )


def _check(initial_scale, period, factor, min_scale) -> tuple[float, int, float, float]:
    owner = "dynamic_loss_scale"
    values = {"initial_scale": initial_scale, "factor": factor, "min_scale": min_scale}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{owner}: {name} must be a number, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{owner}: {name} must be finite and > 0, got {value!r}")
    if factor <= 1:
        raise ValueError(
            f"{owner}: factor must be > 1 (the scale grows and shrinks by it), got {factor!r}"
        )
    if min_scale > initial_scale:
        raise ValueError(
            f"{owner}: min_scale={min_scale!r} is above initial_scale="
            f"{initial_scale!r}; use min_scale <= initial_scale"
        )
    period = check_count(period, f"{owner}: period", positive=True)
    return float(initial_scale), period, float(factor), float(min_scale)


def check_loss_scale_options(options: Mapping[str, Any] | None, owner: str) -> dict[str, Any]:
    """``options``: keyword arguments of :func:`dynamic_loss_scale` but ``inner`` and
    ``axis_name`` (``initial_scale``, ``period``, ``factor``, ``min_scale``), checked
    as it checks them; a one-line ``ValueError`` (naming ``owner``) for anything else.

    Example:
      >>> from adaptjax._loss_scale import check_loss_scale_options
      >>> check_loss_scale_options({"period": 10}, "Controller(loss_scale=...)")
      {'period': 10}
      >>> check_loss_scale_options({"growth": 2}, "Controller(loss_scale=...)")
      Traceback (most recent call last):
      ...
      ValueError: Controller(loss_scale=...): unknown option 'growth'; use initial_scale, period, factor, min_scale
    """  # noqa: E501
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ValueError(
            f"{owner} must be a dict of dynamic_loss_scale's options (e.g. {{'period': 200}}), "
            f"got {options!r}"
        )
    known = [n for n in inspect.signature(dynamic_loss_scale).parameters
             if n not in ("inner", "axis_name")]
    for name in options:
        if name not in known:
            raise ValueError(f"{owner}: unknown option {name!r}; use {', '.join(known)}")
    defaults = {n: inspect.signature(dynamic_loss_scale).parameters[n].default for n in known}
    _check(*({**defaults, **options}[n] for n in known))
    return dict(options)


def _all_finite(tree) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.bool_(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _varying(x) -> frozenset:
    """The shard_map axes an array (or a ``ShapeDtypeStruct``) varies over; empty outside."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10; earlier: vma
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _varying_as(x, like):
    """``x`` marked varying over the axes ``like`` varies over and ``x`` does not."""
    missing = tuple(sorted(_varying(like) - _varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    initial_scale: float = 2.0**15,
    period: int = 2000,
    factor: float = 2.0,
    min_scale: float = 1.0,
) -> LossScaled:
    """Wraps ``inner`` to receive gradients of a loss scaled by the current loss scale.

    The step multiplies the loss by :func:`adaptjax.current_loss_scale` of the
    optimizer state before differentiating; ``update`` then divides the
    gradients by the scale (in their own dtype: float32 for float32 master
    weights), checks them, and either runs ``inner`` on them (finite) or skips
    (zero updates, ``inner``'s state kept), then moves the scale by the rules
    in the module docstring. With ``axis_name`` (inside ``shard_map`` or
    ``pmap``) one scalar all-reduce makes every replica agree on the verdict
    (a single replica's ``inf`` skips the step everywhere), so the replicas
    stay identical; put ``adaptjax.sync_gradients`` inside ``inner`` so it
    sees true-scale gradients. ``inner``'s update runs inside ``lax.cond``:
    a skipped step sends no gradient.

    In :func:`adaptjax.data_parallel_step` pass it as ``loss_scale=`` too:
    the step then scales the loss, unscales each micro-batch's gradients in
    float32 (so its non-finite guard, ``micro_sqnorm`` and the monitors see
    true-scale values), skips a non-finite step on every replica, and moves
    the scale after the skip-or-apply branch; ``update`` receives
    ``loss_scaled=True`` and runs only ``inner``. Wrap just the optimizer
    link there (``adaptjax.sync.sync_chain(dynamic_loss_scale(opt))``, or
    ``optax.chain(sync_gradients("data"), dynamic_loss_scale(opt))``); in
    ``sync_chain``'s chain the guard then rides the gradients' all-reduce.

    Args:
      inner: the transformation to wrap (the sync and the optimizer).
      axis_name: the data-parallel axis; ``None`` outside ``shard_map``.
      initial_scale: the first scale (``2**15``: the largest power of two that
        a float16 cotangent can hold).
      period: finite steps after which the scale grows.
      factor: the scale's growth and shrink factor, > 1.
      min_scale: the scale never shrinks below it.

    Returns:
      A ``LossScaled`` transformation with ``LossScaleState`` state.

    Example:
      >>> import jax, jax.numpy as jnp, optax, adaptjax
      >>> tx = adaptjax.dynamic_loss_scale(optax.sgd(1.0), initial_scale=8.0, period=2)
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> scale = adaptjax.current_loss_scale(state)
      >>> grads = jax.grad(lambda p: scale * jnp.sum(p["w"] ** 2))(params)  # 8 * 2w
      >>> updates, state = tx.update(grads, state, params)
      >>> updates["w"].tolist(), float(state.scale), int(state.good_steps)
      ([-2.0, -2.0], 8.0, 1)
      >>> _, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
      >>> float(state.scale), int(state.good_steps)   # skipped: shrunk, count reset
      (4.0, 0)
    """
    initial_scale, period, factor, min_scale = _check(initial_scale, period, factor, min_scale)
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return wrap(inner.init(params))

    def adjust(state: LossScaleState, finite) -> LossScaleState:
        finite = jnp.asarray(finite, jnp.bool_)
        due = state.good_steps + 1 >= period
        bigger = state.scale * factor
        kept = jnp.where(due & jnp.isfinite(bigger), bigger, state.scale)
        shrunk = jnp.maximum(state.scale / factor, jnp.float32(min_scale))
        return state._replace(
            scale=jnp.where(finite, kept, shrunk).astype(jnp.float32),
            good_steps=jnp.where(finite & ~due, state.good_steps + 1, 0).astype(jnp.int32),
        )

    def update(updates, state: LossScaleState, params=None, *, loss_scaled=False, **extra):
        if loss_scaled:
            # The step unscaled the gradients, checked them and moves the scale itself.
            new_updates, inner_state = inner.update(updates, state.inner_state, params, **extra)
            return new_updates, state._replace(inner_state=inner_state)
        if axis_name is not None:
            check_axes_bound(axis_name, f"dynamic_loss_scale(axis_name={axis_name!r})")
        inv = 1.0 / state.scale
        grads = jax.tree.map(lambda g: (g * inv).astype(g.dtype), updates)
        finite = _all_finite(updates)
        if axis_name is not None:
            bad = jax.lax.psum(jnp.where(finite, 0.0, 1.0).astype(jnp.float32), axis_name)
            finite = bad == 0

        def run(grads, inner_state):
            return inner.update(grads, inner_state, params, **extra)

        # Under shard_map(check_vma=True) both branches must vary over the same axes.
        ran = jax.eval_shape(run, grads, state.inner_state)

        def skip(grads, inner_state):
            zeros = jax.tree.map(lambda s: _varying_as(jnp.zeros(s.shape, s.dtype), s), ran[0])
            return zeros, jax.tree.map(_varying_as, inner_state, ran[1])

        new_updates, inner_state = jax.lax.cond(finite, run, skip, grads, state.inner_state)
        return new_updates, adjust(state._replace(inner_state=inner_state), finite)

    transformation = LossScaled(init, update, inner, adjust, initial_scale)
    wrap = transformation.wrap_state
    return transformation
