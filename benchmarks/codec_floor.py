"""How fast a block-scaled stochastic codec could be here: its passes, timed alone.

TernGrad, QSGD and natural compression need a statistic of each block (max |x|
or the 2-norm) before any code can be drawn, so encoding reads the gradient
twice; decoding writes it once in float32. This script times, on the
7.9M-element gradient of ``benchmarks/compression.py`` and one CPU device, one
call of each in turn (best of many, wall time):

* a float32 copy (the reference of ``throughput_vs_copy``);
* the block statistic alone;
* a bare element-wise pass that reads the gradient and writes one uint8 per
  element (``x > 0``): no random numbers, no packing;
* the codec's real encode and decode.

``floor_vs_copy = copy / (statistic + bare pass + decode)`` is the most a codec
of this shape could reach if drawing and packing its codes cost nothing;
``throughput_vs_copy`` is what it reaches.

Usage::

    python benchmarks/codec_floor.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from adaptjax import compression as ajc  # noqa: E402

D = 7_912_458  # the benchmark model's gradient elements

STATS = {
    "terngrad": lambda x: jnp.max(jnp.abs(x), axis=-1),
    "qsgd": lambda x: jnp.sqrt(jnp.sum(x * x, axis=-1)),
    "natural": lambda x: jnp.max(jnp.abs(x), axis=-1),
}
CODECS = {"terngrad": ajc.terngrad(), "qsgd": ajc.qsgd(7), "natural": ajc.natural()}


def _best(calls, repeats):
    """Best wall time of each ``(fn, arg)``, one call of each in turn."""
    for fn, arg in calls:
        jax.block_until_ready(fn(arg))
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for i, (fn, arg) in enumerate(calls):
            t = time.perf_counter()
            jax.block_until_ready(fn(arg))
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args(argv)

    flat = jnp.asarray(np.random.default_rng(0).normal(size=D).astype(np.float32))
    copy = jax.jit(jnp.copy)
    print("codec     copy ms  stat ms  bare ms  enc ms  dec ms  floor_vs_copy  throughput_vs_copy")
    for name, codec in CODECS.items():
        fmt = codec.fmt
        nb = -(-D // fmt.block)
        x = jnp.pad(flat, (0, nb * fmt.block - D)).reshape(1, nb, fmt.block)
        enc = jax.jit(lambda x, fmt=fmt: fmt.encode(x, jnp.uint32(1)))
        dec = jax.jit(lambda r, fmt=fmt, nb=nb: fmt.decode(r, nb))
        stat = jax.jit(STATS[name])
        bare = jax.jit(lambda x: (x > 0).astype(jnp.uint8))
        rows = enc(x)
        t_copy, t_stat, t_bare, t_enc, t_dec = _best(
            [(copy, flat), (stat, x), (bare, x), (enc, x), (dec, rows)], args.repeats
        )
        floor = t_copy / (t_stat + t_bare + t_dec)
        real = t_copy / (t_enc + t_dec)
        ms = [f"{1e3 * t:7.2f}" for t in (t_copy, t_stat, t_bare, t_enc, t_dec)]
        print(f"{name:9s} {'  '.join(ms)}  {floor:13.0%}  {real:18.0%}")


if __name__ == "__main__":
    main()
