"""Top-k selection: recall against exact top-k and encode+decode throughput vs a copy.

For each selection variant of ``adaptjax.compression.topk`` (``threshold``, the
default, which on CPU runs the native kernel where it was built; ``threshold_xla``,
the same selection in XLA operations, as on other platforms; ``exact``;
``approx``; ``sampled``), on ``--size`` float32 elements
drawn from a standard Gaussian and from a Student-t with 3 degrees of freedom
(heavy tails, like gradients), at the ratios of ``--ratios``:

* ``recall``: the fraction of the exact top-k indices (``lax.top_k`` of |x|)
  that the variant selects;
* ``vs_copy``: copy time / (encode time + decode time) of ``topk(ratio,
  variant=...)``'s ``encode``/``decode`` on one device, each the best wall time
  over calls interleaved with the copy's (a shared machine's speed drifts).

Usage::

    python benchmarks/topk_selection.py [--size 4194304] [--ratios 0.01,0.001] [--repeats 15]

The last line is ``topk_selection recall=<min over distributions and ratios>
vs_copy=<min>`` for the default variant. The target (issue 10 item 7) is
recall >= 0.95 and vs_copy >= 0.25.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from adaptjax.compression import _sparse  # noqa: E402

from adaptjax import compression as ajc  # noqa: E402

VARIANTS = ("threshold", "threshold_xla", "exact", "approx", "sampled")


def _encoder(ratio, variant, k):
    """``encode`` of ``topk(ratio, variant=...)``; ``threshold_xla``: its XLA lane."""
    if variant != "threshold_xla":
        codec = ajc.topk(ratio, variant=variant)
        return jax.jit(lambda v: codec.encode(v, seed=1))

    def enc(v):
        idx, vals = _sparse._select_xla(v.astype(jnp.float32), k)
        return {"values": vals, "indices": idx}

    return jax.jit(enc)


def _best(calls, repeats):
    """Best wall time of each ``(fn, arg)``, the calls taken in turn ``repeats`` times."""
    for fn, arg in calls:
        jax.block_until_ready(fn(arg))
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for i, (fn, arg) in enumerate(calls):
            t = time.perf_counter()
            jax.block_until_ready(fn(arg))
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def rows(size, ratios, repeats, variants=VARIANTS):
    rng = np.random.default_rng(0)
    data = {
        "gaussian": rng.standard_normal(size).astype(np.float32),
        "student_t3": rng.standard_t(3, size).astype(np.float32),
    }
    copy = jax.jit(jnp.copy)
    out = []
    for dist, x in data.items():
        x = jnp.asarray(x)
        for ratio in ratios:
            k = ajc.topk(ratio).k(size)
            exact = np.asarray(jax.jit(lambda v, k=k: jax.lax.top_k(jnp.abs(v), k)[1])(x))
            codec = ajc.topk(ratio)
            dec = jax.jit(lambda p, c=codec: c.decode(p, (size,), seed=1))
            for variant in variants:
                enc = _encoder(ratio, variant, k)
                payload = jax.block_until_ready(enc(x))
                got = np.asarray(payload["indices"])
                recall = np.intersect1d(got[got < size], exact).size / k
                reps = max(2, repeats // 5) if variant in ("exact", "approx") else repeats
                t_copy, t_enc, t_dec = _best([(copy, x), (enc, x), (dec, payload)], reps)
                out.append(dict(dist=dist, ratio=ratio, variant=variant, recall=recall,
                                vs_copy=t_copy / (t_enc + t_dec), enc_ms=t_enc * 1e3,
                                dec_ms=t_dec * 1e3, copy_ms=t_copy * 1e3))
                r = out[-1]
                print(f"{dist:11s} ratio={ratio:<7g} {variant:13s} recall={recall:.4f} "
                      f"vs_copy={r['vs_copy']:.3f} (encode {r['enc_ms']:.2f} ms, decode "
                      f"{r['dec_ms']:.2f} ms, copy {r['copy_ms']:.2f} ms)", flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1 << 22)
    p.add_argument("--ratios", default="0.01,0.001")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",")]
    out = rows(args.size, ratios, args.repeats, tuple(args.variants.split(",")))
    default = [r for r in out if r["variant"] == "threshold"]
    if default:
        print(f"native kernel: {'built' if ajc.native_topk_available() else 'not built'}")
        print(f"topk_selection recall={min(r['recall'] for r in default):.4f} "
              f"vs_copy={min(r['vs_copy'] for r in default):.3f}")


if __name__ == "__main__":
    main()
