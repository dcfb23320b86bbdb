"""The native lane of the threshold top-k on CPU: an XLA FFI handler.

``_topk_cpu`` (built from ``_topk_cpu.cc`` at install, where a C++17 compiler
is found) selects the exact top-k of ``|x|`` in one pass over the leaf: a
sampled threshold, a vectorized compaction of the entries above it, and a
histogram selection among those. On CPU it is about 2-3x faster than the
same selection in XLA operations (the docs' benchmarks page), which
stay the lane on other platforms and where the kernel was not built.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from adaptjax.compression._collectives import varying_axes

_TARGET = "adaptjax_topk_f32"


@functools.cache
def native_topk_available() -> bool:
    """Whether this install has the native top-k kernel that ``topk`` and ``dgc`` use on CPU.

    It is built at install time where a C++17 compiler is found; without it the
    codecs select with XLA operations alone (same result, slower on CPU).

    The kernel is a custom call that XLA gives no compatibility guarantee, so
    ``jax.export`` of a CPU program that uses it needs
    ``disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("adaptjax_topk_f32")]``,
    and the exported program runs only where adaptjax has registered the kernel
    (by calling this function). ``variant="exact"`` exports without it.

    >>> from adaptjax import compression as ajc
    >>> isinstance(ajc.native_topk_available(), bool)
    True
    """
    try:
        from adaptjax.compression import _topk_cpu
    except ImportError:
        return False
    jax.ffi.register_ffi_target(_TARGET, _topk_cpu.handler(), platform="cpu")
    return True


def native_topk(f, k: int):
    """(indices, values) of the exact top-k of ``|f|`` (float32, 1-D), by the CPU kernel.

    Indices ascend; ties at the k-th largest go to the first positions; exact
    zeros are never selected, and slots left unused hold ``(f.size, 0)``: the
    result of the XLA lane (``_sparse._select_threshold``) wherever that is exact.
    Raises ``RuntimeError`` where the kernel was not built (see
    :func:`native_topk_available`).
    """
    if not native_topk_available():
        raise RuntimeError(
            "adaptjax's native top-k kernel was not built (no C++17 compiler at install?); "
            "use select_topk, which falls back to XLA operations"
        )
    out = (jax.ShapeDtypeStruct((k,), jnp.int32), jax.ShapeDtypeStruct((k,), jnp.float32))
    idx, vals = jax.ffi.ffi_call(_TARGET, out, vmap_method="sequential")(f)
    # inside shard_map the results vary over the same mesh axes as the leaf
    return varying_like(f, idx, vals)


def varying_like(x, *ys) -> tuple:
    """``ys`` marked as varying over the shard_map axes that ``x`` varies over
    (a loop carry or a custom call's results keep the leaf's type under
    ``check_vma=True``); unchanged outside shard_map."""
    axes = set(varying_axes(x))
    out = []
    for y in ys:
        missing = tuple(sorted(axes - set(varying_axes(y))))
        out.append(jax.lax.pcast(y, missing, to="varying") if missing else y)
    return tuple(out)

