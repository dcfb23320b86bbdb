"""The per-leaf plan: which lane each leaf takes at ``N`` replicas, and the bytes."""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

import jax
from adaptjax.compression._lanes import LANES, Leaf, lane_buckets
from adaptjax.compression._layout import bf16_bytes, fp32_bytes

if TYPE_CHECKING:
    from adaptjax.compression._base import Codec


def leaf_plan(codec, paths, shapes, n: int) -> list[Leaf]:
    """One :class:`Leaf` per leaf: its lane at ``n`` replicas, checked for the codec.

    A leaf the codec keeps state for and can compress is checked by
    ``codec.check_leaf`` (a one-line ValueError naming the fix); its lane is
    ``codec.method(shape, n)``, a key of :data:`LANES`.

    Args:
      codec: a codec of :mod:`adaptjax.compression`.
      paths: the leaves' key paths.
      shapes: their shapes.
      n: the number of replicas.

    Returns:
      The records, in leaf order.
    """
    plan = []
    for i, (path, shape) in enumerate(zip(paths, shapes, strict=True)):
        shape = tuple(int(d) for d in shape)
        where = jax.tree_util.keystr(path) or "the root"
        stateful = codec.stateful(shape)
        if stateful and codec.can_compress(shape):
            codec.check_leaf(shape, where)
        lane = codec.method(shape, n)
        if lane not in LANES:
            raise ValueError(
                f"{type(codec).__name__}.method returned {lane!r} for the leaf at {where}; "
                f"return one of {tuple(LANES)}"
            )
        plan.append(Leaf(i, where, shape, lane, stateful))
    return plan


def warn_if_nothing_compressed(codec, records: list[Leaf]) -> None:
    """One line when every leaf is under ``codec.min_size``: the codec compresses nothing.

    Called where a sync is traced (Python, once per compiled step), so a
    codec that leaves every leaf in the float32 psum says so at its first step
    instead of only in :func:`plan`. Python shows a warning once per message.
    """
    if not records or any(r.lane != "f32" or r.size >= codec.min_size for r in records):
        return
    largest = max(r.size for r in records)
    warnings.warn(
        f"{codec!r} compresses nothing: all {len(records)} gradient leaves have fewer than "
        f"min_size={codec.min_size} elements (the largest {largest:,}) and travel as float32; "
        f"pass min_size={largest} or less to compress them",
        UserWarning,
        stacklevel=3,
    )


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One leaf of a ``Plan``.

    Attributes:
      path: the leaf's key path, e.g. ``"['w1']"``.
      shape: its shape.
      size: its elements.
      method: the codec's name, ``"f32"`` (one float32 psum: under ``min_size``)
        or ``"bf16"`` (owner-compute bf16: the codec cannot compress it or would
        send more than a bf16 psum at this ``N``).
      bytes: bytes per device per step for this leaf under ``method`` (and the
        transport of its bucket).
      fp32_bytes: a float32 psum's bytes, ``8d(N−1)/N``.
      bf16_bytes: a bf16 psum's bytes, ``4d(N−1)/N``.
      bucket: the exchange it travels in (0 first: buckets go in reverse leaf
        order, lane by lane).
      transport: its bucket's transport (``"owner"``, ``"allgather"``) where
        the lane has a choice, else None.
    """

    path: str
    shape: tuple
    size: int
    method: str
    bytes: float
    fp32_bytes: float
    bf16_bytes: float
    bucket: int = 0
    transport: str | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a codec does with each leaf at ``n`` replicas (a printable table).

    Attributes:
      codec: the codec's name.
      n: the replica count.
      rows: one :class:`PlanRow` per leaf.
      bucket_bytes: the codec's ``bucket_bytes`` (then the table ends with
        the exchanges in the order they go).
    """

    codec: str
    n: int
    rows: tuple[PlanRow, ...]
    bucket_bytes: int | None = None

    @property
    def bytes(self) -> float:
        """Bytes per device per step, all leaves (the per-leaf formulas, unpadded)."""
        return sum(r.bytes for r in self.rows)

    @property
    def fp32_bytes(self) -> float:
        return sum(r.fp32_bytes for r in self.rows)

    @property
    def bf16_bytes(self) -> float:
        return sum(r.bf16_bytes for r in self.rows)

    def methods(self) -> dict[str, str]:
        """``{path: method}``."""
        return {r.path: r.method for r in self.rows}

    @property
    def buckets(self) -> int:
        """Exchanges per step (buckets of every lane)."""
        return len({r.bucket for r in self.rows})

    def __str__(self) -> str:
        head = ("leaf", "shape", "elements", "method", "bytes/dev", "vs fp32", "vs bf16")
        lines: list[tuple[str, ...]] = [head]

        def ratio(a, b):
            return f"{b / a:.1f}x" if a > 0 else "-"

        for r in self.rows:
            lines.append(
                (
                    r.path,
                    "x".join(map(str, r.shape)) or "()",
                    f"{r.size:,}",
                    r.method,
                    f"{r.bytes:,.0f}",
                    ratio(r.bytes, r.fp32_bytes),
                    ratio(r.bytes, r.bf16_bytes),
                )
            )
        lines.append(
            (
                "total",
                "",
                f"{sum(r.size for r in self.rows):,}",
                "",
                f"{self.bytes:,.0f}",
                ratio(self.bytes, self.fp32_bytes),
                ratio(self.bytes, self.bf16_bytes),
            )
        )
        widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
        out = [f"plan: {self.codec} at N={self.n}"]
        for row in lines:
            left = [row[i].ljust(widths[i]) for i in (0, 1)]
            right = [row[i].rjust(widths[i]) for i in (2,)]
            mid = [row[3].ljust(widths[3])]
            tail = [row[i].rjust(widths[i]) for i in (4, 5, 6)]
            out.append("  ".join(left + right + mid + tail).rstrip())
        if self.bucket_bytes is not None:
            first = {}
            for r in self.rows:
                first.setdefault(r.bucket, r)
            many = "s" if self.buckets > 1 else ""
            out.append(f"{self.buckets} exchange{many} of at most {self.bucket_bytes:,} float32 "
                       "bytes, in order: " + ", ".join(
                f"{r.method}{'/' + r.transport if r.transport else ''} from {r.path}"
                for _, r in sorted(first.items())))
        return "\n".join(out)


def plan(grads: Any, codec: Codec, n: int, *, show: bool = True) -> Plan:
    """The per-leaf table of what ``codec`` does at ``n`` replicas, printed and returned.

    A leaf goes ``"f32"`` under the codec's ``min_size``; ``"bf16"`` when the codec
    cannot compress it (PowerSGD on a 1-D leaf) or would send more bytes than a
    bf16 psum at this ``n``; otherwise through the codec. Bytes are the
    per-leaf formulas, under the transport of the leaf's bucket (blocks and
    scales rounded up per leaf). With ``bucket_bytes`` set and more than one
    exchange, a last line lists the exchanges in the order they go.

    Args:
      grads: a pytree of arrays or ``jax.ShapeDtypeStruct`` (shapes only are used).
      codec: a codec of :mod:`adaptjax.compression`.
      n: the number of replicas.
      show: print the table.

    Returns:
      The ``Plan``.

    Example:
      >>> import jax.numpy as jnp
      >>> from adaptjax import compression as ajc
      >>> grads = {"b": jnp.zeros(10), "w": jnp.zeros((1000, 100))}
      >>> p = ajc.plan(grads, ajc.topk(0.01), 8)
      plan: topk at N=8
      leaf   shape     elements  method  bytes/dev  vs fp32  vs bf16
      ['b']  10              10  f32            70     1.0x     0.5x
      ['w']  1000x100   100,000  topk       21,000    33.3x    16.7x
      total             100,010             21,070    33.2x    16.6x
      >>> ajc.plan(grads, ajc.topk(0.2), 8, show=False).methods()["['w']"]
      'bf16'
    """
    if not all(callable(getattr(codec, m, None)) for m in ("method", "leaf_bytes")):
        raise ValueError(f"plan needs a codec of adaptjax.compression, got {type(codec).__name__}")
    if int(n) != n or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n}")
    n = int(n)
    flat = jax.tree_util.tree_leaves_with_path(grads)
    records = leaf_plan(codec, [p for p, _ in flat], [x.shape for _, x in flat], n)
    where = {leaf.index: (b, bucket.transport)
             for b, bucket in enumerate(lane_buckets(codec, records, n)) for leaf in bucket.leaves}
    rows = [
        PlanRow(
            leaf.path,
            leaf.shape,
            leaf.size,
            codec.name if leaf.lane == "codec" else leaf.lane,
            LANES[leaf.lane].bytes(codec, leaf.shape, n, where[leaf.index][1]),
            fp32_bytes(leaf.size, n),
            bf16_bytes(leaf.size, n),
            *where[leaf.index],
        )
        for leaf in records
    ]
    result = Plan(codec.name, n, tuple(rows), getattr(codec, "bucket_bytes", None))
    if show:
        print(result)
    return result
