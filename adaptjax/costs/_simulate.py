"""Replaying a recorded run's policies against modelled step times.

:func:`simulate` reads a run directory (``metrics.jsonl``, ``events.jsonl``),
starts from the run's first configuration and asks fresh copies of the run's
policies (code cannot be read from disk: pass the same ones) exactly when the
controller asked them — on the metrics of every ``policy_every``-th step, with
the decision taking effect two steps later — and carries out their actions by
the controller's own rules (:func:`adaptjax._transition.plan_transition`:
batch rounding, device caps, hyperparameters). Each step costs the modelled
step time of the configuration the replay is in; a configuration first met
costs the run's median compile seconds, a rescale its median rescale seconds.

The metrics a replayed policy sees are the recorded ones of that step, with
``step_time``, ``throughput`` (and ``comm_time``/``comm_share`` when present)
replaced by the modelled ones whenever ``step_time=`` is given or the replay's
configuration left the recorded one; so are ``compile_seconds`` (the median of
the run's compiles that were not compiled ahead: the controller's value at the
run's end) and ``train_seconds`` (the last recorded age, then the replay's
clock; from the start with ``step_time=``, on which the first compile counts).
Both are approximations of what the controller would have said. Metrics of
the training itself (loss, noise scale) are the recorded run's: a replay that
takes another path still reads the recorded run's statistics, which is the
approximation every trace-driven simulator makes.

With ``step_time=None`` the replay uses the run's own measured step times,
and reproduces the recorded run's decisions exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from adaptjax import policies as ajp
from adaptjax._events import event_latencies
from adaptjax._run_config import RunConfig, codec_key
from adaptjax._transition import one_gradient_sample, plan_transition
from adaptjax._walk import find_held
from adaptjax.costs._links import LinkModel
from adaptjax.costs._model import (
    CannotPredict,
    StepTimeModel,
    config_key,
    rescale_report,
    reshape_report,
)
from adaptjax.policies._policy import validate_actions

if TYPE_CHECKING:
    from adaptjax._wire import WireReport

TIME_KEYS = (
    "step_time", "throughput", "comm_time", "comm_share", "compile_seconds", "train_seconds",
)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Another cluster to replay a run on.

    Attributes:
      devices: the most replicas the policies may use (``None``: as recorded).
      bandwidth: link bytes/s for every collective (``None``: the calibrated links).
      latency: seconds per message step with ``bandwidth``.
      own_devices: each replica has its own processor (real accelerators): work
        the calibration host shared between simulated devices is per replica.

    Example:
      >>> from adaptjax.costs import Cluster
      >>> Cluster(devices=64, bandwidth=10e9 / 8, latency=20e-6).devices
      64
    """

    devices: int | None = None
    bandwidth: float | None = None
    latency: float = 0.0
    own_devices: bool = True

    def __post_init__(self) -> None:
        if self.devices is not None and not (isinstance(self.devices, int) and self.devices >= 1):
            raise ValueError(f"Cluster: devices must be an int >= 1, got {self.devices!r}")
        if self.bandwidth is not None:
            LinkModel.from_bandwidth(self.bandwidth, self.latency)  # checks both

    def apply(self, model: StepTimeModel) -> StepTimeModel:
        """``model`` on this cluster: its links and, with ``own_devices``, per-replica work."""
        links = model.links
        if self.bandwidth is not None:
            links = {"*": LinkModel.from_bandwidth(self.bandwidth, self.latency)}
        compute, codecs = model.compute, model.codecs
        if self.own_devices:
            compute = None if compute is None else compute.on_own_devices()
            codecs = {k: dataclasses.replace(c, fixed=c.fixed + c.per_device, per_device=0.0)
                      for k, c in codecs.items()}
        return dataclasses.replace(model, links=links, compute=compute, codecs=codecs)


def predicted_times(model: StepTimeModel, cluster: Cluster | None = None) -> Callable:
    """``config -> seconds`` from ``model`` (on ``cluster``), for :func:`simulate`.

    A configuration's collectives are those of an observed step with the same
    codec and sync, rescaled to its replica count (:func:`rescale_report`).

    Raises:
      CannotPredict: from the returned function, for a configuration the model
        has nothing to predict from.
    """
    on = cluster.apply(model) if cluster is not None else model

    def step_time(config) -> float:
        return on.predict(config, wire_for(model, config)).step_time

    return step_time


def wire_for(model: StepTimeModel, config: RunConfig) -> WireReport:
    """The collectives of ``config``: an observed step's with its codec, rescaled."""
    _, _, _, codec, sync = config_key(config)
    same = [o for o in model.observations if config_key(o.config)[3:] == (codec, sync)]
    if not same:
        what = "a dense step" if codec is None else f"a step with codec {codec!r}"
        raise CannotPredict(
            f"cannot predict {config_key(config)}: no recorded run has {what}; record one first"
        )
    target = _axes(config)
    if list(target) == ["data"] and all(list(_axes(o.config)) == ["data"] for o in same):
        ref = max(same, key=lambda o: config_key(o.config)[0])  # the widest group seen
        return rescale_report(ref.wire, int(config.devices))
    # On a sharded mesh: a step that ran every collective the target needs (each axis the
    # target spans over > 1 device spanned > 1 there too), closest in device count.
    covering = [o for o in same if all(_axes(o.config).get(a, 1) > 1 for a, n in target.items()
                                       if n > 1)]
    if not covering:
        raise CannotPredict(
            f"cannot predict mesh {target}: no recorded step spans each of its axes of more "
            f"than one device (recorded: {[_axes(o.config) for o in same]}); record one"
        )
    ref = min(covering, key=lambda o: abs(math.prod(_axes(o.config).values())
                                          - math.prod(target.values())))
    return reshape_report(ref.wire, _axes(ref.config), target)


def _axes(config) -> dict[str, int]:
    """``{axis: size}`` of a configuration's mesh (``{"data": devices}`` on a 1-D one)."""
    axes = getattr(config, "axes", None)
    return dict(axes) if axes is not None else {"data": int(config.devices)}


@dataclasses.dataclass(frozen=True)
class SimEvent:
    """Something the replay did: at ``step``, ``seconds`` into the modelled run."""

    step: int
    seconds: float
    kind: str  # "decision", "compile", "rescale", "stop", "end"
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Simulation:
    """A replayed run.

    Attributes:
      events: what happened, in order, with modelled seconds since the start.
      decisions: ``(metrics step, [repr of each action])`` of every decision.
      seconds: modelled seconds to the end.
      steps: steps replayed.
      config: the configuration at the end.
      diverged_at: the first step whose configuration differs from the
        recorded run's (``None``: the replay followed it).
    """

    events: tuple[SimEvent, ...]
    decisions: tuple[tuple[int, tuple[str, ...]], ...]
    seconds: float
    steps: int
    config: RunConfig
    diverged_at: int | None

    def __str__(self) -> str:
        lines = [f"{'step':>6s} {'seconds':>10s}  event"]
        lines += [f"{e.step:6d} {e.seconds:10.2f}  {e.kind} {e.detail}".rstrip()
                  for e in self.events]
        return "\n".join(lines)


def read_run(run_dir: str) -> tuple[list[dict], list[dict]]:
    """``(metrics rows, events)`` of a run directory (one-line error if it is not one)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir} is not a run directory (no metrics.jsonl); pass a run_dir")

    def rows(name):
        p = os.path.join(run_dir, name)
        if not os.path.exists(p):
            return []
        with open(p) as f:
            return [json.loads(line) for line in f if line.strip()]

    return rows("metrics.jsonl"), rows("events.jsonl")


def _first_config(events: list[dict], metrics: list[dict]) -> RunConfig:
    for e in events:
        if e.get("kind") in ("compile", "precompile") and isinstance(e.get("config"), dict):
            # the replay's steps are whole batches: a step's micro-batch is not its shape here
            return RunConfig(**{k: v for k, v in e["config"].items() if k != "micro_batch"})
    if metrics and "devices" in metrics[0] and "batch_size" in metrics[0]:
        return RunConfig(int(metrics[0]["devices"]), int(metrics[0]["batch_size"]))
    raise ValueError("the run records no configuration (no compile event); cannot replay it")


def _find_codecs(obj, found: dict) -> None:
    """Codec objects held by policies (``SetCodec``/``SwitchCompression`` fields), by key."""
    kinds = (ajp.SetCodec, ajp.SwitchCompression)
    for o in find_held(obj, lambda o: isinstance(o, kinds), max_depth=6):
        found.setdefault(codec_key(o.codec), o.codec)


def simulate(
    run_dir: str,
    policies: Sequence[ajp.Policy],
    *,
    step_time: Callable[[RunConfig], float] | None = None,
    hyperparams: Mapping[str, float] | None = None,
    policy_every: int = 10,
    max_devices: int | None = None,
    steps: int | None = None,
) -> Simulation:
    """Replays ``policies`` over a recorded run with modelled step times.

    Args:
      run_dir: the recorded run's directory.
      policies: fresh policies built as the run built them.
      step_time: ``config -> seconds`` (e.g. :func:`predicted_times` for
        another :class:`Cluster`); ``None``: the run's own measured times.
      hyperparams: the optimizer's numeric hyperparameters at the start (what
        ``Context.hyperparams`` held); policies' ``SetHyperparams`` update them.
        Held as float32, as the controller's state holds them.
      policy_every: the run's ``policy_every``.
      max_devices: the most replicas policies may ask for (default: the most
        the run used).
      steps: replay this many steps (default: as many as were recorded).

    Returns:
      A :class:`Simulation`.

    Example:
      >>> import json, os, tempfile
      >>> from adaptjax import policies as ajp
      >>> from adaptjax.costs import simulate
      >>> d = tempfile.mkdtemp()
      >>> with open(os.path.join(d, "metrics.jsonl"), "w") as f:
      ...     for s in range(1, 41):
      ...         _ = f.write(json.dumps({"step": s, "step_time": 0.1, "devices": 8.0,
      ...                                 "batch_size": 64.0}) + "\\n")
      >>> sim = simulate(d, [ajp.Schedule({20: ajp.Rescale(devices=4)})],
      ...                step_time=lambda c: 0.1 * 8 / c.devices)
      >>> round(sim.seconds, 2), sim.config.devices
      (5.9, 4)
    """
    if steps is not None and (isinstance(steps, bool) or int(steps) != steps or steps < 1):
        raise ValueError(
            f"steps must be an integer >= 1 (or None: every recorded step), got {steps!r}"
        )
    metrics, events = read_run(run_dir)
    if not metrics:
        raise ValueError(f"{run_dir} has no recorded steps; run it first")
    run = _recorded(metrics, events, max_devices, step_time)
    last = max(run.by_step) if steps is None else int(steps)
    replay = _start(run, policies, hyperparams, step_time)
    policy = ajp.any_of(*policies)
    for s in range(1, last + 1):
        if _carry_out_due(run, replay, s):
            break
        row = _replay_step(run, replay, s, step_time)
        if s % policy_every == 0 and s in run.by_step:
            _decide(run, replay, policy, s, row)
    replay.events.append(SimEvent(s, replay.seconds, "end", _label(replay.config)))
    return Simulation(
        tuple(replay.events), tuple(replay.decisions), replay.seconds, s, replay.config,
        replay.diverged,
    )


@dataclasses.dataclass(frozen=True)
class _Recorded:
    """What a replay reads from the recorded run; the same for the whole replay."""

    metrics: list[dict]
    by_step: dict[int, dict]
    first: RunConfig  # the run's first configuration
    cap: int  # the most replicas policies may ask for
    min_samples: int  # gradient samples per step the run's noise scale needed
    compile_cost: float  # seconds a configuration first met costs: the median compile
    compile_metric: float  # what the controller told policies a compile costs
    rescale_cost: float  # seconds a change of device count costs: the median rescale


def _recorded(metrics, events, max_devices, step_time) -> _Recorded:
    """The recorded run's configuration, device cap, sample needs and median latencies."""
    by_step = {int(r["step"]): r for r in metrics}
    config = _first_config(events, metrics)
    cap = max_devices or max(
        [int(r.get("devices", config.devices)) for r in metrics] + [config.devices]
    )
    # The Controller's default noise scale needs two gradient samples per step,
    # unless the run started on one device without micro-batches (it differences).
    measured = any("noise_scale" in r for r in metrics)
    differencing = one_gradient_sample(config.devices, config.microbatches)
    compile_s = event_latencies(events, "compile")
    rescale_s = event_latencies(events, "rescale")
    compile_cost = statistics.median(compile_s) if compile_s else 0.0
    # what the controller tells policies a compile costs: its compiles less those whose
    # program was compiled ahead (the controller's compile_seconds at the run's end)
    waits = event_latencies([e for e in events if not e.get("compiled_ahead")], "compile")
    return _Recorded(
        metrics, by_step, config, cap,
        min_samples=2 if measured and not differencing else 1,
        compile_cost=compile_cost,
        compile_metric=statistics.median(waits) if waits else compile_cost,
        rescale_cost=statistics.median(rescale_s) if rescale_s else 0.0,
    )


@dataclasses.dataclass
class _Replay:
    """The replay's running state; only the three functions below change it."""

    config: RunConfig
    codec: Any  # the codec object policies see in their Context
    hyper: dict[str, float]
    # The run's age: the recorded one while the replay follows the run, then the
    # replay's clock from the last recorded age on. age_mark = (recorded train_seconds,
    # replay seconds then); the controller's age counts the first compile, which the
    # replay's clock counts only with step_time=.
    age_mark: tuple[float, float]
    seconds: float
    events: list[SimEvent]
    seen: set = dataclasses.field(default_factory=set)
    samples: int = 0
    decisions: list[tuple[int, tuple[str, ...]]] = dataclasses.field(default_factory=list)
    pending: list[tuple[int, list]] = dataclasses.field(default_factory=list)  # (due step, actions)
    diverged: int | None = None


def _start(run: _Recorded, policies, hyperparams, step_time) -> _Replay:
    """The replay at step 0: the run's first configuration, compiled."""
    config = run.first
    codecs: dict = {None: None}
    _find_codecs(list(policies), codecs)
    return _Replay(
        config=config,
        codec=codecs.get(config.codec, config.codec),
        hyper={k: _f32(v) for k, v in (hyperparams or {}).items()},
        age_mark=(run.compile_cost if step_time is None else 0.0, 0.0),
        seconds=run.compile_cost if step_time is not None else 0.0,
        events=[SimEvent(0, 0.0, "compile", _label(config))],
        seen={config},
    )


def _carry_out_due(run: _Recorded, replay: _Replay, s: int) -> bool:
    """Carries out the decisions due at step ``s`` as the controller would; True on a stop."""
    stop = False
    for due, actions in [p for p in replay.pending if p[0] == s]:
        replay.pending.remove((due, actions))
        config = replay.config
        plan = plan_transition(actions, config, max_devices=run.cap, min_samples=run.min_samples)
        replay.hyper.update({k: _f32(v) for k, v in plan.hyperparams.items()})
        if plan.codec_changed:
            replay.codec = plan.codec
        new = plan.config
        if new.devices != config.devices:
            replay.seconds += run.rescale_cost
            replay.events.append(SimEvent(s - 1, replay.seconds, "rescale",
                                          f"{config.devices} -> {new.devices} devices"))
        replay.config = new
        if new not in replay.seen:
            replay.seen.add(new)
            replay.seconds += run.compile_cost
            replay.events.append(SimEvent(s - 1, replay.seconds, "compile", _label(new)))
        if plan.stop is not None:
            replay.events.append(SimEvent(s - 1, replay.seconds, "stop", plan.stop))
            stop = True
    return stop


def _replay_step(run: _Recorded, replay: _Replay, s: int, step_time) -> dict:
    """Step ``s`` in the replay's configuration: its time counted; returns its metrics row."""
    config = replay.config
    row = dict(run.by_step.get(s, {}))
    recorded = (row.get("devices"), row.get("batch_size"))
    follows = recorded == (None, None) or recorded == (float(config.devices),
                                                      float(config.batch_size))
    if replay.diverged is None and not follows:
        replay.diverged = s
    if step_time is None and follows and "step_time" in row:
        t = float(row["step_time"])
    elif step_time is None:
        t = _recorded_time(run.metrics, config)
    else:
        t = float(step_time(config))
    if step_time is not None or not follows:
        row = {k: v for k, v in row.items() if k not in TIME_KEYS}
        row.update(step_time=t, throughput=config.batch_size / t,
                   devices=float(config.devices), batch_size=float(config.batch_size))
        age = replay.age_mark[0] + replay.seconds + t - replay.age_mark[1]
        row.update(compile_seconds=run.compile_metric, train_seconds=age)
    elif "train_seconds" in row:
        replay.age_mark = (float(row["train_seconds"]), replay.seconds + t)
    replay.seconds += t
    replay.samples += config.batch_size
    return row


def _decide(run: _Recorded, replay: _Replay, policy, s: int, row: dict) -> None:
    """Asks the policies at step ``s`` (on ``row``); their actions are due two steps later."""
    config = replay.config
    ctx = ajp.Context(
        step=s, batch_size=config.batch_size, microbatches=config.microbatches,
        devices=config.devices, max_devices=run.cap, hyperparams=replay.hyper,
        codec=replay.codec,
        samples_seen=replay.samples + config.batch_size,  # the next step is dispatched first
        mesh_shape=config.axes if config.mesh_shape is not None else None,
    )
    metrics_in = {k: float(v) for k, v in row.items()
                  if k != "step" and isinstance(v, int | float)}
    actions = validate_actions(policy.decide(metrics_in, ctx), source=policy)
    if actions:
        replay.decisions.append((s, tuple(repr(a) for a in actions)))
        replay.events.append(SimEvent(s, replay.seconds, "decision",
                                      ", ".join(repr(a) for a in actions)))
        replay.pending.append((s + 2, list(actions)))


def _f32(value: float) -> float:
    """``value`` as the controller's state holds a hyperparameter (float32)."""
    return float(np.float32(value))


def _recorded_time(metrics: list[dict], config: RunConfig) -> float:
    times = [float(r["step_time"]) for r in metrics
             if "step_time" in r and r.get("devices") == float(config.devices)
             and r.get("batch_size") == float(config.batch_size)]
    if not times:
        raise CannotPredict(
            f"cannot replay {_label(config)} with measured times: the run never ran it; "
            "pass step_time=predicted_times(model)"
        )
    return statistics.median(times)


def _label(config: Any) -> str:
    n, b, k, codec, sync = config_key(config)
    out = f"devices={n} batch={b}"
    if k != 1:
        out += f" microbatches={k}"
    if codec is not None:
        out += f" codec={codec}"
    if sync is not None:
        out += f" sync={sync}"
    return out
