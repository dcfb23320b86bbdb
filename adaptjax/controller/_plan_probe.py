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

This module reads the request and lays out the visits; it imports no jax (the
``adaptjax plan`` command imports it). The probe itself is
:mod:`adaptjax.controller._probe`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the launcher side imports this module: no jax there
    from adaptjax._run_config import RunConfig

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


def probe_visits(configs: list[RunConfig], steps: int) -> list[tuple[RunConfig, int]]:
    """``(config, timed steps)`` of each visit: :data:`ROUNDS` rounds, forth, back, forth.

    A burst of load on a shared machine then lands on every configuration;
    the ``steps`` timed steps of a configuration are shared among its visits.

    Example:
      >>> from adaptjax.controller._plan_probe import probe_visits
      >>> probe_visits(["a", "b"], steps=4)
      [('a', 2), ('b', 2), ('b', 1), ('a', 1), ('a', 1), ('b', 1)]
    """
    rounds = min(ROUNDS, steps)
    out = []
    for r in range(rounds):
        share = steps // rounds + (r < steps % rounds)
        out += [(config, share) for config in (configs if r % 2 == 0 else configs[::-1])]
    return out
