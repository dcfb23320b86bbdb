"""Every test sees 8 simulated CPU devices (set before jax is imported).

Hangs and timeouts (see the README's test section):

* XLA:CPU runs a multi-device program on a client thread pool of
  max(cores, devices) threads, and a launch that finds a device's in-flight
  queue full blocks one of those threads; a collective already queued then
  cannot get one thread per device and the process deadlocks with the CPU
  idle. ``PJRT_NPROC`` sizes that pool: twice the device count leaves one
  thread per device free even while every device's launch is blocked.
  (``adaptjax.DataParallelStep`` also bounds its steps in flight on CPU; this
  covers the tests' own ``shard_map`` loops too.)
* A collective that still waits ``_COLLECTIVE_TIMEOUT_S`` aborts the run with
  XLA's message naming the rendezvous (and pytest's faulthandler dump of every
  Python thread); any other test running past its ``timeout`` (pytest-timeout,
  pyproject.toml; ``SLOW_TIMEOUT_S`` for ``@pytest.mark.slow``) ends the run
  with a dump of every thread's stack. A native deadlock cannot be interrupted
  inside the process, so both end the run: in seconds, not XLA's default
  minutes.
"""

import os

import pytest

DEVICES = 8
_COLLECTIVE_TIMEOUT_S = 60  # far above any real wait of 8 threads on 2 busy cores
SLOW_TIMEOUT_S = 420

_FLAGS = (
    f"--xla_force_host_platform_device_count={DEVICES}",
    f"--xla_cpu_collective_call_terminate_timeout_seconds={_COLLECTIVE_TIMEOUT_S}",
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=15",
)
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PJRT_NPROC", str(max(2 * DEVICES, os.cpu_count() or 1)))

import jax  # noqa: E402

assert jax.device_count() == DEVICES, "tests need 8 simulated CPU devices; jax was imported early"


def pytest_collection_modifyitems(config, items):
    """End-to-end tests (``@pytest.mark.slow``) get a longer per-test timeout."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
