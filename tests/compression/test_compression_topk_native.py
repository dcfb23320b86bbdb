"""The native top-k kernel (``compression/_topk_cpu.cc``) against exact top-k and the XLA lane.

Every test runs on each scan lane this CPU has (AVX-512, AVX2, scalar). The
kernel's promise: the exact top-k of ``|x|`` among the nonzero entries, indices
ascending, ties at the k-th largest broken by position, values with their sign,
unused slots ``(size, 0)``. With ties broken the same way, the XLA lane
(``_sparse._select_threshold``) must give the very same arrays wherever its
candidates fit its capacity.
"""

from __future__ import annotations

import shutil
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from adaptjax.compression import _sparse
from adaptjax.compression._topk_native import native_topk, native_topk_available

from adaptjax import compression as ajc


def test_the_kernel_is_built_where_there_is_a_compiler():
    # the build is optional (setup.py): a compile error would otherwise pass unnoticed
    cxx = (sysconfig.get_config_var("CXX") or "c++").split()[0]
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx}) here")
    assert ajc.native_topk_available()


needs_kernel = pytest.mark.skipif(not native_topk_available(), reason="native kernel not built")


def _lanes():
    if not native_topk_available():
        return ["none"]
    from adaptjax.compression import _topk_cpu

    return _topk_cpu.scan_lanes()


@pytest.fixture(params=_lanes())
def lane(request):
    if request.param == "none":
        pytest.skip("native kernel not built")
    from adaptjax.compression import _topk_cpu

    _topk_cpu.use_scan_lane(request.param)
    yield request.param
    _topk_cpu.use_scan_lane(_topk_cpu.scan_lanes()[0])


def _native(x, k):
    idx, vals = jax.jit(lambda a: native_topk(a, k))(jnp.asarray(x, jnp.float32))
    return np.asarray(idx), np.asarray(vals)


def _check_topk(x, k, idx, vals):
    """idx/vals: the exact top-k multiset of |x|, ascending unique positions, signed values."""
    size = x.size
    used = idx < size
    assert np.all(np.diff(idx[used]) > 0)  # ascending, so each index once
    np.testing.assert_array_equal(vals[used], x[idx[used]])
    assert np.all(vals[~used] == 0) and np.all(idx[~used] == size)
    want = np.sort(np.asarray(jax.lax.top_k(jnp.abs(jnp.asarray(x)), k)[0]))
    want = want[want > 0]  # zeros are never sent
    np.testing.assert_array_equal(np.sort(np.abs(vals[used])), want)


# 131,071 = 2^17 - 1: every lane ends on a partial vector
@pytest.mark.parametrize("dist", ["gaussian", "student_t3"])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.3])
def test_exact_top_k_and_the_xla_lane_bit_for_bit(lane, dist, ratio):
    rng = np.random.default_rng(7)
    size = 131071
    x = rng.standard_normal(size) if dist == "gaussian" else rng.standard_t(3, size)
    x = x.astype(np.float32)
    k = int(np.ceil(ratio * size))
    idx, vals = _native(x, k)
    _check_topk(x, k, idx, vals)
    if ratio < 0.1:  # within the XLA lane's capacity, where it is exact
        ref_idx, ref_vals = jax.jit(lambda a: _sparse._select_threshold(a, k))(jnp.asarray(x))
        np.testing.assert_array_equal(idx, np.asarray(ref_idx))
        np.testing.assert_array_equal(vals, np.asarray(ref_vals))


def test_ties_at_the_kth_largest_go_to_the_first_positions(lane):
    size = 50000
    x = np.full(size, 0.25, np.float32)
    x[np.arange(3, size, 13)[:1000]] = 1.0  # tied at the k-th largest
    big = np.arange(7, size, 97)[:100]  # 100 entries above the rest
    x[big] = -2.0
    ones = np.flatnonzero(x == 1.0)
    idx, vals = _native(x, 500)
    assert sorted(idx.tolist()) == sorted(big.tolist() + ones[:400].tolist())
    np.testing.assert_array_equal(vals, x[idx])
    idx, _ = _native(np.full(size, 0.5, np.float32), 400)  # all tied
    np.testing.assert_array_equal(idx, np.arange(400))


@pytest.mark.parametrize("nonzero", [0, 300, 2000])  # k = 2621
def test_fewer_nonzeros_than_k_sends_every_nonzero_and_no_zero(lane, nonzero):
    size = 1 << 18
    rng = np.random.default_rng(nonzero)
    x = np.zeros(size, np.float32)
    nz = np.sort(rng.choice(size, nonzero, replace=False))
    x[nz] = rng.standard_normal(nonzero).astype(np.float32) + 0.1
    idx, vals = _native(x, size // 100)
    np.testing.assert_array_equal(idx[:nonzero], nz)
    np.testing.assert_array_equal(vals[:nonzero], x[nz])
    assert np.all(idx[nonzero:] == size) and np.all(vals[nonzero:] == 0)


def test_nan_ranks_above_inf_above_every_finite(lane):
    # |x| compared as bit patterns, as the XLA lane does
    x = np.random.default_rng(3).standard_normal(70000).astype(np.float32)
    x[[5, 600]] = np.nan
    x[[9, 40000]] = [np.inf, -np.inf]
    idx, vals = _native(x, 4)
    np.testing.assert_array_equal(idx, [5, 9, 600, 40000])
    assert np.isnan(vals[[0, 2]]).all() and vals[1] == np.inf and vals[3] == -np.inf


def _sample_positions(size):
    """The kernel's stratified sample positions (SampleThreshold: 8192 strata, a 32-bit mix)."""
    s = min(size, 8192)
    stride = size // s
    s = size // stride
    x = np.arange(s, dtype=np.uint64)
    m = np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & m
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & m
    x ^= x >> np.uint64(16)
    return np.arange(s) * stride + ((x * np.uint64(stride)) >> np.uint64(32)).astype(np.int64)


def test_a_sample_that_overestimates_falls_back_to_every_nonzero(lane):
    # the sample sees only large entries, so its threshold leaves fewer than k candidates:
    # the kernel scans again with every nonzero as a candidate and is still exact
    size = 131072
    rng = np.random.default_rng(4)
    x = rng.random(size).astype(np.float32)
    at = _sample_positions(size)
    x[at] = 10 + rng.random(at.size).astype(np.float32)
    k = size // 10  # above the 8192 sampled (large) entries
    idx, vals = _native(x, k)
    _check_topk(x, k, idx, vals)
    assert set(at.tolist()) <= set(idx.tolist())


def test_candidates_beyond_the_first_buffer_grow_it(lane):
    # 90% of a 1M leaf above the threshold: the candidate buffer grows chunk by chunk
    x = np.random.default_rng(6).standard_normal(1 << 20).astype(np.float32)
    k = int(0.9 * x.size)
    _check_topk(x, k, *_native(x, k))


@needs_kernel
def test_vmap_runs_each_row():
    x = np.random.default_rng(8).standard_normal((3, 40000)).astype(np.float32)
    idx, vals = jax.jit(jax.vmap(lambda a: native_topk(a, 50)))(jnp.asarray(x))
    for row in range(3):
        want_idx, want_vals = _native(x[row], 50)
        np.testing.assert_array_equal(np.asarray(idx[row]), want_idx)
        np.testing.assert_array_equal(np.asarray(vals[row]), want_vals)


@needs_kernel
def test_threshold_variant_lowers_the_kernel_on_cpu_and_xla_ops_elsewhere():
    x = jnp.zeros((65536,), jnp.float32)
    fn = jax.jit(lambda a: _sparse.select_topk(a, 600, "threshold", 0))
    assert 'custom_call_target="adaptjax_topk_f32"' in fn.lower(x).compile().as_text()
    exported = jax.export.export(fn, platforms=["cuda"])(x)  # lowered only, no GPU needed
    assert "adaptjax_topk_f32" not in exported.mlir_module()


def test_without_the_kernel_native_topk_says_so_and_select_topk_falls_back(monkeypatch):
    from adaptjax.compression import _topk_native

    monkeypatch.setattr(_topk_native, "native_topk_available", lambda: False)
    monkeypatch.setattr(_sparse, "native_topk_available", lambda: False)
    x = jnp.asarray(np.random.default_rng(9).standard_normal(65536).astype(np.float32))
    with pytest.raises(RuntimeError, match="^adaptjax's native top-k kernel was not built"):
        _topk_native.native_topk(x, 10)
    fn = jax.jit(lambda a: _sparse.select_topk(a, 600, "threshold", 0))
    assert "adaptjax_topk_f32" not in fn.lower(x).as_text()
    _check_topk(np.asarray(x), 600, *map(np.asarray, fn(x)))


@needs_kernel
def test_jax_export_needs_the_custom_call_check_disabled():
    # the kernel is a custom call without XLA's compatibility guarantee: jax.export
    # refuses it by default and, with the check disabled, runs it like the jit
    x = jnp.asarray(np.random.default_rng(10).standard_normal(65536).astype(np.float32))
    fn = jax.jit(lambda a: _sparse.select_topk(a, 600, "threshold", 0))
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
        jax.export.export(fn, platforms=["cpu"])(x)
    check = jax.export.DisabledSafetyCheck.custom_call("adaptjax_topk_f32")
    exported = jax.export.export(fn, platforms=["cpu"], disabled_checks=[check])(x)
    for got, want in zip(exported.call(x), fn(x), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
