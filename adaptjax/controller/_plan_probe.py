"""``adaptjax plan SCRIPT``: a training script's controller turned into a short probe.

``adaptjax plan`` runs the user's unmodified script with ``ADAPTJAX_PLAN_DIR``
set to a fresh directory. A :class:`adaptjax.Controller` built under it writes
only there (never into the script's ``run_dir``: no lock, no log, no
checkpoint of the user's run), and its first :meth:`~adaptjax.Controller.run`
becomes a probe: a few timed steps at each configuration the cost model needs
(:func:`probe_configs`), observed into an :class:`adaptjax.costs.Planner`
(the one the script's policies hold, else a new one calibrated on the devices
there are), which saves ``costs.json``; then the process exits with status 0
without the policies' further actions or the rest of the script.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the launcher side imports this module: no jax there
    from adaptjax.controller._run_config import RunConfig

#: The environment variable that turns a controller into a probe writing under its value.
PLAN_DIR_ENV = "ADAPTJAX_PLAN_DIR"
#: Timed steps per probed configuration (after the first, which may compile).
PLAN_STEPS_ENV = "ADAPTJAX_PLAN_STEPS"
DEFAULT_STEPS = 10
#: Visits to each configuration: a burst of load on a shared machine lands on all of them.
ROUNDS = 3


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What ``adaptjax plan`` asked of the script's controller (from the environment)."""

    directory: str
    steps: int = DEFAULT_STEPS

    @property
    def run_dir(self) -> str:
        """The controller's run directory inside the plan directory."""
        return os.path.join(self.directory, "run")


def plan_request() -> PlanRequest | None:
    """The probe ``adaptjax plan`` asked for, or ``None`` in an ordinary run.

    Example:
      >>> import os
      >>> from adaptjax.controller._plan_probe import plan_request
      >>> "ADAPTJAX_PLAN_DIR" in os.environ or plan_request() is None
      True
    """
    directory = os.environ.get(PLAN_DIR_ENV)
    if not directory:
        return None
    raw = os.environ.get(PLAN_STEPS_ENV, str(DEFAULT_STEPS))
    try:
        steps = int(raw)
    except ValueError:
        steps = 0
    if steps < 1:
        raise ValueError(f"{PLAN_STEPS_ENV}={raw!r}: timed steps per configuration must be >= 1")
    return PlanRequest(os.path.abspath(directory), steps)


def probe_configs(config: RunConfig, codecs: Iterable[str | None],
                  max_devices: int) -> list[RunConfig]:
    """The configurations a probe times, the script's own batch (dense) first.

    The compute fit needs dense steps at two per-replica batch sizes (the
    script's and half of it, or double when half does not split evenly) and
    at two replica counts (half the script's, or 2 from one); each codec the
    policies may switch to is timed at the script's batch. All are synchronous
    (S-SGD): a script's sync strategy is not probed (a planner's configurations
    carry none).

    Example:
      >>> from adaptjax import RunConfig
      >>> from adaptjax.controller._plan_probe import probe_configs
      >>> for c in probe_configs(RunConfig(4, 32), [None, "onebit"], max_devices=8):
      ...     print(c.devices, c.batch_size, c.codec)
      4 32 None
      4 16 None
      4 32 onebit
      2 16 None
    """
    n, b, k = config.devices, config.batch_size, config.microbatches
    dense = config.replace(codec=None, sync=None)
    half = b // 2
    other = half if half >= n * k and half % (n * k) == 0 else 2 * b
    out = [dense, dense.replace(batch_size=other)]
    out += [dense.replace(codec=c) for c in codecs if c is not None]
    m = n // 2 if n >= 2 else (2 if max_devices >= 2 else None)
    if m is not None:
        out.append(dense.replace(devices=m, batch_size=b // n * m))
    return list(dict.fromkeys(out))


def find_planner(policies):
    """The :class:`adaptjax.costs.Planner` the policies hold, or ``None``."""
    from adaptjax._walk import find_held
    from adaptjax.costs._planner import Planner

    held = find_held(list(policies), lambda o: isinstance(o, Planner), max_depth=4)
    return held[0] if held else None


def probe(controller, request: PlanRequest, policies) -> str:
    """Times ``controller`` at each probe configuration; returns the saved costs.json path.

    The policies never decide. The configurations are visited in
    :data:`ROUNDS` rounds (forth, back, forth: one rescale between rounds),
    ``request.steps`` timed steps each in all, through the controller's own
    dispatch and metrics reader (the first step of a visit, which may compile,
    is not timed); the median of a configuration's step intervals is observed
    into the planner, which is attached to ``controller`` (its ``run_dir`` is
    the plan directory's). Links the planner has none of are calibrated
    afterwards, for the collective kinds the probed steps use only.
    """
    from adaptjax import policies as ajp
    from adaptjax.costs._links import message_steps
    from adaptjax.costs._planner import FILENAME, Planner

    ctrl = controller
    if not hasattr(ctrl.data, "batch_at"):
        raise ValueError(
            "adaptjax plan reads each configuration's collectives from its compiled step and "
            f"needs a dataset with batch_at; {type(ctrl.data).__name__} has none (use "
            "adaptjax.ArrayDataset)"
        )
    planner = find_planner(policies) or Planner()
    configs = probe_configs(ctrl.config, ctrl.steps.codecs, ctrl.max_devices)
    configs = [c for c in configs if c.devices <= ctrl.max_devices]
    calibrate = planner.links is None
    planner.attach(ctrl, calibrate=False)  # time only the kinds the probed steps use, below
    times: dict[RunConfig, float] = {}
    rounds = min(ROUNDS, request.steps)
    for r in range(rounds):
        share = request.steps // rounds + (r < request.steps % rounds)
        for config in configs if r % 2 == 0 else configs[::-1]:
            _move_to(ctrl, config, ajp)
            ctrl.reader.restart_clock()
            for _ in range(share + 1):
                ctrl._dispatch()
                ctrl._record(lag=1)
            ctrl._record(lag=0)
            ctrl._to_decide.clear()  # a probe decides nothing
            t = ctrl.latest_metrics.get("step_time")  # the median of every visit's intervals
            if t is not None:
                times[config] = float(t)
    times = {c: times[c] for c in configs if c in times}  # the script's batch first
    if calibrate:
        kinds = sorted({c.kind for config in times for c in planner._wire(config).collectives
                        if message_steps(c.kind, c.group_size) > 0})
        planner.calibrate(ctrl.max_devices, kinds=kinds)
    planner.run_dir = ctrl.run_dir
    for config, t in times.items():
        planner.observe(config, t)
    path = os.path.join(ctrl.run_dir, FILENAME)
    if not times:
        planner.save(path)
    print(f"adaptjax plan: timed {len(times)} configuration(s), {request.steps} steps each; "
          f"wrote {path}", file=sys.stderr, flush=True)
    return path


def _move_to(ctrl, config: RunConfig, ajp) -> None:
    """Moves ``ctrl`` to ``config`` by the controller's own transitions."""
    now = ctrl.config
    actions = []
    if config.sync != now.sync:
        actions.append(ajp.SetSync(ctrl.steps.strategies.get(config.sync)))
    if config.codec != now.codec:
        actions.append(ajp.SetCodec(ctrl.steps.codecs.get(config.codec)))
    if config.devices != now.devices:
        actions.append(ajp.Rescale(devices=config.devices))
    if config.batch_size != now.batch_size or config.microbatches != now.microbatches:
        actions.append(ajp.SetBatchSize(config.batch_size, config.microbatches))
    if actions:
        ctrl.apply(actions)
