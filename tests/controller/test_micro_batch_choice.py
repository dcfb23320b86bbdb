"""choose_micro_batch: how RunSpec(micro_batch_size="auto") carries a batch change.

Each case states its answer from the model in the module's docstring: per call
T(m) = alpha + beta * m, so a compile of k * m saves (k - 1) * alpha per step over
k micro-steps of m, and pays when that, times the steps left, exceeds the compile's
seconds; a step's bytes are its fixed part plus temporaries in proportion to m.
"""

import pytest

import adaptjax
from adaptjax.controller._micro_batch import Program, choose_micro_batch


def choose(batch, programs, *, memory=None, compile_s=10.0, left=100, unit=8):
    return choose_micro_batch(batch, unit, programs, device_memory=memory,
                              compile_seconds=compile_s, steps_left=left)


def test_a_compiled_whole_batch_runs_whole_without_a_compile():
    c = choose(64, [Program(32, 0.1), Program(64, 0.15)])
    assert (c.micro_batch, c.compiles) == (None, False)


def test_the_compile_pays_exactly_when_k_minus_1_alpha_times_the_steps_left_exceeds_it():
    alpha, beta = 0.02, 0.001  # T(32) = 0.052, T(64) = 0.084: the fit recovers alpha
    progs = [Program(32, alpha + beta * 32), Program(64, alpha + beta * 64)]
    # 256 = 4 micro-steps of 64 (the largest compiled divisor): saves 3 * alpha per step
    need = 10.0 / (3 * alpha)  # steps left at which the saving equals the compile
    below = choose(256, progs, left=int(need) - 1)
    above = choose(256, progs, left=int(need) + 1)
    assert (below.micro_batch, below.compiles) == (64, False)
    assert (above.micro_batch, above.compiles, above.meanwhile) == (None, True, 64)
    assert "would save at most" in below.reason and "may pay" in above.reason


def test_one_timed_program_bounds_the_saving_by_its_own_call():
    # alpha <= T(32) = 0.1: 2 micro-steps save at most 0.1 s a step; 50 steps -> 5 s < 10 s
    assert choose(64, [Program(32, 0.1)], left=50).micro_batch == 32
    assert choose(64, [Program(32, 0.1)], left=200).micro_batch is None  # 20 s > 10 s


def test_a_fit_with_no_fixed_cost_never_pays_for_a_compile():
    progs = [Program(32, 0.001 * 32), Program(64, 0.001 * 64)]  # alpha = 0: k calls cost one
    assert choose(256, progs, left=10**9).micro_batch == 64


def test_without_a_timing_or_a_compile_time_the_whole_batch_is_compiled():
    assert choose(64, [Program(32)]).micro_batch is None  # not timed yet
    assert choose(64, [Program(32, 0.1)], compile_s=None).micro_batch is None
    assert choose(64, []).compiles  # nothing compiled here (e.g. after a rescale)


def test_a_batch_that_would_not_fit_runs_micro_steps_of_a_compiled_one_that_does():
    # 32 samples: 1000 fixed + 400 temporaries -> 256 would need 1000 + 3200 = 4200 bytes
    progs = [Program(32, 0.1, memory=1400, temp=400)]
    c = choose(256, progs, memory=2000, left=10**9)  # a compile would pay, but cannot fit
    assert (c.micro_batch, c.compiles) == (32, False)
    assert "~4.2e+03 bytes per device, over 2000" in c.reason
    assert choose(256, progs, memory=4200).micro_batch is None  # exactly fits


def test_with_no_compiled_divisor_the_largest_that_fits_is_compiled():
    # two programs measured, neither dividing 192: bytes = 1000 + 12.5 * m, so a limit of
    # 2300 fits m <= 104, and the largest multiple of 8 there that divides 192 is 96
    progs = [Program(40, 0.1, memory=1500, temp=500), Program(72, 0.1, memory=1900, temp=900)]
    c = choose(192, progs, memory=2300, unit=8)
    assert (c.micro_batch, c.compiles) == (96, True)


def test_a_batch_that_nothing_fits_is_a_one_line_error():
    progs = [Program(32, 0.1, memory=1400, temp=400)]
    with pytest.raises(ValueError) as e:
        choose(64, progs, memory=1000)
    assert "\n" not in str(e.value)
    assert str(e.value).endswith("raise CompileOptions.device_memory or shard the model "
                                 "(RunSpec.mesh_shape)")


def test_a_misspelt_auto_is_a_one_line_error():
    with pytest.raises(ValueError) as e:
        adaptjax.RunSpec(run_dir="/tmp/x", batch_size=64, micro_batch_size="Auto")
    assert str(e.value) == ("RunSpec.micro_batch_size must be a positive integer, 'auto' or "
                            "None, got 'Auto'")


def test_a_bad_device_memory_is_a_one_line_error():
    with pytest.raises(ValueError) as e:
        adaptjax.CompileOptions(device_memory=-1)
    assert str(e.value) == "CompileOptions.device_memory must be a positive integer, got -1"


def test_bytes_that_fall_with_the_batch_are_read_as_the_largest_steps_share():
    # XLA may report fewer bytes for a larger step (fusion, rematerialisation): a falling line
    # would let any batch fit, so the largest step's fixed bytes + its temporaries' share
    # stand in: 1000 + 800 * 256 / 64 = 4200 > 4000
    progs = [Program(32, 0.1, memory=2000, temp=1000), Program(64, 0.1, memory=1800, temp=800)]
    assert choose(256, progs, memory=4000).micro_batch == 64
    assert choose(256, progs, memory=4200).micro_batch is None


def test_a_backend_without_a_memory_analysis_reads_no_bytes():
    from adaptjax.controller._step_cache import _memory_use

    class NoAnalysis:  # jax's Compiled.memory_analysis() where XLA gives none
        def memory_analysis(self):
            return None

    assert _memory_use(NoAnalysis()) is None
    # no bytes read: every batch counts as fitting, and the timing decides
    assert choose(256, [Program(32, 0.1)], memory=1, left=10**6).micro_batch is None


def test_a_fixed_micro_batch_size_is_the_micro_batch_of_a_configuration_naming_none():
    import jax.numpy as jnp
    import optax

    from adaptjax.controller._step_cache import StepCache

    # a planner's candidate or an older checkpoint's configuration has no micro_batch
    steps = StepCache(model={"w": jnp.zeros(2)}, loss_fn=lambda p, b: 0.0,
                      optimizer=optax.sgd(0.1), micro_batch_size=32)
    assert steps.compiled(adaptjax.RunConfig(8, 128)) == adaptjax.RunConfig(8, 32)
    assert steps.micro_steps(adaptjax.RunConfig(8, 128)) == 4
    auto = StepCache(model={"w": jnp.zeros(2)}, loss_fn=lambda p, b: 0.0,
                     optimizer=optax.sgd(0.1), micro_batch_size="auto")
    assert auto.compiled(adaptjax.RunConfig(8, 128)) == adaptjax.RunConfig(8, 128)
    assert auto.compiled(adaptjax.RunConfig(8, 128, micro_batch=16)) == adaptjax.RunConfig(8, 16)

