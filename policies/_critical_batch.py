"""The critical batch size measured by branching training, and the policy that asks for it.

From one state, branches train at several batch sizes B; the loss each reaches
says how much a step at B is worth. McCandlish et al.'s model of one step,

    ΔL(B) = ΔL_max / (1 + B_crit / B),

makes a branch of K_B steps at batch B lower the loss by about
K_B · ΔL_max · B / (B + B_crit). ``fit_critical_batch`` fits ΔL_max and
B_crit to the measured drops; :class:`CriticalBatchProbe` asks the controller
for such a measurement (a :class:`Probe` action) every so many steps, and the
controller logs its result as the metric ``critical_batch``, which policies
(e.g. ``BatchSizeWarmup(metric="critical_batch")``) act on as on ``noise_scale``.

References:
  McCandlish et al., "An Empirical Model of Large-Batch Training", 2018.
  Merrill et al., "Critical Batch Size Revisited", 2025 (measuring it by branching).
"""

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
from adaptjax.policies._actions import Action, Probe
from adaptjax.policies._checks import (
    check_choice,
    check_float,
    check_int,
    check_optional_int,
    read_metric,
)
from adaptjax.policies._context import Context
from adaptjax.policies._goodput import LR_RULES
from adaptjax.policies._policy import StatefulPolicy


class CriticalBatchFit(NamedTuple):
    """What ``fit_critical_batch`` returns.

    Attributes:
      critical_batch: B_crit in samples; 0.0 when every step improved the loss
        alike whatever its batch, ``inf`` when progress grew in proportion to
        the batch over the whole range, ``nan`` when the branches made no progress.
      max_improvement: ΔL_max, the loss decrease per step at an infinite batch.
      rmse: the root-mean-square residual of the fitted loss drops.

    Example:
      >>> CriticalBatchFit(critical_batch=100.0, max_improvement=0.01, rmse=0.0).critical_batch
      100.0
    """

    critical_batch: float
    max_improvement: float
    rmse: float


def _check_branches(batch_sizes, loss_drops, steps) -> tuple[np.ndarray, ...]:
    owner = "fit_critical_batch"
    sizes = [check_float(b, owner=owner, name="every batch size", low=0.0) for b in batch_sizes]
    drops = [check_float(d, owner=owner, name="every loss drop") for d in loss_drops]
    if len(sizes) != len(drops):
        raise ValueError(
            f"{owner}: got {len(sizes)} batch sizes but {len(drops)} loss drops; "
            "pass one loss drop per branch"
        )
    if isinstance(steps, int | float | np.integer | np.floating):
        steps = [steps] * len(sizes)
    counts = [check_float(k, owner=owner, name="every step count", low=0.0) for k in steps]
    if len(counts) != len(sizes):
        raise ValueError(
            f"{owner}: got {len(counts)} step counts for {len(sizes)} branches; pass one per "
            "branch (or one number for all)"
        )
    if min(sizes + counts) <= 0.0:
        raise ValueError(f"{owner}: batch sizes and step counts must be > 0")
    if len(set(sizes)) < 3:
        raise ValueError(
            f"{owner}: needs branches at 3 or more distinct batch sizes, got {sorted(set(sizes))}"
        )
    return np.asarray(sizes), np.asarray(drops), np.asarray(counts)


def _best_scale(shape: np.ndarray, drops: np.ndarray) -> tuple[float, float]:
    """(a, SSE) of the least-squares fit drops ≈ a · shape."""
    a = float(shape @ drops / (shape @ shape))
    return a, float(np.sum((a * shape - drops) ** 2))


def fit_critical_batch(
    batch_sizes: Sequence[float],
    loss_drops: Sequence[float],
    steps: float | Sequence[float],
) -> CriticalBatchFit:
    """Least-squares fit of B_crit and ΔL_max to the loss drops of branches at several batches.

    A branch ran ``steps`` optimizer steps at batch B from the common state and
    its loss (on evaluation data common to all branches) fell by D. The model
    D(B) = K_B · ΔL_max · B / (B + B_crit) is fitted by least squares on the
    drops: for a fixed B_crit the best ΔL_max has a closed form, and B_crit is
    found by a search over a log grid from min(B)/10³ to max(B)·10³, refined
    by golden section, the two limits (B_crit → 0 and → ∞) included. Branches
    of equal tokens (K_B = tokens / B) or of equal steps both fit.

    Args:
      batch_sizes: the branches' batch sizes (samples), 3 or more distinct, > 0.
      loss_drops: the loss decrease each branch reached (start loss − end loss).
      steps: the optimizer steps of each branch, or one number for all, > 0.

    Returns:
      A :class:`CriticalBatchFit`.

    Example:
      >>> sizes = [16, 32, 64, 128, 256]
      >>> drops = [4096 / b * 0.01 * b / (b + 100) for b in sizes]  # B_crit = 100
      >>> fit = fit_critical_batch(sizes, drops, steps=[4096 / b for b in sizes])
      >>> round(fit.critical_batch, 3), round(fit.max_improvement, 6)
      (100.0, 0.01)
    """
    sizes, drops, counts = _check_branches(batch_sizes, loss_drops, steps)

    def sse(log_c):  # float or array of log B_crit -> the least-squares SSE at each
        shape = counts * sizes / (sizes + np.exp(np.asarray(log_c))[..., None])
        a = shape @ drops / np.einsum("...i,...i->...", shape, shape)
        return np.sum((a[..., None] * shape - drops) ** 2, axis=-1)

    flat_a, flat_sse = _best_scale(counts, drops)  # B_crit -> 0: every step alike
    linear_a, linear_sse = _best_scale(counts * sizes, drops)  # B_crit -> inf: ∝ B
    grid = np.linspace(math.log(sizes.min() / 1e3), math.log(sizes.max() * 1e3), 121)
    i = int(np.argmin(sse(grid)))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    f1, f2 = sse(x1), sse(x2)
    for _ in range(60):  # golden section: the bracket shrinks by 0.618 each turn
        if f1 <= f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - ratio * (hi - lo)
            f1 = sse(x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + ratio * (hi - lo)
            f2 = sse(x2)
    log_c = (lo + hi) / 2.0
    c = math.exp(log_c)
    a, best = _best_scale(counts * sizes / (sizes + c), drops)
    if flat_sse <= best:
        c, a, best = 0.0, flat_a, flat_sse
    if linear_sse < best:  # ΔL_max -> inf with ΔL_max / B_crit -> linear_a
        c, a, best = math.inf, math.inf if linear_a > 0 else -math.inf, linear_sse
    rmse = math.sqrt(best / len(sizes))
    if not a > 0.0:
        return CriticalBatchFit(math.nan, a, rmse)
    return CriticalBatchFit(c, a, rmse)


@dataclasses.dataclass(frozen=True, eq=False)
class CriticalBatchProbe(StatefulPolicy):
    """Asks the controller to measure the critical batch by branching, every ``every`` steps.

    Returns a :class:`Probe` at the first evaluation at or after step
    ``start`` and then every ``every`` steps. The controller branches from the
    state in memory, trains ``steps`` x max(B) / B steps at each batch B (the
    same samples for every branch, scaled learning rate), fits
    ``fit_critical_batch`` to the losses reached, logs the metric
    ``critical_batch`` and returns to the main run bit-exactly. The policy reads
    ``critical_batch`` back: without explicit ``sizes`` the next probe's sizes
    are centred on the larger of the current batch and the last measurement
    (c/4, c/2, c, 2c, 4c, powers of two times the replicas x micro-batches,
    at most ``max_batch_size``); after an infinite one (the drops grew with
    the batch up to the largest size), on twice the last probe's largest size.

    Args:
      every: steps between probes, >= 1.
      sizes: the branches' batch sizes (3 or more distinct), or ``None`` (see above).
      steps: optimizer steps of the largest branch, >= 1 (every branch trains
        on as many samples). The default, 16, is what
        the adaptive-batch benchmark probes its byte-level LM with; with
        the default rate sweep every batch's best drop was positive there.
      start: the first step a probe may be asked at, >= 0.
      lr_rule: how a branch's learning rate follows its batch from the current
        one (``"sqrt"``, the rule for Adam; see ``lr_scale``).
      max_batch_size: the largest branch batch ``sizes=None`` may choose (``None``: no limit).
      lr_multipliers: factors on each branch's learning rate, the best loss of
        each batch counting (see :class:`Probe`); ``(1.0,)``: the rule's rate
        alone, a quarter of the default's cost. The default sweep is
        ``(0.125, 0.25, 0.5, 1.0)``: on that LM (``--quick``, ``"sqrt"``, 16
        steps) the rule's rate alone read an infinite critical batch (the
        drops rose with the batch), the sweep read 188, 252 and 301 at a
        quarter, half and three quarters of the run (best factors 0.125-0.5;
        196, 264 and 323 with ``"adascale"``).

    Example:
      >>> from adaptjax.policies import Context, CriticalBatchProbe
      >>> policy = CriticalBatchProbe(every=500, sizes=(32, 64, 128, 256), steps=20)
      >>> ctx = Context(step=0, batch_size=64, microbatches=1, devices=8, max_devices=8,
      ...               hyperparams={})
      >>> [probe] = policy.decide({}, ctx)
      >>> probe.batch_sizes, probe.steps, probe.lr_multipliers
      ((32, 64, 128, 256), 20, (0.125, 0.25, 0.5, 1.0))
      >>> policy.decide({"critical_batch": 180.0}, ctx)  # not due until step 500
      []
    """

    every: int
    sizes: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)
    steps: int = dataclasses.field(default=16, kw_only=True)
    start: int = dataclasses.field(default=0, kw_only=True)
    lr_rule: str = dataclasses.field(default="sqrt", kw_only=True)
    max_batch_size: int | None = dataclasses.field(default=None, kw_only=True)
    lr_multipliers: tuple[float, ...] = dataclasses.field(
        default=(0.125, 0.25, 0.5, 1.0), kw_only=True)

    def __post_init__(self) -> None:
        owner = "CriticalBatchProbe"
        object.__setattr__(self, "every", check_int(self.every, owner=owner, name="every",
                                                    minimum=1))
        object.__setattr__(self, "steps", check_int(self.steps, owner=owner, name="steps",
                                                    minimum=1))
        object.__setattr__(self, "start", check_int(self.start, owner=owner, name="start",
                                                    minimum=0))
        check_choice(self.lr_rule, LR_RULES, owner=owner, name="lr_rule")
        object.__setattr__(self, "max_batch_size", check_optional_int(
            self.max_batch_size, owner=owner, name="max_batch_size", minimum=1))
        # sizes and multipliers are checked as the action checks them
        sizes = (1, 2, 3) if self.sizes is None else self.sizes
        probe = Probe(sizes, steps=self.steps, lr_rule=self.lr_rule,
                      lr_multipliers=self.lr_multipliers)
        object.__setattr__(self, "lr_multipliers", probe.lr_multipliers)
        if self.sizes is not None:
            object.__setattr__(self, "sizes", probe.batch_sizes)
        super().__post_init__()

    def _initial_state(self) -> dict:
        # last_probe: the step of the last request; last_top: its largest batch;
        # measured: [[step, critical_batch], ...] (inf: above the sizes probed)
        return {"last_probe": None, "last_top": None, "measured": []}

    def _due(self, ctx: Context) -> bool:
        last = self._state["last_probe"]
        return ctx.step >= self.start if last is None else ctx.step >= last + self.every

    def _probe(self, ctx: Context) -> Probe | None:
        if self.sizes is not None:
            return self._make(self.sizes)
        unit = ctx.devices * ctx.microbatches
        measured = self._state["measured"]
        last = measured[-1][1] if measured else 0.0
        if last == math.inf:  # the drops never fell: look above the last probe's sizes
            last = 2.0 * (self._state.get("last_top") or ctx.batch_size)
        centre = max(ctx.batch_size, last)
        top = self.max_batch_size or math.inf
        sizes = set()
        for k in range(-2, 3):
            m = unit * 2 ** max(round(math.log2(max(centre * 2.0**k / unit, 1.0))), 0)
            if m <= top:
                sizes.add(int(m))
        if len(sizes) < 3:
            return None  # max_batch_size leaves no room for three branches
        return self._make(tuple(sorted(sizes)))

    def _make(self, sizes: tuple[int, ...]) -> Probe:
        return Probe(sizes, steps=self.steps, lr_rule=self.lr_rule,
                     lr_multipliers=self.lr_multipliers)

    def _remember(self, metrics: Mapping[str, float], ctx: Context) -> None:
        """Keeps a new ``critical_batch`` reading (a value held from an earlier probe is not new:
        ``critical_batch_step``, where given, names the step it was measured at). ``inf`` (the
        drops grew with the batch over every size probed) is kept: the next probe looks higher."""
        value = read_metric(metrics, "critical_batch")
        if value is None and metrics and metrics.get("critical_batch") == math.inf:
            value = math.inf
        if value is None:
            return
        at = read_metric(metrics, "critical_batch_step")
        measured = self._state["measured"]
        if measured and (measured[-1][0] == at if at is not None else measured[-1][1] == value):
            return
        measured.append([ctx.step if at is None else int(at), value])
        del measured[:-16]

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        """``[Probe]`` when one is due, else ``[]``; a fresh ``critical_batch`` is remembered."""
        self._remember(metrics, ctx)
        measured = self._state["measured"]
        if not self._due(ctx):
            return []
        probe = self._probe(ctx)
        if probe is None:
            return []
        self._state["last_probe"] = ctx.step
        self._state["last_top"] = probe.batch_sizes[-1]
        why = f"CriticalBatchProbe: every {self.every} steps (last: {measured[-1][1]:.4g})" \
            if measured else f"CriticalBatchProbe: every {self.every} steps (first probe)"
        return [dataclasses.replace(probe, reason=why)]

    def upcoming(self, ctx: Context) -> list[Action]:
        """The next probe (the controller can compile its batch sizes ahead)."""
        probe = self._probe(ctx)
        return [] if probe is None else [probe]
