"""``python -m adaptjax.cli._plan_child SCRIPT ARGS...``: a script run as ``adaptjax plan``'s probe.

``adaptjax plan`` starts this module instead of the script itself: it installs
the probe (``adaptjax.cli._probe.Probe``, through
``adaptjax.controller._plan_probe.use_probe``) and then runs the script as
``python SCRIPT ARGS`` would (``__main__``, its ``sys.argv`` and its
directory first on ``sys.path``). The controller imports nothing of the cost
model; the probe, which needs it, reaches the controller this way.

Nothing here imports jax before the script does: a script may set
``JAX_PLATFORMS`` or ``XLA_FLAGS`` before its own ``import jax``.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from adaptjax.controller._plan_probe import PlanRequest, Probe, use_probe


def _cli_probe(controller, request: PlanRequest, policies) -> Probe:
    """``adaptjax.cli._probe.Probe``, imported when a controller first asks (it imports jax)."""
    from adaptjax.cli import _probe

    return _probe.Probe(controller, request, policies)


def run_script(argv: Sequence[str]) -> None:
    """Installs the probe and runs ``argv[0]`` as ``__main__`` with ``argv[1:]`` as arguments."""
    if not argv:
        raise SystemExit("usage: python -m adaptjax.cli._plan_child SCRIPT [ARGS ...]")
    script = os.path.abspath(argv[0])
    use_probe(_cli_probe)
    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` has it (-m put the cwd)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    run_script(sys.argv[1:])
