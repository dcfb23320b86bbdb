"""The planner policies ask: predicted step times from a model refitted on the run's own steps.

:class:`Planner` is what policies given
``planner=`` call ``step_time(candidate)`` (``None`` when the model cannot
tell), pass on each measured step time through ``observe`` (the model is
refitted on them), and ask ``explore(candidates)`` which unpredictable
configuration is worth probing.

The search is cost-aware, as in HeterBO: each candidate's seconds per sample
is a Gaussian around the model's prediction (σ: the model's relative error on
the steps measured so far; for a codec never measured, its dense twin's
prediction with σ = 50%); its expected improvement over the best measured
configuration, times the samples of ``horizon_steps`` steps, is the time a
switch could save, and probing costs ``probe_steps`` steps plus a compile.
The candidate with the most saving per second of probing is probed when the
saving exceeds the cost.

Attached to a controller, the planner also turns the communication knobs of
each configuration's step (:meth:`Planner.schedule`): the dense lane (one
all-reduce, or reduce-scatter + all-gather) and a quantizer codec's bucket
size, whichever the calibrated links predict fastest at its device count.
Each choice is logged (a ``schedule`` event) and saved in ``costs.json``.

On a sharded mesh (:attr:`adaptjax.RunConfig.mesh_shape`) the links are also
calibrated per mesh axis (``calibrate_axis_links``), a
candidate may name a mesh shape (its collectives are the observed step's,
moved by :func:`adaptjax.costs.reshape_report`), and :attr:`Planner.memory`
holds the parameter and optimizer bytes per device of every shape of the
run's device count (:func:`adaptjax.costs.state_bytes_per_device`), which
``adaptjax plan`` prints next to each shape's predicted step.

References:
  Jones, Schonlau and Welch, "Efficient Global Optimization of Expensive
  Black-Box Functions", 1998 (expected improvement).
  HeterBO (cost-aware Bayesian optimisation over deployments, listed in the
  project's REFERENCES.md): expected improvement per unit of search cost.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax

from adaptjax._run_config import RunConfig, codec_key, precision_key
from adaptjax._wire import Collective, WireReport, wire_bytes
from adaptjax.costs._calibrate import DEFAULT_KINDS, calibrate_axis_links, calibrate_links
from adaptjax.costs._links import LinkModel
from adaptjax.costs._meshes import mesh_shapes, state_bytes_per_device
from adaptjax.costs._model import (
    CannotPredict,
    Observation,
    Prediction,
    StepTimeModel,
    _Dense,
    as_report,
)
from adaptjax.costs._schedule import OWNER_COMPUTE, buckets, choose_bucket_bytes, choose_dense_lane
from adaptjax.costs._simulate import wire_for
from adaptjax.sync._registry import sync_key

if TYPE_CHECKING:
    import adaptjax
    from adaptjax.policies import Candidate

#: A codec's ``transport`` for each exchange kind the planner prices.
CODEC_TRANSPORT = {OWNER_COMPUTE: "owner", "all-gather": "allgather"}


def _transport_kinds(codec) -> tuple[str, ...]:
    """The exchange kinds to price for ``codec``: its own transport if it names one."""
    if not hasattr(codec, "transport"):
        return (OWNER_COMPUTE,)
    if codec.transport is None:
        return tuple(CODEC_TRANSPORT)
    return tuple(k for k, t in CODEC_TRANSPORT.items() if t == codec.transport)


FILENAME = "costs.json"



def _is_block_codec(codec: Any) -> bool:
    """Whether ``codec`` is priced by its buckets: a dataclass with the block codecs' fields."""
    return bool(dataclasses.is_dataclass(codec) and hasattr(codec, "bucket_bytes")
                and hasattr(codec, "method") and getattr(codec, "bits", None))

class Planner:
    """Predicted step times for policies, from a :class:`StepTimeModel` refitted online.

    Args:
      links: ``{collective kind: LinkModel}``; ``None`` times micro-collectives
        when attached to a controller (``calibrate_links``).
      bandwidth: pin every collective to this link (bytes/s) instead.
      latency: seconds per message step with ``bandwidth``.
      wire_of: ``config -> WireReport`` of a configuration's compiled step;
        :meth:`attach` sets it from the controller.
      horizon_steps: steps a better configuration would run for (the search's value).
      probe_steps: steps a probe costs (with one compile).
      compile_seconds: the seconds a compile costs a probe.

    Example:
      >>> from adaptjax import Collective
      >>> from adaptjax.costs import LinkModel, Planner
      >>> from adaptjax.policies import Candidate
      >>> def wire(config):  # one 4 MB all-reduce
      ...     n = config.devices
      ...     b = 2 * (n - 1) / n * 4e6
      ...     return [Collective("all-reduce", "f32", (10**6,), 10**6, n, b, b, "f32")]
      >>> planner = Planner({"all-reduce": LinkModel(0.0, 1e-8)}, wire_of=wire)
      >>> planner.step_time(Candidate(4, 64)) is None  # nothing measured yet
      True
      >>> for b in (32, 64):  # 10 ms + 1 ms per replica sample + the all-reduce
      ...     planner.observe(Candidate(4, b), 0.01 + 0.001 * b / 4 + 0.06)
      >>> round(planner.step_time(Candidate(4, 128)), 6)
      0.102
    """

    def __init__(
        self,
        links: Mapping[str, LinkModel] | None = None,
        *,
        bandwidth: float | None = None,
        latency: float = 0.0,
        wire_of: Callable[[Any], WireReport | Sequence[Collective]] | None = None,
        horizon_steps: int = 1000,
        probe_steps: int = 20,
        compile_seconds: float = 5.0,
    ):
        if bandwidth is not None:
            links = {"*": LinkModel.from_bandwidth(bandwidth, latency)}
        self.links = None if links is None else dict(links)
        self.wire_of = wire_of
        self.horizon_steps = int(horizon_steps)
        self.probe_steps = int(probe_steps)
        self.compile_seconds = float(compile_seconds)
        self.run_dir: str | None = None
        self._times: dict[RunConfig, float] = {}
        self._wires: dict[RunConfig, WireReport] = {}
        self._steps = None  # the controller's StepCache, once attached
        #: ``{config: {option: value, "predicted_s": {...}}}``: the choices of :meth:`schedule`.
        self.schedules: dict[RunConfig, dict[str, Any]] = {}
        #: ``{"data=2,fsdp=4": bytes}``: parameters and optimizer state per device of each
        #: mesh shape of a sharded run's device count (set by :meth:`attach`).
        self.memory: dict[str, int] = {}
        self.model = StepTimeModel(self.links or {})

    # ---- wiring ------------------------------------------------------------------------
    def attach(self, controller: adaptjax.Controller, *, calibrate: bool = True) -> Planner:
        """Reads compiled steps' collectives from ``controller``; calibrates links if unset.

        With ``calibrate=False`` links stay unset until :meth:`calibrate` is
        called (e.g. for only the collective kinds the steps turn out to use).

        Also saves the model to ``controller.run_dir/costs.json`` at every refit,
        which ``adaptjax plan RUN_DIR`` reads, and from then on builds each
        configuration's step with the communication options :meth:`schedule`
        predicts fastest (attach before the run starts: a step already built
        keeps its options), logging each choice as a ``schedule`` event.
        """
        steps, data = controller.steps, controller.data

        def wire_of(config):
            return wire_bytes(steps.step(config).jitted, *steps.abstract_args(config, data))

        self.wire_of = wire_of
        self.run_dir = controller.run_dir
        config = controller.config
        sharded = config.mesh_shape is not None
        if self.links is None and calibrate:
            self.calibrate(controller.max_devices, mesh_shape=config.axes if sharded else None)
        self._steps = steps
        if sharded:
            tx = steps.tx(config.codec, config.sync, config.precision)
            self.memory = {
                shape_label(shape): state_bytes_per_device(steps.model, tx, shape,
                                                           sharding=steps.sharding)
                for shape in mesh_shapes(config.device_count, tuple(config.axes),
                                         config.batch_size, config.microbatches)
            }

        def schedule(config: RunConfig) -> dict[str, Any]:
            options = self.schedule(config)
            if config in self.schedules:
                controller.log.event("schedule", step=controller.step,
                                     config=dataclasses.asdict(config), **self.schedules[config])
            return options

        steps.schedule = schedule
        return self

    def schedule(self, config: RunConfig) -> dict[str, Any]:
        """The communication options the model predicts fastest for ``config``'s step.

        Without a codec (under a strategy that averages gradients),
        ``{"dense_lane": ...}`` from :func:`adaptjax.costs.choose_dense_lane`
        on the gradients' bytes; with a block codec (the quantizers),
        ``{"bucket_bytes": B, "transport": T}`` from
        :func:`adaptjax.costs.choose_bucket_bytes` over the leaves the codec
        compresses (``B = None``: one exchange, the codec's default, when the
        best bucket holds the whole lane), with the backward pass the model has
        fitted as overlap, and ``T`` the transport (``"owner"``: an all-to-all
        then an all-gather; ``"allgather"``: one all-gather) whose best bucket
        the links predict faster, so the planner's links, not the codec's
        default transport model, decide it (codecs without a ``transport``
        field are priced as owner-compute and given ``B`` alone). ``{}`` when
        nothing is attached, on one device, or when the links cannot tell (a
        collective kind never timed). The choice
        and its predicted seconds are kept in :attr:`schedules`.
        """
        steps, n = self._steps, config.devices
        if steps is None or n < 2:
            return {}
        codec = steps.codecs.get(config.codec)
        leaves = steps.param_leaves()
        try:
            if codec is None:
                if steps.strategy(config.sync).local_models:
                    return {}
                # the monitors' scalars: one more operand (their few bytes hardly count)
                scalars = 64.0 if steps.monitors else 0.0
                lane, times = choose_dense_lane(
                    self.model, float(sum(math.prod(s) * d.itemsize for s, d in leaves)), n,
                    leaves=len(leaves), scalar_bytes=scalars)
                self.schedules[config] = {"dense_lane": lane, "predicted_s": times}
                return {"dense_lane": lane}
            if not _is_block_codec(codec):
                return {}
            # the codec's buckets: whole leaves, from the last (the backward pass's first)
            lane_bytes = [4.0 * math.prod(shape) for shape, _ in reversed(leaves)
                          if codec.method(shape, n) == "codec"]
            if not lane_bytes:
                return {}
            overlap = 0.0
            if self.model.compute is not None and self.model.overlap > 0:
                overlap = self.model.overlap * self.model.compute.time(
                    devices=n, batch_size=config.batch_size, microbatches=config.microbatches)
            whole = sum(lane_bytes)
            candidates = sorted({*(2.0**k for k in range(12, 29) if 2.0**k < whole), whole})
            kinds = _transport_kinds(codec)
            by_kind = {kind: choose_bucket_bytes(
                self.model, lane_bytes, n, kind=kind, candidates=candidates,
                overlap_compute=overlap, wire_fraction=float(codec.bits) / 32.0, split=False)
                for kind in kinds}
        except CannotPredict:
            return {}
        # ties: at 2 replicas the one all-gather (the same bytes), else owner-compute
        kind = min(by_kind, key=lambda k: (by_kind[k][1][by_kind[k][0]],
                                           (k == OWNER_COMPUTE) == (n == 2)))
        best, times = by_kind[kind]
        count = len(buckets(lane_bytes, best, split=False))
        bucket = None if count == 1 else int(best)
        chosen: dict[str, Any] = {"bucket_bytes": bucket}
        if hasattr(codec, "transport"):
            chosen["transport"] = CODEC_TRANSPORT[kind]
        self.schedules[config] = {**chosen, "buckets": count, "predicted_s": times[best],
                                  "one_exchange_s": times[whole]}
        return chosen

    def calibrate(self, devices: int, kinds: Sequence[str] | None = None, *,
                  mesh_shape: Mapping[str, int] | None = None) -> dict:
        """Times micro-collectives on up to ``devices`` devices and uses them as the links.

        ``kinds`` (default: every kind ``calibrate_links``
        times); with fewer than two devices there is nothing to time and the
        links are empty. With ``mesh_shape`` (``{"data": 2, "fsdp": 4}``) each
        kind is also timed over each axis of that mesh
        (``calibrate_axis_links``: ``"all-gather@fsdp"``, ...).
        """
        n = min(int(devices), len(jax.devices()))
        kinds = DEFAULT_KINDS if kinds is None else tuple(kinds)
        self.links = calibrate_links(n, kinds=kinds) if n >= 2 and kinds else {}
        if mesh_shape is not None and kinds:
            self.links.update(calibrate_axis_links(mesh_shape, kinds=kinds))
        self.model = dataclasses.replace(self.model, links=self.links)
        return self.links

    @staticmethod
    def config_of(candidate: Candidate | RunConfig) -> RunConfig:
        """The :class:`adaptjax.RunConfig` of a policy's candidate (its sync and precision kept:
        a step's time depends on both)."""
        codec, sync = candidate.codec, getattr(candidate, "sync", None)
        return RunConfig(int(candidate.devices), int(candidate.batch_size),
                         int(candidate.microbatches),
                         codec if isinstance(codec, str) or codec is None else codec_key(codec),
                         sync if isinstance(sync, str) or sync is None else sync_key(sync),
                         precision_key(getattr(candidate, "precision", None)),
                         mesh_shape=getattr(candidate, "mesh_shape", None))

    def _wire(self, config: RunConfig) -> WireReport:
        if config in self._wires:
            return self._wires[config]
        if self.wire_of is not None:
            report = as_report(self.wire_of(config))
            self._wires[config] = report
            return report
        return wire_for(self.model, config)

    # ---- the policies' protocol ---------------------------------------------------------
    def observe(self, candidate: Candidate | RunConfig, step_time: float) -> None:
        """Records a measured step time at ``candidate`` and refits the model."""
        config = self.config_of(candidate)
        if not (isinstance(step_time, int | float) and math.isfinite(step_time)
                and step_time > 0):
            return
        new = config not in self._times
        self._times[config] = float(step_time)
        if new:
            self._wire(config)  # compiles the step's HLO once per configuration
        self.refit()

    def refit(self) -> StepTimeModel:
        """Refits the model on every observed configuration (and saves it with a run_dir)."""
        obs = [Observation(c, self._wire(c), t) for c, t in self._times.items()]
        self.model = StepTimeModel.fit(self.links or {}, obs)
        if self.run_dir is not None:
            self.save(os.path.join(self.run_dir, FILENAME))
        return self.model

    def predict(self, candidate: Candidate | RunConfig) -> Prediction:
        """The model's :class:`Prediction` (raises :class:`CannotPredict`)."""
        config = self.config_of(candidate)
        self.model.codec_time(config)  # a codec never measured: say so before compiling
        return self.model.predict(config, self._wire_known(config))

    def _wire_known(self, config: RunConfig) -> WireReport:
        if config in self._wires:
            return self._wires[config]
        try:
            return wire_for(self.model, config)  # no compile for a codec already seen
        except CannotPredict:
            if self.wire_of is None:
                raise
            return self._wire(config)

    def step_time(self, candidate: Candidate | RunConfig) -> float | None:
        """Predicted seconds per step at ``candidate``, or ``None`` when the model cannot tell."""
        try:
            return self.predict(candidate).step_time
        except CannotPredict:
            return None

    def explore(self, candidates: Sequence[Any]) -> Any | None:
        """The candidate with the most expected saving per second of probing, if worth it."""
        if not self._times:
            return None
        rel = self._relative_error()
        best = min(t / c.batch_size for c, t in self._times.items())
        pick, pick_score = None, 0.0
        for cand in candidates:
            config = self.config_of(cand)
            if config in self._times:
                continue
            try:
                mu, sigma = self.predict(cand).step_time, rel
            except CannotPredict:
                try:
                    mu = self.model.predict(_Dense(config), self._dense_wire(config)).step_time
                except CannotPredict:
                    continue
                sigma = 0.5
            f_mu, f_sigma = mu / config.batch_size, max(sigma, 1e-3) * mu / config.batch_size
            z = (best - f_mu) / f_sigma
            ei = (best - f_mu) * _phi_cdf(z) + f_sigma * _phi_pdf(z)
            saving = ei * config.batch_size * self.horizon_steps
            cost = self.probe_steps * mu + self.compile_seconds
            if saving > cost and saving / cost > pick_score:
                pick, pick_score = cand, saving / cost
        return pick

    def _dense_wire(self, config: RunConfig) -> WireReport:
        return wire_for(self.model, config.replace(codec=None, sync=None))

    def _relative_error(self) -> float:
        errs = []
        for o in self.model.observations:
            try:
                p = self.model.predict(o.config, o.wire).step_time
            except CannotPredict:
                continue
            errs.append(((p - o.step_time) / o.step_time) ** 2)
        return max(math.sqrt(sum(errs) / len(errs)) if errs else 0.0, 0.05)

    # ---- persistence -------------------------------------------------------------------
    def to_json(self) -> dict:
        """The links and observations as plain JSON (what ``adaptjax plan`` reads)."""
        return {
            "links": {k: [v.alpha, v.beta, v.pinned, v.alpha_operand]
                      for k, v in (self.links or {}).items()},
            "observations": [
                {"config": dataclasses.asdict(c), "step_time": t,
                 "wire": _wire_json(self._wire(c))}
                for c, t in self._times.items()
            ],
            "schedules": [{"config": dataclasses.asdict(c), **chosen}
                          for c, chosen in self.schedules.items()],
            "memory": dict(self.memory),
        }

    def save(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> Planner:
        """A planner from a saved ``costs.json`` (predicts by rescaling observed steps)."""
        if os.path.isdir(path):
            path = os.path.join(path, FILENAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"no {FILENAME} at {path}: attach an adaptjax.costs.Planner to the run "
                "(planner.attach(controller)) so it records one"
            )
        with open(path) as f:
            data = json.load(f)
        planner = cls({k: LinkModel(*v) for k, v in data["links"].items()})
        for row in data["observations"]:
            config = RunConfig(**row["config"])
            planner._times[config] = float(row["step_time"])
            planner._wires[config] = _wire_from_json(row["wire"])
        planner.memory = {str(k): int(v) for k, v in data.get("memory", {}).items()}
        planner.refit()
        return planner


def _wire_json(report: WireReport) -> dict:
    return {
        "num_devices": report.num_devices,
        "conditionals": [list(c) for c in report.conditionals],
        "collectives": [
            {"kind": c.kind, "group_size": c.group_size, "bytes": c.bytes,
             "compiled_bytes": c.compiled_bytes, "is_async": c.is_async,
             "num_operands": c.num_operands, "branch": [list(b) for b in c.branch],
             "axes": list(c.axes)}
            for c in report.collectives
        ],
    }


def _wire_from_json(data: dict) -> WireReport:
    colls = tuple(
        Collective(c["kind"], "", (), 0, int(c["group_size"]), float(c["bytes"]),
                   float(c["compiled_bytes"]), "", is_async=bool(c["is_async"]),
                   num_operands=int(c.get("num_operands", 1)),
                   branch=tuple((str(n), int(b)) for n, b in c["branch"]),
                   axes=tuple(str(a) for a in c.get("axes", ())))
        for c in data["collectives"]
    )
    return WireReport(colls, data["num_devices"], tuple((str(n), int(k))
                                                        for n, k in data["conditionals"]))


def shape_label(shape) -> str:
    """``"data=2,fsdp=4"``: a mesh shape as ``adaptjax plan`` and ``lm.py --mesh`` write it."""
    return ",".join(f"{a}={n}" for a, n in dict(shape).items())


def _phi_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def _phi_pdf(z: float) -> float:
    return math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
