"""What the batch-size policies share: the valid sizes, the noise-scale reading, the LR rule.

``AdaptiveBatchSize`` (goodput) and ``BatchSizeWarmup`` (the noise scale alone)
decide differently but move the batch the same way: to a multiple of the
replicas x micro-batches in [min, max], on a noise-scale reading that is not
flagged stale, with the learning rate following the batch by a rule.
"""

import math
from collections.abc import Mapping

from adaptjax.policies._actions import Action, SetBatchSize, SetHyperparams
from adaptjax.policies._checks import check_int, check_optional_int, read_metric
from adaptjax.policies._context import Context
from adaptjax.policies._goodput import lr_scale
from adaptjax.policies._policy import StatefulPolicy


def check_batch_range(policy, owner: str) -> None:
    """``policy.max_batch_size`` and ``min_batch_size`` checked and set (one-line errors)."""
    top = check_int(policy.max_batch_size, owner=owner, name="max_batch_size", minimum=1)
    low = check_optional_int(policy.min_batch_size, owner=owner, name="min_batch_size", minimum=1)
    if low is not None and low > top:
        raise ValueError(
            f"{owner}: min_batch_size={low} exceeds max_batch_size={top}; "
            "make min_batch_size <= max_batch_size"
        )
    object.__setattr__(policy, "max_batch_size", top)
    object.__setattr__(policy, "min_batch_size", low)


def batch_bounds(
    ctx: Context, *, low: int, high: int, multiple_of: int | None
) -> tuple[int, int, int]:
    """``(step, lowest, highest)``: the valid batches are the multiples of ``step`` in between.

    ``step`` is ``ctx.devices * ctx.microbatches`` (lcm ``multiple_of``), so a
    proposal stays divisible; ``lowest > highest`` when no valid batch exists.

    Example:
      >>> ctx = Context(step=0, batch_size=64, microbatches=1, devices=8, max_devices=8,
      ...               hyperparams={})
      >>> batch_bounds(ctx, low=20, high=1000, multiple_of=None)
      (8, 24, 1000)
    """
    step = ctx.devices * ctx.microbatches
    if multiple_of is not None:
        step = math.lcm(step, multiple_of)
    return step, -(-low // step) * step, high // step * step


def noise_reading(metrics: Mapping[str, float] | None, key: str = "noise_scale") -> float | None:
    """The noise scale ``metrics[key]`` to act on, or ``None`` (absent, or flagged stale).

    A metric ``key + "_valid"`` that is present and not positive marks a held
    (stale) or meaningless reading (see ``adaptjax.GradientNoiseScale``). For
    ``"noise_scale"`` without a reading, ``grad_variance / grad_sqnorm`` stands in.
    Negative values are clamped to 0.

    Example:
      >>> noise_reading({"noise_scale": 40.0, "noise_scale_valid": 1.0})
      40.0
      >>> noise_reading({"noise_scale": 40.0, "noise_scale_valid": 0.0}) is None
      True
      >>> noise_reading({"grad_variance": 8.0, "grad_sqnorm": 0.5})
      16.0
    """
    if metrics is not None and key + "_valid" in metrics:
        valid = read_metric(metrics, key + "_valid")
        if valid is None or valid <= 0.0:
            return None
    phi = read_metric(metrics, key)
    if phi is None and key == "noise_scale":
        variance = read_metric(metrics, "grad_variance")
        sqnorm = read_metric(metrics, "grad_sqnorm")
        if variance is None or sqnorm is None or sqnorm <= 0.0:
            return None
        phi = variance / sqnorm
    return None if phi is None else max(phi, 0.0)


class BatchSizePolicy(StatefulPolicy):
    """Base of the batch-size policies (private): the learning rate that follows the batch.

    A subclass is a frozen dataclass with the fields ``lr_rule``,
    ``optimizer_kind`` and ``lr_key``, and starts its state from
    :meth:`_lr_state`. M₀ is ``ctx.base_batch_size`` (else the batch size) and
    base_lr is ``ctx.hyperparams[lr_key]`` at the first decision; both are kept
    in the state. A proposal moves the learning rate to base_lr × rule(M/M₀).
    If something else changed the learning rate since the policy last set it
    (e.g. ``ReduceLROnPlateau``), the base is rescaled by that change first, so
    the other policy's decision is kept; a proposal never carried out leaves
    the base alone.
    """

    lr_rule: str  # the subclass's dataclass fields
    optimizer_kind: str
    lr_key: str

    @staticmethod
    def _lr_state() -> dict:
        return {
            "base_batch_size": None,  # M₀
            "base_lr": None,  # the learning rate at M₀
            "lr_factor": 1.0,  # rule(S) of the batch size in effect
            "last_lr": None,  # the learning rate this policy expects in effect
            "pending": None,  # last proposal: {"batch_size", "lr", "lr_factor"}
        }

    def _current_lr(self, ctx: Context) -> float:
        if self.lr_key not in ctx.hyperparams:
            raise ValueError(
                f"{type(self).__name__}(lr_rule={self.lr_rule!r}): ctx.hyperparams has no "
                f"{self.lr_key!r} (has {sorted(ctx.hyperparams)}); pass lr_key=... "
                "or lr_rule='none'"
            )
        return ctx.hyperparams[self.lr_key]

    def _begin(self, ctx: Context) -> None:
        """Fixes M₀ and base_lr at the first decision; settles a proposal carried out."""
        state = self._state
        if state["base_batch_size"] is None:
            state["base_batch_size"] = ctx.base_batch_size or ctx.batch_size
            if self.lr_rule != "none":
                state["base_lr"] = state["last_lr"] = self._current_lr(ctx)
        pending = state["pending"]
        if pending is not None and pending["batch_size"] == ctx.batch_size:
            state["lr_factor"], state["last_lr"] = pending["lr_factor"], pending["lr"]
            state["pending"] = None

    def _lr_factor(self, scale: float, phi: float, metrics: Mapping[str, float]) -> float:
        base = self._state["base_batch_size"]
        variance = read_metric(metrics, "grad_variance")
        sqnorm = read_metric(metrics, "grad_sqnorm")
        if variance is not None and sqnorm is not None:
            sigma_sq, mu_sq = variance / base, sqnorm
        else:  # σ²/μ² = φ/M₀ is all the gain depends on.
            sigma_sq, mu_sq = phi / base, 1.0
        return lr_scale(
            self.lr_rule, scale, optimizer_kind=self.optimizer_kind, sigma_sq=sigma_sq,
            mu_sq=mu_sq,
        )

    def _propose(self, best: int, phi: float, metrics: Mapping[str, float],
                 ctx: Context, why: str) -> list[Action]:
        """``[SetBatchSize(best), SetHyperparams(...)]`` (the batch alone with rule "none")."""
        state = self._state
        actions: list[Action] = [SetBatchSize(best, reason=why)]
        if self.lr_rule != "none":
            lr = self._current_lr(ctx)
            if lr != state["last_lr"]:  # changed by someone else: keep their change
                state["base_lr"] = lr / state["lr_factor"]
                state["last_lr"] = lr
            base = state["base_batch_size"]
            factor = self._lr_factor(best / base, phi, metrics)
            new_lr = state["base_lr"] * factor
            state["pending"] = {"batch_size": best, "lr": new_lr, "lr_factor": factor}
            actions.append(
                SetHyperparams(
                    {self.lr_key: new_lr},
                    reason=f"{type(self).__name__}: {self.lr_rule} learning-rate rule for "
                    f"batch {best} = {best / base:.3g} x {base}: factor {factor:.3g} on base "
                    f"{state['base_lr']:.3g}",
                )
            )
        return actions
