"""``adaptjax plan``'s probe: the planner that observes the timed visits, and its costs.json.

The controller's loop drives the probe (see ``adaptjax.controller._plan_probe``,
whose ``Probe`` protocol this class meets): for each of :meth:`Probe.visits` it
moves to the configuration by its own transitions (``move_actions``),
dispatches and records the steps, and hands the median step interval to
:meth:`Probe.observe`; :meth:`Probe.finish` then fits and saves the planner's
``costs.json``. The CLI layer holds it because it needs both the controller's
parts and the cost model, which import nothing of each other; the plan's child
process (``adaptjax.cli._plan_child``) installs it.
"""

from __future__ import annotations

import os
import sys

from adaptjax._run_config import RunConfig
from adaptjax._walk import find_held
from adaptjax.controller._plan_probe import PlanRequest, probe_configs, probe_visits
from adaptjax.costs._links import message_steps
from adaptjax.costs._planner import FILENAME, Planner


def find_planner(policies):
    """The :class:`adaptjax.costs.Planner` the policies hold, or ``None``."""
    held = find_held(list(policies), lambda o: isinstance(o, Planner), max_depth=4)
    return held[0] if held else None


class Probe:
    """Times a controller at each probe configuration, into a planner that saves costs.json.

    The planner is the one the policies hold, else a new one; it is attached
    to ``controller`` (whose ``run_dir`` is the plan directory's). Links the
    planner has none of are calibrated in :meth:`finish`, for the collective
    kinds the probed steps use only.

    Args:
      controller: the :class:`adaptjax.Controller` built under ``adaptjax plan``.
      request: what ``adaptjax plan`` asked for (``plan_request``).
      policies: the controller's policies (they never decide in a probe).
    """

    def __init__(self, controller, request: PlanRequest, policies):
        if not hasattr(controller.data, "batch_at"):
            raise ValueError(
                "adaptjax plan reads each configuration's collectives from its compiled step "
                f"and needs a dataset with batch_at; {type(controller.data).__name__} has none "
                "(use adaptjax.ArrayDataset)"
            )
        self.request = request
        self.planner = find_planner(policies) or Planner()
        configs = probe_configs(controller.config, controller.steps.codecs,
                                controller.max_devices)
        self.configs = [c for c in configs if c.devices <= controller.max_devices]
        self._calibrate = self.planner.links is None
        sharded = controller.config.mesh_shape is not None
        self._mesh_shape = controller.config.axes if sharded else None  # links per axis
        # time only the collective kinds the probed steps use (finish)
        self.planner.attach(controller, calibrate=False)
        self.times: dict[RunConfig, float] = {}

    def visits(self) -> list[tuple[RunConfig, int]]:
        """``(config, timed steps)`` of each visit, in order (``probe_visits``)."""
        return probe_visits(self.configs, self.request.steps)

    def observe(self, config: RunConfig, step_time: float | None) -> None:
        """The median step interval of ``config``'s visits so far (``None``: not timed)."""
        if step_time is not None:
            self.times[config] = float(step_time)

    def finish(self, run_dir: str, max_devices: int) -> str:
        """Calibrates, observes every timed configuration and saves; returns costs.json's path."""
        times = {c: self.times[c] for c in self.configs if c in self.times}  # script's batch first
        planner = self.planner
        if self._calibrate:
            kinds = sorted({c.kind for config in times for c in planner._wire(config).collectives
                            if message_steps(c.kind, c.group_size) > 0})
            planner.calibrate(max_devices, kinds=kinds, mesh_shape=self._mesh_shape)
        planner.run_dir = run_dir
        for config, t in times.items():
            planner.observe(config, t)
        path = os.path.join(run_dir, FILENAME)
        if not times:
            planner.save(path)
        print(f"adaptjax plan: timed {len(times)} configuration(s), {self.request.steps} steps "
              f"each; wrote {path}", file=sys.stderr, flush=True)
        return path
