"""Which codec defaults train worse than dense sync with which optimizers, and what to use.

The codec-optimizer benchmark (docs/benchmarks.md) trains every codec's default construction
with SGD+momentum and with AdamW (a CNN on digits, a byte-level LM) and
compares each with dense sync at equal steps. Where a default pairing falls
more than 1% behind dense, :meth:`adaptjax.compression.Codec.pairing_warning`
returns one line naming the better choice, and the codec's
:func:`adaptjax.sync_gradients` link warns with it when
:func:`adaptjax.data_parallel_step` first traces the step (the first place
that sees both the codec and the optimizer).
"""

from __future__ import annotations

from typing import Any

import jax
import optax

# Optimizers whose update divides by a second-moment estimate.
_ADAM_STATES = (optax.ScaleByAdamState, optax.ScaleByAmsgradState, optax.ScaleByBeliefState)
_MOMENTUM_STATES = (optax.TraceState,)


def optimizer_family(optimizer_state: Any) -> str:
    """``"adam"``, ``"momentum"`` or ``"sgd"``: what the optimizer's state holds.

    Adam-family: a ``ScaleByAdamState`` (``adam``, ``adamw``, ``nadam``,
    ``lamb``, ...), ``ScaleByAmsgradState`` or ``ScaleByBeliefState``
    anywhere in the state (``optax.inject_hyperparams`` included); momentum: an
    ``optax.TraceState`` (``optax.sgd(lr, momentum=...)``).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from adaptjax.compression._pairing import optimizer_family
      >>> p = {"w": jnp.zeros(3)}
      >>> [optimizer_family(tx.init(p)) for tx in
      ...  (optax.adamw(1e-3), optax.sgd(0.1, momentum=0.9), optax.sgd(0.1))]
      ['adam', 'momentum', 'sgd']
    """
    kinds = _ADAM_STATES + _MOMENTUM_STATES
    nodes = jax.tree.leaves(optimizer_state, is_leaf=lambda x: isinstance(x, kinds))
    if any(isinstance(n, _ADAM_STATES) for n in nodes):
        return "adam"
    if any(isinstance(n, _MOMENTUM_STATES) for n in nodes):
        return "momentum"
    return "sgd"


_FAMILY = {"adam": "an Adam-family optimizer", "momentum": "SGD with momentum"}

_FOR_ADAM = ("use natural() (8-bit codes), or adaptjax.compression.onebit_adam(learning_rate, "
             "freeze_step=...) in place of sync_gradients and the Adam optimizer")
_FOR_MOMENTUM = "use qsgd() instead"
_NOISE = "coarse stochastic codes feed their variance into Adam's second moment"
_SCALED = "each sent coordinate is scaled by 1/ratio, a variance far above the gradient's"
_OWN_MOMENTUM = "dgc() applies momentum itself, "

# (codec name, optimizer family) -> (what goes wrong, the better choice), for
# the default pairings the codec-optimizer benchmark measured more than 1%
# behind dense sync (its table is in docs/guide/compression.md).
_RULES: dict[tuple[str, str], tuple[str, str]] = {
    ("onebit", "adam"): ("signs with error feedback spoil Adam's second moment", _FOR_ADAM),
    ("terngrad", "adam"): (_NOISE, _FOR_ADAM),
    ("qsgd", "adam"): (_NOISE, _FOR_ADAM),
    ("topk", "adam"): ("error feedback's delayed bursts spoil Adam's second moment", _FOR_ADAM),
    ("randomk", "adam"): (_SCALED, _FOR_ADAM),
    ("dgc", "adam"): (_OWN_MOMENTUM + "before Adam's own", _FOR_ADAM),
    ("powersgd", "adam"): ("low-rank error feedback spoils Adam's second moment", _FOR_ADAM),
    ("onebit", "momentum"): ("the 1-bit codes' error feedback lags the momentum", _FOR_MOMENTUM),
    ("terngrad", "momentum"): ("three levels add more variance than the momentum averages out",
                               _FOR_MOMENTUM),
    ("topk", "momentum"): ("error feedback at ratio 0.01 lags the momentum", _FOR_MOMENTUM),
    ("powersgd", "momentum"): ("rank 4 leaves too much to error feedback", _FOR_MOMENTUM),
    ("randomk", "momentum"): (_SCALED, _FOR_MOMENTUM),
    ("dgc", "momentum"): (_OWN_MOMENTUM + "on top of the optimizer's",
                          "use optax.sgd without momentum with dgc()"),
}
# Rules that hold only for some settings: a codec outside them is not warned.
_APPLIES = {
    "dgc": lambda codec: codec.momentum > 0,  # measured with its default momentum 0.9
    "topk": lambda codec: codec.ratio <= 0.01,  # measured at 0.01; sparser is no better
    "powersgd": lambda codec: codec.rank <= 4,  # measured at rank 4; a lower rank is no better
}


def pairing_warning(codec: Any, optimizer_state: Any) -> str | None:
    """The line :meth:`adaptjax.compression.Codec.pairing_warning` returns (``None``: no advice).

    Args:
      codec: an ``adaptjax.compression`` codec.
      optimizer_state: the init state of the transformations after the sync.

    Returns:
      ``"<codec> with <optimizer family> trains worse than dense sync (<why>): <better>"``
      for a pairing in the measured table, else ``None``.
    """
    family = optimizer_family(optimizer_state)
    rule = _RULES.get((codec.name, family))
    if rule is None or not _APPLIES.get(codec.name, lambda c: True)(codec):
        return None
    why, better = rule
    return f"{codec!r} with {_FAMILY[family]} trains worse than dense sync ({why}): {better}"
