"""The host-side controller: one linear loop of dispatch, record, decide, apply."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import inspect
import json
import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from adaptjax import policies as ajp
from adaptjax._codec import GradientCodec
from adaptjax._data import check_count
from adaptjax._mesh import make_mesh
from adaptjax._monitors import GradientNoiseScale, GradientNorm, GradientSNR
from adaptjax._per_replica import merge_replicas
from adaptjax._state import merge_model, train_state_shardings
from adaptjax._walk import find_held
from adaptjax.controller._compilation_cache import enable_compilation_cache
from adaptjax.controller._metrics_reader import MetricsReader, Snapshot
from adaptjax.controller._plan_probe import plan_request, probe
from adaptjax.controller._rebuild import rebuild_state
from adaptjax.controller._run_config import RunConfig, codec_key
from adaptjax.controller._run_dir import RunDirectory, check_writable_dir, elapsed, user_stacklevel
from adaptjax.controller._run_lock import RunLock
from adaptjax.controller._step_cache import OPTIMIZER, SYNC, StepCache
from adaptjax.controller._transition import (
    Transition,
    monitor_sample_needs,
    one_gradient_sample,
    plan_transition,
    sample_split,
)
from adaptjax.launch._distributed import (
    EXIT_RESCALE,
    broadcast_json,
    can_give,
    check_same,
    decisions_checked,
    global_batch,
    heartbeat,
    is_primary,
    max_processes,
    process_rows,
    processes_for,
    write_rescale_request,
)
from adaptjax.sync._registry import register_strategies, resolve_sync, sync_key
from adaptjax.sync._strategy import consensus_params

#: Exit code after SIGTERM: a checkpoint of the current step was written; start again to resume.
EXIT_PREEMPTED = 75


class NonFiniteTraining(RuntimeError):
    """Every step of a long stretch produced non-finite updates (all of them were skipped).

    Raised by :meth:`Controller.run` after ``max_nonfinite_steps`` consecutive
    skipped steps, instead of finishing a run that learned nothing.

    Example:
      >>> import adaptjax
      >>> issubclass(adaptjax.NonFiniteTraining, RuntimeError)
      True
    """


def _lower_thread_priority() -> None:
    """Lowest CPU priority for the calling thread (Linux: per thread); elsewhere nothing.

    The background compiler then takes only the cycles the training steps leave.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed
        pass


def _find_codecs(obj, found: dict) -> None:
    """Collects codec objects held by policies (e.g. ``SwitchCompression.codec``)."""
    held = find_held(
        obj,
        lambda o: isinstance(o, ajp.SetCodec)
        or (isinstance(o, GradientCodec) and not isinstance(o, type)),
        max_depth=4,
    )
    for o in held:
        codec = o.codec if isinstance(o, ajp.SetCodec) else o
        if codec is not None:
            found[codec_key(codec)] = codec


class _NoPolicy(ajp.Policy):
    """What runs when no policy is given: decides nothing."""

    def decide(self, metrics, ctx):
        return []


def _check_hyperparams(optimizer, hyperparams) -> dict:
    """Checks ``hyperparams`` against ``optimizer``'s signature and values; returns a dict."""
    if not isinstance(hyperparams, Mapping):
        raise ValueError(
            f"hyperparams must be a dict of the optimizer's arguments, got "
            f"{type(hyperparams).__name__}"
        )
    name = getattr(optimizer, "__qualname__", repr(optimizer))
    try:
        params = inspect.signature(optimizer).parameters
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        names = [
            k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        for key in hyperparams:
            if key not in names:
                raise ValueError(
                    f"hyperparams has {key!r}, which {name} does not take; its arguments are "
                    f"{', '.join(names)}"
                )
        for k, p in params.items():
            if p.default is p.empty and p.kind is not p.VAR_POSITIONAL and k not in hyperparams:
                raise ValueError(f"hyperparams needs {k!r}: {name} has no default for it")
    for key, value in hyperparams.items():
        if isinstance(value, bool) or not isinstance(value, int | float | np.number):
            continue
        if not math.isfinite(float(value)):
            raise ValueError(f"hyperparams[{key!r}] must be finite, got {value}")
        if key == "learning_rate" and not float(value) > 0:
            raise ValueError(f"learning_rate must be > 0, got {value}")
    return dict(hyperparams)


class Controller:
    """Runs adaptive data-parallel training: step, measure, decide, act.

    Every step runs :func:`adaptjax.data_parallel_step` on a 1-D ``"data"``
    mesh with ``optax.named_chain(("sync", sync_gradients(codec, monitors)),
    ("optimizer", inject_hyperparams(optimizer)), ("update_norm", ...))``, so
    hyperparameters live in the state (``state.opt_state["optimizer"]``) and
    change without recompiling.

    **The loop.** Each turn runs, in this order and with no path back:
    *dispatch* step *t* -> *record* the metrics of earlier steps into
    ``metrics.jsonl`` (read one step behind, so dispatch never waits on the
    device; drained at checkpoint, evaluation and final steps) -> *decide*
    once, on the snapshot of step *t-1* when ``(t-1) % policy_every == 0``
    (``Context.step`` is *t-1*, the step the metrics belong to) -> *apply* the
    actions. A decision on step *s* always takes effect before step *s+2* is
    dispatched, so what policies see and when their actions act depends on
    step numbers only: a resumed run makes the decisions the uninterrupted one
    made. Recording never decides and applying never records a decision.

    **Actions.** ``SetHyperparams`` writes into the state (no compilation);
    ``SetBatchSize`` changes the next batch (compiled once per shape, then
    cached; rounded to a multiple of replicas x micro-batches, logged as
    ``batch_rounded``); ``SetCodec`` swaps the sync's codec (its own state
    starts fresh; optimizer and monitor states carry over); ``Rescale`` goes
    through an Orbax checkpoint that records the new configuration, then a
    restore onto the new mesh; ``Checkpoint``; ``Stop``; ``Rollback`` returns
    params and optimizer state to the latest checkpoint while the step count,
    data cursor and policy state go on forward. A configuration change is a
    transition: a checkpoint written for it holds the configuration the run
    continues in together with the policy state that chose it, so a kill at
    any instant resumes in a state the uninterrupted run also passed through.

    **Promises under faults.** One controller per ``run_dir`` (an advisory
    lock; a second gets a one-line error naming the holder's pid). Logs are
    fsynced at every checkpoint and truncated to the checkpoint on resume, so
    every step and event is logged once. Checkpoints carry checksums; a resume
    skips (and moves to ``run_dir/quarantine/``) any that fail verification,
    newest first. On an exception or Ctrl-C the in-flight checkpoint is
    finished or discarded before the exception leaves :meth:`run`; on SIGTERM
    (preemption) the current step is checkpointed and the process exits with
    :data:`EXIT_PREEMPTED` (75). Every argument is checked before anything
    touches the disk.

    **Under** ``adaptjax plan SCRIPT``. With ``ADAPTJAX_PLAN_DIR`` set (the
    command sets it for the script it runs) the controller writes only into
    that directory (``run_dir`` is never opened, locked or created; ``resume``
    starts fresh; no evaluation, TensorBoard or periodic checkpoint), and
    :meth:`run` becomes a short probe: a few timed steps at each configuration
    the cost model needs, observed into an :class:`adaptjax.costs.Planner`
    (the policies' own, else a new one), which saves ``costs.json``; then the
    process exits with status 0, without the policies' actions.

    Args:
      model: a flax NNX module or a pytree of float parameters (the initial values).
      loss_fn: ``loss_fn(model_or_params, batch) -> loss`` (or ``(loss, aux)``).
      optimizer: an optax optimizer factory such as ``optax.adamw``.
      hyperparams: its keyword arguments, checked against its signature
        (numbers live in the state).
      data: an :class:`adaptjax.ArrayDataset` (or anything with ``next_batch``,
        ``state_dict`` and ``load_state_dict``).
      devices: initial replica count.
      batch_size: initial global batch.
      run_dir: where logs and checkpoints go; it must not already hold
        checkpoints unless ``resume=True``.
      microbatches: gradient accumulation steps (``None``: 1, or 2 where the run
        starts on one device with an even batch, so that the noise scale has
        two gradient samples at the same parameters; ``1`` there makes the
        noise scale difference consecutive steps instead, which moving
        parameters bias upwards). Likewise a rescale to one device splits
        the batch in two, and a rescale from one device to more takes a
        split of two back, unless the same decision sets micro-batches.
      policies: policies from :mod:`adaptjax.policies`, combined with ``any_of``.
      codec: initial codec (``None``: dense fp32 sync).
      sync: initial synchronisation strategy (:class:`adaptjax.SyncStrategy` or
        its name; ``None``: S-SGD). ``SetSync`` (e.g. from
        :class:`adaptjax.policies.SwitchSync`) changes it during the run: the
        state is rebuilt without losing anything (the mean of the local
        models becomes the model, optimizer state carries over) and each
        strategy's step is compiled once and cached.
      monitors: monitors for :func:`adaptjax.sync_gradients` (default: noise
        scale, SNR and gradient norm; where a run starts on one device without
        micro-batches, the noise scale and SNR difference consecutive steps'
        gradients, ``differencing=True``).
      norm_chunks: see :func:`adaptjax.sync_gradients` (``None``: its default).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      policy_every: ask the policies about every this many steps.
      checkpoint_every: periodic checkpoints (``None``: only on rescale and at the end).
      max_to_keep: checkpoints kept on disk.
      eval_fn: ``eval_fn(model_or_params) -> {name: float}``, run every
        ``eval_every`` steps on the model after that step; its values join
        that step's metrics, prefixed ``eval_``.
      eval_every: evaluation interval in steps.
      max_devices: the most replicas a policy may ask for (default: all devices).
      link_bandwidth: bytes/s of the modelled interconnect. When set, the
        controller reads the bytes each compiled step sends (from its HLO, via
        :func:`adaptjax.wire_bytes`) and reports ``comm_time`` (= bytes /
        bandwidth) and ``comm_share`` (= comm / (measured step time + comm)),
        which ``SwitchCompression`` needs.
      progress: show a tqdm progress bar.
      tensorboard: write TensorBoard event files.
      compilation_cache_dir: JAX's persistent compilation cache, so a resume or
        relaunch compiles nothing it compiled before: ``"auto"`` (default) uses
        ``$XDG_CACHE_HOME/adaptjax/jax-compilation-cache`` unless JAX already
        has a cache directory; a path uses that; ``None`` leaves JAX as it is.
      resume: continue from the newest intact checkpoint in ``run_dir``.
      on_step: optional hook ``on_step(controller)`` called after each dispatch.
      max_nonfinite_steps: stop with :class:`NonFiniteTraining` after this many
        consecutive skipped (non-finite) steps; ``None`` never stops.
      precompile_upcoming: compile, in a background thread, the configurations
        that policies announce through ``Policy.upcoming`` (``ElasticScale``'s
        and ``Schedule``'s next entries), so that the change does not wait for
        XLA when it comes (``background_compile`` events).

    Example:
      >>> import tempfile, numpy as np, jax.numpy as jnp, optax, adaptjax
      >>> from adaptjax import policies as ajp
      >>> x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
      >>> data = adaptjax.ArrayDataset({"x": x, "y": x.sum(1)}, seed=0)
      >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
      >>> ctrl = adaptjax.Controller(
      ...     model={"w": jnp.zeros(4)}, loss_fn=loss, optimizer=optax.sgd,
      ...     hyperparams={"learning_rate": 0.1}, data=data, devices=4, batch_size=32,
      ...     policies=[ajp.Schedule({10: ajp.Rescale(devices=2)})],
      ...     run_dir=tempfile.mkdtemp(), progress=False, tensorboard=False)
      >>> ctrl.run(steps=20)
      >>> ctrl.step, ctrl.config.devices, ctrl.data.cursor
      (20, 2, 640)
      >>> ctrl.close()
    """

    def __init__(
        self,
        *,
        model,
        loss_fn: Callable[..., Any],
        optimizer: Callable[..., optax.GradientTransformation],
        hyperparams: Mapping[str, Any],
        data,
        devices: int,
        batch_size: int,
        run_dir: str | os.PathLike,
        microbatches: int | None = None,
        policies: Sequence[ajp.Policy] = (),
        codec=None,
        sync=None,
        monitors: Sequence[Any] | None = None,
        norm_chunks: int | None = None,
        has_aux: bool = False,
        policy_every: int = 10,
        checkpoint_every: int | None = None,
        max_to_keep: int | None = 3,
        eval_fn: Callable[[Any], Mapping[str, float]] | None = None,
        eval_every: int | None = None,
        max_devices: int | None = None,
        link_bandwidth: float | None = None,
        progress: bool = True,
        tensorboard: bool = True,
        compilation_cache_dir: str | os.PathLike | None = "auto",
        resume: bool = False,
        on_step: Callable[[Controller], None] | None = None,
        max_nonfinite_steps: int | None = 100,
        precompile_upcoming: bool = True,
    ):
        # ---- every argument is checked before anything touches the disk ----------------
        run_dir = os.fspath(run_dir)
        # Under ``adaptjax plan SCRIPT``: write only into the plan directory, start fresh.
        self._plan = plan_request()
        if self._plan is not None:
            run_dir, resume, tensorboard, progress = self._plan.run_dir, False, False, False
        resolve_sync(sync).check(devices, codec)
        if microbatches is None:
            one_even = devices == 1 and isinstance(batch_size, int) and batch_size % 2 == 0
            microbatches = 2 if one_even else 1
        self.config = RunConfig(devices, batch_size, microbatches, codec_key(codec), sync_key(sync))
        # Under a launcher that may start more processes, a policy may ask for their devices.
        available = max(len(jax.devices()), jax.local_device_count() * max_processes())
        self.max_devices = (
            available
            if max_devices is None
            else check_count(max_devices, "max_devices", positive=True)
        )
        if self.max_devices > available:
            raise ValueError(
                f"max_devices={self.max_devices} but only {available} devices exist; "
                f"use max_devices <= {available}"
            )
        if self.max_devices < self.config.devices:
            raise ValueError(
                f"max_devices={self.max_devices} is below devices={self.config.devices}; "
                f"use max_devices >= {self.config.devices}"
            )
        # On resume the checkpoint's configuration decides (a relaunch may have fewer devices).
        if jax.process_count() == 1 and not resume:
            make_mesh(self.config.devices)  # more devices than exist -> one-line error
        elif not resume and not can_give(self.config.devices):
            raise ValueError(
                f"devices={self.config.devices} cannot be spread evenly over "
                f"{jax.process_count()} processes of {jax.local_device_count()} devices; use a "
                f"multiple of {jax.process_count()} up to {len(jax.devices())}"
            )
        self.policy_every = check_count(policy_every, "policy_every", positive=True)
        self.checkpoint_every = (
            None
            if checkpoint_every is None
            else check_count(checkpoint_every, "checkpoint_every", positive=True)
        )
        self.eval_every = (
            None if eval_every is None else check_count(eval_every, "eval_every", positive=True)
        )
        self.max_nonfinite_steps = (
            None
            if max_nonfinite_steps is None
            else check_count(max_nonfinite_steps, "max_nonfinite_steps", positive=True)
        )
        if eval_fn is not None and eval_every is None:
            raise ValueError("eval_fn needs eval_every (evaluate every this many steps)")
        if link_bandwidth is not None and not (
            isinstance(link_bandwidth, int | float)
            and math.isfinite(link_bandwidth)
            and link_bandwidth > 0
        ):
            raise ValueError(
                f"link_bandwidth must be a positive number of bytes/s, got {link_bandwidth!r}"
            )
        hyperparams = _check_hyperparams(optimizer, hyperparams)
        for attr in ("next_batch", "state_dict", "load_state_dict"):
            if not hasattr(data, attr):
                raise ValueError(
                    f"data has no {attr}(); wrap arrays in adaptjax.ArrayDataset or an "
                    "iterable in adaptjax.IterableDataset"
                )
        check_writable_dir(run_dir)
        if is_primary():
            RunLock.check_free(run_dir)  # a live owner is the first thing to report
        ckpt_dir = os.path.join(run_dir, "checkpoints")
        has_checkpoints = os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))
        if not resume and has_checkpoints:
            raise ValueError(
                f"run_dir {run_dir} already holds checkpoints; use Controller.resume(...) "
                "to continue that run or choose a new run_dir"
            )
        if resume and not has_checkpoints:
            raise ValueError(f"no complete checkpoint in {ckpt_dir} to resume from")
        self.policy = ajp.any_of(*policies) if policies else _NoPolicy()
        if monitors is None:
            # One gradient sample per step (one device, no micro-batches): the noise
            # scale then comes from consecutive steps' gradients.
            one = one_gradient_sample(devices, microbatches)
            monitors = (
                GradientNoiseScale(differencing=one), GradientSNR(differencing=one),
                GradientNorm(),
            )
        monitors = tuple(monitors)
        self._sample_needs = monitor_sample_needs(monitors)
        min_samples, min_replicas = self._sample_needs
        if not resume and devices < min_replicas:
            raise ValueError(
                f"GradientNoiseScale(preconditioned=True) needs {min_replicas} replicas per "
                f"step and devices={devices}; use GradientNoiseScale(differencing=True) on "
                "one device"
            )
        if not resume and devices * microbatches < min_samples:
            raise ValueError(
                f"the noise scale needs {min_samples} gradient samples per step and "
                f"devices={devices} x microbatches={microbatches} gives "
                f"{devices * microbatches}; use microbatches={sample_split(min_samples, devices)} "
                "or GradientNoiseScale(differencing=True)"
            )
        self.steps = StepCache(
            model=model,
            loss_fn=loss_fn,
            optimizer=optimizer,
            hyperparams=hyperparams,
            monitors=monitors,
            norm_chunks=norm_chunks,
            has_aux=has_aux,
        )
        self.steps.add_codec(codec)
        _find_codecs(list(policies), self.steps.codecs)
        self.steps.add_sync(sync)
        register_strategies(list(policies), self.steps)
        self._warn_unproducible_metrics(monitors, link_bandwidth, eval_fn)
        enable_compilation_cache(compilation_cache_dir)

        self.data = data
        self.eval_fn = eval_fn
        self._policies = list(policies)
        if self._plan is not None:  # a probe times steps: no evaluation, no periodic checkpoint
            self.eval_fn, self.eval_every, self.checkpoint_every = None, None, None
        self.link_bandwidth = link_bandwidth
        self.on_step = on_step
        self._progress = progress
        self.reader = MetricsReader(self._comm_time)
        self.compilations = 0
        # the waits of the run's compiles, the time of this process's first step and the
        # run's age before it (a resume's checkpoint), which policies see as
        # compile_seconds and train_seconds (_switch_cost_metrics)
        self._compile_waits: list[float] = []
        self._first_dispatch: float | None = None
        self._age_before = 0.0
        self.step = 0
        self.samples_seen = 0
        self.latest_metrics: dict[str, float] = {}
        self._to_decide: list[Snapshot] = []
        # Hyperparameters in force, known on the host (None: read from the state once).
        self._host_hparams: dict[str, float] | None = None
        self._hparams_of_step: dict[int, dict[str, float]] = {}
        self._stop_reason: str | None = None
        self._preempted = threading.Event()
        # Configurations policies announce (Policy.upcoming), compiled in the background.
        self._precompile_upcoming = bool(precompile_upcoming)
        self._background: dict[RunConfig, concurrent.futures.Future | None] = {}  # None: logged
        # configurations compiled by Controller.precompile or, successfully, in the background
        self._compiled_ahead: set[RunConfig] = set()
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None
        self._hints_waiting = False  # announced after a change: asked once its step compiled

        # ---- the disk: lock first, then logs and state ---------------------------------
        self._dir = RunDirectory(run_dir, max_to_keep=max_to_keep)
        try:
            if resume:
                self._resume(
                    dict(
                        devices=devices,
                        batch_size=batch_size,
                        microbatches=microbatches,
                        codec=codec_key(codec),
                        sync=sync_key(sync),
                    ),
                    hyperparams,
                    tensorboard,
                )
            else:
                # Rows left by an earlier attempt that never checkpointed are recomputed.
                self._dir.open_log(tensorboard=tensorboard, resume_from=0)
                self.state = self.steps.init_state(self.config)
        except BaseException:
            self._dir.close()
            raise

    # ------------------------------------------------------------------ construction
    @classmethod
    def resume(cls, run_dir: str | os.PathLike | None = None, **kwargs) -> Controller:
        """Continues the run in ``run_dir`` from its newest intact checkpoint.

        Pass the same model, loss, optimizer, data, policies and codecs as the
        original run (code can't be read from disk); ``run_dir`` may be given
        here or among those arguments. The configuration in force, the
        hyperparameters, the data cursor, the optimizer and policy states come
        from the checkpoint, so the run continues exactly where it was; a
        passed value the checkpoint overrides is named in a one-line warning.
        """
        if run_dir is None and "run_dir" not in kwargs:
            raise ValueError("Controller.resume needs run_dir")
        kwargs.setdefault("run_dir", run_dir)
        if run_dir is not None and os.fspath(kwargs["run_dir"]) != os.fspath(run_dir):
            raise ValueError(
                f"Controller.resume got two run_dirs ({run_dir} and {kwargs['run_dir']}); pass one"
            )
        kwargs["resume"] = True
        return cls(**kwargs)

    def _warn_unproducible_metrics(self, monitors, link_bandwidth, eval_fn) -> None:
        produced_by = {
            "comm_share": link_bandwidth is not None,
            "comm_time": link_bandwidth is not None,
        }
        builtin = (GradientNoiseScale, GradientSNR, GradientNorm)
        if all(isinstance(m, builtin) for m in monitors):  # a user's monitor may produce any
            for key, cls in (("noise_scale", GradientNoiseScale), ("grad_snr", GradientSNR)):
                produced_by[key] = any(isinstance(m, cls) for m in monitors)
        needed = ajp.required_metrics(self.policy)
        for metric in sorted(needed):
            if metric.startswith("eval_") and eval_fn is None:
                reason = "no eval_fn was given"
            elif produced_by.get(metric, True):
                continue
            elif metric.startswith("comm_"):
                reason = "it needs link_bandwidth= (bytes/s of the link)"
            else:
                reason = "no monitor produces it"
            warnings.warn(
                f"a policy needs the metric {metric!r}, which this controller never produces "
                f"({reason}); that policy cannot act",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    # ------------------------------------------------------------------ the loop
    @property
    def model(self):
        """The current model (NNX module) or params, on the host's view of the mesh.

        Under a strategy with local models, the mean of the replicas' models
        (:func:`adaptjax.consensus_params`).
        """
        params = consensus_params(self.state.params, self.state.opt_state)
        return merge_model(self.state.graphdef, params, self.state.model_state)

    @property
    def run_dir(self) -> str:
        """The run directory's path."""
        return self._dir.path

    @property
    def log(self):
        """The run's :class:`adaptjax.RunLog` (``log.events`` lists this session's events)."""
        return self._dir.log

    @property
    def checkpoints(self):
        """The run's :class:`adaptjax.RunCheckpoints`."""
        return self._dir.checkpoints

    @property
    def nonfinite_count(self) -> int:
        """Steps skipped so far for non-finite values (recorded steps)."""
        return self.reader.nonfinite_count

    def run(self, steps: int) -> None:
        """Trains until ``self.step == steps`` (absolute) or a policy stops the run.

        A checkpoint of the last step is written at the end. On SIGTERM the
        current step is checkpointed and ``SystemExit(EXIT_PREEMPTED)`` is
        raised; on any exception (Ctrl-C included) the in-flight checkpoint is
        finished or discarded, the logs are synced and the run directory is
        released before the exception propagates.
        """
        steps = check_count(steps, "steps")
        if self._plan is not None:
            self._probe_and_exit()
        if steps < self.step:
            raise ValueError(
                f"run(steps={steps}) counts absolute steps, and this run is already at step "
                f"{self.step}; pass steps >= {self.step}"
            )
        from tqdm.auto import tqdm

        bar = tqdm(
            total=steps,
            initial=self.step,
            disable=not self._progress or not is_primary(),
            desc="adaptjax",
            dynamic_ncols=True,
        )
        try:
            with self._sigterm_checkpoints():
                while self.step < steps and self._stop_reason is None:
                    self._turn(final=self.step + 1 >= steps)
                    bar.update(1)
                    if self._progress and self.latest_metrics:
                        bar.set_postfix(
                            loss=f"{self.latest_metrics.get('loss', math.nan):.4f}",
                            bs=self.config.batch_size,
                            dev=self.config.devices,
                            refresh=False,
                        )
                    if self._preempt_agreed():
                        self._preempt()
                self._record(lag=0)
                self._log_background()
                self._checkpoint()
                self._dir.confirm(block=True)
        except BaseException:
            self.close()
            raise
        finally:
            bar.close()

    def _probe_and_exit(self) -> None:
        """Under ``adaptjax plan``: time the configurations the cost model needs, then exit 0."""
        try:
            probe(self, self._plan, self._policies)
        finally:
            self.close()
        raise SystemExit(0)

    def _turn(self, final: bool) -> None:
        """One turn: dispatch -> record -> decide -> apply (-> periodic checkpoint)."""
        self._dispatch()
        if self._hints_waiting:
            self._compile_upcoming()
        self._log_background()
        t = self.step
        if self.on_step is not None:
            self.on_step(self)
        sync_point = (
            final or self._every(self.checkpoint_every, t) or self._every(self.eval_every, t)
        )
        self._record(lag=0 if sync_point else 1)
        while self._to_decide and self._to_decide[0].step < t:
            snapshot = self._to_decide.pop(0)
            self._decide(snapshot)
            # after each decision, not before the first: the first decisions often
            # change the configuration at once (a codec, a batch size)
            self._compile_upcoming()
        if self._every(self.checkpoint_every, self.step):
            self._checkpoint()
        if sync_point:
            self.reader.restart_clock()  # evaluation and checkpoints are not step time
        self._dir.confirm(block=False)

    @staticmethod
    def _every(n: int | None, step: int) -> bool:
        return bool(n) and step % n == 0

    def _next_batch(self, config: RunConfig):
        """The global batch; across processes each process reads only its own rows of it."""
        if jax.process_count() == 1:
            return self.data.next_batch(config.batch_size)
        start, stop = process_rows(config.batch_size, config.devices)
        if hasattr(self.data, "next_rows"):
            local = self.data.next_rows(config.batch_size, start, stop)
        else:  # e.g. an IterableDataset: read the whole batch, keep this process's rows
            local = jax.tree.map(lambda x: x[start:stop], self.data.next_batch(config.batch_size))
        return global_batch(local, self.steps.mesh(config.devices), config.batch_size)

    def _dispatch(self) -> None:
        config = self.config
        fn = self.steps.step(config)
        batch = self._next_batch(config)
        before = fn.jitted._cache_size()
        t0 = time.perf_counter()
        if self._first_dispatch is None:
            self._first_dispatch = t0
        pending = self._background.get(config)
        if pending is not None:
            if not pending.done():
                # compiling in the background: wait for it rather than compile twice
                concurrent.futures.wait([pending])
            if not pending.cancelled() and pending.exception() is None:
                self._compiled_ahead.add(config)
        if self._host_hparams is None:
            self._host_hparams = self.hyperparams
        self.state, metrics = fn(self.state, batch)
        compiled = fn.jitted._cache_size() > before
        self.step += 1
        self._hparams_of_step[self.step] = self._host_hparams
        self.samples_seen += config.batch_size
        if compiled:
            self.compilations += 1
            fields = {"step": self.step, "latency_s": elapsed(t0),
                      "config": dataclasses.asdict(config)}
            if config in self._compiled_ahead:
                # its program was compiled ahead: the wait says nothing of a compile's cost
                fields["compiled_ahead"] = True
            else:
                self._compile_waits.append(fields["latency_s"])
            self.log.event("compile", **fields)
        self.reader.push(self.step, config, metrics, compiled=compiled)
        heartbeat()

    def drain(self) -> None:
        """Records the metrics of every dispatched step now (waits for the device)."""
        self._record(lag=0)

    def _record(self, lag: int) -> None:
        """Reads finished steps' metrics into the log; queues the ones policies will see."""
        for snap in self.reader.read(lag):
            if self.eval_fn is not None and self._every(self.eval_every, snap.step):
                assert snap.step == self.step, "evaluation runs on the model of its own step"
                t0 = time.perf_counter()
                results = {f"eval_{k}": float(v) for k, v in self.eval_fn(self.model).items()}
                snap.metrics.update(results)
                self.log.event("eval", step=snap.step, latency_s=elapsed(t0), **results)
            for key, value in self._hparams_of_step.pop(snap.step, {}).items():
                snap.metrics.setdefault(key, value)  # e.g. learning_rate, for plots and TensorBoard
            if self.link_bandwidth is not None and "comm_time" in snap.metrics:
                snap.metrics.setdefault(  # bytes per device per step, from the compiled HLO
                    "wire_bytes", snap.metrics["comm_time"] * float(self.link_bandwidth)
                )
            # recorded with the row, so that a replay (adaptjax.costs.simulate) sees them too
            for key, value in self._switch_cost_metrics().items():
                snap.metrics.setdefault(key, value)
            self.latest_metrics = snap.metrics
            self.log.metrics(snap.step, snap.metrics)
            if snap.step % self.policy_every == 0:
                self._to_decide.append(snap)
        limit = self.max_nonfinite_steps
        if limit is not None and self.reader.nonfinite_streak >= limit:
            self.log.event("nonfinite_stop", step=self.step, streak=self.reader.nonfinite_streak)
            raise NonFiniteTraining(
                f"the last {self.reader.nonfinite_streak} recorded steps all had non-finite "
                "updates and were skipped; lower the learning rate or check the data"
            )

    # ------------------------------------------------------------------ decisions
    def context(self, step: int | None = None) -> ajp.Context:
        """The :class:`adaptjax.policies.Context` policies see (``step``: the metrics' step)."""
        return ajp.Context(
            step=self.step if step is None else step,
            batch_size=self.config.batch_size,
            microbatches=self.config.microbatches,
            devices=self.config.devices,
            max_devices=self.max_devices,
            hyperparams=self.hyperparams,
            codec=self.steps.codecs.get(self.config.codec),
            samples_seen=self.samples_seen,
            sync=self.steps.strategies.get(self.config.sync),
        )

    def _switch_cost_metrics(self) -> dict[str, float]:
        """``compile_seconds`` (median wait of the run's compiles) and ``train_seconds``.

        What a move to a configuration not compiled yet costs (compiles whose
        program was compiled ahead, ``compiled_ahead`` in their event, are left
        out) and how long the run has been training, both carried across a
        resume by the checkpoint, for policies that weigh a change against its
        compile (``AdaptiveBatchSize``). Every metrics row carries them.
        """
        if not self._compile_waits or self._first_dispatch is None:
            return {}
        return {
            "compile_seconds": float(np.median(self._compile_waits)),
            "train_seconds": self._train_seconds(),
        }

    def _train_seconds(self) -> float:
        """The run's age: before this process (from the checkpoint) plus since its first step."""
        now = 0.0 if self._first_dispatch is None else time.perf_counter() - self._first_dispatch
        return self._age_before + now

    def _decide(self, snapshot: Snapshot) -> None:
        metrics = dict(snapshot.metrics)
        if jax.process_count() > 1:
            # Step times are measured per process: every process decides on process 0's.
            metrics = broadcast_json(metrics)
        actions = ajp.validate_actions(
            self.policy.decide(metrics, self.context(snapshot.step)),
            source=self.policy,
        )
        if decisions_checked():
            check_same(
                [self.step, snapshot.step, [repr(a) for a in actions]],
                f"the decision on the metrics of step {snapshot.step}",
            )
        if actions:
            self.log.event(
                "decision",
                step=self.step,
                metrics_step=snapshot.step,
                actions=[repr(a) for a in actions],
                # Why, in the policies' words, and what they saw (adaptjax report lists both).
                reasons=[getattr(a, "reason", "") for a in actions],
                metrics=metrics,
            )
            self.apply(actions)

    def apply(self, actions: Sequence[ajp.Action]) -> None:
        """Carries out actions now, as one transition (policies' actions go through here too)."""
        actions = ajp.validate_actions(list(actions))
        names = self.hyperparams.keys()
        plan = self._transition(actions, hyperparam_names=names)
        if plan.rollback is not None:
            self.rollback(plan.rollback)
            plan = self._transition(actions, hyperparam_names=names)
        self._carry_out(plan)

    def _transition(self, actions: Sequence[ajp.Action], **kwargs) -> Transition:
        """:func:`plan_transition` from the configuration in force, with this run's limits."""
        min_samples, min_replicas = self._sample_needs
        return plan_transition(
            actions, self.config, max_devices=self.max_devices,
            strategies=self.steps.strategies, min_samples=min_samples,
            min_replicas=min_replicas, **kwargs,
        )

    def _carry_out(self, plan: Transition) -> None:
        if plan.hyperparams:
            self.set_hyperparams(plan.hyperparams)
        if plan.codec_changed:
            self._swap_codec(plan.codec)
        if plan.sync_changed:
            self._swap_sync(plan.sync)
        new = plan.config
        if plan.requested_batch is not None:
            self.log.event(
                "batch_rounded",
                step=self.step,
                requested=plan.requested_batch,
                batch_size=new.batch_size,
                replicas=new.devices,
                microbatches=new.microbatches,
            )
        if new.devices != self.config.devices:
            self._rescale_to(new)
        else:
            self.config = new
        if plan.checkpoint:
            self._checkpoint()
        if plan.stop is not None:
            self._stop_reason = plan.stop
            self.log.event("stop", step=self.step, reason=plan.stop)

    # ------------------------------------------------------------------ actions
    @property
    def hyperparams(self) -> dict[str, float]:
        """The optimizer's numeric hyperparameters as the state holds them now."""
        inject = self.state.opt_state[OPTIMIZER]
        return {k: float(v) for k, v in jax.device_get(inject.hyperparams).items()}

    def set_hyperparams(self, values: Mapping[str, float]) -> None:
        """Writes hyperparameters into the optimizer state: no compilation."""
        inject = self.state.opt_state[OPTIMIZER]
        plan_transition(
            [ajp.SetHyperparams(dict(values))],
            self.config,
            max_devices=self.max_devices,
            hyperparam_names=inject.hyperparams.keys(),
        )
        sharding = NamedSharding(self.steps.mesh(self.config.devices), P())
        new = dict(inject.hyperparams)
        for key, value in values.items():
            new[key] = jax.device_put(np.asarray(value, dtype=new[key].dtype), sharding)
        opt_state = dict(self.state.opt_state)
        opt_state[OPTIMIZER] = inject._replace(hyperparams=new)
        self.state = dataclasses.replace(
            self.state, opt_state=type(self.state.opt_state)(opt_state)
        )
        self.log.event(
            "set_hyperparams", step=self.step, **{k: float(v) for k, v in values.items()}
        )
        if self._host_hparams is not None:
            self._host_hparams = {**self._host_hparams, **{k: float(v) for k, v in values.items()}}

    def set_batch_size(self, batch_size: int, microbatches: int | None = None) -> None:
        """Changes the global batch (and optionally the micro-batch count) from the next step."""
        self.apply([ajp.SetBatchSize(batch_size, microbatches)])

    def set_codec(self, codec) -> None:
        """Switches the sync's codec (``None``: dense). Optimizer and monitor states carry over."""
        self.apply([ajp.SetCodec(codec)])

    def rescale(self, devices: int) -> None:
        """Moves training to ``devices`` replicas through an Orbax checkpoint.

        Raises ``ValueError`` (before anything is written) when more devices are
        asked for than exist or than ``max_devices``. The global batch is rounded
        to a multiple of the new replica count x microbatches if needed.
        """
        self.apply([ajp.Rescale(devices=check_count(devices, "devices", positive=True))])

    def _swap_codec(self, codec) -> None:
        key = self.steps.add_codec(codec)
        if self.config.sync is not None:  # a strategy with local models: one rebuild
            new = self.config.replace(codec=key)
            tx = self.steps.tx(new.codec, new.sync)
            mesh = self.steps.mesh(new.devices)
            self.state = rebuild_state(self.state, tx, mesh, carry_sync=False)
            self.config = new
            self.log.event("set_codec", step=self.step, codec=key)
            return
        old = self.state
        fresh = self.steps.init_state(self.config.replace(codec=key))
        sync = fresh.opt_state[SYNC]._replace(
            count=old.opt_state[SYNC].count,
            monitor_states=old.opt_state[SYNC].monitor_states,
            metrics=old.opt_state[SYNC].metrics,
        )
        opt_state = dict(old.opt_state)
        opt_state[SYNC] = sync
        self.state = dataclasses.replace(old, opt_state=type(old.opt_state)(opt_state))
        self.config = self.config.replace(codec=key)
        self.log.event("set_codec", step=self.step, codec=key)

    def set_sync(self, strategy) -> None:
        """Switches the synchronisation strategy (a strategy, its name, or ``None``: S-SGD)."""
        self.apply([ajp.SetSync(strategy)])

    def _swap_sync(self, strategy) -> None:
        key = self.steps.add_sync(strategy)
        new = self.config.replace(sync=key)
        tx = self.steps.tx(new.codec, new.sync)
        carry = key is None and self.config.sync is None
        self.state = rebuild_state(self.state, tx, self.steps.mesh(new.devices), carry_sync=carry)
        self.config = new
        self.log.event("set_sync", step=self.step, sync=repr(self.steps.strategy(key)))

    def _rescale_to(self, new: RunConfig) -> None:
        """A transition to another mesh: checkpoint with ``new`` as the config, reshard onto it.

        The checkpoint records ``new`` as the configuration the run continues in
        (a crash before it completes resumes from the previous one, whose
        decisions replay). It is written in the background while the state moves
        to the new mesh in memory by the rule a restore applies
        (:func:`adaptjax.merge_replicas`), so the loop never waits for the disk;
        a resume from it restores the same values.
        """
        t0 = time.perf_counter()
        old = self.config
        relaunched = jax.process_count() > 1 or max_processes() > 1
        if relaunched and processes_for(new.devices) != jax.process_count():
            self._relaunch(new)
        self.config = new
        event = {"kind": "rescale", "devices_from": old.devices, "devices_to": new.devices}
        self._checkpoint(transition=event)
        state = merge_replicas(self.state, new.devices)
        self.state = jax.device_put(
            state, train_state_shardings(state, self.steps.mesh(new.devices))
        )
        self.reader.restart_clock()
        event["latency_s"] = elapsed(t0)  # logged with its checkpoint, once that is complete

    def _relaunch(self, new: RunConfig) -> None:
        """A transition to another process count: checkpoint ``new``, exit with EXIT_RESCALE."""
        old = self.config
        processes = processes_for(new.devices)
        self.config = new
        event = {
            "kind": "rescale",
            "devices_from": old.devices,
            "devices_to": new.devices,
            "processes_from": jax.process_count(),
            "processes_to": processes,
        }
        self._checkpoint(transition=event)
        self._dir.confirm(block=True)
        self.log.event(
            "relaunch", step=self.step, processes=processes, exit_code=EXIT_RESCALE
        )
        write_rescale_request(processes, new.devices)
        self.close()
        raise SystemExit(EXIT_RESCALE)

    def rollback(self, reason: str = "") -> None:
        """Returns params and optimizer state to the latest checkpoint.

        The run goes on forward from here: the step count, the data cursor,
        the non-finite count and the policies' state are kept, so the batches
        that led to the problem are not replayed and a policy does not repeat
        the decision that led here. The configuration (mesh, batch, codec) is
        the checkpoint's.
        """
        latest = self._dir.latest_step()
        if latest is None:
            raise ValueError(
                "Rollback needs a checkpoint; set checkpoint_every or return Checkpoint() first"
            )
        t0 = time.perf_counter()
        meta = self._dir.checkpoints.read_meta(latest)
        self.config = self._config_from(meta)
        self.state, _ = self._dir.checkpoints.restore(
            latest,
            target_state=self.steps.abstract_state(self.config),
            mesh=self.steps.mesh(self.config.devices),
        )
        self._host_hparams = None  # the checkpoint's
        # The steps being undone happened: their rows are logged, but no policy decides on them.
        self._record(lag=0)
        self._to_decide.clear()
        self.reader.restart_clock()
        self.log.event(
            "rollback", step=self.step, latency_s=elapsed(t0), reason=reason, to_checkpoint=latest
        )

    def precompile(
        self,
        devices: int | None = None,
        batch_size: int | None = None,
        microbatches: int | None = None,
        codec=...,
    ) -> float:
        """Compiles the step of a configuration ahead of time; returns the seconds it took.

        Use it before a change no policy announces (``Policy.upcoming``; those
        are compiled in the background already) so that the first step after
        it does not wait for XLA: the compiled program lands in JAX's
        compilation cache and the step's first call finds it. Arguments
        default to the current configuration; it blocks until compiled.

        Example:
          >>> # ctrl.precompile(batch_size=256)   # before your own set_batch_size(256)
        """
        config = RunConfig(
            devices=self.config.devices if devices is None else devices,
            batch_size=self.config.batch_size if batch_size is None else batch_size,
            microbatches=self.config.microbatches if microbatches is None else microbatches,
            codec=self.config.codec if codec is ... else self.steps.add_codec(codec),
            sync=self.config.sync,
        )
        if not hasattr(self.data, "batch_at"):
            raise ValueError("precompile needs a dataset with batch_at (e.g. ArrayDataset)")
        seconds = self.steps.compile(config, self.data)
        self._compiled_ahead.add(config)
        self.log.event(
            "precompile", step=self.step, latency_s=seconds, config=dataclasses.asdict(config)
        )
        return seconds

    def _compile_upcoming(self) -> None:
        """Compiles, in a background thread, the configurations policies announce.

        Each action of ``policy.upcoming(ctx)`` that changes the batch, the
        device count or the codec names a configuration; one not compiled yet
        is compiled by a single background thread, so the step that first runs
        in it finds the program in JAX's cache (``background_compile`` events).
        Off with ``precompile_upcoming=False``, under several processes, and
        for datasets without ``batch_at``. Right after a change, the hints wait
        until the new configuration's own step has compiled.
        """
        if (
            not self._precompile_upcoming
            or jax.process_count() > 1
            or not hasattr(self.data, "batch_at")
        ):
            return
        # Not while the step of a configuration just changed to compiles in the
        # foreground: asked again after its first dispatch.
        self._hints_waiting = not self.steps.has_run(self.config)
        if self._hints_waiting:
            return
        for action in ajp.upcoming(self.policy, self.context()):
            if not isinstance(action, ajp.SetBatchSize | ajp.Rescale | ajp.SetCodec):
                continue
            try:
                if isinstance(action, ajp.SetCodec):
                    self.steps.add_codec(action.codec)
                config = self._transition([action]).config
            except Exception:  # a hint never stops training; the action would say why
                continue
            if config in self._background or self.steps.has_run(config):
                continue
            if self._compiler is None:
                self._compiler = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="adaptjax-compile",
                    initializer=_lower_thread_priority,
                )
            # shapes read here: the thread shares neither the model nor the dataset
            try:
                args = self.steps.abstract_args(config, self.data)
            except Exception as error:  # a hint never stops training; the action would say why
                future: concurrent.futures.Future = concurrent.futures.Future()
                future.set_exception(error)
            else:
                future = self._compiler.submit(self.steps.compile, config, args=args)
            self._background[config] = future

    def _log_background(self) -> None:
        """Logs each finished background compile once (``background_compile``)."""
        for config, future in self._background.items():
            if future is None or not future.done():
                continue
            self._background[config] = None
            if future.cancelled():
                continue
            fields = {"step": self.step, "config": dataclasses.asdict(config)}
            error = future.exception()
            if error is not None:
                fields["error"] = f"{type(error).__name__}: {error}".splitlines()[0]
            else:
                fields["latency_s"] = future.result()
                self._compiled_ahead.add(config)
            self.log.event("background_compile", **fields)

    def _comm_time(self, config: RunConfig) -> float | None:
        """Modelled seconds per step on the link: HLO bytes per device / bandwidth."""
        if self.link_bandwidth is None:
            return None
        total = self.steps.wire_total(config, self.data)
        return None if total is None else total / float(self.link_bandwidth)

    # ------------------------------------------------------------------ persistence
    def _meta(self) -> dict:
        return {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "nonfinite_count": self.reader.nonfinite_count,
            "config": dataclasses.asdict(self.config),
            "data": self.data.state_dict(),
            "policy": json.loads(json.dumps(self.policy.state_dict())),
            "to_decide": [{"step": s.step, "metrics": s.metrics} for s in self._to_decide],
            # what _switch_cost_metrics continues from after a resume
            "train_seconds": self._train_seconds(),
            "compile_waits": list(self._compile_waits),
        }

    def _checkpoint(self, transition: dict | None = None) -> None:
        """Checkpoints the current step (the transition's: rewritten with the new config)."""
        self._record(lag=0)
        latest = self._dir.latest_step()
        if latest == self.step:
            if transition is None:
                return
            # Same arrays, new configuration: the checkpoint must say what the run continues in.
            self._dir.checkpoints.delete(self.step)
        t0 = time.perf_counter()
        events = [{"kind": "checkpoint"}]
        if transition is not None:
            events.append(transition)
        self._dir.save(self.step, self.state, self._meta(), events)
        events[0]["latency_s"] = elapsed(t0)  # the time the loop waited; the write goes on

    def save_checkpoint(self) -> None:
        """Writes a consistent checkpoint now (state, data cursor, config, policy state)."""
        self._checkpoint()

    def _config_from(self, meta: Mapping) -> RunConfig:
        config = RunConfig(**meta["config"])
        if config.codec not in self.steps.codecs:
            raise ValueError(
                f"the checkpoint was written with codec {config.codec!r}; pass that codec "
                "as codec= or inside a policy"
            )
        if config.sync not in self.steps.strategies:
            raise ValueError(
                f"the checkpoint was written with sync strategy {config.sync}; pass it as sync= "
                "or inside a policy"
            )
        return config

    def _resume(self, passed: dict, hyperparams: Mapping, tensorboard: bool) -> None:
        t0 = time.perf_counter()

        def load(step):
            meta = self._dir.checkpoints.read_meta(step)
            config = self._config_from(meta)
            wanted = processes_for(config.devices)
            if (jax.process_count() > 1 or max_processes() > 1) and wanted != jax.process_count():
                # The run continues on another process count: ask the launcher for it.
                write_rescale_request(wanted, config.devices)
                raise SystemExit(EXIT_RESCALE)
            state, _ = self._dir.checkpoints.restore(
                step,
                target_state=self.steps.abstract_state(config),
                mesh=self.steps.mesh(config.devices),
            )
            return config, state, meta

        step, (config, state, meta), skipped = self._dir.restore_newest_intact(load)
        self._dir.open_log(tensorboard=tensorboard, resume_from=step)
        for s in skipped:
            self.log.event(
                "checkpoint_skipped",
                step=step,
                skipped_step=s["step"],
                reason=s["reason"],
                moved_to=s["moved_to"],
            )
        self._dir.recover_events(step, meta)
        self.config, self.state = config, state
        self.step = int(meta["step"])
        self.samples_seen = int(meta["samples_seen"])
        self.reader.nonfinite_count = int(meta["nonfinite_count"])
        self.data.load_state_dict(meta["data"])
        self.policy.load_state_dict(meta["policy"])
        self._to_decide = [
            Snapshot(int(s["step"]), config, dict(s["metrics"])) for s in meta.get("to_decide", [])
        ]
        self.latest_metrics = dict(self._to_decide[-1].metrics) if self._to_decide else {}
        self._age_before = float(meta.get("train_seconds", 0.0))  # absent in older checkpoints
        self._compile_waits = [float(w) for w in meta.get("compile_waits", [])]
        for key, value in passed.items():
            if value != getattr(config, key):
                self._warn_override(key, value, getattr(config, key))
        held = self.hyperparams
        for key, value in hyperparams.items():
            numeric = isinstance(value, int | float | np.number) and not isinstance(value, bool)
            if key in held and numeric and np.float32(value) != np.float32(held[key]):
                self._warn_override(key, value, held[key])
        self.log.event("resume", step=step, latency_s=elapsed(t0))

    @staticmethod
    def _warn_override(key, passed, kept) -> None:
        warnings.warn(
            f"resume: {key}={passed!r} was passed, but the run continues with the checkpoint's "
            f"{key}={kept!r} (its state decides; change it with an action after resuming)",
            UserWarning,
            stacklevel=user_stacklevel(),
        )

    # ------------------------------------------------------------------ faults
    @contextlib.contextmanager
    def _sigterm_checkpoints(self):
        """While training, SIGTERM asks for a checkpoint and a clean exit (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGTERM, lambda *_: self._preempted.set())
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _preempt_agreed(self) -> bool:
        """Whether to stop for SIGTERM now; across processes all agree, at policy steps."""
        if jax.process_count() == 1:
            return self._preempted.is_set()
        if self.step % self.policy_every:
            return False
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self._preempted.is_set()))
        return bool(np.asarray(flags).any())

    def _preempt(self) -> None:
        self.log.event("preempted", step=self.step, exit_code=EXIT_PREEMPTED)
        self._checkpoint()
        self.close()
        raise SystemExit(EXIT_PREEMPTED)

    def close(self) -> None:
        """Finishes or discards the in-flight checkpoint, syncs the logs, releases ``run_dir``."""
        if self._compiler is not None:  # a compile under way finishes; queued ones are dropped
            self._compiler.shutdown(wait=False, cancel_futures=True)
        self._dir.close()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
