"""``SwitchCompression``: compress gradients while communication dominates the step."""

import dataclasses
from collections.abc import Mapping

from adaptjax.policies._actions import Action, SetCodec
from adaptjax.policies._checks import check_float, check_planner, read_metric
from adaptjax.policies._context import Context
from adaptjax.policies._planner import current, explore, observe, predict
from adaptjax.policies._policy import Policy


@dataclasses.dataclass(frozen=True, eq=False)
class SwitchCompression(Policy):
    """Turns ``codec`` on when ``comm_share`` exceeds a threshold, off below another.

    ``comm_share`` is the fraction of step time spent in communication. When no
    codec is active and it exceeds ``when_comm_share_above``, emits
    ``SetCodec(codec)``. When a codec is active and ``off_below`` is set and the
    share falls below it, emits ``SetCodec(None)``. Compression is "on" whenever
    ``ctx.codec`` is not ``None``, whichever codec that is. Keep ``off_below``
    well under the on-threshold (compression lowers the share it is judged
    by), or wrap the policy in ``hysteresis``/``cooldown``. Stateless.

    With a ``planner`` (e.g. ``adaptjax.costs.Planner``) the policy asks for
    the predicted step time with and without ``codec`` at the current
    configuration and switches to the faster one when it is faster by at least
    ``min_gain`` — including back to no compression (the batch is the same, so
    goodput follows step time). A configuration the planner cannot predict
    (a codec never measured) is probed when the planner's ``explore`` says it is
    worth it; otherwise the thresholds on ``comm_share`` decide, as without one.

    Args:
      codec: the codec to switch on: an opaque object the user built, never ``None``.
      when_comm_share_above: the on-threshold, in [0, 1).
      off_below: the off-threshold, in [0, when_comm_share_above), or ``None`` to never
        switch off.
      planner: an :class:`adaptjax.costs.Planner` (or any object with
        ``step_time(candidate)``), or ``None``.
      min_gain: with a planner, the smallest predicted relative speed-up worth a switch.

    Example:
      >>> from adaptjax.policies import Context, SwitchCompression
      >>> codec = "onebit"  # stands for e.g. adaptjax.compression.onebit()
      >>> policy = SwitchCompression(codec, when_comm_share_above=0.3, off_below=0.1)
      >>> ctx = Context(step=10, batch_size=64, microbatches=1, devices=8, max_devices=8,
      ...               hyperparams={})
      >>> policy.decide({"comm_share": 0.45}, ctx)
      [SetCodec(codec='onebit')]
      >>> policy.decide({"comm_share": 0.2}, ctx)
      []
      >>> class Model:  # predicts the codec slower than the dense sync
      ...     def step_time(self, c):
      ...         return 0.1 if c.codec is None else 0.3
      >>> SwitchCompression(codec, planner=Model()).decide({"comm_share": 0.9}, ctx)
      []
    """

    codec: object
    when_comm_share_above: float = dataclasses.field(default=0.3, kw_only=True)
    off_below: float | None = dataclasses.field(default=None, kw_only=True)
    planner: object = dataclasses.field(default=None, kw_only=True)
    min_gain: float = dataclasses.field(default=0.05, kw_only=True)

    def __post_init__(self) -> None:
        owner = "SwitchCompression"
        check_planner(self.planner, owner)
        object.__setattr__(
            self, "min_gain", check_float(self.min_gain, owner=owner, name="min_gain", low=0.0)
        )
        if self.codec is None:
            raise ValueError(
                f"{owner}: codec must be a codec object, got None; "
                "to switch compression off, use off_below=..."
            )
        above = check_float(
            self.when_comm_share_above, owner=owner, name="when_comm_share_above", low=0.0,
            high=1.0, high_open=True,
        )
        object.__setattr__(self, "when_comm_share_above", above)
        if self.off_below is not None:
            below = check_float(
                self.off_below, owner=owner, name="off_below", low=0.0, high=above,
                high_open=True,
            )
            object.__setattr__(self, "off_below", below)

    def required_metrics(self) -> frozenset[str]:
        """``{"comm_share"}`` (``{"step_time"}`` with a planner): without it this never acts."""
        return frozenset({"step_time"} if self.planner is not None else {"comm_share"})

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        """Returns ``[SetCodec(codec)]``, ``[SetCodec(None)]`` or ``[]``."""
        if self.planner is not None:
            observe(self.planner, metrics, ctx)
            here = current(ctx)
            on, off = here._replace(codec=self.codec), here._replace(codec=None)
            t_on, t_off = predict(self.planner, on), predict(self.planner, off)
            if t_on is not None and t_off is not None:
                if ctx.codec is None and t_on * (1.0 + self.min_gain) <= t_off:
                    return [SetCodec(self.codec)]
                if ctx.codec is not None and t_off * (1.0 + self.min_gain) <= t_on:
                    return [SetCodec(None)]
                return []
            unknown = [c for c, t in ((on, t_on), (off, t_off)) if t is None and c != here]
            probe = explore(self.planner, unknown)
            if probe is not None:
                return [SetCodec(probe.codec)]
        share = read_metric(metrics, "comm_share")
        if share is None:
            return []
        if ctx.codec is None and share > self.when_comm_share_above:
            why = f"comm_share {share:.3g} > {self.when_comm_share_above:.3g}: compress"
            return [SetCodec(self.codec, reason=f"SwitchCompression: {why}")]
        if ctx.codec is not None and self.off_below is not None and share < self.off_below:
            why = f"comm_share {share:.3g} < off_below {self.off_below:.3g}: dense again"
            return [SetCodec(None, reason=f"SwitchCompression: {why}")]
        return []
