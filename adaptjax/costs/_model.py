"""The step-time model: compute + codec work + communication (α–β per collective).

For a configuration (replicas, global batch, micro-batches, codec, sync
strategy) and the collectives of its compiled step (:func:`adaptjax.wire_bytes`)::

    step = compute(n, b, k) + codec(codec, sync, n) + Σ link[kind].time(N, bytes)
           − min(async communication, overlap · compute)

``compute`` is a :class:`~adaptjax.costs.ComputeModel` fitted on the dense
steps (on a sharded mesh ``n`` counts every device: FSDP splits each
replica's rows over its axis, tensor parallelism its matmuls); ``codec`` is
each codec's own encode/decode work (``fixed + per_device·n``), fitted on the
steps measured with it; each collective costs
``message_steps·α + β·bytes`` (:class:`~adaptjax.costs.LinkModel`, one per
collective kind, or per kind and mesh axis: ``"all-gather@fsdp"`` prices
FSDP's all-gathers on the link inside a replica, ``"all-reduce@data"`` the
sync between replicas; :func:`reshape_report` moves a step's collectives to
another mesh shape); branches of a ``lax.cond`` are averaged as in
``WireReport.total``. Collectives XLA schedules asynchronously
(``-start``/``-done``) may hide behind computation: ``overlap`` (fitted, 0 when
the program has none) is the fraction of compute they can hide behind.

``compute`` is fitted on the dense steps of one precision (``RunConfig.
precision``; the one measured most, float32 on a tie), and each other
precision measured scales it by a factor fitted on its own dense steps.

A configuration the model has no measurement for is never guessed:
:meth:`StepTimeModel.predict` raises :class:`CannotPredict` with a one-line
reason (a codec never measured, communication never timed, no step times).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from adaptjax._wire import Collective, WireReport, _ring_bytes
from adaptjax.costs._compute import ComputeModel, fit_compute, nnls
from adaptjax.costs._links import LinkModel, message_steps

# The least share of a measured step counted as compute (see StepTimeModel._fit_compute).
_MIN_COMPUTE = 0.05


class CannotPredict(ValueError):
    """The model has no measurement to predict this configuration from (one-line reason)."""


def config_key(config: Any) -> tuple[int, int, int, str | None, str | None]:
    """``(devices, batch_size, microbatches, codec, sync)`` of a RunConfig-like object.

    ``codec`` is the codec's key (``codec_key``); ``sync`` the
    sync strategy's name when the configuration has one (``None``: synchronous).

    Example:
      >>> from adaptjax import RunConfig
      >>> from adaptjax.costs._model import config_key
      >>> config_key(RunConfig(devices=4, batch_size=64))
      (4, 64, 1, None, None)
    """
    sync = getattr(config, "sync", None)
    return (int(config.devices), int(config.batch_size), int(getattr(config, "microbatches", 1)),
            config.codec, None if sync is None else str(sync))


def precision_of(config: Any) -> str:
    """The precision key of a RunConfig-like object (``"float32"`` where it names none)."""
    precision = getattr(config, "precision", None)
    return "float32" if precision is None else str(precision)


def _base_precision(dense: Sequence[Observation]) -> str:
    """The precision compute is fitted in: the one of most dense steps, float32 on a tie."""
    counts = collections.Counter(precision_of(o.config) for o in dense)
    return max(counts, key=lambda p: (counts[p], p == "float32")) if counts else "float32"


def compute_devices(config: Any) -> int:
    """The devices that share a step's computation: every device of the mesh.

    ``config.device_count`` (a :class:`adaptjax.RunConfig` on a sharded mesh)
    or its replicas.
    """
    return int(getattr(config, "device_count", config.devices))


def link_key(kind: str, axes: Sequence[str] | str = ()) -> str:
    """The key of a kind's link on mesh ``axes``: ``"all-gather@fsdp"`` (``kind`` without axes).

    Example:
      >>> from adaptjax.costs._model import link_key
      >>> link_key("all-gather", ("fsdp",)), link_key("all-reduce", "data+fsdp"), link_key("all-to-all")
      ('all-gather@fsdp', 'all-reduce@data+fsdp', 'all-to-all')
    """  # noqa: E501
    axes = axes if isinstance(axes, str) else "+".join(axes)
    return f"{kind}@{axes}" if axes else kind


def _message(kind: str, sent: float, n: int) -> float:
    """The message behind ``sent`` bytes per device of a ``kind`` collective over ``n`` devices:
    the all-reduced buffer, the gathered result, the scattered or exchanged buffer."""
    if kind == "all-reduce":
        return sent * n / (2 * (n - 1)) if n > 1 else 0.0
    if kind == "collective-permute":
        return sent
    return sent * n / (n - 1) if n > 1 else 0.0


def _sent(kind: str, n: int, message: float) -> float:
    """Bytes per device of a ``kind`` collective of ``message`` over ``n`` devices."""
    return _ring_bytes("all-to-all" if kind == "all-gather" else kind, n, message)


def as_report(wire: WireReport | Sequence[Collective]) -> WireReport:
    """A ``WireReport`` from a report or a sequence of collectives."""
    if isinstance(wire, WireReport):
        return wire
    return WireReport(tuple(wire))


def rescale_report(wire: WireReport | Sequence[Collective], devices: int) -> WireReport:
    """The same program's collectives on ``devices`` replicas, at the same message size.

    Every collective over the whole mesh keeps its message (the all-reduced
    buffer, the gathered result, the exchanged buffer) and its bytes follow the
    ring formula at the new group size. Exact for all-reduce, all-to-all,
    reduce-scatter and the owner-compute codecs; for an all-gather whose
    per-replica piece is fixed (top-k values) it under-counts growth with N.

    Example:
      >>> from adaptjax import Collective
      >>> from adaptjax.costs import rescale_report
      >>> c = Collective("all-reduce", "f32", (100,), 100, 2, 400.0, 400.0, "f32")
      >>> rescale_report([c], 4).collectives[0].bytes  # 2(N-1)/N · 400
      600.0
    """
    report = as_report(wire)
    old = report.num_devices or max((c.group_size for c in report.collectives), default=1)
    out = []
    for c in report.collectives:
        if c.group_size != old or c.group_size == devices:
            out.append(c)
            continue
        new = {f: _sent(c.kind, devices, _message(c.kind, getattr(c, f), c.group_size))
               for f in ("bytes", "compiled_bytes")}
        out.append(dataclasses.replace(c, group_size=devices, **new))
    return WireReport(tuple(out), devices, report.conditionals)


def reshape_report(wire: WireReport | Sequence[Collective], old: Mapping[str, int],
                   new: Mapping[str, int]) -> WireReport:
    """The same program's collectives on mesh ``new`` (``{axis: size}``), from mesh ``old``.

    Each collective keeps its axes (:attr:`adaptjax.Collective.axes`) and
    spans the new sizes of them (one that spans a single device is left out:
    it sends nothing). Its message follows the sharding: a collective over
    ``"data"`` alone moves each device's shard of the gradients, which grows
    by ``old / new`` model-axes devices (``fsdp × model``); the model axes'
    collectives (FSDP's all-gathers of weights, the reductions of their
    gradients) move whole weights and keep their message. Bytes follow the
    ring formula. An estimate where leaves stay whole (small ones, or where
    the rule finds no divisible dimension on the new mesh).

    Raises:
      CannotPredict: a collective whose axes the report does not know.

    Example:
      >>> from adaptjax import Collective
      >>> from adaptjax.costs import reshape_report
      >>> sync = Collective("all-reduce", "f32", (250,), 250, 2, 1000.0, 1000.0, "f32",
      ...                   axes=("data",))
      >>> gather = Collective("all-gather", "f32", (250,), 250, 4, 3000.0, 3000.0, "f32",
      ...                     axes=("fsdp",))
      >>> r = reshape_report([sync, gather], {"data": 2, "fsdp": 4}, {"data": 4, "fsdp": 2})
      >>> [(c.group_size, c.bytes) for c in r.collectives]  # 2 x the shard; the same weights
      [(4, 3000.0), (2, 2000.0)]
    """
    report = as_report(wire)

    def model(shape):
        return math.prod(n for a, n in shape.items() if a != "data")

    growth = model(old) / model(new)
    out = []
    for c in report.collectives:
        if not c.axes:
            raise CannotPredict(
                f"cannot move a {c.kind} to mesh {dict(new)}: its mesh axes are unknown (a "
                "costs.json written before sharded meshes?); record the step again"
            )
        n = math.prod(int(new.get(a, 1)) for a in c.axes)
        if n <= 1:
            continue
        scale = growth if c.axes == ("data",) else 1.0
        sent = {f: _sent(c.kind, n, scale * _message(c.kind, getattr(c, f), c.group_size))
                for f in ("bytes", "compiled_bytes")}
        out.append(dataclasses.replace(c, group_size=n, **sent))
    return WireReport(tuple(out), math.prod(new.values()), report.conditionals)


@dataclasses.dataclass(frozen=True)
class Observation:
    """One configuration's measured step time and the collectives of its compiled step.

    Attributes:
      config: a :class:`adaptjax.RunConfig` (or anything with ``devices``,
        ``batch_size``, ``microbatches``, ``codec`` and optionally ``sync``).
      wire: its ``WireReport`` (or the collectives).
      step_time: the measured seconds per step (a median).
    """

    config: Any
    wire: WireReport
    step_time: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "wire", as_report(self.wire))
        t = self.step_time
        if not (isinstance(t, int | float) and math.isfinite(t) and t > 0):
            raise ValueError(f"Observation: step_time must be a positive number, got {t!r}")


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A predicted step and its parts (seconds), with the bytes each device sends.

    Attributes:
      step_time: predicted seconds per step.
      compute: the computation's seconds.
      codec: the codec's own encode/decode seconds (0 for a dense sync).
      comm: the collectives' seconds (before overlap).
      hidden: communication seconds hidden behind computation.
      bytes: bytes each device sends per step (``WireReport.total``).
    """

    step_time: float
    compute: float
    codec: float
    comm: float
    hidden: float
    bytes: float


@dataclasses.dataclass(frozen=True)
class CodecCost:
    """A codec's own seconds per step: ``fixed + per_device·n`` (n replicas)."""

    fixed: float = 0.0
    per_device: float = 0.0

    def time(self, devices: int) -> float:
        return self.fixed + self.per_device * devices


@dataclasses.dataclass(frozen=True)
class StepTimeModel:
    """Predicts the seconds of one training step per configuration.

    Build it with :meth:`fit` from the links (timed micro-collectives,
    ``calibrate_links``, or a pinned
    :meth:`LinkModel.from_bandwidth`) and measured steps; :meth:`refit` with
    more observations as the run goes on.

    Attributes:
      links: ``{collective kind: LinkModel}``; ``"*"`` applies to every kind
        without its own entry (a pinned bandwidth).
      compute: the fitted computation model, or ``None`` before any dense step
        was measured.
      codecs: ``{(codec key, sync): CodecCost}`` for the configurations measured;
        ``(None, None)`` (dense, synchronous) costs nothing extra.
      overlap: fraction of compute that asynchronous collectives hide behind.
      observations: the measurements the model was fitted on.
      precisions: ``{precision key: factor}``: each measured precision's
        compute as a multiple of ``compute``, which is fitted on the dense steps
        of the precision measured most (float32 on a tie; its factor is 1).
        Empty: ``compute`` holds for every precision.

    Example:
      >>> from adaptjax import Collective, RunConfig
      >>> from adaptjax.costs import LinkModel, StepTimeModel
      >>> from adaptjax.costs._model import Observation
      >>> link = LinkModel(alpha=1e-4, beta=1e-8)
      >>> def wire(n):  # one all-reduce of 4 MB
      ...     b = 2 * (n - 1) / n * 4e6
      ...     return [Collective("all-reduce", "f32", (10**6,), 10**6, n, b, b, "f32")]
      >>> obs = [Observation(RunConfig(2, b), wire(2),
      ...                    0.01 + 0.001 * b / 2 + link.time("all-reduce", 2, 4e6))
      ...        for b in (16, 32, 64)]
      >>> model = StepTimeModel.fit({"all-reduce": link}, obs)
      >>> p = model.predict(RunConfig(4, 128), wire(4))
      >>> round(p.comm, 6), round(p.step_time, 4)
      (0.0606, 0.1026)
    """

    links: Mapping[str, LinkModel]
    compute: ComputeModel | None = None
    codecs: Mapping[tuple[str | None, str | None], CodecCost] = dataclasses.field(
        default_factory=dict
    )
    overlap: float = 0.0
    observations: tuple[Observation, ...] = ()
    precisions: Mapping[str, float] = dataclasses.field(default_factory=dict)

    # ---- prediction --------------------------------------------------------------------
    def link(self, kind: str, axes: Sequence[str] | str = ()) -> LinkModel:
        """The link of ``kind`` on mesh ``axes``: ``"kind@axes"``, else ``kind``, else ``"*"``."""
        if axes and link_key(kind, axes) in self.links:
            return self.links[link_key(kind, axes)]
        if kind in self.links:
            return self.links[kind]
        if "*" in self.links:
            return self.links["*"]
        if not self.links:
            raise CannotPredict(
                f"cannot predict communication ({kind}): no collective was timed (calibrated "
                "on one device?); run calibrate_links() on >= 2 devices or pin "
                "LinkModel.from_bandwidth(...)"
            )
        raise CannotPredict(
            f"cannot predict communication: no α–β fit for {kind} (have "
            f"{', '.join(sorted(self.links))}); calibrate_links(kinds=(..., {kind!r}))"
        )

    def comm_time(self, wire: WireReport | Sequence[Collective]) -> tuple[float, float]:
        """(all, asynchronous) seconds of a program's collectives; branches averaged."""
        report = as_report(wire)

        def secs(c: Collective) -> float:
            if message_steps(c.kind, c.group_size) == 0 or c.compiled_bytes == 0:
                return 0.0
            return self.link(c.kind, c.axes).time(c.kind, c.group_size, c.compiled_bytes,
                                                  c.num_operands)

        def secs_async(c: Collective) -> float:
            return secs(c) if c.is_async else 0.0

        return report._fold(secs, _mean), report._fold(secs_async, _mean)

    def codec_time(self, config: Any) -> float:
        devices, _, _, codec, sync = config_key(config)
        if (codec, sync) == (None, None):
            return 0.0
        cost = self.codecs.get((codec, sync))
        if cost is None:
            what = f"codec {codec!r}" if codec is not None else "sync"
            if sync is not None:
                what += f" with sync {sync!r}"
            raise CannotPredict(
                f"cannot predict {what}: no step with it was measured; run a few steps with it "
                "(Planner.explore probes it) and refit"
            )
        return cost.time(devices)

    def precision_factor(self, config: Any) -> float:
        """How much ``config``'s precision scales ``compute`` (see ``precisions``)."""
        precision = precision_of(config)
        if not self.precisions:
            return 1.0
        if precision not in self.precisions:
            raise CannotPredict(
                f"cannot predict precision {precision!r}: no dense step in it was measured; run "
                "a few steps in it and refit"
            )
        return self.precisions[precision]

    def predict(self, config: Any, wire: WireReport | Sequence[Collective]) -> Prediction:
        """The predicted step of ``config`` whose compiled step has collectives ``wire``.

        Raises:
          CannotPredict: (a ``ValueError``) with a one-line reason when the
            model has no measurement for part of it.
        """
        devices, batch, micro, _, _ = config_key(config)
        if self.compute is None:
            raise CannotPredict(
                "cannot predict compute: no recorded step times; run a few steps (or fit from "
                "a run directory) first"
            )
        report = as_report(wire)
        every = compute_devices(config)
        compute = self.compute.time(devices=every, batch_size=batch, microbatches=micro)
        compute *= self.precision_factor(config)
        codec = self.codec_time(config)
        comm, comm_async = self.comm_time(report) if every > 1 else (0.0, 0.0)
        hidden = min(comm_async, self.overlap * compute)
        return Prediction(compute + codec + comm - hidden, compute, codec, comm, hidden,
                          report.total)

    # ---- fitting -----------------------------------------------------------------------
    @classmethod
    def fit(
        cls,
        links: Mapping[str, LinkModel],
        observations: Iterable[Observation],
        *,
        compute: ComputeModel | None = None,
    ) -> StepTimeModel:
        """Fits compute on the dense steps, then each codec on its residuals.

        Args:
          links: the α–β model of each collective kind (``"*"``: every kind).
          observations: measured steps.
          compute: a fixed compute model (skips fitting it).

        Returns:
          The fitted model (``compute`` is ``None`` when there are no dense steps
          with two per-replica batch sizes and none was given).
        """
        obs = tuple(observations)
        base = cls(dict(links), compute, {}, 0.0, obs)
        every_dense = [o for o in obs if config_key(o.config)[3:] == (None, None)]
        in_base = _base_precision(every_dense)
        dense = [o for o in every_dense if precision_of(o.config) == in_base]
        has_async = any(c.is_async for o in dense for c in o.wire.collectives)
        best = None
        for overlap in ((0.0, 0.25, 0.5, 0.75, 1.0) if has_async else (0.0,)):
            model = dataclasses.replace(base, overlap=overlap)
            if compute is None:
                model = model._fit_compute(dense)
            err = model._error(dense)
            if best is None or err < best[0]:
                best = (err, model)
        assert best is not None  # the loop ran at least once
        model = best[1]
        if model.compute is None:
            return model
        model = model._fit_precisions(every_dense, in_base)
        groups: dict[tuple, list[Observation]] = {}
        for o in obs:
            key = config_key(o.config)[3:]
            if key != (None, None) and precision_of(o.config) in model.precisions:
                groups.setdefault(key, []).append(o)
        codecs = {}
        for key, rows in groups.items():
            # The codec's own seconds: what the step took beyond its dense twin's prediction.
            ys = np.array([o.step_time - model.predict(_Dense(o.config), o.wire).step_time
                           for o in rows])
            ns = [config_key(o.config)[0] for o in rows]
            w = 1.0 / np.array([o.step_time for o in rows])
            if len(set(ns)) >= 2:
                a = np.array([[1.0, float(n)] for n in ns])
                x = nnls(a * w[:, None], ys * w)
                codecs[key] = CodecCost(float(x[0]), float(x[1]))
            else:
                codecs[key] = CodecCost(max(float(np.sum(ys * w * w) / np.sum(w * w)), 0.0), 0.0)
        return dataclasses.replace(model, codecs=codecs)

    def refit(self, more: Iterable[Observation]) -> StepTimeModel:
        """This model refitted with ``more`` observations added (pinned links kept)."""
        return StepTimeModel.fit(self.links, (*self.observations, *more))

    def _fit_precisions(self, dense: list[Observation], in_base: str) -> StepTimeModel:
        """Each other precision's compute as a multiple of ``in_base``'s (relative fit)."""
        rows: dict[str, list[tuple[float, float, float]]] = {}
        for o in dense:
            precision = precision_of(o.config)
            if precision == in_base:
                continue
            base = self.predict(_InPrecision(o.config, in_base), o.wire)
            # the base's compute c, and what this step left for compute: t - comm + hidden
            y = o.step_time - base.comm + base.hidden
            rows.setdefault(precision, []).append((base.compute, y, 1.0 / o.step_time))
        factors = {in_base: 1.0}
        for precision, xs in rows.items():
            num = math.fsum(w * w * c * y for c, y, w in xs)
            den = math.fsum(w * w * c * c for c, y, w in xs)
            factors[precision] = max(num / den, _MIN_COMPUTE) if den > 0 else 1.0
        return dataclasses.replace(self, precisions=factors)

    def _fit_compute(self, dense: list[Observation]) -> StepTimeModel:
        rows = []
        for o in dense:
            _, b, k, _, _ = config_key(o.config)
            n = compute_devices(o.config)
            comm, comm_async = self.comm_time(o.wire) if n > 1 else (0.0, 0.0)
            rows.append((n, b, k, o.step_time, comm, comm_async))
        if len({b / n for n, b, *_ in rows}) < 2:
            return self
        # A measured step always computes something. Where the link model claims (nearly)
        # all of it for communication, the row says nothing about compute: a residual near
        # 0 s would get a huge weight in the relative fit and pull every compute
        # coefficient to zero (a one-replica step predicted at 0 s). Such rows are left
        # out while two per-replica batch sizes remain; otherwise they count
        # _MIN_COMPUTE of their step as compute.
        informative = [r for r in rows if r[3] - r[4] > _MIN_COMPUTE * r[3]]  # t - comm
        if len({b / n for n, b, *_ in informative}) >= 2:
            rows = informative
        # hidden = min(async, overlap·compute) depends on compute: iterate twice.
        secs = [max(t - c, _MIN_COMPUTE * t) for _, _, _, t, c, _ in rows]
        model = None
        for _ in range(3):
            model = fit_compute([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                                secs)
            secs = []
            for n, b, k, t, c, ca in rows:
                comp = model.time(devices=n, batch_size=b, microbatches=k)
                secs.append(max(t - c + min(ca, self.overlap * comp), _MIN_COMPUTE * t))
        return dataclasses.replace(self, compute=model)

    def _error(self, dense: list[Observation]) -> float:
        if self.compute is None:
            return math.inf
        return math.fsum(
            ((self.predict(o.config, o.wire).step_time - o.step_time) / o.step_time) ** 2
            for o in dense
        )


@dataclasses.dataclass(frozen=True)
class _Dense:
    """A configuration seen as its dense, synchronous twin (same replicas and batch)."""

    inner: Any

    @property
    def devices(self):
        return self.inner.devices

    @property
    def batch_size(self):
        return self.inner.batch_size

    @property
    def microbatches(self):
        return getattr(self.inner, "microbatches", 1)

    @property
    def device_count(self):
        return compute_devices(self.inner)

    @property
    def precision(self):
        return precision_of(self.inner)

    codec = None
    sync = None


@dataclasses.dataclass(frozen=True)
class _InPrecision:
    """A configuration seen in another precision (same replicas, batch, codec and sync)."""

    inner: Any
    precision: str

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs)
