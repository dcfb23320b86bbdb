"""Start-up calibration: a few timed micro-collectives fit each kind's α and β.

Each kind (all-reduce, all-gather, all-to-all, reduce-scatter) is timed at a
few message sizes on two group sizes (2 replicas and all of them), as the
median of ``repeats`` runs, minus the median of the same program without the
collective (launch overhead is a step's cost, not a collective's). The bytes
of each timed program are read from its compiled HLO (:func:`adaptjax.wire_bytes`),
so a collective XLA widens is timed and counted at the width it really runs.
A few seconds in all.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from adaptjax._wire import wire_bytes
from adaptjax.costs._links import LinkModel, fit_alpha_beta, fit_operand_alpha

DEFAULT_KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter")
DEFAULT_SIZES = (1 << 12, 1 << 16, 1 << 20)  # bytes of the per-device f32 buffer
TUPLE_OPERANDS = 8  # operands of the timed tuple all-reduce (alpha_operand)


def _program(kind: str, axis: str):
    if kind == "all-reduce":
        return lambda x: jax.lax.psum(x, axis)
    if kind == "all-gather":
        return lambda x: jax.lax.all_gather(x, axis, tiled=True)
    if kind == "all-to-all":
        return lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)
    if kind == "reduce-scatter":
        return lambda x: jax.lax.psum_scatter(x, axis, tiled=True)
    raise ValueError(f"calibrate_links: unknown kind {kind!r}; use one of {DEFAULT_KINDS}")


def _median_seconds(fn, x, repeats: int) -> float:
    jax.block_until_ready(fn(x))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _groups(devices: int) -> list[int]:
    """Group sizes to time: 2 and all devices; under jax.distributed all of them only.

    A group of two would leave the other processes out of the program.
    """
    return sorted({2, devices}) if jax.process_count() == 1 else [devices]


def _ones(n: int, elems: int):
    """A ``(n·elems,)`` float32 array of ones sharded over a mesh of the first ``n`` devices.

    Built shard by shard: under jax.distributed each process gives its own.
    """
    mesh = Mesh(np.array(jax.devices()[:n]), ("calib",))
    x = jax.make_array_from_callback(
        (n * elems,), NamedSharding(mesh, P("calib")),
        lambda index: np.ones((n * elems,), np.float32)[index])
    return mesh, x


def time_collectives(
    devices: int,
    kinds: Sequence[str] = DEFAULT_KINDS,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 7,
) -> list[tuple[str, int, float, float]]:
    """Times micro-collectives on the first ``devices`` devices.

    Under ``jax.distributed`` every process calls it (each supplies its own
    shards) and only the group of all ``devices`` is timed.

    Returns:
      ``(kind, group size, bytes each device sent, seconds)`` per timing.
    """
    if devices < 2:
        raise ValueError(
            f"calibrate_links needs >= 2 devices to time a collective, got {devices}; "
            "pin LinkModel.from_bandwidth(...) instead"
        )
    out = []
    for n in _groups(devices):
        for size in sizes:
            # divisible by n for scatter / all-to-all
            mesh, x = _ones(n, max(size // 4 // n, 1) * n)
            base = jax.jit(jax.shard_map(lambda v: v * 2.0, mesh=mesh, in_specs=P("calib"),
                                         out_specs=P("calib")))
            t_base = _median_seconds(base, x, repeats)
            for kind in kinds:
                # psum and a tiled all_gather leave every replica the whole result.
                spec_out = P() if kind in ("all-reduce", "all-gather") else P("calib")
                body = _program(kind, "calib")
                fn = jax.jit(jax.shard_map(lambda v, body=body: body(v * 2.0), mesh=mesh,
                                           in_specs=P("calib"), out_specs=spec_out,
                                           check_vma=False))
                report = wire_bytes(fn, x)
                sent = sum(c.compiled_bytes for c in report.collectives if c.kind == kind)
                secs = max(_median_seconds(fn, x, repeats) - t_base, 0.0)
                out.append((kind, n, float(sent), secs))
    return out


def time_tuple_all_reduce(
    devices: int,
    operands: int = TUPLE_OPERANDS,
    size: int = DEFAULT_SIZES[0],
    repeats: int = 7,
) -> list[tuple[int, int, float, float]]:
    """Times one all-reduce of ``operands`` buffers of ``size`` bytes per device each.

    The program is one tuple all-reduce (as XLA's combiner makes of a step's
    per-leaf psums; checked in its compiled HLO), timed on the same groups as
    :func:`time_collectives`, minus the same program without the collective.

    Returns:
      ``(group size, operands, bytes each device sent, seconds)`` per group.
    """
    out = []
    for n in _groups(devices):
        mesh, x = _ones(n, max(size // 4, 1))

        def parts(v):
            return tuple(v * (i + 1.0) for i in range(operands))

        base = jax.jit(jax.shard_map(parts, mesh=mesh, in_specs=P("calib"),
                                     out_specs=P("calib")))
        fn = jax.jit(jax.shard_map(lambda v: jax.lax.psum(parts(v), "calib"), mesh=mesh,
                                   in_specs=P("calib"), out_specs=P(), check_vma=False))
        report = wire_bytes(fn, x)
        found = [c for c in report.collectives if c.kind == "all-reduce"]
        if [c.num_operands for c in found] != [operands]:
            raise RuntimeError(
                f"time_tuple_all_reduce: expected one all-reduce of {operands} operands in the "
                f"compiled program, found {[c.num_operands for c in found]}"
            )
        secs = max(_median_seconds(fn, x, repeats) - _median_seconds(base, x, repeats), 0.0)
        out.append((n, operands, float(found[0].compiled_bytes), secs))
    return out


def calibrate_links(
    devices: int | None = None,
    *,
    kinds: Sequence[str] = DEFAULT_KINDS,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 7,
) -> dict[str, LinkModel]:
    """Fits α and β of each collective kind from timed micro-collectives.

    For the all-reduce also the latency of each further operand of a tuple
    all-reduce (:func:`time_tuple_all_reduce`, ``LinkModel.alpha_operand``).

    Args:
      devices: replicas to time over (default: every device).
      kinds: the collective kinds to fit.
      sizes: per-device buffer sizes in bytes (>= 2 distinct).
      repeats: timed runs per program (the median is used).

    Returns:
      ``{kind: LinkModel}``, ready for :meth:`StepTimeModel.fit`.

    Example:
      >>> import jax
      >>> from adaptjax.costs._calibrate import calibrate_links
      >>> links = calibrate_links(min(len(jax.devices()), 2), kinds=("all-reduce",),
      ...                         sizes=(4096, 65536), repeats=3)
      >>> links["all-reduce"].beta >= 0
      True
    """
    n = len(jax.devices()) if devices is None else int(devices)
    rows = time_collectives(n, kinds, sizes, repeats)
    links = {}
    for kind in kinds:
        mine = [r for r in rows if r[0] == kind]
        links[kind] = fit_alpha_beta(kind, [r[1] for r in mine], [r[2] for r in mine],
                                     [r[3] for r in mine])
    if "all-reduce" in links:  # the only kind XLA joins into tuples here
        tuples = time_tuple_all_reduce(n, size=min(sizes), repeats=repeats)
        links["all-reduce"] = fit_operand_alpha(links["all-reduce"], "all-reduce",
                                                *zip(*tuples, strict=True))
    return links


def time_axis_collectives(
    mesh_shape: Mapping[str, int],
    kinds: Sequence[str] = DEFAULT_KINDS,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 7,
) -> list[tuple[str, str, int, float, float]]:
    """Times micro-collectives over each axis of a ``{axis: size}`` mesh, the others apart.

    On a (data 2, fsdp 4) mesh an all-gather over ``"fsdp"`` runs in two
    groups of four at once, as FSDP's do; its links are those inside a
    replica (a node, when ``"fsdp"`` is the last axis on GPUs). Axes of one
    device are skipped.

    Returns:
      ``(kind, axis, group size, bytes each device sent, seconds)`` per timing.
    """
    from adaptjax.launch._distributed import mesh_devices  # the run's own device order

    shape = {str(a): int(n) for a, n in dict(mesh_shape).items()}
    axes, total = tuple(shape), math.prod(shape.values())
    mesh = Mesh(np.array(mesh_devices(total), dtype=object).reshape(tuple(shape.values())), axes)
    out = []
    for axis, k in shape.items():
        if k < 2:
            continue
        others = tuple(a for a in axes if a != axis)
        for size in sizes:
            elems = max(size // 4 // k, 1) * k
            x = jax.make_array_from_callback(
                (total * elems,), NamedSharding(mesh, P(axes)),
                lambda index, n=total * elems: np.ones((n,), np.float32)[index])
            base = jax.jit(jax.shard_map(lambda v: v * 2.0, mesh=mesh, in_specs=P(axes),
                                         out_specs=P(axes)))
            t_base = _median_seconds(base, x, repeats)
            for kind in kinds:
                whole = kind in ("all-reduce", "all-gather")  # the axis's copies agree
                spec_out = P(others if others else None) if whole else P(axes)
                body = _program(kind, axis)
                fn = jax.jit(jax.shard_map(lambda v, body=body: body(v * 2.0), mesh=mesh,
                                           in_specs=P(axes), out_specs=spec_out,
                                           check_vma=False))
                report = wire_bytes(fn, x)
                sent = sum(c.compiled_bytes for c in report.collectives if c.kind == kind)
                secs = max(_median_seconds(fn, x, repeats) - t_base, 0.0)
                out.append((kind, axis, k, float(sent), secs))
    return out


def calibrate_axis_links(
    mesh_shape: Mapping[str, int],
    *,
    kinds: Sequence[str] = DEFAULT_KINDS,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 7,
) -> dict[str, LinkModel]:
    """α and β of each collective kind on each axis of a mesh: ``{"all-gather@fsdp": ...}``.

    Keys are ``"kind@axis"``; a :class:`~adaptjax.costs.StepTimeModel`
    prices a collective over one axis by its axis's link before its kind's
    (:meth:`~adaptjax.costs.StepTimeModel.link`).

    Example:
      >>> from adaptjax.costs._calibrate import calibrate_axis_links
      >>> links = calibrate_axis_links({"data": 2, "fsdp": 4}, kinds=("all-gather",),
      ...                              sizes=(4096, 65536), repeats=3)
      >>> sorted(links)
      ['all-gather@data', 'all-gather@fsdp']
    """
    from adaptjax.costs._model import link_key

    rows = time_axis_collectives(mesh_shape, kinds, sizes, repeats)
    links = {}
    for kind in kinds:
        for axis in dict.fromkeys(r[1] for r in rows):
            mine = [r for r in rows if r[:2] == (kind, axis)]
            if mine:
                links[link_key(kind, (axis,))] = fit_alpha_beta(
                    kind, [r[2] for r in mine], [r[3] for r in mine], [r[4] for r in mine])
    return links
