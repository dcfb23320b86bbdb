"""The host-side controller: runs the step, reads metrics, asks policies, carries out actions."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from adaptjax import policies as ajp
from adaptjax._checkpoint import CheckpointManager
from adaptjax._codec import GradientCodec
from adaptjax._metrics import update_norm
from adaptjax._monitors import GradientNoiseScale, GradientNorm, GradientSNR
from adaptjax._run_log import RunLog
from adaptjax._state import abstract_state, init_state, merge_model, shape_struct
from adaptjax._step import DataParallelStep, data_parallel_step, make_mesh
from adaptjax._sync import SyncState, sync_gradients

_CKPT = "checkpoints"


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The configuration that decides which compiled step runs.

    Attributes:
      devices: replicas on the 1-D ``"data"`` mesh.
      batch_size: global batch (samples per step).
      microbatches: gradient accumulation steps per replica.
      codec: the codec's key (see :func:`codec_key`), or ``None`` for a dense sync.

    Example:
      >>> from adaptjax import RunConfig
      >>> RunConfig(devices=8, batch_size=64)
      RunConfig(devices=8, batch_size=64, microbatches=1, codec=None)
    """

    devices: int
    batch_size: int
    microbatches: int = 1
    codec: str | None = None


def codec_key(codec) -> str | None:
    """A stable name for a codec object: its ``repr`` without memory addresses.

    Example:
      >>> from adaptjax import codec_key
      >>> codec_key(None) is None
      True
    """
    if codec is None:
        return None
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(codec))


def _check_writable_dir(path: str) -> None:
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(
            f"run_dir {path} is not writable ({probe} is not a writable directory); "
            "choose a run_dir you can write to"
        )


def _find_codecs(obj, found: dict, depth: int = 0) -> None:
    """Collects codec objects held by policies (e.g. ``SwitchCompression.codec``)."""
    if depth > 4 or obj is None or isinstance(obj, str | int | float | bool):
        return
    if isinstance(obj, ajp.SetCodec):
        if obj.codec is not None:
            found[codec_key(obj.codec)] = obj.codec
        return
    if isinstance(obj, GradientCodec) and not isinstance(obj, type):
        found[codec_key(obj)] = obj
        return
    if isinstance(obj, Mapping):
        for v in obj.values():
            _find_codecs(v, found, depth + 1)
        return
    if isinstance(obj, list | tuple):
        for v in obj:
            _find_codecs(v, found, depth + 1)
        return
    attrs = getattr(obj, "__dict__", None)
    if attrs:
        for v in attrs.values():
            _find_codecs(v, found, depth + 1)


class _NoPolicy(ajp.Policy):
    """What runs when no policy is given: decides nothing."""

    def decide(self, metrics, ctx):
        return []


class Controller:
    """Runs adaptive data-parallel training: step, measure, decide, act.

    Every step runs :func:`adaptjax.data_parallel_step` on a 1-D ``"data"``
    mesh with ``optax.chain(sync_gradients(codec, monitors), optimizer,
    update_norm())``. The optimizer is wrapped in ``optax.inject_hyperparams``
    so hyperparameters live in the state and change without recompiling.

    The host reads each step's metrics one step behind (dispatch never waits
    on the device) except at *sync points* — checkpoint and evaluation steps,
    and the last step — where it drains them first, so what a policy sees and
    when its actions take effect depends only on step numbers: a resumed run
    makes the same decisions as an uninterrupted one. Policies are asked
    every ``policy_every`` steps; their actions are carried out before the
    next step is dispatched:

    * ``SetHyperparams``: written into the state (no compilation).
    * ``SetBatchSize``: the next batch has the new size (compiled once per
      shape, then cached); the data cursor is a sample index, so no sample is
      skipped or repeated. A size that doesn't divide by replicas x
      microbatches is rounded to the nearest multiple (logged as
      ``batch_rounded``).
    * ``Rescale``: checkpoint through Orbax, build the new mesh, restore onto
      it (per-replica state merged by its rule), continue; the global batch is
      rounded to a multiple of the new replica count if needed.
    * ``SetCodec``: the sync uses the new codec (``None``: dense); the codec's
      own state (e.g. error-feedback residuals) starts fresh, optimizer and
      monitor states carry over.
    * ``Checkpoint``, ``Stop``; ``Rollback`` returns params and optimizer
      state to the latest checkpoint while the step count, data cursor and
      policy state go on forward (see :meth:`rollback`).

    Compiled steps are cached per :class:`RunConfig`, so returning to a
    configuration seen before never compiles. ``run_dir`` receives
    ``metrics.jsonl``, ``events.jsonl``, ``tensorboard/`` and ``checkpoints/``.

    Args:
      model: a flax NNX module or a pytree of float parameters (the initial values).
      loss_fn: ``loss_fn(model_or_params, batch) -> loss`` (or ``(loss, aux)``).
      optimizer: an optax optimizer factory such as ``optax.adamw``.
      hyperparams: its keyword arguments (numbers live in the state).
      data: an :class:`adaptjax.ArrayDataset` (or anything with ``next_batch``,
        ``state_dict`` and ``load_state_dict``).
      devices: initial replica count.
      batch_size: initial global batch.
      run_dir: where logs and checkpoints go; it must not already hold
        checkpoints unless ``resume=True``.
      microbatches: gradient accumulation steps.
      policies: policies from :mod:`adaptjax.policies`, combined with ``any_of``.
      codec: initial codec (``None``: dense fp32 sync).
      monitors: monitors for :func:`adaptjax.sync_gradients` (default: noise
        scale, SNR and gradient norm).
      norm_chunks: see :func:`adaptjax.sync_gradients`.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      policy_every: ask the policies every this many steps.
      checkpoint_every: periodic checkpoints (``None``: only on rescale and at the end).
      max_to_keep: checkpoints kept on disk.
      eval_fn: ``eval_fn(model_or_params) -> {name: float}``, run at sync points
        every ``eval_every`` steps; names are prefixed ``eval_``.
      eval_every: evaluation interval in steps.
      max_devices: the most replicas a policy may ask for (default: all devices).
      link_bandwidth: bytes/s of the modelled interconnect. When set, the
        controller reads the bytes each compiled step sends (from its HLO, via
        :func:`adaptjax.wire_bytes`) and reports ``comm_time`` (= bytes /
        bandwidth) and ``comm_share`` (= comm / (measured step time + comm)).
        Simulated CPU devices have no real link, so this is a model, stated
        as such.
      progress: show a tqdm progress bar.
      tensorboard: write TensorBoard event files.
      compilation_cache_dir: enable JAX's persistent compilation cache there.
      resume: continue from the latest complete checkpoint in ``run_dir``.
      on_step: optional hook ``on_step(controller)`` called after each dispatch.

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
        microbatches: int = 1,
        policies: Sequence[ajp.Policy] = (),
        codec=None,
        monitors: Sequence[Any] | None = None,
        norm_chunks: int = 1,
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
        compilation_cache_dir: str | None = None,
        resume: bool = False,
        on_step: Callable[[Controller], None] | None = None,
    ):
        # --- everything is checked before anything touches the disk ----------------
        run_dir = os.fspath(run_dir)
        available = len(jax.devices())
        self.max_devices = available if max_devices is None else int(max_devices)
        if self.max_devices > available:
            raise ValueError(
                f"max_devices={self.max_devices} but only {available} devices exist; "
                f"use max_devices <= {available}"
            )
        make_mesh(devices)  # more devices than exist -> one-line error
        for name, value in (("policy_every", policy_every), ("microbatches", microbatches)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name, value in (("checkpoint_every", checkpoint_every), ("eval_every", eval_every)):
            if value is not None and int(value) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if eval_fn is not None and eval_every is None:
            raise ValueError("eval_fn needs eval_every (evaluate every this many steps)")
        self._check_batch(int(batch_size), int(devices), int(microbatches))
        for attr in ("next_batch", "state_dict", "load_state_dict"):
            if not hasattr(data, attr):
                raise ValueError(
                    f"data has no {attr}(); wrap arrays in adaptjax.ArrayDataset or an "
                    "iterable in adaptjax.IterableDataset"
                )
        _check_writable_dir(run_dir)
        ckpt_dir = os.path.join(run_dir, _CKPT)
        self.checkpoints = CheckpointManager(ckpt_dir, max_to_keep=max_to_keep)
        latest = self.checkpoints.latest_step()
        if not resume and latest is not None:
            raise ValueError(
                f"run_dir {run_dir} already holds checkpoints; use Controller.resume(...) "
                "to continue that run or choose a new run_dir"
            )
        if resume and latest is None:
            raise ValueError(f"no complete checkpoint in {ckpt_dir} to resume from")
        self.policy = ajp.any_of(*policies) if policies else _NoPolicy()
        self._codecs: dict[str | None, Any] = {None: None}
        if codec is not None:
            self._codecs[codec_key(codec)] = codec
        _find_codecs(list(policies), self._codecs)

        if compilation_cache_dir is not None:
            jax.config.update("jax_compilation_cache_dir", os.fspath(compilation_cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.data = data
        self.run_dir = run_dir
        self.has_aux = has_aux
        self.norm_chunks = int(norm_chunks)
        self.monitors = (
            (GradientNoiseScale(), GradientSNR(), GradientNorm())
            if monitors is None
            else tuple(monitors)
        )
        self.policy_every = int(policy_every)
        self.checkpoint_every = checkpoint_every
        self.eval_fn = eval_fn
        self.eval_every = eval_every
        self.link_bandwidth = link_bandwidth
        self.on_step = on_step
        self._model = model
        self.hyperparams = {k: v for k, v in hyperparams.items()}
        self._hyper_numeric = {
            k: float(v)
            for k, v in self.hyperparams.items()
            if isinstance(v, int | float | np.number) and not isinstance(v, bool)
        }
        self.config = RunConfig(int(devices), int(batch_size), int(microbatches), codec_key(codec))
        self._meshes: dict[int, Any] = {}
        self._txs: dict[str | None, optax.GradientTransformation] = {}
        self._steps: dict[RunConfig, DataParallelStep] = {}
        self._comm_bytes: dict[RunConfig, float | None] = {}
        self._step_times: dict[RunConfig, list[float]] = {}
        self.compilations = 0
        self.step = 0
        self.samples_seen = 0
        self.nonfinite_count = 0
        self.latest_metrics: dict[str, float] = {}
        self._stop_reason: str | None = None
        self._pending: list[tuple[int, RunConfig, Any]] = []
        self._last_ready: float | None = None
        self._fresh_config = True

        os.makedirs(run_dir, exist_ok=True)
        self.log = RunLog(run_dir, tensorboard=tensorboard)
        self._progress = progress
        if resume:
            self._resume_latest()
        else:
            self.state = init_state(model, self._tx(self.config.codec), self._mesh(devices))

    # ------------------------------------------------------------------ construction
    @classmethod
    def resume(cls, run_dir: str | os.PathLike, **kwargs) -> Controller:
        """Continues the run in ``run_dir`` from its latest complete checkpoint.

        Pass the same model, loss, optimizer, data, policies and codecs as the
        original run (the code can't be read from disk); the configuration in
        force, the data cursor, the optimizer and policy states come from the
        checkpoint, so the run continues exactly where it was.
        """
        return cls(run_dir=run_dir, resume=True, **kwargs)

    @staticmethod
    def _check_batch(batch_size: int, devices: int, microbatches: int) -> None:
        if batch_size < devices:
            raise ValueError(
                f"batch_size {batch_size} is smaller than the replica count {devices}; "
                f"use batch_size >= {devices}"
            )
        if batch_size % (devices * microbatches):
            raise ValueError(
                f"batch_size {batch_size} is not divisible by replicas x microbatches = "
                f"{devices} x {microbatches}; use a multiple of {devices * microbatches}"
            )

    def _mesh(self, devices: int):
        if devices not in self._meshes:
            self._meshes[devices] = make_mesh(devices)
        return self._meshes[devices]

    def _tx(self, key: str | None) -> optax.GradientTransformation:
        if key not in self._txs:
            if key not in self._codecs:
                raise ValueError(
                    f"codec {key!r} is not known to this controller; pass it as codec= "
                    "or inside a policy (e.g. SwitchCompression(codec))"
                )
            opt = optax.inject_hyperparams(self.optimizer, hyperparam_dtype=np.float32)(
                **self.hyperparams
            )
            self._txs[key] = optax.chain(
                sync_gradients(
                    "data",
                    codec=self._codecs[key],
                    monitors=self.monitors,
                    norm_chunks=self.norm_chunks,
                ),
                opt,
                update_norm(),
            )
        return self._txs[key]

    def _step_fn(self, config: RunConfig) -> DataParallelStep:
        if config not in self._steps:
            self._steps[config] = data_parallel_step(
                self.loss_fn,
                self._tx(config.codec),
                self._mesh(config.devices),
                microbatches=config.microbatches,
                has_aux=self.has_aux,
            )
        return self._steps[config]

    # ------------------------------------------------------------------ the loop
    @property
    def model(self):
        """The current model (NNX module) or params, on the host's view of the mesh."""
        return merge_model(self.state.graphdef, self.state.params, self.state.model_state)

    def run(self, steps: int) -> None:
        """Trains until ``self.step == steps`` (absolute) or a policy stops the run.

        A final checkpoint is written at the end.
        """
        from tqdm.auto import tqdm

        bar = tqdm(
            total=steps,
            initial=self.step,
            disable=not self._progress,
            desc="adaptjax",
            dynamic_ncols=True,
        )
        try:
            while self.step < steps and self._stop_reason is None:
                self._dispatch()
                bar.update(1)
                if self._progress and self.latest_metrics:
                    bar.set_postfix(
                        loss=f"{self.latest_metrics.get('loss', float('nan')):.4f}",
                        bs=self.config.batch_size,
                        dev=self.config.devices,
                        refresh=False,
                    )
                if self._is_sync_point(self.step) or self.step >= steps:
                    self._drain()
                    self._after_sync_point()
            self._checkpoint_here()
        finally:
            bar.close()
            self.log.flush()

    def close(self) -> None:
        """Flushes logs and waits for pending checkpoint writes."""
        self._drain()
        self.log.close()
        self.checkpoints.close()

    def _is_sync_point(self, step: int) -> bool:
        return bool(
            (self.checkpoint_every and step % self.checkpoint_every == 0)
            or (self.eval_every and step % self.eval_every == 0)
        )

    def _dispatch(self) -> None:
        config = self.config
        fn = self._step_fn(config)
        batch = self.data.next_batch(config.batch_size)
        before = fn.jitted._cache_size()
        t0 = time.perf_counter()
        self.state, metrics = fn(self.state, batch)
        if fn.jitted._cache_size() > before:
            self.compilations += 1
            self.log.event(
                "compile",
                step=self.step + 1,
                latency_s=time.perf_counter() - t0,
                config=dataclasses.asdict(config),
            )
            self._fresh_config = True
        self.step += 1
        self.samples_seen += config.batch_size
        self._pending.append((self.step, config, metrics))
        if self.on_step is not None:
            self.on_step(self)
        # Read the previous step's metrics: it is done (or nearly) while this one runs.
        while len(self._pending) > 1:
            self._consume(self._pending.pop(0))

    def _drain(self) -> None:
        while self._pending:
            self._consume(self._pending.pop(0))

    def _consume(self, item) -> None:
        step, config, metrics = item
        values = jax.device_get(metrics)
        now = time.perf_counter()
        flat = {}
        for key, value in values.items():
            if key == "aux":
                for k, v in jax.tree_util.tree_leaves_with_path(value):
                    flat["aux" + jax.tree_util.keystr(k)] = float(np.asarray(v))
            else:
                flat[key] = float(np.asarray(value))
        self.nonfinite_count += int(flat.get("nonfinite", 0.0) > 0)
        flat["nonfinite_count"] = float(self.nonfinite_count)
        # Step time: the interval between two consecutive completions, skipping
        # the first step of a configuration (compilation, changed shapes).
        if self._last_ready is not None and not self._fresh_config:
            times = self._step_times.setdefault(config, [])
            times.append(now - self._last_ready)
            del times[:-32]  # the median of the last 32 is all that is read
        self._fresh_config = False
        self._last_ready = now
        times = self._step_times.get(config)
        if times:
            step_time = float(np.median(times))
            flat["step_time"] = step_time
            flat["throughput"] = config.batch_size / step_time
            comm = self._comm_time(config)
            if comm is not None:
                flat["comm_time"] = comm
                flat["comm_share"] = comm / (step_time + comm)
        flat["batch_size"] = float(config.batch_size)
        flat["devices"] = float(config.devices)
        self.latest_metrics = flat
        self.log.metrics(step, flat)
        evaluates_here = self.eval_fn is not None and step % self.eval_every == 0
        if step % self.policy_every == 0 and not evaluates_here:
            self._decide(step, flat)  # eval steps decide once, after the evaluation

    def _abstract_args(self, config: RunConfig):
        """The step's (state, batch) arguments at ``config``, as ShapeDtypeStructs."""
        batch = jax.tree.map(shape_struct, self.data.batch_at(0, config.batch_size))
        mesh = self._mesh(config.devices)
        return abstract_state(self._model, self._tx(config.codec), mesh), batch

    def _wire_total(self, config: RunConfig) -> float | None:
        if config not in self._comm_bytes:
            from adaptjax._wire import wire_bytes

            total = None
            if hasattr(self.data, "batch_at"):
                total = wire_bytes(self._step_fn(config).jitted, *self._abstract_args(config)).total
            self._comm_bytes[config] = total
        return self._comm_bytes[config]

    def _comm_time(self, config: RunConfig) -> float | None:
        """Modelled seconds per step on the link: HLO bytes per device / bandwidth."""
        if self.link_bandwidth is None:
            return None
        total = self._wire_total(config)
        if total is None:
            return None
        return total / float(self.link_bandwidth)

    def _after_sync_point(self) -> None:
        step = self.step
        if self.eval_every and step % self.eval_every == 0 and self.eval_fn is not None:
            t0 = time.perf_counter()
            results = {f"eval_{k}": float(v) for k, v in self.eval_fn(self.model).items()}
            self.latest_metrics.update(results)
            self.log.metrics(step, results)
            self.log.event("eval", step=step, latency_s=time.perf_counter() - t0, **results)
            if step % self.policy_every == 0:
                self._decide(step, self.latest_metrics)
        if self.checkpoint_every and step % self.checkpoint_every == 0:
            self._checkpoint_here()
        # Evaluation and checkpoint time is not step time: restart the clock.
        self._last_ready = None

    # ------------------------------------------------------------------ decisions
    def context(self) -> ajp.Context:
        """The :class:`adaptjax.policies.Context` policies see now."""
        return ajp.Context(
            step=self.step,
            batch_size=self.config.batch_size,
            microbatches=self.config.microbatches,
            devices=self.config.devices,
            max_devices=self.max_devices,
            hyperparams=dict(self._hyper_numeric),
            codec=self._codecs.get(self.config.codec),
            samples_seen=self.samples_seen,
        )

    def _decide(self, step: int, metrics: Mapping[str, float]) -> None:
        actions = ajp.validate_actions(
            self.policy.decide(dict(metrics), self.context()), source=self.policy
        )
        if actions:
            self.log.event("decision", step=step, actions=[repr(a) for a in actions])
            self.apply(actions)

    def apply(self, actions: Sequence[ajp.Action]) -> None:
        """Carries out actions now (policies' actions go through here too)."""
        actions = ajp.validate_actions(list(actions))
        order = {ajp.Rollback: 0, ajp.Rescale: 1, ajp.SetCodec: 2, ajp.SetBatchSize: 3}
        for action in sorted(actions, key=lambda a: order.get(type(a), 4)):
            t0 = time.perf_counter()
            if isinstance(action, ajp.SetHyperparams):
                self.set_hyperparams(dict(action.values))
            elif isinstance(action, ajp.SetBatchSize):
                self.set_batch_size(action.batch_size, action.microbatches)
            elif isinstance(action, ajp.Rescale):
                devices = action.devices
                if devices is None:
                    devices = int(np.prod(action.mesh_shape))
                self.rescale(devices)
            elif isinstance(action, ajp.SetCodec):
                self.set_codec(action.codec)
            elif isinstance(action, ajp.Checkpoint):
                self._checkpoint_here()
            elif isinstance(action, ajp.Stop):
                self._stop_reason = action.reason or "stopped by a policy"
            elif isinstance(action, ajp.Rollback):
                self.rollback(action.reason)
            self.log.event(
                "action", step=self.step, action=repr(action), latency_s=time.perf_counter() - t0
            )

    def precompile(
        self,
        devices: int | None = None,
        batch_size: int | None = None,
        microbatches: int | None = None,
        codec=...,
    ) -> float:
        """Compiles the step of a configuration ahead of time; returns the seconds it took.

        Use it before a scheduled rescale or batch change (or in a background
        thread) so the first step after the change does not wait for XLA: the
        compiled program lands in JAX's compilation cache and the step's first
        call finds it. Arguments default to the current configuration.

        Example:
          >>> # ctrl.precompile(devices=4)   # before ElasticScale's 8 -> 4
        """
        config = RunConfig(
            devices=self.config.devices if devices is None else int(devices),
            batch_size=self.config.batch_size if batch_size is None else int(batch_size),
            microbatches=self.config.microbatches if microbatches is None else int(microbatches),
            codec=self.config.codec if codec is ... else codec_key(codec),
        )
        if codec is not ... and config.codec not in self._codecs:
            self._codecs[config.codec] = codec
        self._check_batch(config.batch_size, config.devices, config.microbatches)
        if not hasattr(self.data, "batch_at"):
            raise ValueError("precompile needs a dataset with batch_at (e.g. ArrayDataset)")
        t0 = time.perf_counter()
        self._step_fn(config).jitted.lower(*self._abstract_args(config)).compile()
        seconds = time.perf_counter() - t0
        self.log.event(
            "precompile", step=self.step, latency_s=seconds, config=dataclasses.asdict(config)
        )
        return seconds

    # ------------------------------------------------------------------ actions
    def set_hyperparams(self, values: Mapping[str, float]) -> None:
        """Writes hyperparameters into the optimizer state: no compilation."""
        inject = self._inject_state(self.state.opt_state)
        unknown = sorted(set(values) - set(inject.hyperparams))
        if unknown:
            raise ValueError(
                f"unknown hyperparameter {unknown[0]!r}; this optimizer has "
                f"{sorted(inject.hyperparams)}"
            )
        new = dict(inject.hyperparams)
        sharding = NamedSharding(self._mesh(self.config.devices), P())
        for key, value in values.items():
            old = inject.hyperparams[key]
            new[key] = jax.device_put(np.asarray(value, dtype=old.dtype), sharding)
            self._hyper_numeric[key] = float(value)
        opt_state = self._replace_inject(self.state.opt_state, inject._replace(hyperparams=new))
        self.state = dataclasses.replace(self.state, opt_state=opt_state)

    @staticmethod
    def _inject_state(opt_state):
        return opt_state[1]

    @staticmethod
    def _replace_inject(opt_state, inject):
        return (opt_state[0], inject, *opt_state[2:])

    def _round_batch(self, batch_size: int, devices: int, microbatches: int) -> int:
        unit = devices * microbatches
        rounded = max(unit, int(round(batch_size / unit)) * unit)
        if rounded != batch_size:
            self.log.event(
                "batch_rounded",
                step=self.step,
                requested=batch_size,
                batch_size=rounded,
                replicas=devices,
                microbatches=microbatches,
            )
        return rounded

    def set_batch_size(self, batch_size: int, microbatches: int | None = None) -> None:
        """Changes the global batch (and optionally the micro-batch count).

        The next batch starts at the next sample of the stream. A size that
        isn't a multiple of replicas x microbatches is rounded to the nearest
        one (an event records it).
        """
        k = self.config.microbatches if microbatches is None else int(microbatches)
        if int(batch_size) < 1 or k < 1:
            raise ValueError(f"batch_size and microbatches must be >= 1, got {batch_size}, {k}")
        batch_size = self._round_batch(int(batch_size), self.config.devices, k)
        self.config = dataclasses.replace(self.config, batch_size=batch_size, microbatches=k)

    def set_codec(self, codec) -> None:
        """Switches the sync's codec (``None``: dense). Optimizer and monitor states carry over."""
        key = codec_key(codec)
        if key not in self._codecs:
            self._codecs[key] = codec
        if key == self.config.codec:
            return
        old = self.state
        fresh = init_state(self._model, self._tx(key), self._mesh(self.config.devices))
        old_sync: SyncState = old.opt_state[0]
        new_sync = fresh.opt_state[0]._replace(
            count=old_sync.count,
            monitor_states=old_sync.monitor_states,
            metrics=old_sync.metrics,
        )
        opt_state = (new_sync, *old.opt_state[1:])
        self.state = dataclasses.replace(old, opt_state=opt_state)
        self.config = dataclasses.replace(self.config, codec=key)

    def rescale(self, devices: int) -> None:
        """Moves training to ``devices`` replicas through an Orbax checkpoint.

        Raises ``ValueError`` (before anything is written) when more devices are
        asked for than exist or than ``max_devices``. The global batch is rounded
        to a multiple of the new replica count x microbatches if needed.
        """
        devices = int(devices)
        if devices > self.max_devices:
            raise ValueError(
                f"cannot rescale to {devices} devices: max_devices is {self.max_devices}; "
                f"use devices <= {self.max_devices}"
            )
        mesh = self._mesh(devices)  # raises for more devices than exist
        if devices == self.config.devices:
            return
        t0 = time.perf_counter()
        old_devices = self.config.devices
        self._checkpoint_here()
        batch = self._round_batch(self.config.batch_size, devices, self.config.microbatches)
        self.config = dataclasses.replace(self.config, devices=devices, batch_size=batch)
        target = abstract_state(self._model, self._tx(self.config.codec), mesh)
        self.state, _ = self.checkpoints.restore(self.step, target_state=target, mesh=mesh)
        self._last_ready = None
        self.log.event(
            "rescale",
            step=self.step,
            latency_s=time.perf_counter() - t0,
            devices_from=old_devices,
            devices_to=devices,
        )

    def rollback(self, reason: str = "") -> None:
        """Returns params and optimizer state to the latest checkpoint.

        The run goes on forward from here: the step count, the data cursor,
        the non-finite count and the policies' state are kept, so the batches
        that led to the problem are not replayed and a policy does not repeat
        the decision that led here. The configuration (mesh, batch, codec) is
        the checkpoint's.
        """
        latest = self.checkpoints.latest_step()
        if latest is None:
            raise ValueError(
                "Rollback needs a checkpoint; set checkpoint_every or return Checkpoint() first"
            )
        t0 = time.perf_counter()
        self._pending = []  # metrics of steps being undone
        self._restore(latest, state_only=True)
        self.log.event(
            "rollback",
            step=self.step,
            latency_s=time.perf_counter() - t0,
            reason=reason,
            to_checkpoint=latest,
        )

    # ------------------------------------------------------------------ persistence
    def _meta(self) -> dict:
        return {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "nonfinite_count": self.nonfinite_count,
            "config": dataclasses.asdict(self.config),
            "hyperparams": dict(self._hyper_numeric),
            "data": self.data.state_dict(),
            "policy": json.loads(json.dumps(self.policy.state_dict())),
        }

    def _checkpoint_here(self) -> None:
        """Saves a checkpoint at the current step unless the latest one is already there."""
        self._drain()
        if self.checkpoints.latest_step() != self.step:
            self.save_checkpoint()

    def save_checkpoint(self) -> None:
        """Writes a consistent checkpoint (state, data cursor, config, policy state)."""
        self._drain()
        t0 = time.perf_counter()
        self.checkpoints.save(self.step, self.state, self._meta(), wait=False)
        self.log.event("checkpoint", step=self.step, latency_s=time.perf_counter() - t0)

    def _restore(self, step: int, *, state_only: bool = False) -> None:
        meta = self.checkpoints.read_meta(step)
        config = RunConfig(**meta["config"])
        if config.codec not in self._codecs:
            raise ValueError(
                f"the checkpoint was written with codec {config.codec!r}; pass that codec "
                "as codec= or inside a policy"
            )
        mesh = self._mesh(config.devices)
        target = abstract_state(self._model, self._tx(config.codec), mesh)
        self.state, meta = self.checkpoints.restore(step, target_state=target, mesh=mesh)
        self.config = config
        self._hyper_numeric.update({k: float(v) for k, v in meta["hyperparams"].items()})
        self._pending = []
        self._last_ready = None
        self._fresh_config = True
        if state_only:
            return
        self.step = int(meta["step"])
        self.samples_seen = int(meta["samples_seen"])
        self.nonfinite_count = int(meta["nonfinite_count"])
        self.data.load_state_dict(meta["data"])
        self.policy.load_state_dict(meta["policy"])

    def _resume_latest(self) -> None:
        t0 = time.perf_counter()
        step = self.checkpoints.latest_step()
        self._restore(step)
        self.log.truncate_metrics_after(step)
        self.log.event("resume", step=step, latency_s=time.perf_counter() - t0)
