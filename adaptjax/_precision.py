"""Mixed precision: the dtype a step computes in, with float32 master weights.

A :class:`Precision` names three dtypes (as in DeepMind's ``jmp``): the one the
forward and backward passes compute in, the one parameters are kept in (always
float32 here: master weights and optimizer state never leave it), and the one
the loss function's outputs come back in. :func:`with_precision` applies it to
a loss function by casting at the function's edge, which works the same for a
plain pytree of parameters and for a flax NNX module:

* float leaves of the parameters (an NNX module's ``nnx.Param`` variables) and
  of the batch are cast to ``compute`` when the loss function is called, so
  every matmul of the model runs in ``compute``; integer leaves (labels,
  tokens, counts, RNG keys) are left alone;
* the loss (and aux) are cast back to ``output``;
* the cast is inside the differentiated function, so the gradient reaches the
  float32 master parameters as float32 (a cast's transpose casts back).

Why casting rather than flax NNX's ``dtype``/``param_dtype``: those are fixed
when the module is built and live in its graph definition, so moving a running
job between precisions would mean building another module and converting its
state. Casting at the edge leaves the model, the train state and its
checkpoints exactly as they are in float32: changing precision is a new
compiled step over the same state (a checkpoint written in one precision
resumes in another unchanged; float16 adds only its loss scale around the
optimizer's state, which the :class:`adaptjax.Controller` wraps and unwraps
on a switch), and it works for models that are not NNX at all. Inside the
model, what is not a parameter (NNX ``BatchStat`` running statistics, RNG
streams) stays in its own dtype; flax's normalisation layers reduce in float32
anyway.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

#: The dtypes a step may compute in.
DTYPES = ("float32", "bfloat16", "float16")
_ALIASES = {
    "f32": "float32",
    "fp32": "float32",
    "bf16": "bfloat16",
    "f16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def dtype_name(value: Any, *, owner: str, name: str, choices: tuple[str, ...] = DTYPES) -> str:
    """``value`` (a name, an alias such as ``"bf16"``, or a dtype) as one of ``choices``."""
    text = None
    if isinstance(value, str):
        text = _ALIASES.get(value.lower(), value.lower())
    else:
        try:
            text = np.dtype(value).name
        except TypeError:
            text = None
    if text not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{owner}: unknown {name} dtype {value!r}; use one of {allowed}")
    return text


def _is_float(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def cast_floats(tree, dtype):
    """``tree`` with every floating-point array leaf cast to ``dtype`` (others untouched).

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> out = cast_floats({"x": np.ones(2, np.float32), "y": np.arange(2)}, jnp.bfloat16)
      >>> str(out["x"].dtype), str(out["y"].dtype)
      ('bfloat16', 'int64')
    """
    dtype = jnp.dtype(dtype)

    def cast(x):
        if _is_float(x) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtypes of a training step: ``compute``, ``params`` (float32) and ``output``.

    Every field accepts a name (``"bfloat16"``), an alias (``"bf16"``) or a
    dtype and is stored as its canonical name, so equal precisions compare and
    hash alike (it keys compiled steps). Master weights and optimizer state are
    float32 always: ``params`` accepts nothing else, it exists so the three
    dtypes read as in ``jmp.Policy``. ``compute="float16"`` needs dynamic loss
    scaling: wrap the optimizer in :func:`adaptjax.dynamic_loss_scale` and pass
    it to :func:`adaptjax.data_parallel_step` as ``loss_scale=``
    (``check_precision`` and the step refuse float16 without). The
    :class:`adaptjax.Controller` does both itself (``precision="float16"``,
    the scale's options in ``loss_scale=``).

    Args:
      compute: the dtype the forward and backward passes run in.
      params: the dtype parameters are stored in: ``"float32"``.
      output: the dtype of the loss function's outputs (loss and aux).

    Example:
      >>> import adaptjax
      >>> p = adaptjax.Precision("bf16")
      >>> p
      Precision(compute='bfloat16', params='float32', output='float32')
      >>> p.key, adaptjax.Precision.of("bfloat16") == p
      ('bfloat16', True)
      >>> adaptjax.Precision("int8")
      Traceback (most recent call last):
      ...
      ValueError: Precision: unknown compute dtype 'int8'; use one of 'float32', 'bfloat16', 'float16'
    """  # noqa: E501

    compute: str = "float32"
    params: str = "float32"
    output: str = "float32"

    def __post_init__(self) -> None:
        owner = "Precision"
        object.__setattr__(self, "compute", dtype_name(self.compute, owner=owner, name="compute"))
        object.__setattr__(self, "output", dtype_name(self.output, owner=owner, name="output"))
        params = dtype_name(self.params, owner=owner, name="params")
        if params != "float32":
            raise ValueError(
                f"{owner}: params={params!r}, but master weights and optimizer state stay "
                f"float32; use params='float32' and compute={params!r}"
            )
        object.__setattr__(self, "params", params)

    @property
    def key(self) -> str:
        """Its short stable name, such as ``"bfloat16"`` or ``"float16,output=float16"``."""
        if self.output == "float32":
            return self.compute
        return f"{self.compute},output={self.output}"

    @classmethod
    def of(cls, value: Any) -> Precision:
        """A :class:`Precision` from one, from its :attr:`key`, or ``None`` (float32)."""
        if isinstance(value, Precision):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            compute, _, rest = value.partition(",")
            fields = {"compute": compute}
            for part in filter(None, rest.split(",")):
                name, eq, dtype = part.partition("=")
                if not eq or name not in ("params", "output"):
                    raise ValueError(
                        f"Precision: cannot read {value!r}; use a key such as 'bfloat16' or "
                        "'float16,output=float16'"
                    )
                fields[name] = dtype
            return cls(**fields)
        return cls(compute=value)

    @property
    def is_full(self) -> bool:
        """Whether nothing is cast (compute and output are float32)."""
        return self.compute == "float32" and self.output == "float32"

    @property
    def needs_loss_scale(self) -> bool:
        """Whether gradients underflow without loss scaling (``compute == "float16"``)."""
        return self.compute == "float16"

    def cast_to_compute(self, tree: Any) -> Any:
        """Float leaves of ``tree`` in ``compute``."""
        return cast_floats(tree, self.compute)

    def cast_to_output(self, tree: Any) -> Any:
        """Float leaves of ``tree`` in ``output``."""
        return cast_floats(tree, self.output)

    def cast_to_params(self, tree: Any) -> Any:
        """Float leaves of ``tree`` in ``params`` (float32)."""
        return cast_floats(tree, self.params)


def _nnx_module(model) -> bool:
    if "flax" not in sys.modules:  # a pytree model: flax need not be importable
        return False
    from flax import nnx

    return isinstance(model, nnx.Module)


def _call_in(precision: Precision, loss_fn, model, batch):
    if not _nnx_module(model):
        return loss_fn(precision.cast_to_compute(model), batch)
    from flax import nnx

    # a copy of the values: nnx.state hands out the module's own Variable objects
    params = jax.tree.map(lambda x: x, nnx.state(model, nnx.Param))
    nnx.update(model, precision.cast_to_compute(params))
    try:  # the module's other variables (statistics, RNG counts) change in place as usual
        return loss_fn(model, batch)
    finally:
        nnx.update(model, params)  # the caller's module keeps its float32 parameters


def with_precision(
    loss_fn: Callable[..., Any],
    precision: Precision | str | None,
    *,
    decode: Callable[[Any], Any] | None = None,
) -> Callable[..., Any]:
    """``loss_fn`` computing in ``precision``: casts at its edge (see the module docstring).

    The returned ``f(model, batch)`` decodes the batch (``decode``, e.g. an
    :class:`adaptjax.ArrayDataset`'s ``decode`` for quantized features),
    casts its float leaves and the model's float parameters to
    ``precision.compute``, calls ``loss_fn`` and casts the outputs to
    ``precision.output``. The model may be a pytree of parameters or a flax
    NNX module (as :func:`adaptjax.data_parallel_step` passes it: the module's
    ``nnx.Param`` values are swapped for their casts during the call and
    restored after it). Use it as the step's loss function; differentiate with
    respect to the float32 parameters as before. To keep the loss itself in
    float32 while the model computes in bfloat16, cast the logits inside
    ``loss_fn`` (``logits.astype(jnp.float32)``), as ``examples/lm.py`` does.

    With float32 compute and output and no ``decode``, ``loss_fn`` itself is
    returned (the same program compiles).

    Args:
      loss_fn: ``loss_fn(model_or_params, batch) -> loss`` (or ``(loss, aux)``).
      precision: a :class:`Precision`, its key (``"bfloat16"``), or ``None``.
      decode: ``decode(batch) -> batch``, applied first (inside the step).

    Returns:
      The wrapped loss function.

    Example:
      >>> import jax, jax.numpy as jnp, adaptjax
      >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
      >>> bf16 = adaptjax.with_precision(loss, "bfloat16")
      >>> params, batch = {"w": jnp.ones((3, 2))}, {"x": jnp.full((4, 3), 0.1)}
      >>> value, grads = jax.value_and_grad(bf16)(params, batch)
      >>> value.dtype, grads["w"].dtype   # float32 loss, float32 master gradients
      (dtype('float32'), dtype('float32'))
      >>> def spy(p, b):
      ...     print(p["w"].dtype, b["x"].dtype)   # what the model computes in
      ...     return loss(p, b)
      >>> _ = adaptjax.with_precision(spy, "bfloat16")(params, batch)
      bfloat16 bfloat16
      >>> adaptjax.with_precision(loss, "float32") is loss
      True
    """
    precision = Precision.of(precision)
    if decode is not None and not callable(decode):
        raise ValueError(f"with_precision: decode must be callable(batch), got {decode!r}")
    if precision.is_full and decode is None:
        return loss_fn

    def loss_in_precision(model, batch):
        if decode is not None:
            batch = decode(batch)
        out = _call_in(precision, loss_fn, model, precision.cast_to_compute(batch))
        return precision.cast_to_output(out)

    loss_in_precision.precision = precision
    return loss_in_precision


def _first_overflow(params, dtype) -> tuple[str, float] | None:
    """``(path, max |x|)`` of the first float parameter beyond ``dtype``'s finite range."""
    limit = float(jnp.finfo(dtype).max)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not _is_float(leaf) or not np.size(leaf):
            continue
        peak = float(np.max(np.abs(np.asarray(jax.device_get(leaf), np.float32))))
        if not peak <= limit:
            return jax.tree_util.keystr(path), peak
    return None


def check_precision(
    precision: Precision | str | None, model_or_params: Any, tx: optax.GradientTransformation
) -> Precision:
    """Checks that ``model_or_params`` and ``tx`` can train in ``precision``; returns it.

    Before anything compiles (``tx``'s state is traced with ``jax.eval_shape``,
    never run), a one-line ``ValueError`` for:

    * ``compute="float16"`` without dynamic loss scaling in ``tx`` (no
      ``LossScaleState`` in its state): float16 gradients
      underflow to zero and its activations overflow past 65504; wrap the
      optimizer in :func:`adaptjax.dynamic_loss_scale`;
    * a parameter whose magnitude is beyond the compute dtype's largest finite
      value (it would be ``inf`` from the first cast).

    Args:
      precision: a :class:`Precision` (or its key).
      model_or_params: a pytree of parameters or a flax NNX module.
      tx: the optax transformation the step will run.

    Returns:
      The :class:`Precision`.

    Example:
      >>> import jax.numpy as jnp, optax, adaptjax
      >>> params = {"w": jnp.ones(3)}
      >>> check_precision("bfloat16", params, optax.sgd(0.1)).compute
      'bfloat16'
      >>> check_precision("float16", params, optax.sgd(0.1))
      Traceback (most recent call last):
      ...
      ValueError: compute='float16' needs dynamic loss scaling: wrap the optimizer in adaptjax.dynamic_loss_scale(tx), or use compute='bfloat16'
      >>> tx = adaptjax.dynamic_loss_scale(optax.sgd(0.1))
      >>> check_precision("float16", params, tx).key
      'float16'
    """  # noqa: E501
    from adaptjax._loss_scale import has_loss_scale
    from adaptjax._state import split_model

    precision = Precision.of(precision)
    params = split_model(model_or_params)[1]
    if precision.needs_loss_scale and not has_loss_scale(jax.eval_shape(tx.init, params)):
        raise ValueError(
            f"compute={precision.compute!r} needs dynamic loss scaling: wrap the optimizer in "
            "adaptjax.dynamic_loss_scale(tx), or use compute='bfloat16'"
        )
    if precision.compute == "float16":  # bfloat16 has float32's range
        found = _first_overflow(params, jnp.float16)
        if found is not None:
            path, peak = found
            raise ValueError(
                f"parameter {path} reaches |x| = {peak:.4g}, beyond float16's largest finite "
                "value 65504 (it would be inf); use compute='bfloat16'"
            )
    return precision
