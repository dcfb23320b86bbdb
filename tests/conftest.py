"""Every test sees 8 simulated CPU devices (set before jax is imported)."""

import os

# A loaded 2-core machine can delay one simulated device's thread past XLA's default
# collective rendezvous timeout; give it time instead of aborting the process.
_FLAGS = (
    "--xla_force_host_platform_device_count=8",
    "--xla_cpu_collective_call_terminate_timeout_seconds=600",
)
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 8, "tests need 8 simulated CPU devices; jax was imported too early"
