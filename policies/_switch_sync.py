"""``SwitchSync``: change how replicas synchronise when a rule over the metrics says so."""

import dataclasses
from collections.abc import Callable, Mapping

from adaptjax.policies._actions import Action, SetSync
from adaptjax.policies._checks import check_metric_gate, read_metric
from adaptjax.policies._context import Context
from adaptjax.policies._policy import Policy


@dataclasses.dataclass(frozen=True, eq=False)
class SwitchSync(Policy):
    """Switches to ``to`` when ``when(metrics, ctx)`` holds and another strategy runs.

    ``when`` is any rule you write; for the common case give ``metric`` and
    ``below``/``above`` instead. For example, DiLoCo once the gradient noise
    scale is small against the batch (averaging every step buys little
    then), measured while S-SGD runs (the noise scale is only measured under
    S-SGD), or back to S-SGD (``to=None``) when a loss plateaus. It never
    emits the strategy already running (``ctx.sync``, compared by ``==``), so
    it is stateless and safe to ask every evaluation. The strategy is an
    opaque value built by the user (``adaptjax.sync.DiLoCo(H=32)``) or its name.

    Args:
      to: the strategy to switch to; ``None`` means S-SGD.
      when: ``when(metrics, ctx) -> bool``; or leave it out and give ``metric``.
      metric: the metric a threshold rule reads (e.g. ``"noise_scale"``).
      below: switch when ``metrics[metric] < below * scale``.
      above: switch when ``metrics[metric] > above * scale``.
      relative_to_batch: ``scale = ctx.batch_size`` (``below=0.5``: noise
        scale under half the batch); else ``scale = 1``.

    Example:
      >>> from adaptjax.policies import Context, SwitchSync
      >>> ctx = Context(step=100, batch_size=256, microbatches=1, devices=8, max_devices=8,
      ...               hyperparams={})
      >>> policy = SwitchSync("diloco", metric="noise_scale", below=0.5, relative_to_batch=True)
      >>> policy.decide({"noise_scale": 90.0}, ctx)
      [SetSync(strategy='diloco')]
      >>> policy.decide({"noise_scale": 900.0}, ctx)
      []
      >>> import dataclasses
      >>> late = SwitchSync(None, when=lambda m, c: c.step >= 1000)  # back to S-SGD
      >>> later = dataclasses.replace(ctx, step=1000, sync="diloco")
      >>> late.decide({}, ctx), late.decide({}, later)
      ([], [SetSync(strategy=None)])
    """

    to: object | None
    when: Callable[[Mapping[str, float], Context], bool] | None = dataclasses.field(
        default=None, kw_only=True
    )
    metric: str | None = dataclasses.field(default=None, kw_only=True)
    below: float | None = dataclasses.field(default=None, kw_only=True)
    above: float | None = dataclasses.field(default=None, kw_only=True)
    relative_to_batch: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        owner = "SwitchSync"
        if (self.when is None) == (self.metric is None):
            raise ValueError(
                f"{owner}: give exactly one of when=(a rule) and metric=(with below= or above=)"
            )
        if self.when is not None and not callable(self.when):
            raise ValueError(f"{owner}: when must be callable(metrics, ctx) -> bool")
        if self.metric is not None:
            check_metric_gate(self, owner)

    def required_metrics(self) -> frozenset[str]:
        """The threshold rule's metric (a ``when`` rule may read any)."""
        return frozenset() if self.metric is None else frozenset({self.metric})

    def _holds(self, metrics: Mapping[str, float], ctx: Context) -> bool:
        if self.when is not None:
            return bool(self.when(metrics, ctx))
        metric, below, above = self.metric, self.below, self.above
        assert metric is not None  # no when: a metric rule (__post_init__ checked exactly one)
        value = read_metric(metrics, metric)
        if value is None:
            return False
        scale = float(ctx.batch_size) if self.relative_to_batch else 1.0
        if below is not None:
            return value < below * scale
        assert above is not None  # exactly one of below and above (checked in __post_init__)
        return value > above * scale

    def decide(self, metrics: Mapping[str, float], ctx: Context) -> list[Action]:
        """Returns ``[SetSync(to)]`` when the rule holds and ``to`` is not running, else ``[]``."""
        if _same(ctx.sync, self.to) or not self._holds(metrics, ctx):
            return []
        if self.metric is None:
            why = "SwitchSync: the user's rule holds"
        else:
            rule = f"below {self.below}" if self.below is not None else f"above {self.above}"
            per = " x batch size" if self.relative_to_batch else ""
            why = f"SwitchSync: {self.metric} {metrics.get(self.metric)!r} is {rule}{per}"
        return [SetSync(self.to, reason=why)]


def _same(running, wanted) -> bool:
    ssgd = (None, "ssgd")
    if running in ssgd or repr(running) == "SSGD()":
        return wanted in ssgd or repr(wanted) == "SSGD()"
    return running == wanted
