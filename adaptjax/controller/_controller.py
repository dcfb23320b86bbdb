"""The host-side controller: one linear loop of dispatch, record, decide, apply.

The loop is the only code that assigns the run's state and configuration and
the only caller of recording and checkpointing. Its parts sit below it and
never call back: the checked arguments and the spec (``_arguments``,
``_spec``, ``_options``), the hooks (``_hooks``), the step cache, the metrics
reader, the transition planner and the function that carries a transition
out (``_carry_out``), the run directory and what a checkpoint holds
(``_persistence``), the background compiler, the run clock, preemption and
``adaptjax plan``'s probe.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import optax

from adaptjax import policies as ajp
from adaptjax._config_meshes import mesh_context, rescale_target
from adaptjax._data import check_count
from adaptjax._input_codec import batch_bytes
from adaptjax._run_config import RunConfig
from adaptjax._state import merge_model
from adaptjax._transition import Transition, plan_transition
from adaptjax.controller._arguments import (
    Checked,
    check_arguments,
    check_loss_shapes,
    replica_rows,
)
from adaptjax.controller._background import BackgroundCompiler
from adaptjax.controller._carry_out import (
    Carried,
    carry_out,
    hyperparam_names,
    hyperparams_of,
    restore_latest,
    roll_back,
)
from adaptjax.controller._compilation_cache import enable_compilation_cache
from adaptjax.controller._feed import run_micro_steps, step_batches
from adaptjax.controller._hooks import Evaluate, Hook, TensorBoard
from adaptjax.controller._metrics_reader import MetricsReader, Snapshot, add_host_metrics
from adaptjax.controller._micro_batch import Carrier
from adaptjax.controller._persistence import (
    checkpoint_meta,
    resume_from,
    snapshots_of,
    warn_overrides,
)
from adaptjax.controller._plan_probe import make_probe, move_actions
from adaptjax.controller._preemption import EXIT_PREEMPTED, Preemption
from adaptjax.controller._probe_branch import ProbeRunner
from adaptjax.controller._replica_lr import replica_metrics_of
from adaptjax.controller._run_clock import RunClock
from adaptjax.controller._run_dir import RunDirectory, elapsed, user_stacklevel
from adaptjax.controller._spec import RunSpec, resumed_spec, save_spec
from adaptjax.controller._step_cache import StepCache, comm_seconds, register_held
from adaptjax.launch._distributed import (
    EXIT_RESCALE,
    broadcast_json,
    check_same,
    decisions_checked,
    heartbeat,
    write_rescale_request,
)
from adaptjax.policies._policy import upcoming, validate_actions
from adaptjax.sync._strategy import consensus_params

if TYPE_CHECKING:  # annotations only
    from adaptjax.controller._checkpoint import RunCheckpoints
    from adaptjax.controller._run_log import NullRunLog, RunLog


class NonFiniteTraining(RuntimeError):
    """Every step of a long stretch produced non-finite updates (all of them were skipped).

    Raised by :meth:`Controller.run` after ``max_nonfinite_steps`` consecutive
    skipped steps, instead of finishing a run that learned nothing.

    Example:
      >>> import adaptjax
      >>> issubclass(adaptjax.NonFiniteTraining, RuntimeError)
      True
    """


def _every(n: int | None, step: int) -> bool:
    return bool(n) and step % n == 0


def _within_reach(ctrl: Controller, actions: list) -> list:
    """``actions`` without a ``Rescale`` beyond ``ctrl.max_devices``: no transition applies it.

    The policy that asked (named by its action's reason, ``"Name: ..."``) is
    warned once per controller (``ctrl._warned_beyond``), in one line; the run goes on
    with the other actions.
    """
    kept, warned = [], ctrl._warned_beyond
    for a in actions:
        n = None
        if isinstance(a, ajp.Rescale):
            try:
                n = rescale_target(a, ctrl.config)[0]  # replicas: max_devices counts them
            except ValueError:
                n = None  # a shape the transition refuses, with its own message
        if n is None or n <= ctrl.max_devices:
            kept.append(a)
            continue
        prefix = a.reason.partition(":")[0].strip()
        who = prefix if prefix.isidentifier() else "/".join(
            type(p).__name__ for p in ctrl._policies)
        if who not in warned:
            warned.add(who)
            warnings.warn(
                f"{who}: {a!r} cannot apply: max_devices is {ctrl.max_devices}; the action is "
                "skipped (pass a larger max_devices to allow it; said once per policy)",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
    return kept


def _first_checked(ctrl: Controller, batch, config: RunConfig):
    """``batch``; the first one of a dataset without ``batch_at`` first checks the loss on it.

    (Other datasets are checked at construction or resume, see ``check_arguments``.)
    """
    if not ctrl._loss_checked:
        ctrl._loss_checked = True
        check_loss_shapes(ctrl.steps.model, ctrl.steps.loss_fn, batch, replica_rows(config),
                          ctrl.steps.has_aux)
    return batch


class Controller:
    """Runs adaptive data-parallel training: step, measure, decide, act.

    Each step is :func:`adaptjax.data_parallel_step` of ``optax.named_chain(("sync",
    sync_gradients(codec, monitors)), ("optimizer", optimizer with a rate factor),
    ...)``: hyperparameters live in the state and change without recompiling.

    **The loop.** Each turn runs, in this order and with no path back:
    *dispatch* step *t* -> *record* the metrics of earlier steps (read one step
    behind, so dispatch never waits on the device) -> *decide* once, on the
    metrics of step *t-1* when ``(t-1) % policy_every == 0`` -> *apply* the
    actions as one transition. Decisions depend on step numbers only, so a
    resumed run makes the decisions the uninterrupted one made.

    **Actions.** ``SetHyperparams`` writes into the state; ``SetBatchSize``,
    ``SetCodec``, ``SetSync`` and ``SetPrecision`` change the compiled step (each
    configuration compiled once, then cached; a batch is rounded to a multiple of
    replicas x micro-batches); ``Rescale`` moves the state to the new mesh and
    writes a checkpoint that records the configuration the run continues in;
    ``Checkpoint``; ``Stop``; ``Rollback`` returns params and optimizer state
    to the latest checkpoint while the step, data cursor and policy state go on.

    **Faults.** One controller per ``run_dir`` (a lock). Every step and event
    is logged once, even across a kill and resume; a resume skips checkpoints
    that fail their checksums. On SIGTERM the step is checkpointed and the
    process exits with :data:`EXIT_PREEMPTED`. Under ``adaptjax plan SCRIPT``,
    :meth:`run` is a short probe of step times that exits with status 0.

    Args:
      model: a flax NNX module or a pytree of float parameters.
      loss_fn: ``loss_fn(model_or_params, batch) -> loss`` (or ``(loss, aux)``: ``has_aux``).
      optimizer: any ``optax.GradientTransformation`` (``optax.adam(1e-3)``, a chain with a
        schedule, ``optax.inject_hyperparams(...)``, whose hyperparameters policies set).
      data: an :class:`adaptjax.ArrayDataset` (or anything with ``next_batch``,
        ``state_dict`` and ``load_state_dict``).
      spec: the :class:`adaptjax.RunSpec` (run directory, devices, batch, policies, ...); it
        is saved in the run directory, so :meth:`resume` needs it only for fields JSON cannot
        hold (policies among them).
      hooks: :class:`adaptjax.Hook` objects, each with its cadence (``None``:
        :func:`adaptjax.default_hooks`, a progress bar and TensorBoard; ``[]``: none).

    Example:
      >>> import tempfile, numpy as np, jax.numpy as jnp, optax, adaptjax
      >>> from adaptjax import policies as ajp
      >>> x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
      >>> data = adaptjax.ArrayDataset({"x": x, "y": x.sum(1)}, seed=0)
      >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
      >>> spec = adaptjax.RunSpec(run_dir=tempfile.mkdtemp(), devices=4, batch_size=32,
      ...                         policies=[ajp.Schedule({10: ajp.Rescale(devices=2)})])
      >>> ctrl = adaptjax.Controller({"w": jnp.zeros(4)}, loss, optax.sgd(0.1), data, spec,
      ...                            hooks=[])
      >>> ctrl.run(steps=20)
      >>> ctrl.step, ctrl.config.devices, ctrl.data.cursor
      (20, 2, 640)
      >>> ctrl.close()
    """

    def __init__(
        self, model: Any, loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation,
        data: Any, spec: RunSpec, *, hooks: Sequence[Hook] | None = None,
    ) -> None:
        """See the class. Checks every argument, then takes ``run_dir`` and the state."""
        self._setup(check_arguments(model, loss_fn, optimizer, data, spec, hooks, resume=False),
                    model, loss_fn, optimizer, data)

    def _setup(self, a: Checked, model, loss_fn, optimizer, data) -> None:
        """Builds the controller from its checked arguments (nothing touched the disk before)."""
        spec = a.spec
        self.spec, self.max_devices, self.policy = spec, a.max_devices, a.policy
        self.hooks, self._plan_request = a.hooks, a.plan
        self._evaluations = [h for h in a.hooks if isinstance(h, Evaluate)]
        self._policies = a.policies
        self.steps = StepCache(model=model, loss_fn=loss_fn, optimizer=optimizer,
                               has_aux=spec.has_aux, learning_rate=spec.learning_rate,
                               monitors=a.monitors, sharding=spec.sharding,
                               norm_chunks=spec.norm_chunks, loss_scale=spec.loss_scale,
                               micro_batch_size=spec.micro_batch_size,
                               optimizer_syncs=a.optimizer_syncs)
        register_held(self.steps, spec.codec, spec.sync, self._policies)
        a = dataclasses.replace(a, config=self.steps.start(a.config, data, spec.precision))
        min_samples, min_replicas = a.sample_needs  # what the monitors need of a configuration
        self._limits: dict[str, Any] = dict(
            max_devices=a.max_devices, strategies=self.steps.strategies, min_samples=min_samples,
            min_replicas=min_replicas, device_limit=a.device_limit,
            check_mesh=self.steps.check_mesh, micro_batch_size=spec.micro_batch_size,
            optimizer_syncs=a.optimizer_syncs)
        enable_compilation_cache(spec.compile.cache_dir)
        self.reader = MetricsReader(functools.partial(comm_seconds, self.steps, data,
                                                      spec.link_bandwidth))
        self.data, self.clock = data, RunClock()  # clock: compile_seconds, train_seconds
        self.compilations = self.step = self.samples_seen = 0
        self.latest_metrics: dict[str, float] = {}
        self._to_decide: list[Snapshot] = []
        self._host_hparams: dict[str, float] | None = None  # in force (None: read the state)
        self._hparams_of_step: dict[int, dict[str, float]] = {}
        self._stop_reason: str | None = None
        self._warned_beyond: set[str] = set()  # policies warned of a Rescale beyond reach
        self._loss_checked = hasattr(data, "batch_at")  # if so, at construction or resume
        self._preemption = Preemption()
        self._compiler = BackgroundCompiler(self.steps, enabled=a.compile_ahead)  # upcoming's
        self._hints_waiting = False  # announced after a change: asked once its step compiled
        self._dir = RunDirectory(spec.run_dir, max_to_keep=spec.checkpoint.max_to_keep)
        try:
            self.config, self.state = self._start(a)
        except BaseException:
            self._dir.close()
            raise
        self._prober = ProbeRunner(self.steps, data, self._compiler, self.clock, self.reader,
                                   self._transition)
        self._carrier = None if spec.micro_batch_size != "auto" or a.plan else Carrier(
            self.steps, data, self._compiler, self.reader, self.clock, spec.compile.device_memory)

    def _start(self, a: Checked) -> tuple[RunConfig, Any]:
        """Opens the logs; returns the configuration and state the run starts from."""
        tensorboard = next((h.every for h in a.hooks if isinstance(h, TensorBoard)), None)
        if not a.resume:
            save_spec(self._dir.path, a.spec)
            # Rows left by an earlier attempt that never checkpointed are recomputed.
            self._dir.open_log(tensorboard=tensorboard, resume_from=0)
            return a.config, self.steps.init_state(a.config)
        t0 = time.perf_counter()
        r = resume_from(self._dir, self.steps, self.data, self.policy)
        self._dir.open_log(tensorboard=tensorboard, resume_from=r.step)
        self.step, self.samples_seen = int(r.meta["step"]), int(r.meta["samples_seen"])
        self._log(r.skipped)  # checkpoint_skipped events
        self._dir.recover_events(r.step, r.meta)
        self.reader.nonfinite_count = int(r.meta["nonfinite_count"])
        self._to_decide = snapshots_of(r.meta, r.config)
        self.latest_metrics = dict(self._to_decide[-1].metrics) if self._to_decide else {}
        self.clock = RunClock.from_state(r.meta)
        warn_overrides(self.steps.injected_values(), hyperparams_of(r.state))
        self.log.event("resume", step=r.step, latency_s=elapsed(t0))
        return r.config, r.state

    @classmethod
    def resume(
        cls, run_dir: str | os.PathLike | None = None, *, model: Any,
        loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation, data: Any,
        spec: RunSpec | None = None, hooks: Sequence[Hook] | None = None,
    ) -> Controller:
        """Continues the run in ``run_dir`` from its newest intact checkpoint.

        Pass the code of the original run (it can't be read from disk); the
        spec is the one saved in ``run_dir`` unless one is passed (its fields
        that differ from the saved ones are named in one warning), and the
        configuration, hyperparameters, data cursor, optimizer and policy
        states come from the checkpoint, so the run continues exactly where it was.
        """
        spec = resumed_spec(run_dir, spec)
        ctrl = cls.__new__(cls)
        ctrl._setup(check_arguments(model, loss_fn, optimizer, data, spec, hooks, resume=True),
                    model, loss_fn, optimizer, data)
        return ctrl

    @property
    def model(self) -> Any:
        """The current model (NNX module) or params; under local models, their mean."""
        params = consensus_params(self.state.params, self.state.opt_state)
        return merge_model(self.state.graphdef, params, self.state.model_state)

    @property
    def hyperparams(self) -> dict[str, float]:
        """The optimizer's numeric hyperparameters as the state holds them."""
        return hyperparams_of(self.state)

    @property
    def run_dir(self) -> str:
        """The run directory's path."""
        return self._dir.path

    @property
    def log(self) -> RunLog | NullRunLog:
        """The ``RunLog`` (``log.events``: this session's events); on processes
        other than 0, a stand-in that keeps ``events`` in memory and writes nothing."""
        assert self._dir.log is not None  # set when the run directory is opened
        return self._dir.log

    @property
    def checkpoints(self) -> RunCheckpoints:
        """The run's :class:`adaptjax.RunCheckpoints`."""
        return self._dir.checkpoints

    @property
    def nonfinite_count(self) -> int:
        """Steps skipped so far for non-finite values (recorded)."""
        return self.reader.nonfinite_count

    def context(self, step: int | None = None) -> ajp.Context:
        """The :class:`adaptjax.policies.Context` policies see (``step``: the metrics' step)."""
        return ajp.Context(
            step=self.step if step is None else step, batch_size=self.config.batch_size,
            microbatches=self.config.microbatches, devices=self.config.devices,
            **mesh_context(self.config, self.max_devices, self._limits["device_limit"]),
            hyperparams=self.hyperparams,
            codec=self.steps.codecs.get(self.config.codec), samples_seen=self.samples_seen,
            sync=self.steps.strategies.get(self.config.sync), precision=self.config.precision_name,
            compiled_batch_sizes=self._compiler.compiled_batch_sizes(self.config),
            micro_batch_sizes=(self._compiler.compiled_programs(self.config)
                               if self.steps.accumulates else frozenset()),
        )

    def run(self, steps: int) -> None:
        """Trains until ``self.step == steps`` (absolute) or a policy stops; checkpoints the end.

        On SIGTERM: a checkpoint, then ``SystemExit(EXIT_PREEMPTED)``. On any
        exception (Ctrl-C too) the in-flight checkpoint is finished or discarded
        and ``run_dir`` released before the exception propagates.
        """
        steps = check_count(steps, "steps")
        if self._plan_request is not None:
            self._probe_and_exit()
        if steps < self.step:
            raise ValueError(
                f"run(steps={steps}) counts absolute steps, and this run is already at step "
                f"{self.step}; pass steps >= {self.step}"
            )
        for hook in self.hooks:
            hook.start(self, steps)
        try:
            with self._preemption.armed():
                while self.step < steps and self._stop_reason is None:
                    self._turn(final=self.step + 1 >= steps)
                    if self._preemption.agreed(self.step, self.spec.policy_every):
                        self._preempt()
                self._record(lag=0)
                self._log(self._compiler.finished())
                self._checkpoint()
                self._dir.confirm(block=True)
        except BaseException:
            self.close()
            raise
        finally:
            for hook in self.hooks:
                hook.end(self)

    def _turn(self, final: bool) -> None:
        """One turn: dispatch -> record -> decide -> apply (-> periodic checkpoint)."""
        self._dispatch()
        if self._hints_waiting:
            self._compile_upcoming()
        self._log(self._compiler.finished())
        t = self.step
        for hook in self.hooks:
            if t % hook.every == 0:
                hook(self)
        every = self.spec.checkpoint.every
        sync_point = final or _every(every, t) or any(t % h.every == 0 for h in self._evaluations)
        self._record(lag=0 if sync_point else 1)
        while self._to_decide and self._to_decide[0].step < t:
            self._decide(self._to_decide.pop(0))
            if self._carrier is not None:  # "auto": the whole step once compiled ahead
                self._land(self._carrier.whole(self.state, self.config, self.step))
            # after each decision, not before the first: the first decisions often
            # change the configuration at once (a codec, a batch size)
            self._compile_upcoming()
        if _every(every, self.step):
            self._checkpoint()
        if sync_point:
            self.reader.restart_clock()  # evaluation and checkpoints are not step time
        self._dir.confirm(block=False)

    def _dispatch(self) -> None:
        """Dispatches one step of the configuration in force (it never waits for its result);
        under ``micro_batch_size``, its micro-steps (one compiled program, one metrics row)."""
        config = self.config
        fn = self.steps.step(config)
        batches = step_batches(self.data, config, self.steps)
        batch = _first_checked(self, batches[0], self.steps.compiled(config))
        before = fn.jitted._cache_size()
        t0 = time.perf_counter()
        self.clock.started(t0)
        self._compiler.wait_for(config)  # compiling in the background: wait, never twice
        hparams = self._host_hparams if self._host_hparams is not None else self.hyperparams
        self._host_hparams = hparams
        self.state, metrics = run_micro_steps(fn, self.state, batches)
        compiled = fn.jitted._cache_size() > before
        self.step += 1
        self._hparams_of_step[self.step] = hparams
        self.samples_seen += config.batch_size
        if compiled:
            self.compilations += 1
            fields = {"latency_s": elapsed(t0), "config": dataclasses.asdict(config),
                      "input_bytes": batch_bytes(batch)}  # host -> device per step
            if config in self._compiler.compiled_ahead:
                fields["compiled_ahead"] = True  # so the wait says nothing of a compile's cost
            else:
                self.clock.compiled(fields["latency_s"])
            self.log.event("compile", step=self.step, **fields)
        self.reader.push(self.step, config, metrics, compiled=compiled)
        heartbeat()

    def drain(self) -> None:
        """Records the metrics of every dispatched step now (waits for the device)."""
        self._record(lag=0)

    def _record(self, lag: int) -> None:
        """Reads finished steps' metrics into the log; queues the ones policies will see."""
        for snap in self.reader.read(lag):
            for hook in self._evaluations:
                if snap.step % hook.every == 0:
                    snap.metrics.update(self._evaluate(hook, snap.step))
            add_host_metrics(snap.metrics, self._hparams_of_step.pop(snap.step, {}),
                             self.spec.link_bandwidth, self.clock.metrics())
            self.latest_metrics = snap.metrics
            self.log.metrics(snap.step, snap.metrics)
            if snap.step % self.spec.policy_every == 0:
                self._to_decide.append(snap)
        limit, streak = self.spec.max_nonfinite_steps, self.reader.nonfinite_streak
        if limit is not None and streak >= limit:
            self.log.event("nonfinite_stop", step=self.step, streak=streak)
            raise NonFiniteTraining(
                f"the last {streak} recorded steps all had non-finite "
                "updates and were skipped; lower the learning rate or check the data"
            )

    def _evaluate(self, hook: Evaluate, step: int) -> dict[str, float]:
        """``hook``'s evaluation of the model of ``step`` (the newest), prefixed ``eval_``."""
        assert step == self.step, "evaluation runs on the model of its own step"
        t0 = time.perf_counter()
        results = hook.results(self.model)
        self.log.event("eval", step=step, latency_s=elapsed(t0), **results)
        return results

    def _decide(self, snapshot: Snapshot) -> None:
        """Asks the policies about ``snapshot``; applies what they return."""
        # under local SGD / DiLoCo, each replica's measurements at the latest sync (one read)
        metrics = {**snapshot.metrics, **replica_metrics_of(self.state.opt_state)}
        if jax.process_count() > 1:
            # Step times are measured per process: every process decides on process 0's.
            metrics = broadcast_json(metrics)
        actions = validate_actions(
            self.policy.decide(metrics, self.context(snapshot.step)), source=self.policy)
        said = [repr(a) for a in actions]
        if decisions_checked():
            check_same([self.step, snapshot.step, said],
                       f"the decision on the metrics of step {snapshot.step}")
        if actions:  # why, in the policies' words, and what they saw (for adaptjax report)
            self.log.event("decision", step=self.step, metrics_step=snapshot.step, actions=said,
                           reasons=[getattr(a, "reason", "") for a in actions], metrics=metrics)
            self.apply(_within_reach(self, actions))

    def apply(self, actions: Sequence[ajp.Action]) -> None:
        """Carries out actions now, as one transition (policies' actions go through here too).

        The one way to change a run by hand: ``ctrl.apply([ajp.SetBatchSize(256)])``,
        ``ctrl.apply([ajp.Rescale(devices=4)])`` (or ``mesh_shape={"data": 1, "fsdp": 4}``),
        ``ctrl.apply([ajp.SetHyperparams({"learning_rate": 1e-4})])``, ``ajp.SetCodec``,
        ``ajp.SetSync``, ``ajp.Checkpoint()``, ``ajp.Stop()``, ...
        """
        actions = validate_actions(list(actions))
        names = hyperparam_names(self.state, actions)  # replica_lr/i: checked here
        plan = self._transition(actions, hyperparam_names=names)  # checks all, changes nothing
        if plan.rollback is not None:
            self.rollback(plan.rollback)
            plan = self._transition(actions, hyperparam_names=names)
        if self._carrier is not None:  # micro_batch_size="auto": whole or micro-steps, and why
            plan, events = self._carrier.carry(plan, self.config, self.step)
            self._log(events)
        t0 = time.perf_counter()
        carried = carry_out(self.state, self.config, plan, self.steps)
        self._land(carried)  # a sharded move: the state is restored from its checkpoint below
        if carried.transition or plan.sync_changed or plan.codec_changed:
            self._host_hparams = None  # replicas came, went or restarted: read replica_lr/i
        elif plan.hyperparams and self._host_hparams is not None:
            self._host_hparams = {**self._host_hparams, **plan.hyperparams}
        if carried.relaunch is not None:
            self._relaunch(carried, carried.relaunch)
        if carried.transition is not None:  # logged with its checkpoint, once that is complete
            self._checkpoint(transition=carried.transition, since=t0)
            if carried.restore:  # onto the new mesh's shardings, as a resume would
                self._land(restore_latest(self._dir.checkpoints, self.steps, self.config))
            self.reader.restart_clock()
        elif plan.checkpoint:
            self._checkpoint()
        if plan.probe is not None:  # branches from the state, which it leaves as it is
            self._record(lag=0)
            self._log(self._prober.run(plan.probe, self.state, self.config, self.latest_metrics,
                                       self.step))
        if plan.stop is not None:
            self._stop_reason = plan.stop
            self.log.event("stop", step=self.step, reason=plan.stop)

    def _transition(self, actions: Sequence[ajp.Action], **kwargs) -> Transition:
        """:func:`plan_transition` from the configuration in force, with this run's limits."""
        return plan_transition(actions, self.config, **self._limits, **kwargs)

    def _land(self, carried: Carried) -> None:
        """Continues from a carried-out transition: its state and configuration, its events."""
        self.state, self.config = carried.state, carried.config
        self._log(carried.events)

    def _log(self, events: Sequence[Mapping]) -> None:
        """Logs ``events`` (``{"kind": ..., field: value}``) at the current step."""
        for e in events:
            self.log.event(e["kind"], step=self.step, **{k: v for k, v in e.items() if k != "kind"})

    def rollback(self, reason: str = "") -> None:
        """Returns params, optimizer state and configuration to the latest checkpoint.

        The step count, the data cursor, the non-finite count and the policies'
        state go on forward, so the batches that led here are not replayed and
        a policy does not repeat the decision that led here.
        """
        carried = roll_back(self._dir.checkpoints, self.steps, reason)
        # The steps being undone happened: their rows are logged, but no policy decides on them.
        self._record(lag=0)
        self._to_decide.clear()
        self._land(carried)
        self._host_hparams = None  # the checkpoint's
        self.reader.restart_clock()

    def _relaunch(self, carried: Carried, processes: int) -> None:
        """A transition to ``processes`` processes: checkpoint it, exit with EXIT_RESCALE."""
        self._checkpoint(transition=carried.transition)
        self._dir.confirm(block=True)
        self.log.event("relaunch", step=self.step, processes=processes, exit_code=EXIT_RESCALE)
        write_rescale_request(processes, self.config.device_count)
        self.close()
        raise SystemExit(EXIT_RESCALE)

    def precompile(self, devices: int | None = None, batch_size: int | None = None,
                   microbatches: int | None = None, codec: Any = ...) -> float:
        """Compiles a configuration's step now (blocking); returns the seconds it took.

        For a change no policy announces (announced ones are compiled in the
        background): its first step then finds the program compiled. Arguments
        default to the configuration in force, e.g. ``ctrl.precompile(batch_size=256)``
        (under ``RunSpec(micro_batch_size="auto")``, the whole batch's step).
        """
        at = self.config if self._carrier is None else self.config.replace(micro_batch=None)
        config, seconds = self._compiler.compile_now(
            at, self.data, codec, devices=devices, batch_size=batch_size, microbatches=microbatches)
        self.log.event("precompile", step=self.step, latency_s=seconds,
                       config=dataclasses.asdict(config))
        return seconds

    def _compile_upcoming(self) -> None:
        """Compiles in the background what policies announce (``upcoming``; see
        :meth:`BackgroundCompiler.submit_upcoming`), once the step in force has compiled."""
        self._hints_waiting = self._compiler.enabled and not self.steps.has_run(self.config)
        if self._compiler.enabled and not self._hints_waiting:
            hints = upcoming(self.policy, self.context())
            self._compiler.submit_upcoming(hints, lambda a: self._transition(a).config, self.data)

    def _checkpoint(self, transition: dict | None = None, since: float | None = None) -> None:
        """Checkpoints the current step (a transition's: rewritten with the new configuration)."""
        self._record(lag=0)
        if self._dir.latest_step() == self.step:
            if transition is None:
                return
            # Same arrays, new configuration: the checkpoint must say what the run continues in.
            self._dir.checkpoints.delete(self.step)
        meta = checkpoint_meta(
            step=self.step, samples_seen=self.samples_seen,
            nonfinite_count=self.reader.nonfinite_count, config=self.config, data=self.data,
            policy=self.policy, to_decide=self._to_decide, clock=self.clock.state_dict(),
        )
        events = [{"kind": "checkpoint"}] + ([transition] if transition is not None else [])
        self._dir.save(self.step, self.state, meta, events, since=since)

    def save_checkpoint(self) -> None:
        """Writes a consistent checkpoint now (state, data cursor, config, policy state)."""
        self._checkpoint()

    def _preempt(self) -> None:
        """SIGTERM: checkpoint this step and exit with :data:`EXIT_PREEMPTED`."""
        self.log.event("preempted", step=self.step, exit_code=EXIT_PREEMPTED)
        self._checkpoint()
        self.close()
        raise SystemExit(EXIT_PREEMPTED)

    def _probe_and_exit(self) -> None:
        """Under ``adaptjax plan``: time the configurations the cost model needs, then exit 0."""
        try:
            assert self._plan_request is not None  # set when the run is under adaptjax plan
            probe = make_probe(self, self._plan_request, self._policies)
            for config, timed in probe.visits():
                self.apply(move_actions(self.config, config, self.steps))
                self.reader.restart_clock()
                for _ in range(timed + 1):  # the first step of a visit may compile
                    self._dispatch()
                    self._record(lag=1)
                self._record(lag=0)
                self._to_decide.clear()  # a probe decides nothing
                probe.observe(config, self.latest_metrics.get("step_time"))
            probe.finish(self.run_dir, self.max_devices)
        finally:
            self.close()
        raise SystemExit(0)

    def close(self) -> None:
        """Finishes or discards the in-flight checkpoint, syncs the logs, releases ``run_dir``."""
        self._compiler.shutdown()
        self._dir.close()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
