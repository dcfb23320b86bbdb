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

This module reads the request, lays out the visits and holds the probe's
factory; it imports no jax (the ``adaptjax plan`` command imports it). The
probe itself needs the cost model, which the controller does not import:
``adaptjax plan`` runs the script through ``adaptjax.cli._plan_child``, which
installs it (:func:`use_probe`) as ``adaptjax.cli._probe.Probe``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from adaptjax import policies as ajp  # pure: no jax

if TYPE_CHECKING:  # the launcher side imports this module: no jax there
    from adaptjax._run_config import RunConfig
    from adaptjax.controller._step_cache import StepCache

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

    Raises a one-line ``ValueError`` when ``ADAPTJAX_PLAN_DIR`` is set in a
    process ``adaptjax plan`` did not start (no probe installed: :func:`use_probe`).

    Example:
      >>> import os
      >>> from adaptjax.controller._plan_probe import plan_request
      >>> "ADAPTJAX_PLAN_DIR" in os.environ or plan_request() is None
      True
    """
    directory = os.environ.get(PLAN_DIR_ENV)
    if not directory:
        return None
    if _factory is None:
        raise ValueError(
            f"{PLAN_DIR_ENV} is set but no plan probe is installed; run the script under "
            "`adaptjax plan SCRIPT -- ARGS` (or unset it)"
        )
    raw = os.environ.get(PLAN_STEPS_ENV, str(DEFAULT_STEPS))
    try:
        steps = int(raw)
    except ValueError:
        steps = 0
    if steps < 1:
        raise ValueError(f"{PLAN_STEPS_ENV}={raw!r}: timed steps per configuration must be >= 1")
    return PlanRequest(os.path.abspath(directory), steps)


class Probe(Protocol):
    """What a controller under ``adaptjax plan`` drives (built by :func:`make_probe`).

    The controller visits each of :meth:`visits` by its own transitions
    (:func:`move_actions`), hands each visit's median step interval to
    :meth:`observe`, then calls :meth:`finish`.
    """

    def visits(self) -> list[tuple[RunConfig, int]]:
        """``(config, timed steps)`` of each visit, in order."""
        ...

    def observe(self, config: RunConfig, step_time: float | None) -> None:
        """The median step interval of ``config``'s visits so far (``None``: not timed)."""
        ...

    def finish(self, run_dir: str, max_devices: int) -> str:
        """Saves what was timed under ``run_dir``; returns the saved file's path."""
        ...


#: ``factory(controller, request, policies)`` -> a :class:`Probe`.
ProbeFactory = Callable[[Any, PlanRequest, list], Probe]

# One slot, not a list: a process probes for one ``adaptjax plan`` and has one
# probe to build; installing another replaces it. Module-level because the
# controller is built by the user's unmodified script, which passes nothing
# of the plan; only the plan's child process (adaptjax.cli._plan_child) sets it.
_factory: ProbeFactory | None = None


def use_probe(factory: ProbeFactory | None) -> None:
    """Installs the probe factory a controller under ``adaptjax plan`` uses (``None``: none)."""
    global _factory
    _factory = factory


def make_probe(controller, request: PlanRequest, policies) -> Probe:
    """The installed factory's probe of ``controller`` (:func:`use_probe`)."""
    if _factory is None:
        raise ValueError("no plan probe is installed; run the script under `adaptjax plan`")
    return _factory(controller, request, policies)


def move_actions(now: RunConfig, config: RunConfig, steps: StepCache) -> list[ajp.Action]:
    """The actions that move a controller from ``now`` to ``config``."""
    actions: list[ajp.Action] = []
    if config.sync != now.sync:
        actions.append(ajp.SetSync(steps.strategies.get(config.sync)))
    if config.codec != now.codec:
        actions.append(ajp.SetCodec(steps.codecs.get(config.codec)))
    if (config.devices, config.mesh_shape) != (now.devices, now.mesh_shape):
        sharded = config.mesh_shape is not None or now.mesh_shape is not None
        actions.append(ajp.Rescale(mesh_shape=config.axes) if sharded
                       else ajp.Rescale(devices=config.devices))
    if config.batch_size != now.batch_size or config.microbatches != now.microbatches:
        actions.append(ajp.SetBatchSize(config.batch_size, config.microbatches))
    return actions


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
