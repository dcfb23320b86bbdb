"""The α–β model of one collective kind on one link, and its least-squares fit.

A ring collective over ``N`` devices is a sequence of message steps; each step
costs the latency α and each byte a device sends costs β (the inverse
bandwidth). With ``B`` the bytes each device sends (what
:func:`adaptjax.wire_bytes` reports per collective):

====================  ==============  ==================================
kind                  message steps   seconds
====================  ==============  ==================================
all-reduce            ``2 (N-1)``     ``2 (N-1) α + β B``
all-gather            ``N-1``         ``(N-1) α + β B``
reduce-scatter        ``N-1``         ``(N-1) α + β B``
all-to-all            ``N-1``         ``(N-1) α + β B``
collective-permute    ``1``           ``α + β B``
====================  ==============  ==================================

References:
  Thakur, Rabenseifner and Gropp, "Optimization of collective communication
  operations in MPICH", IJHPCA 2005 (the α–β cost of ring collectives).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")


def message_steps(kind: str, group_size: int) -> int:
    """Latency-bound message steps of a ring collective of ``kind`` over ``group_size``.

    Example:
      >>> from adaptjax.costs._links import message_steps
      >>> message_steps("all-reduce", 4), message_steps("all-gather", 4), message_steps("all-reduce", 1)
      (6, 3, 0)
    """  # noqa: E501
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}: use one of {', '.join(KINDS)}")
    if group_size <= 1:
        return 0
    if kind == "all-reduce":
        return 2 * (group_size - 1)
    if kind == "collective-permute":
        return 1
    return group_size - 1


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """Seconds of one collective: ``steps * (alpha + (operands-1) * alpha_operand) + beta * bytes``.

    ``steps`` is ``message_steps``, ``bytes`` what each device sends.

    A tuple collective (XLA's all-reduce combiner joins a step's per-leaf
    psums into one instruction with an operand per leaf) may pay a latency per
    operand: over gloo across processes each operand costs about a whole
    collective's latency, while XLA:CPU in one process moves them together.
    ``calibrate_links`` measures ``alpha_operand``.

    Attributes:
      alpha: seconds per message step (latency), >= 0.
      beta: seconds per byte a device sends (1 / bandwidth), >= 0.
      pinned: whether a user gave these numbers (a refit keeps them).
      alpha_operand: seconds per message step for each operand after the
        first of a tuple collective, >= 0.

    Example:
      >>> from adaptjax.costs import LinkModel
      >>> link = LinkModel.from_bandwidth(1e9 / 8, latency=1e-4)  # 1 Gbit/s, 100 µs
      >>> round(link.time("all-reduce", 2, 1e6), 6)  # 2 steps + 1 MB
      0.0082
    """

    alpha: float
    beta: float
    pinned: bool = False
    alpha_operand: float = 0.0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "alpha_operand"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"LinkModel: {name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def from_bandwidth(cls, bandwidth: float, latency: float = 0.0) -> LinkModel:
        """A pinned link of ``bandwidth`` bytes/s and ``latency`` seconds per message step."""
        if not (isinstance(bandwidth, int | float) and math.isfinite(bandwidth) and bandwidth > 0):
            raise ValueError(f"bandwidth must be a positive number of bytes/s, got {bandwidth!r}")
        return cls(alpha=float(latency), beta=1.0 / float(bandwidth), pinned=True)

    def time(self, kind: str, group_size: int, bytes_sent: float, operands: int = 1) -> float:
        """Seconds for one collective of ``kind`` over ``group_size`` sending ``bytes_sent``.

        Example:
          >>> from adaptjax.costs import LinkModel
          >>> link = LinkModel(alpha=1e-3, beta=0.0, alpha_operand=1e-3)
          >>> round(link.time("all-reduce", 2, 0.0, operands=3), 6)  # 2 steps x 3 operands
          0.006
        """
        if bytes_sent < 0:
            raise ValueError(f"bytes_sent must be >= 0, got {bytes_sent}")
        steps = message_steps(kind, group_size)
        if steps == 0:
            return 0.0
        latency = self.alpha + (max(int(operands), 1) - 1) * self.alpha_operand
        return steps * latency + self.beta * float(bytes_sent)


def fit_alpha_beta(
    kind: str,
    group_sizes: Sequence[int],
    bytes_sent: Sequence[float],
    seconds: Sequence[float],
) -> LinkModel:
    """Least-squares α and β (both >= 0) of one collective kind from timed collectives.

    Solves ``seconds ≈ message_steps(kind, N) * α + bytes_sent * β``. When the
    unconstrained solution has a negative coefficient, the better of the two
    one-coefficient fits is used (the exact non-negative solution for two
    coefficients). Needs at least two timings that are not proportional in
    (steps, bytes), e.g. two message sizes.

    Args:
      kind: the collective kind (see ``message_steps``).
      group_sizes: ``N`` of each timing (> 1).
      bytes_sent: bytes each device sent in each timing (ring formula).
      seconds: the measured seconds of each.

    Returns:
      The fitted :class:`LinkModel`.

    Example:
      >>> from adaptjax.costs._links import fit_alpha_beta, message_steps
      >>> sizes = [1e3, 1e5, 1e6, 1e3, 1e6]
      >>> groups = [2, 2, 2, 8, 8]
      >>> secs = [message_steps("all-gather", n) * 2e-5 + b * 1e-9 for n, b in zip(groups, sizes)]
      >>> link = fit_alpha_beta("all-gather", groups, sizes, secs)
      >>> round(link.alpha, 12), round(link.beta, 15)
      (2e-05, 1e-09)
    """
    xs = [(float(message_steps(kind, int(n))), float(b)) for n, b in zip(group_sizes, bytes_sent,
                                                                          strict=True)]
    ys = [float(s) for s in seconds]
    if len(xs) != len(ys):
        raise ValueError(
            f"fit_alpha_beta: {len(xs)} timings but {len(ys)} seconds; pass one time per timing"
        )
    rows = [(x, y) for x, y in zip(xs, ys, strict=True) if x[0] > 0]
    if len(rows) < 2:
        raise ValueError(
            f"fit_alpha_beta({kind!r}): needs >= 2 timings on groups of >= 2 devices, got "
            f"{len(rows)}; time the collective at two message sizes"
        )
    for _, y in rows:
        if not (math.isfinite(y) and y >= 0):
            raise ValueError(f"fit_alpha_beta: every time must be finite and >= 0, got {y!r}")
    saa = sum(x[0] * x[0] for x, _ in rows)
    sbb = sum(x[1] * x[1] for x, _ in rows)
    sab = sum(x[0] * x[1] for x, _ in rows)
    say = sum(x[0] * y for x, y in rows)
    sby = sum(x[1] * y for x, y in rows)
    det = saa * sbb - sab * sab
    if det > 1e-12 * saa * sbb:
        alpha = (say * sbb - sby * sab) / det
        beta = (saa * sby - sab * say) / det
        if alpha >= 0 and beta >= 0:
            return LinkModel(alpha, beta)
    cands = [LinkModel(max(say / saa, 0.0), 0.0)]
    if sbb > 0:
        cands.append(LinkModel(0.0, max(sby / sbb, 0.0)))

    def sse(m: LinkModel) -> float:
        return sum((x[0] * m.alpha + x[1] * m.beta - y) ** 2 for x, y in rows)

    return min(cands, key=sse)


def fit_operand_alpha(link: LinkModel, kind: str, group_sizes: Sequence[int],
                      operands: Sequence[int], bytes_sent: Sequence[float],
                      seconds: Sequence[float]) -> LinkModel:
    """``link`` with ``alpha_operand`` fitted from timed tuple collectives.

    Least squares (clipped at 0) of what ``link`` leaves unexplained,
    ``seconds - link.time(kind, N, bytes)``, on ``message_steps(kind, N) *
    (operands - 1)``.

    Example:
      >>> from adaptjax.costs import LinkModel
      >>> from adaptjax.costs._links import fit_operand_alpha
      >>> link = LinkModel(1e-4, 1e-9)
      >>> secs = [2 * (1e-4 + 7 * 5e-4) + 8e3 * 1e-9, 14 * (1e-4 + 7 * 5e-4) + 8e3 * 1e-9]
      >>> round(fit_operand_alpha(link, "all-reduce", [2, 8], [8, 8], [8e3, 8e3],
      ...                         secs).alpha_operand, 9)
      0.0005
    """
    xs, rs = [], []
    for n, k, b, t in zip(group_sizes, operands, bytes_sent, seconds, strict=True):
        x = message_steps(kind, int(n)) * (int(k) - 1)
        if x > 0:
            xs.append(float(x))
            rs.append(float(t) - link.time(kind, int(n), float(b)))
    if not xs:
        raise ValueError(
            f"fit_operand_alpha({kind!r}): needs a timing with >= 2 operands on >= 2 devices"
        )
    value = sum(x * r for x, r in zip(xs, rs, strict=True)) / sum(x * x for x in xs)
    return dataclasses.replace(link, alpha_operand=max(value, 0.0))
