"""Compiled steps keyed by :class:`adaptjax.RunConfig`: meshes, transformations, steps."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from adaptjax import policies as ajp
from adaptjax._accumulation import AccumulateState, accumulate, set_micro_steps
from adaptjax._chain import named_chain
from adaptjax._codec import GradientCodec
from adaptjax._config_meshes import build_mesh, check_shardings
from adaptjax._loss_scale import LossScaled, check_loss_scale_options, dynamic_loss_scale
from adaptjax._metrics import update_norm
from adaptjax._precision import Precision, check_precision, with_precision
from adaptjax._run_config import RunConfig, codec_key, controller_precision
from adaptjax._state import abstract_state, init_state, shape_struct, split_model
from adaptjax._step import DataParallelStep, data_parallel_step
from adaptjax._sync import sync_gradients
from adaptjax._transition import check_optimizer_sync
from adaptjax._walk import find_held
from adaptjax._wire import wire_bytes
from adaptjax.controller._hyperparams import injected_values, with_rate_factor
from adaptjax.sync._registry import register_strategies, resolve_sync, sync_key
from adaptjax.sync._ssgd import SSGD
from adaptjax.sync._strategy import pass_gradients

#: Names of the controller's chain; optimizer state is addressed by them, never by position.
SYNC, OPTIMIZER, UPDATE_NORM = "sync", "optimizer", "update_norm"
#: The strategy's model synchronisation (only for strategies with local models).
MODEL_SYNC = "model_sync"
#: Communication options a schedule may choose for a configuration's step.
STEP_OPTIONS = ("dense_lane", "bucket_bytes", "transport")


@dataclasses.dataclass
class StepCache:
    """Builds and remembers everything a :class:`RunConfig` needs to run a step.

    The transformation is ``optax.named_chain(("sync", sync_gradients(...)),
    ("optimizer", with_rate_factor(optimizer, learning_rate)), ("update_norm",
    update_norm()))``, so ``state.opt_state["optimizer"]`` is a
    :class:`~adaptjax.controller._hyperparams.RateFactorState` around the
    optimizer's state whatever else the chain holds (a policy's learning rate
    is its factor, or an ``inject_hyperparams`` value: see
    :mod:`adaptjax.controller._hyperparams`). Under a synchronisation strategy with
    local models (``RunConfig.sync``, see :class:`adaptjax.sync.SyncStrategy`) the
    chain is ``("sync", pass-through), ("optimizer", with_rate_factor(per-replica optimizer)),
    ("model_sync", the strategy's post step), ("update_norm", ...)``. With an
    optimizer that syncs the gradients itself (``optimizer_syncs``, e.g.
    ``compression.onebit_adam``) ``"sync"`` is a pass-through too: the
    optimizer's own collectives are the step's only ones (besides the
    non-finite guard's two scalars, then a collective of their own), and, as
    under local models, no monitor runs. Meshes
    are cached by shape (:attr:`RunConfig.mesh_shape`, or the device count of
    a 1-D mesh), transformations by codec and strategy key, compiled steps by
    the whole configuration: returning to a configuration seen before
    compiles nothing.

    On a sharded mesh (``RunConfig.mesh_shape`` with ``"fsdp"`` or
    ``"model"``), ``sharding`` (see :func:`adaptjax.param_specs`; ``None``:
    :class:`adaptjax.FSDP`) places the parameters and the state that follows
    them, for every state built here and every step.

    A configuration's ``precision`` (:attr:`RunConfig.precision`) is applied
    to the loss function by :func:`adaptjax.with_precision`, with ``decode``
    (a dataset's, e.g. :meth:`adaptjax.ArrayDataset.decode` for quantized
    input features) run first, inside the compiled step. Master weights and
    optimizer state are float32 in every precision: bfloat16 is another
    compiled step over the same state. float16 (whose gradients underflow
    without it) adds dynamic loss scaling: the ``"optimizer"`` link is
    wrapped in :func:`adaptjax.dynamic_loss_scale` (with the options in
    ``loss_scale``: ``initial_scale``, ``period``, ``factor``, ``min_scale``)
    and the step is built with it as ``loss_scale=``, so
    ``state.opt_state["optimizer"]`` is a ``LossScaleState``
    whose ``inner_state`` is the optimizer's state (readers look through it:
    :func:`adaptjax._loss_scale.split_loss_scale`); the step reports the
    metric ``loss_scale``.

    ``schedule`` (set by :meth:`adaptjax.costs.Planner.attach`) maps a
    configuration to its step's communication options (:data:`STEP_OPTIONS`):
    ``dense_lane`` (of :func:`adaptjax.sync_gradients`, without a codec),
    ``bucket_bytes`` and ``transport`` (fields of the codec, set on a copy of
    it). They change the step's collectives, never the state's structure, so
    states are built without them; each configuration's options are asked for once, when its
    step is first built, and kept in :attr:`options_of`. Without a schedule
    every step is built as before.

    With ``micro_batch_size`` set (:attr:`adaptjax.RunSpec.micro_batch_size`:
    :attr:`accumulates`) the chain is wrapped whole in
    :func:`adaptjax.accumulate`, so ``state.opt_state`` is an
    ``AccumulateState`` whose ``inner_state`` is the named chain's
    (:func:`chain_state` finds it either way). A configuration with a
    ``micro_batch`` (or, naming none, a numeric ``micro_batch_size``) runs the
    step compiled for one micro-batch (:meth:`compiled`): every batch that is a
    multiple of it runs the same program, :meth:`micro_steps` times per
    optimizer step, its number set in the state (:meth:`with_micro_steps`).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from adaptjax import RunConfig
      >>> from adaptjax.controller._step_cache import StepCache
      >>> cache = StepCache(model={"w": jnp.zeros(2)}, loss_fn=lambda p, b: 0.0,
      ...                   optimizer=optax.sgd(0.1))
      >>> state = cache.init_state(RunConfig(devices=2, batch_size=4))
      >>> list(state.opt_state)
      ['sync', 'optimizer', 'update_norm']
      >>> cache.step(RunConfig(2, 4)) is cache.step(RunConfig(2, 4))
      True
    """

    model: Any
    loss_fn: Callable[..., Any]
    optimizer: optax.GradientTransformation
    # the rate (or schedule) the optimizer was built with, when no inject_hyperparams holds it
    learning_rate: float | Callable[[Any], Any] | None = None
    monitors: Sequence[Any] = ()
    norm_chunks: int | None = None  # None: sync_gradients' default
    has_aux: bool = False
    codecs: dict[str | None, Any] = dataclasses.field(default_factory=lambda: {None: None})
    strategies: dict[str | None, Any] = dataclasses.field(default_factory=lambda: {None: SSGD()})
    schedule: Callable[[RunConfig], Mapping[str, Any]] | None = None
    decode: Callable[[Any], Any] | None = None  # the dataset's: batch codes -> features
    sharding: Any = None  # how parameters lie on a sharded mesh (None: adaptjax.FSDP())
    # dynamic_loss_scale's options for float16 steps (None: its defaults)
    loss_scale: Mapping[str, Any] | None = None
    # RunSpec.micro_batch_size: set, the chain is in adaptjax.accumulate; a number, the
    # micro-batch of a configuration that names none (RunConfig.micro_batch)
    micro_batch_size: int | str | None = None
    # the optimizer syncs the gradients itself (adaptjax._codec.syncs_itself): "sync" passes
    # each replica's gradient through, and neither a codec nor local models can join it
    optimizer_syncs: bool = False

    def __post_init__(self) -> None:
        self.loss_scale = check_loss_scale_options(self.loss_scale, "loss_scale")
        self.options_of: dict[RunConfig, dict[str, Any]] = {}
        self._meshes: dict[tuple, Any] = {}
        # each chain with its dynamic_loss_scale link (None: not loss-scaled)
        self._txs: dict[tuple, tuple[optax.GradientTransformation, LossScaled | None]] = {}
        self._steps: dict[RunConfig, DataParallelStep] = {}
        self._wire: dict[RunConfig, float | None] = {}
        self._memory: dict[RunConfig, tuple[int, int] | None] = {}
        # The controller's background compiles build through here too: one builder at a time.
        self._lock = threading.RLock()

    def add_codec(self, codec) -> str | None:
        """Registers ``codec`` (if new) and returns its key."""
        key = codec_key(codec)
        self.codecs.setdefault(key, codec)
        return key

    def add_sync(self, strategy) -> str | None:
        """Registers ``strategy`` (a strategy, a name or ``None``) and returns its key."""
        strategy = resolve_sync(strategy)
        key = sync_key(strategy)
        self.strategies.setdefault(key, strategy)
        return key

    def strategy(self, key: str | None):
        if key not in self.strategies:
            raise ValueError(
                f"sync strategy {key!r} is not known to this controller; pass it as sync= "
                "or inside a policy (e.g. SwitchSync(strategy))"
            )
        return self.strategies[key]

    def mesh(self, config: RunConfig | int):
        """``config``'s mesh (an int: the 1-D mesh of that many devices), built once."""
        if not isinstance(config, RunConfig):
            config = RunConfig(config, config)
        key = (config.devices, config.mesh_shape)
        with self._lock:
            if key not in self._meshes:
                self._meshes[key] = build_mesh(config)
            return self._meshes[key]

    def check_mesh(self, config: RunConfig, what: str = "") -> None:
        """A one-line ``ValueError`` (starting with ``what``) unless the model's shardings fit
        ``config``'s mesh (:func:`check_shardings`); nothing is compiled or placed."""
        check_shardings(self.model, config, self.sharding, what=what)

    def options(self, config: RunConfig) -> dict[str, Any]:
        """The communication options of ``config``'s step (``{}`` without a schedule)."""
        with self._lock:
            return self._options(config)

    def _options(self, config: RunConfig) -> dict[str, Any]:
        if config not in self.options_of:
            chosen = dict(self.schedule(config)) if self.schedule is not None else {}
            unknown = sorted(set(chosen) - set(STEP_OPTIONS))
            if unknown:
                raise ValueError(
                    f"schedule returned unknown step options {unknown}; use {STEP_OPTIONS}"
                )
            self.options_of[config] = chosen
        return self.options_of[config]

    def injected_values(self) -> dict[str, float]:
        """The numeric hyperparameters the optimizer's ``inject_hyperparams`` states start with."""
        return injected_values(self.optimizer, split_model(self.model)[1])

    def param_leaves(self) -> list[tuple[tuple[int, ...], Any]]:
        """``(shape, dtype)`` of each trained parameter (= gradient) leaf, in tree order."""
        params = split_model(self.model)[1]
        return [(tuple(np.shape(x)), np.dtype(x.dtype)) for x in jax.tree.leaves(params)]

    def tx(
        self, key: str | None, sync: str | None = None, precision: str | None = None,
        **options: Any,
    ) -> optax.GradientTransformation:
        """The chain for codec ``key``, strategy ``sync`` and ``precision`` (a
        :attr:`RunConfig.precision`: float16's chain is loss-scaled), with
        communication ``options``."""
        with self._lock:
            return self._tx(key, sync, precision, **options)[0]

    def loss_scaled(self, config: RunConfig) -> LossScaled | None:
        """The :func:`adaptjax.dynamic_loss_scale` link of ``config``'s chain (float16), or
        ``None``; built once, with the chain."""
        with self._lock:
            return self._tx(config.codec, config.sync, config.precision)[1]

    def _tx(self, key: str | None, sync: str | None, precision: str | None, **options: Any):
        defaults = {"dense_lane": "all-reduce", "bucket_bytes": None, "transport": None}
        options = {k: v for k, v in options.items() if defaults.get(k, ...) != v}
        scaled = Precision.of(precision).needs_loss_scale
        cache = (key, sync, scaled, *sorted(options.items()))
        if cache not in self._txs:
            if key not in self.codecs:
                raise ValueError(
                    f"codec {key!r} is not known to this controller; pass it as codec= "
                    "or inside a policy (e.g. SwitchCompression(codec))"
                )
            strategy = self.strategy(sync)
            codec = self.codecs[key]
            strategy.check(2, codec)
            lane = {"dense_lane": options["dense_lane"]} if "dense_lane" in options else {}
            fields = {k: options[k] for k in ("bucket_bytes", "transport")
                      if options.get(k) is not None}
            if fields and codec is not None:
                codec = dataclasses.replace(codec, **fields)
            rate = self.learning_rate
            if self.optimizer_syncs:  # its own collectives alone (precompile(codec=...) too)
                check_optimizer_sync(codec, strategy, action=True)
            if not strategy.local_models:
                chunks = {} if self.norm_chunks is None else {"norm_chunks": self.norm_chunks}
                pre = pass_gradients() if self.optimizer_syncs else sync_gradients(
                    "data", codec=codec, monitors=self.monitors, **chunks, **lane
                )
                parts = [(SYNC, pre), (OPTIMIZER, with_rate_factor(self.optimizer, rate))]
            else:
                parts = [
                    (SYNC, strategy.pre("data")),
                    (OPTIMIZER, with_rate_factor(strategy.optimizer(self.optimizer), rate)),
                    (MODEL_SYNC, strategy.post("data", codec=codec)),
                ]
            scale = None
            if scaled:  # around the optimizer link alone: the guard still rides the sync
                scale = dynamic_loss_scale(parts[1][1], **(self.loss_scale or {}))
                parts[1] = (OPTIMIZER, scale)
            tx = named_chain(*parts, (UPDATE_NORM, update_norm()))
            if self.accumulates:  # the whole chain, its collectives too
                tx = accumulate(tx)
            self._txs[cache] = tx, scale
        return self._txs[cache]

    def check_precision(self, precision) -> str | None:
        """The :attr:`RunConfig.precision` of ``precision``, checked for this model.

        A one-line ``ValueError`` for an unknown precision or what
        ``check_precision`` refuses (float16 and a parameter
        beyond its range); nothing is compiled.
        """
        key = controller_precision(precision)
        check_precision(Precision.of(key), self.model, self.tx(None, precision=key))
        return key

    def start(self, config: RunConfig, data, precision) -> RunConfig:
        """A run's first ``config`` in ``precision`` (``check_precision``), for ``data``.

        Takes the dataset's ``decode`` (an :class:`adaptjax.ArrayDataset` with
        quantized ``features``): every step then decodes its batch inside the
        compiled program, and only the codes cross host -> device. On a sharded
        mesh the model's shardings are checked against it (:meth:`check_mesh`).
        """
        self.decode = getattr(data, "decode", None)
        self.check_mesh(config)
        return config.replace(precision=self.check_precision(precision))

    def loss(self, config: RunConfig) -> Callable[..., Any]:
        """The loss ``config``'s step differentiates: decode, then cast to its precision."""
        return with_precision(self.loss_fn, config.precision, decode=self.decode)

    @property
    def accumulates(self) -> bool:
        """Whether the chain is in :func:`adaptjax.accumulate` (``micro_batch_size`` set)."""
        return self.micro_batch_size is not None

    def compiled(self, config: RunConfig) -> RunConfig:
        """The configuration ``config``'s program is compiled for: ``config`` itself, or
        with a micro-batch (:meth:`micro_batch`), ``config`` at a batch of one micro-batch."""
        micro = self.micro_batch(config)
        return config if micro is None else config.replace(batch_size=micro, micro_batch=None)

    def micro_batch(self, config: RunConfig) -> int | None:
        """The samples of one call at ``config``: its ``micro_batch``, else a numeric
        ``micro_batch_size`` (a configuration built without one: a planner's, an older
        checkpoint's), else ``None`` (the whole batch)."""
        fixed = self.micro_batch_size if isinstance(self.micro_batch_size, int) else None
        return config.micro_batch if config.micro_batch is not None else fixed

    def micro_steps(self, config: RunConfig) -> int:
        """Calls of the compiled step per optimizer step at ``config``."""
        micro = self.micro_batch(config)
        return 1 if micro is None else config.batch_size // micro

    def with_micro_steps(self, state, config: RunConfig):
        """``state`` set to take ``config``'s batch in :meth:`micro_steps` micro-steps
        (:func:`adaptjax.set_micro_steps`: no compile); as it is without ``accumulates``."""
        if not self.accumulates:
            return state
        k = self.micro_steps(config)
        return dataclasses.replace(state, opt_state=set_micro_steps(state.opt_state, k))

    def step(self, config: RunConfig) -> DataParallelStep:
        """The compiled step of ``config`` (built once per :meth:`compiled` configuration)."""
        config = self.compiled(config)
        with self._lock:
            if config not in self._steps:
                tx, scale = self._tx(
                    config.codec, config.sync, config.precision, **self._options(config)
                )
                self._steps[config] = data_parallel_step(
                    self.loss(config),
                    tx,
                    self.mesh(config),
                    microbatches=config.microbatches,
                    has_aux=self.has_aux,
                    sync=self.strategy(config.sync),
                    sharding=self.sharding,
                    loss_scale=scale,  # float16: the chain's dynamic_loss_scale link
                )
            return self._steps[config]

    def has_run(self, config: RunConfig) -> bool:
        """Whether a step of ``config`` has been called (so its program is compiled)."""
        with self._lock:
            step = self._steps.get(self.compiled(config))
        return step is not None and step.jitted._cache_size() > 0

    def init_state(self, config: RunConfig):
        """A fresh train state for ``config`` (its structure follows codec, sync, precision)."""
        state = init_state(
            self.model, self.tx(config.codec, config.sync, config.precision),
            self.mesh(config), sharding=self.sharding,
        )
        return self.with_micro_steps(state, config)

    def abstract_state(self, config: RunConfig):
        """:meth:`init_state` as ``ShapeDtypeStruct``s with shardings: a restore's target."""
        return abstract_state(
            self.model, self.tx(config.codec, config.sync, config.precision),
            self.mesh(config), sharding=self.sharding,
        )

    def abstract_args(self, config: RunConfig, data):
        """The step's ``(state, batch)`` at ``config`` as ``ShapeDtypeStruct``s (no arrays)."""
        batch = jax.tree.map(shape_struct, data.batch_at(0, self.compiled(config).batch_size))
        return self.abstract_state(config), batch

    def compile(self, config: RunConfig, data=None, *, args=None) -> float:
        """Compiles ``config``'s step ahead of time; returns the seconds it took.

        ``args``: the step's ``(state, batch)`` structs (:meth:`abstract_args`),
        so that another thread can compile without touching the model or ``data``.
        """
        t0 = time.perf_counter()
        if args is None:
            args = self.abstract_args(config, data)
        use = _memory_use(self.step(config).jitted.lower(*args).compile())
        if use is not None:
            with self._lock:
                self._memory.setdefault(self.compiled(config), use)
        return time.perf_counter() - t0

    def memory(self, config: RunConfig, data) -> tuple[int, int] | None:
        """``(bytes, temporaries)`` a device holds while running :meth:`compiled` ``config``'s
        step, by XLA's memory analysis of the compiled program (bytes: arguments + outputs -
        aliased + temporaries); kept from :meth:`compile`, else it compiles the program
        ahead to read it (``data``: ``batch_at``). ``None`` where XLA gives no analysis."""
        config = self.compiled(config)
        with self._lock:
            if config not in self._memory:  # compiled by jit's dispatch: compile to read it
                args = self.abstract_args(config, data)
                self._memory[config] = _memory_use(self.step(config).jitted.lower(*args).compile())
            return self._memory[config]

    def wire_total(self, config: RunConfig, data) -> float | None:
        """Bytes each device sends per step at ``config`` (from the HLO), cached.

        With a ``micro_batch``, those of the compiled micro-step: its
        gradient collectives run once per optimizer step (on the last
        micro-step); only the non-finite guard's two scalars cross on every
        micro-step, which this leaves out.
        """
        config = self.compiled(config)
        if config not in self._wire:
            total = None
            if hasattr(data, "batch_at"):
                args = self.abstract_args(config, data)
                report = wire_bytes(self.step(config).jitted, *args)
                total = self.strategy(config.sync).amortised_bytes(report)
            self._wire[config] = total
        return self._wire[config]


def _memory_use(compiled) -> tuple[int, int] | None:
    """``(bytes, temporaries)`` per device of a compiled program (XLA's memory analysis;
    ``None`` on a backend that gives none)."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes)
    return int(total), int(m.temp_size_in_bytes)


def chain_state(opt_state):
    """The controller's named chain's state (by link name: ``"sync"``, ``"optimizer"``, ...).

    ``opt_state`` itself, or under ``RunSpec.micro_batch_size`` the ``inner_state`` of
    the :func:`adaptjax.accumulate` around the chain.
    """
    return opt_state.inner_state if isinstance(opt_state, AccumulateState) else opt_state


def with_chain_state(opt_state, links):
    """``opt_state`` with ``links`` as its named chain's state (see :func:`chain_state`)."""
    if isinstance(opt_state, AccumulateState):
        return opt_state._replace(inner_state=links)
    return links


def register_held(steps: StepCache, codec, sync, policies) -> None:
    """Registers the run's ``codec`` and ``sync`` and those ``policies`` hold, in ``steps``.

    E.g. ``SwitchCompression.codec`` or ``SwitchSync``'s strategy: a checkpoint
    names them by key, and a resume finds the objects here.
    """
    steps.add_codec(codec)
    held = find_held(
        list(policies),
        lambda o: isinstance(o, ajp.SetCodec)
        or (isinstance(o, GradientCodec) and not isinstance(o, type)),
        max_depth=4,
    )
    for o in held:
        obj = o.codec if isinstance(o, ajp.SetCodec) else o
        if obj is not None:
            steps.codecs[codec_key(obj)] = obj  # the policy's own object
    steps.add_sync(sync)
    register_strategies(list(policies), steps)


def comm_seconds(steps: StepCache, data, bandwidth: float | None, config: RunConfig):
    """Modelled seconds per step on a link of ``bandwidth`` bytes/s: HLO bytes per device / it.

    ``None`` without a bandwidth or when the step's bytes cannot be read (no ``batch_at``).
    """
    if bandwidth is None:
        return None
    total = steps.wire_total(config, data)
    return None if total is None else total / float(bandwidth)
