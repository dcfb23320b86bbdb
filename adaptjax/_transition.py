"""What a decision asks for: actions folded into one transition, before anything runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from adaptjax import policies as ajp
from adaptjax._config_meshes import describe, rescale_target
from adaptjax._run_config import (
    RunConfig,
    codec_key,
    controller_precision,
    round_batch,
)
from adaptjax.policies._policy import validate_actions
from adaptjax.sync._registry import resolve_sync, sync_key

_KEEP = object()  # "SetCodec was not asked for" (None means: back to a dense sync)


@dataclasses.dataclass(frozen=True)
class Transition:
    """A decision's actions folded into the changes they ask for, in the order they run.

    Carried out as: ``rollback`` -> ``hyperparams`` -> ``codec`` and ``sync``
    (one rebuild of the state when the strategy changes) -> ``precision``
    (another compiled step over the same float32 state; into float16 the
    optimizer state is wrapped in a fresh loss scale, out of it unwrapped and
    the scale dropped) -> the new
    ``config`` (batch, micro-batches, devices and mesh shape; a new mesh goes
    through a checkpoint that records ``config`` as the configuration the run
    continues in) -> ``checkpoint`` -> ``probe`` (branches trained from the
    state the run continues with, which they leave untouched; see
    :mod:`adaptjax.controller._probe_branch`) -> ``stop``. When two actions ask
    for the same thing, the later one wins; hyperparameter updates merge.

    Attributes:
      config: the configuration to continue in.
      requested_batch: the batch asked for when rounding changed it, else ``None``.
      hyperparams: hyperparameter values to write into the optimizer state.
      codec: the codec object to switch to (``None``: dense) when ``codec_changed``.
      codec_changed: whether the codec changes.
      sync: the :class:`adaptjax.sync.SyncStrategy` to switch to when ``sync_changed``.
      sync_changed: whether the synchronisation strategy changes.
      precision_changed: whether the precision changes (``config.precision``
        is the new one's key, ``None`` for float32).
      rollback: the reason of a ``Rollback``, or ``None``.
      checkpoint: whether a ``Checkpoint`` was asked for.
      probe: the :class:`adaptjax.policies.Probe` to run, or ``None``.
      stop: the reason of a ``Stop``, or ``None``.

    Example:
      >>> from adaptjax import RunConfig, policies as ajp
      >>> from adaptjax._transition import plan_transition
      >>> t = plan_transition([ajp.Rescale(devices=3), ajp.SetBatchSize(64)],
      ...                     RunConfig(devices=8, batch_size=32), max_devices=8)
      >>> t.config.devices, t.config.batch_size, t.requested_batch
      (3, 63, 64)
      >>> t = plan_transition([ajp.SetPrecision("bfloat16")], t.config, max_devices=8)
      >>> t.config.precision, t.precision_changed
      ('bfloat16', True)
    """

    config: RunConfig
    requested_batch: int | None = None
    hyperparams: dict = dataclasses.field(default_factory=dict)
    codec: object = None
    codec_changed: bool = False
    sync: object = None
    sync_changed: bool = False
    precision_changed: bool = False
    rollback: str | None = None
    checkpoint: bool = False
    probe: ajp.Probe | None = None
    stop: str | None = None


def plan_transition(
    actions: Sequence[ajp.Action],
    config: RunConfig,
    *,
    max_devices: int,
    hyperparam_names: Sequence[str] | None = None,
    strategies: Mapping[str | None, object] | None = None,
    min_samples: int = 1,
    min_replicas: int = 1,
    device_limit: int | None = None,
    check_mesh: Callable[[RunConfig, str], None] | None = None,
    micro_batch_size: int | str | None = None,
    optimizer_syncs: bool = False,
) -> Transition:
    """Folds ``actions`` into one :class:`Transition` from ``config``; checks every request.

    Raises a one-line ``ValueError`` (before anything is carried out) for more
    devices than ``max_devices`` or a hyperparameter the optimizer does not
    have (when ``hyperparam_names`` is given) or a learning rate <= 0, for an
    unknown precision (:func:`controller_precision`), and for
    a synchronisation strategy that cannot run in the new configuration
    (gossip on one replica, a codec the strategy cannot carry); ``strategies``
    maps the current config's sync key to its strategy (``None``: S-SGD).

    ``min_samples`` and ``min_replicas``: the gradient samples (replicas x
    micro-batches) and replicas per step the monitors need (see
    :func:`monitor_sample_needs`). Landing on fewer devices than
    ``min_samples`` splits the batch into that many micro-batches, and leaving
    such a configuration (for at least ``min_samples`` devices) takes the
    split back, unless an action set the micro-batches; fewer replicas than
    ``min_replicas``, or micro-batches set too few, raise.

    A ``Rescale`` sets the replicas (``devices``, the ``"data"`` axis) and,
    on a sharded mesh, the other axes (:func:`rescale_target`): a mesh of more
    than ``device_limit`` devices raises, and ``check_mesh(config, what)``
    (the step cache's) raises when the model's shardings cannot take the new
    shape, naming the leaf.

    ``micro_batch_size`` (:attr:`adaptjax.RunSpec.micro_batch_size`): every
    step is whole micro-batches of it (the new config's ``micro_batch``), each
    split over the replicas; a batch that is not a multiple of it, or
    replicas x micro-batches that do not divide it, raise
    (:func:`check_micro_batch`) instead of being rounded. ``"auto"``: the
    ``micro_batch`` in force is kept while the step's shape stays, and is
    ``None`` (the whole batch) when it changes; the controller then chooses it.

    ``optimizer_syncs``: the optimizer syncs the gradients itself
    (:func:`adaptjax._codec.syncs_itself`), so a codec or a strategy with local
    models raises (:func:`check_optimizer_sync`).
    """
    asked = _fold(actions, config)
    devices = asked.devices
    _check_devices(devices, max_devices, min_replicas)
    micro = _microbatches(asked, config, min_samples)
    hyper = asked.hyperparams
    if hyperparam_names is not None:
        unknown = sorted(set(hyper) - set(hyperparam_names))
        if unknown:
            raise ValueError(
                f"the optimizer does not expose the hyperparameter {unknown[0]!r}; it exposes "
                f"{sorted(hyperparam_names)} (build it with optax.inject_hyperparams to expose "
                "its arguments, or pass RunSpec(learning_rate=...) for the rate)"
            )
    if "learning_rate" in hyper and not hyper["learning_rate"] > 0:
        raise ValueError(f"learning_rate must be > 0, got {hyper['learning_rate']}")
    codec = asked.codec
    codec_changed = codec is not _KEEP and codec_key(codec) != config.codec
    sync, sync_changed = _sync(asked, config, devices, strategies)
    if optimizer_syncs:
        check_optimizer_sync(None if codec is _KEEP else codec, sync, action=True)
    precision = (
        config.precision if asked.precision is _KEEP else controller_precision(asked.precision)
    )
    wanted = config.batch_size if asked.batch is None else asked.batch
    fixed = isinstance(micro_batch_size, int)
    if fixed:  # whole micro-batches: nothing to round
        check_micro_batch(wanted, micro_batch_size, devices, micro)
    rounded = round_batch(wanted, devices, micro)
    new = config.replace(
        devices=devices,
        mesh_shape=asked.mesh_shape,
        batch_size=rounded,
        microbatches=micro,
        codec=codec_key(codec) if codec_changed else config.codec,
        sync=sync_key(sync) if sync_changed else config.sync,
        precision=precision,
        micro_batch=micro_batch_size if fixed else None,
    )
    if micro_batch_size == "auto" and new == config.replace(micro_batch=None):
        new = config  # the same step: the same program and micro-steps
    _check_mesh(config, new, device_limit, check_mesh)
    return Transition(
        config=new,
        requested_batch=wanted if rounded != wanted else None,
        hyperparams=hyper,
        codec=None if codec is _KEEP else codec,
        codec_changed=codec_changed,
        sync=sync if sync_changed else None,
        sync_changed=sync_changed,
        precision_changed=precision != config.precision,
        rollback=asked.rollback,
        checkpoint=asked.checkpoint,
        probe=asked.probe,
        stop=asked.stop,
    )


@dataclasses.dataclass
class _Asked:
    """What a decision's actions ask for, before any check (``_KEEP``: not asked)."""

    devices: int
    mesh_shape: tuple | None
    microbatches: int
    microbatches_set: bool = False
    batch: int | None = None
    hyperparams: dict = dataclasses.field(default_factory=dict)
    codec: object = _KEEP
    sync: object = _KEEP
    precision: object = _KEEP
    rollback: str | None = None
    checkpoint: bool = False
    probe: ajp.Probe | None = None
    stop: str | None = None


def _fold(actions: Sequence[ajp.Action], config: RunConfig) -> _Asked:
    """Folds ``actions`` in order: the later one wins; hyperparameter updates merge."""
    asked = _Asked(
        devices=config.devices, mesh_shape=config.mesh_shape, microbatches=config.microbatches
    )
    for action in validate_actions(list(actions)):
        if isinstance(action, ajp.SetHyperparams):
            asked.hyperparams.update({k: float(v) for k, v in action.values.items()})
        elif isinstance(action, ajp.SetBatchSize):
            asked.batch = int(action.batch_size)
            if action.microbatches is not None:
                asked.microbatches, asked.microbatches_set = int(action.microbatches), True
        elif isinstance(action, ajp.Rescale):
            asked.devices, asked.mesh_shape = rescale_target(action, config)
        elif isinstance(action, ajp.SetCodec):
            asked.codec = action.codec
        elif isinstance(action, ajp.SetSync):
            asked.sync = resolve_sync(action.strategy)
        elif isinstance(action, ajp.SetPrecision):
            asked.precision = action.precision
        elif isinstance(action, ajp.Checkpoint):
            asked.checkpoint = True
        elif isinstance(action, ajp.Stop):
            asked.stop = action.reason or "stopped by a policy"
        elif isinstance(action, ajp.Rollback):
            asked.rollback = action.reason or "rollback"
        elif isinstance(action, ajp.Probe):
            asked.probe = action
    return asked


def _check_devices(devices: int, max_devices: int, min_replicas: int) -> None:
    if devices > max_devices:
        raise ValueError(
            f"cannot rescale to {devices} devices: max_devices is {max_devices}; "
            f"use devices <= {max_devices}"
        )
    if devices < min_replicas:
        raise ValueError(
            f"cannot rescale to {devices} device(s): the noise scale's preconditioned "
            f"norms need {min_replicas} replicas; use GradientNoiseScale(differencing=True) "
            "to measure on one device"
        )


def _check_mesh(config: RunConfig, new: RunConfig, device_limit, check_mesh) -> None:
    """The new mesh fits the job's devices and the model's shardings (one-line errors)."""
    if (new.devices, new.mesh_shape) == (config.devices, config.mesh_shape):
        return
    if device_limit is not None and new.device_count > device_limit:
        raise ValueError(
            f"cannot rescale to {describe(new)}: it needs {new.device_count} devices and the job "
            f"has {device_limit}; use a shape whose sizes multiply to at most {device_limit}"
        )
    if check_mesh is not None and new.mesh_shape is not None:
        check_mesh(new, f"Rescale to a shape the model's shardings cannot take ({new.axes}): ")


def _microbatches(asked: _Asked, config: RunConfig, min_samples: int) -> int:
    """The micro-batches that give the monitors ``min_samples`` gradient samples per step."""
    devices, micro = asked.devices, asked.microbatches
    split = sample_split(min_samples, devices)
    if devices * micro < min_samples:
        if asked.microbatches_set:
            raise ValueError(
                f"microbatches={micro} on {devices} device(s) gives the noise scale "
                f"{devices * micro} gradient sample(s) per step; use microbatches >= "
                f"{split} or GradientNoiseScale(differencing=True)"
            )
        return split
    if (
        not asked.microbatches_set
        and config.devices < min_samples <= devices
        and micro == sample_split(min_samples, config.devices)
    ):
        return 1  # the split was for the sample count alone
    return micro


def _sync(asked: _Asked, config: RunConfig, devices: int, strategies) -> tuple[object, bool]:
    """``(strategy, changed)`` after the transition, checked on ``devices`` with its codec."""
    sync = asked.sync
    changed = sync is not _KEEP and sync_key(sync) != config.sync
    if sync is _KEEP:
        known = strategies or {}
        sync = resolve_sync(known.get(config.sync) if config.sync in known else None)
        if config.sync is not None and config.sync not in known:
            sync = None  # unknown here: its checks ran when it was chosen
    codec = asked.codec
    has_codec = (codec is not None) if codec is not _KEEP else config.codec is not None
    if sync is not None:  # a strategy already (resolve_sync returns one as it is)
        resolve_sync(sync).check(devices, object() if has_codec else None)
    return sync, changed


def check_optimizer_sync(codec, sync, *, action: bool) -> None:
    """One-line ``ValueError`` when an optimizer that syncs the gradients itself (such as
    ``adaptjax.compression.onebit_adam``) would run with a codec or a strategy with local
    models (``action``: asked for by ``SetCodec``/``SetSync``, else by the ``RunSpec``).

    Example:
      >>> from adaptjax import compression as ajc
      >>> from adaptjax._transition import check_optimizer_sync
      >>> check_optimizer_sync(None, None, action=True)
      >>> check_optimizer_sync(ajc.bf16(), None, action=True)
      Traceback (most recent call last):
      ...
      ValueError: SetCodec(bf16()) cannot run with an optimizer that syncs the gradients itself (such as adaptjax.compression.onebit_adam): the gradients would be synced twice; keep codec None while it runs
    """  # noqa: E501
    if codec is not None:
        key = codec_key(codec)
        name, field = (f"SetCodec({key})", "keep codec None while it runs") if action else (
            f"codec={key}", "drop codec=")
    elif sync is not None and resolve_sync(sync).local_models:
        key = sync_key(sync)
        name, field = (f"SetSync({key})", "keep S-SGD while it runs") if action else (
            f"sync={key}", "drop sync=")
    else:
        return
    raise ValueError(
        f"{name} cannot run with an optimizer that syncs the gradients itself (such as "
        f"adaptjax.compression.onebit_adam): the gradients would be synced twice; {field}")


def check_micro_batch(batch_size: int, micro_batch_size: int, devices: int,
                      microbatches: int) -> None:
    """One-line ``ValueError`` unless ``batch_size`` is whole micro-batches of
    ``micro_batch_size`` and each micro-batch splits over ``devices`` x ``microbatches``.

    Example:
      >>> from adaptjax._transition import check_micro_batch
      >>> check_micro_batch(96, 32, 8, 1)
      >>> check_micro_batch(80, 32, 8, 1)
      Traceback (most recent call last):
      ...
      ValueError: batch_size 80 is not a multiple of RunSpec.micro_batch_size 32: a step accumulates whole micro-batches; use a multiple of 32 (a batch-size policy: multiple_of=32)
    """  # noqa: E501
    if batch_size % micro_batch_size:
        raise ValueError(
            f"batch_size {batch_size} is not a multiple of RunSpec.micro_batch_size "
            f"{micro_batch_size}: a step accumulates whole micro-batches; use a multiple of "
            f"{micro_batch_size} (a batch-size policy: multiple_of={micro_batch_size})")
    unit = devices * microbatches
    if micro_batch_size % unit:
        raise ValueError(
            f"RunSpec.micro_batch_size {micro_batch_size} does not split over replicas x "
            f"microbatches = {devices} x {microbatches}; use a micro_batch_size that is a "
            f"multiple of {unit}")


def monitor_sample_needs(monitors) -> tuple[int, int]:
    """``(min_samples, min_replicas)`` per step for ``monitors`` to measure.

    A :class:`adaptjax.GradientNoiseScale` (or :class:`adaptjax.GradientSNR`)
    without ``differencing`` needs two gradient samples per step (replicas x
    micro-batches); preconditioned, two replicas. Other monitors need one.

    Example:
      >>> import adaptjax
      >>> from adaptjax._transition import monitor_sample_needs
      >>> monitor_sample_needs([adaptjax.GradientNoiseScale(), adaptjax.GradientNorm()])
      (2, 1)
      >>> monitor_sample_needs([adaptjax.GradientSNR(differencing=True)])
      (1, 1)
    """
    samples = replicas = 1
    for m in monitors:
        if getattr(m, "differencing", True) is False:
            samples = 2
            if getattr(m, "preconditioned", False):
                replicas = 2
    return samples, replicas


def sample_split(min_samples: int, devices: int) -> int:
    """The micro-batches that give ``devices`` replicas ``min_samples`` gradient samples."""
    return -(-min_samples // devices)


def one_gradient_sample(devices: int, microbatches: int) -> bool:
    """Whether a step has one gradient sample (one device, no micro-batches).

    The :class:`adaptjax.Controller`'s default noise scale then differences
    consecutive steps' gradients.
    """
    return devices == 1 and microbatches == 1
