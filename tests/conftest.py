"""Every test sees 8 simulated CPU devices (set before jax is imported).

Hangs and timeouts (see the README's test section):

* XLA:CPU runs a multi-device program on a client thread pool of
  max(cores, devices) threads, and a launch that finds a device's in-flight
  queue full blocks one of those threads; a collective already queued then
  cannot get one thread per device and the process deadlocks with the CPU
  idle. ``PJRT_NPROC`` sizes that pool: twice the device count leaves one
  thread per device free even while every device's launch is blocked.
  (``DataParallelStep`` also bounds its steps in flight on CPU; this
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
import signal
import sys

import pytest

# the tests' helper modules (_controller_args, controller_job, ...) import by name
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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
# The suite's own persistent compilation cache: it starts empty (as on a fresh CI machine,
# so the suite's time is honest), is shared with the jobs the tests start, and leaves the
# user's ~/.cache alone.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="adaptjax-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("PJRT_NPROC", str(max(2 * DEVICES, os.cpu_count() or 1)))

import jax  # noqa: E402

assert jax.device_count() == DEVICES, "tests need 8 simulated CPU devices; jax was imported early"


# The fast loop, ``pytest -m "not slow"`` (<= 3 minutes on 2 idle cores), leaves out the
# tests marked @pytest.mark.slow in their files and these, the slowest of the rest by
# ``--durations`` (10-35 s each on a loaded 2-core machine); every module stays covered
# (its docstring examples run in test_docstrings.py, and a faster test of the same
# file stays in). The full suite runs them all.
_LEFT_OUT_OF_THE_FAST_LOOP = {
    "tests/controller/test_controller_run.py::test_every_sample_seen_once_per_epoch_across_batch_and_mesh_changes",  # noqa: E501
    "tests/controller/test_controller_run.py::test_returning_to_a_seen_configuration_does_not_compile",
    "tests/controller/test_controller_run.py::test_rescale_8_4_8_matches_the_same_run_without_rescale",
    "tests/controller/test_controller_run.py::test_run_dir_outputs",
    "tests/compression/test_compression_error_feedback.py::test_ef21_invariant[powersgd]",
    "tests/compression/test_compression_error_feedback.py::test_ef21_invariant[onebit]",
    "tests/compression/test_compression_error_feedback.py::test_merge_replicas_keeps_the_error_feedback_debt[onebit]",  # noqa: E501
    "tests/compression/test_compression_error_feedback.py::test_ef14_telescoping_identity[terngrad+ef]",
    "tests/compression/test_compression_sync.py::test_noise_scale_with_a_codec_matches_the_analytic_value",
    "tests/compression/test_compression_sync.py::test_data_parallel_step_with_codec_state[onebit]",
    "tests/compression/test_compression_sync.py::test_optax_chain_form",
    "tests/compression/test_compression_wire.py::test_wire_bytes_match_formula_on_8_devices[terngrad]",
    "tests/compression/test_compression_wire.py::test_two_level_sends_bf16_on_the_fast_axis_and_bits_on_the_slow_one",  # noqa: E501
    "tests/test_noise_scale_analytic.py::test_preconditioned_noise_scale_is_right_from_the_first_steps_the_averages_cover[0.99-1000]",  # noqa: E501
    "tests/test_noise_scale_analytic.py::test_noise_dominated_readings_are_held_and_flagged_never_huge",  # noqa: E501
    "tests/test_noise_scale_analytic.py::test_snr_and_variance_against_direct_per_example_computation",  # noqa: E501
    "tests/sync/test_sync_switch.py::test_switch_strategies_and_rescale_under_them_lose_nothing",
    "tests/test_step_data_parallel.py::test_flax_nnx_model_matches_single_device",
    "tests/test_step_one_collective.py::test_monitors_with_a_codec_add_no_gradient_sized_collective",  # noqa: E501
    "tests/compression/test_network_transport.py::test_mean_plus_mean_residual_is_the_exact_mean[onebit-owner]",  # noqa: E501
    "tests/controller/test_controller_faults.py::test_one_decision_fires_once_even_when_it_rescales",
    "tests/test_step_data_parallel.py::test_matches_single_device_full_batch[8-1]",
    "tests/controller/test_controller_run.py::test_rescale_to_a_count_that_does_not_divide_the_batch_rounds_and_logs",  # noqa: E501
    "tests/compression/test_compression_error_feedback.py::test_merge_replicas_keeps_the_error_feedback_debt[topk]",  # noqa: E501
}


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects
def pytest_configure(config):
    """Ctrl-C as a user's program gets it, in every test process and the jobs they start.

    A process started in the background by a non-interactive shell (``pytest
    ... &`` in a script, or CI's runner) inherits ``SIGINT`` ignored, and so
    would every job a fault test starts: their Ctrl-C would never arrive. Python's
    own handler is put back (jobs then start with the default, as from a terminal).
    """
    del config
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    """Marks the fast loop's leave-outs slow; slow tests get a longer per-test timeout."""
    collected = {item.nodeid for item in items}
    files = {nodeid.split("::")[0] for nodeid in collected}
    stale = sorted(
        n for n in _LEFT_OUT_OF_THE_FAST_LOOP if n.split("::")[0] in files and n not in collected
    )
    # a moved or renamed file would silently put its slowest tests back in the fast loop
    stale += sorted(
        n for n in _LEFT_OUT_OF_THE_FAST_LOOP if not (config.rootpath / n.split("::")[0]).is_file()
    )
    if stale:
        raise pytest.UsageError(f"tests/conftest.py names tests that do not exist: {stale}")
    timeouts = config.pluginmanager.hasplugin("timeout")  # pytest-timeout (the dev extra)
    for item in items:
        if item.nodeid in _LEFT_OUT_OF_THE_FAST_LOOP:
            item.add_marker(pytest.mark.slow)
        if (
            timeouts
            and item.get_closest_marker("slow")
            and not item.get_closest_marker("timeout")
        ):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


@pytest.fixture
def json_from_python_on_devices():
    """``run(code, devices)``: runs ``code`` in a fresh Python on ``devices`` simulated CPU
    devices and returns its last stdout line, parsed as JSON."""
    import json
    import subprocess
    import sys

    def run(code: str, devices: int, timeout: float = 600):
        env = dict(os.environ)
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        env["JAX_PLATFORMS"] = "cpu"
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=env, capture_output=True, text=True, timeout=timeout, check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


@pytest.fixture(scope="session")
def load_script():
    """``load(path)``: the module of the repository's script ``path`` (e.g.
    ``"benchmarks/frontier.py"``), loaded once under a name of its own (never the
    file's bare name: ``benchmarks/compression.py`` would hand that to the stdlib)."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    loaded = {}

    def load(path: str):
        if path not in loaded:
            name = "script_" + path.replace("/", "_").removesuffix(".py")
            spec = importlib.util.spec_from_file_location(name, os.path.join(root, path))
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            loaded[path] = module
        return loaded[path]

    return load
