"""Error-feedback rules as small strategy objects, one per rule.

A codec's ``sync`` asks its rule, per leaf that keeps state (``None`` buffers
elsewhere), what to compress and, from the lanes' residuals, the new buffers
and the output. A new rule is one class here with three methods:

* ``prepare(grads, ctx)``: anything computed over all stateful leaves at once
  (DGC's clipping scale); ``None`` for the others;
* ``inputs(g, bufs, prep)``: ``(x, carry)``, what the replica compresses and
  what ``outputs`` needs back (DGC's new velocity);
* ``outputs(g, x, out, res, bufs, shared, carry, lane)``: ``(new worker
  buffers, new shared buffers, output)`` from the compressed mean ``out`` and
  the residual ``res = x − C(x)`` (the part of ``x`` not sent); ``lane`` is
  the leaf's lane (``"codec"``, ``"bf16"``, see :mod:`._lanes`).

``keys`` names the per-replica buffers (zeros at ``init``), ``shared_keys``
the replicated ones, and ``residual`` says whether the lanes must compute
residuals at all.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax.numpy as jnp

from adaptjax._tree import tree_sq_norm


@dataclasses.dataclass(frozen=True)
class NoFeedback:
    """No error feedback: each replica compresses its gradient as it is."""

    keys: ClassVar[tuple[str, ...]] = ()
    shared_keys: ClassVar[tuple[str, ...]] = ()
    residual: ClassVar[bool] = False

    def prepare(self, grads, ctx):
        del grads, ctx

    def inputs(self, g, bufs, prep):
        del bufs, prep
        return g, None

    def outputs(self, g, x, out, res, bufs, shared, carry, lane):
        del g, x, res, carry, lane
        return bufs, shared, out


@dataclasses.dataclass(frozen=True)
class EF14(NoFeedback):
    """EF14: send ``C(g + e)``, keep ``e ← g + e − C(g + e)`` (Seide et al. 2014)."""

    keys: ClassVar[tuple[str, ...]] = ("ef",)
    residual: ClassVar[bool] = True

    def inputs(self, g, bufs, prep):
        del prep
        return g + bufs["ef"], None

    def outputs(self, g, x, out, res, bufs, shared, carry, lane):
        del g, x, bufs, carry, lane
        return {"ef": res}, shared, out


@dataclasses.dataclass(frozen=True)
class EF21(NoFeedback):
    """EF21: send ``C(∇ − g_i)``, ``g_i ← g_i + C(∇ − g_i)``, output ``ĝ ← ĝ + mean C``.

    Richtárik et al. 2021; ``ĝ`` (``"ghat"``) is replicated.
    """

    keys: ClassVar[tuple[str, ...]] = ("g",)
    shared_keys: ClassVar[tuple[str, ...]] = ("ghat",)
    residual: ClassVar[bool] = True

    def inputs(self, g, bufs, prep):
        del prep
        return g - bufs["g"], None

    def outputs(self, g, x, out, res, bufs, shared, carry, lane):
        del x, bufs, carry, lane
        ghat = shared["ghat"] + out
        return {"g": g - res}, {**shared, "ghat": ghat}, ghat


@dataclasses.dataclass(frozen=True)
class MomentumCorrection(NoFeedback):
    """DGC's momentum correction, momentum-factor masking and local clipping.

    Velocity ``u ← m·u + s·g`` and accumulation ``v ← v + u``; ``v`` is sent,
    and where an entry went out both ``u`` and ``v`` are zeroed (Lin et al.
    2018). ``s`` clips the replica's gradient norm to ``clip_norm/√N``.
    """

    momentum: float = 0.9
    clip_norm: float | None = None

    keys: ClassVar[tuple[str, ...]] = ("u", "v")
    residual: ClassVar[bool] = True

    def prepare(self, grads, ctx):
        if self.clip_norm is None:
            return 1.0
        norm = jnp.sqrt(tree_sq_norm(grads))
        limit = self.clip_norm / math.sqrt(ctx.n)
        return jnp.minimum(1.0, limit / jnp.maximum(norm, 1e-30))

    def inputs(self, g, bufs, prep):
        u = self.momentum * bufs["u"] + prep * g
        return bufs["v"] + u, u

    def outputs(self, g, x, out, res, bufs, shared, carry, lane):
        del g, bufs
        u = jnp.where(res != x, 0.0, carry) if lane == "codec" else carry
        return {"u": u, "v": res}, shared, out


def feedback_for(mode: str | None) -> NoFeedback:
    """The rule of ``error_feedback=`` (``None``, ``"ef14"`` or ``"ef21"``)."""
    return {None: NoFeedback(), "ef14": EF14(), "ef21": EF21()}[mode]
