"""A controller's arguments, every one checked before anything touches the disk.

:func:`check_arguments` takes what was passed to :class:`adaptjax.Controller`
and returns it checked (:class:`Checked`), or raises the first problem as a
one-line ``ValueError`` naming the fix, in the order the arguments are read:
the configuration, the devices, the options, the hyperparameters, the model,
the data (and the loss on the shapes of its batches), the run directory, the
monitors. It writes nothing and compiles nothing.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import traceback
import warnings
from collections.abc import Mapping

import jax
import numpy as np
import optax

from adaptjax import policies as ajp
from adaptjax._codec import syncs_itself
from adaptjax._config_meshes import job_devices, start_shape
from adaptjax._data import check_count
from adaptjax._mesh import make_mesh
from adaptjax._monitors import GradientNoiseScale, GradientNorm, GradientSNR
from adaptjax._run_config import RunConfig, codec_key
from adaptjax._state import merge_model, split_model
from adaptjax._transition import (
    check_micro_batch,
    check_optimizer_sync,
    monitor_sample_needs,
    one_gradient_sample,
    sample_split,
)
from adaptjax._tree import check_float_tree
from adaptjax._walk import find_held
from adaptjax.controller._hooks import Evaluate, Hook, check_hooks
from adaptjax.controller._options import check_cache_dir
from adaptjax.controller._plan_probe import PlanRequest, plan_request
from adaptjax.controller._run_dir import (
    CHECKPOINTS,
    check_resumable,
    check_writable_run_dir,
    user_stacklevel,
)
from adaptjax.controller._run_lock import RunLock
from adaptjax.controller._spec import RunSpec
from adaptjax.launch._distributed import can_give, is_primary
from adaptjax.policies._policy import required_metrics
from adaptjax.sync._registry import resolve_sync, sync_key


@dataclasses.dataclass(frozen=True)
class Checked:
    """A controller's arguments after :func:`check_arguments`."""

    spec: RunSpec
    resume: bool
    config: RunConfig
    max_devices: int
    policy: ajp.Policy
    policies: list[ajp.Policy]
    hooks: list[Hook]
    monitors: tuple
    sample_needs: tuple[int, int]  # (min_samples, min_replicas): monitor_sample_needs
    plan: PlanRequest | None
    # whether announced configurations are compiled in the background: asked for, on one
    # process, with a dataset that gives a batch's shapes without reading it (batch_at)
    compile_ahead: bool
    device_limit: int = 1  # the devices the job may have (a mesh of more is refused)
    # the optimizer syncs the gradients itself (onebit_adam): no sync link, no monitors
    optimizer_syncs: bool = False


class NoPolicy(ajp.Policy):
    """What runs when no policy is given: decides nothing."""

    def decide(self, metrics, ctx):
        return []


def check_arguments(model, loss_fn, optimizer, data, spec: RunSpec, hooks,
                    resume: bool) -> Checked:
    """Checks :class:`adaptjax.Controller`'s arguments; writes nothing, compiles nothing.

    Under ``adaptjax plan`` (:func:`plan_request`) the run directory is the
    plan's, the run starts fresh, has no hooks (no progress bar, TensorBoard
    or evaluation) and checkpoints only when a probe needs it.
    """
    if not isinstance(spec, RunSpec):
        raise ValueError(f"spec must be an adaptjax.RunSpec, got {type(spec).__name__}")
    hooks = check_hooks(hooks)
    plan = plan_request()
    if plan is not None:  # write only into the plan directory, start fresh, time steps only
        spec = spec.replace(run_dir=plan.run_dir,
                            checkpoint=dataclasses.replace(spec.checkpoint, every=None))
        resume, hooks = False, []
    devices, mesh_shape = start_shape(spec.devices, spec.mesh_shape)
    resolve_sync(spec.sync).check(devices, spec.codec)
    batch_size, microbatches = spec.batch_size, spec.microbatches
    fixed = spec.micro_batch_size if isinstance(spec.micro_batch_size, int) else None
    per_call = fixed or batch_size  # the samples of one compiled step ("auto": whole at first)
    if microbatches is None:
        one_even = devices == 1 and isinstance(per_call, int) and per_call % 2 == 0
        microbatches = 2 if one_even else 1
    if fixed is not None:
        check_micro_batch(batch_size, fixed, devices, microbatches)
    config = RunConfig(devices, batch_size, microbatches, codec_key(spec.codec),
                       sync_key(spec.sync), mesh_shape=mesh_shape, micro_batch=fixed)
    max_devices = check_devices(config, spec.max_devices, resume)
    check_cache_dir(spec.compile.cache_dir, "CompileOptions.cache_dir")
    check_optimizer(optimizer, spec.learning_rate)
    check_float_tree(split_model(model)[1], "parameters")
    optimizer_syncs = check_optimizer_syncs(optimizer, model, spec)
    check_data(data)
    check_loss_signature(loss_fn)
    if hasattr(data, "batch_at") and not resume:
        # On resume: once the checkpoint's model was checked (resume_from); datasets without
        # batch_at: on their first batch (the controller's _first_checked).
        rows = replica_rows(config)
        check_loss_shapes(model, loss_fn, data.batch_at(0, rows), rows, spec.has_aux)
    check_run_dir(os.fspath(spec.run_dir), resume)
    policies = list(spec.policies)
    policy = ajp.any_of(*policies) if policies else NoPolicy()
    monitors = () if optimizer_syncs else check_monitors(spec.monitors, devices, microbatches,
                                                         resume)
    evaluates = any(isinstance(h, Evaluate) for h in hooks)
    warn_unproducible_metrics(policy, monitors, spec.link_bandwidth, evaluates)
    warn_unreachable_schedules(policies, max_devices)
    return Checked(
        spec=spec, resume=resume, config=config, max_devices=max_devices, policy=policy,
        policies=policies, hooks=hooks, monitors=monitors,
        sample_needs=monitor_sample_needs(monitors), plan=plan,
        compile_ahead=spec.compile.precompile_upcoming and jax.process_count() == 1
        and hasattr(data, "batch_at"), device_limit=job_devices(),
        optimizer_syncs=optimizer_syncs,
    )


def check_devices(config: RunConfig, max_devices: int | None, resume: bool) -> int:
    """The most replicas a policy may ask for (default: every device the job may have)."""
    # Under a launcher that may start more processes, a policy may ask for their devices.
    available = job_devices()
    limit = available if max_devices is None else check_count(max_devices, "max_devices",
                                                              positive=True)
    if limit > available:
        raise ValueError(
            f"max_devices={limit} but only {available} devices exist; "
            f"use max_devices <= {available}"
        )
    if limit < config.devices:
        raise ValueError(
            f"max_devices={limit} is below devices={config.devices}; "
            f"use max_devices >= {config.devices}"
        )
    # On resume the checkpoint's configuration decides (a relaunch may have fewer devices).
    if jax.process_count() == 1 and not resume:
        make_mesh(config.axes if config.mesh_shape else config.devices)  # too many: one line
    elif not resume and not can_give(config.device_count):
        raise ValueError(
            f"devices={config.device_count} cannot be spread evenly over "
            f"{jax.process_count()} processes of {jax.local_device_count()} devices; use a "
            f"multiple of {jax.process_count()} up to {len(jax.devices())}"
        )
    return limit


def check_optimizer(optimizer, learning_rate) -> None:
    """``optimizer`` is an optax transformation; ``learning_rate`` a rate > 0, a schedule or
    ``None``."""
    if not isinstance(optimizer, optax.GradientTransformation):
        name = getattr(optimizer, "__qualname__", type(optimizer).__name__)
        raise ValueError(
            f"optimizer must be an optax.GradientTransformation such as optax.adam(1e-3), "
            f"got {name}; build it with its arguments (and inject_hyperparams to expose them)")
    if learning_rate is None or callable(learning_rate):
        return
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, int | float | np.number):
        raise ValueError(
            f"learning_rate must be the optimizer's rate (a float) or its optax schedule, got "
            f"{type(learning_rate).__name__}")
    if not (math.isfinite(float(learning_rate)) and float(learning_rate) > 0):
        raise ValueError(f"learning_rate must be > 0 and finite, got {learning_rate}")


def check_optimizer_syncs(optimizer, model, spec: RunSpec) -> bool:
    """Whether ``optimizer`` syncs the gradients itself (:func:`adaptjax._codec.syncs_itself`,
    e.g. ``compression.onebit_adam``); if so, a one-line ``ValueError`` for the spec's codec,
    strategy with local models or monitors (they read the mean gradient the controller's sync
    would form, which such an optimizer never hands over)."""
    if not syncs_itself(optimizer, split_model(model)[1]):
        return False
    check_optimizer_sync(spec.codec, spec.sync, action=False)
    if spec.monitors:
        raise ValueError(
            "monitors= cannot run with an optimizer that syncs the gradients itself (such as "
            "adaptjax.compression.onebit_adam): they read the mean gradient, which it keeps to "
            "itself; drop monitors=")
    return True


def check_data(data) -> None:
    """The dataset has what the controller calls (and a checkpoint saves)."""
    for attr in ("next_batch", "state_dict", "load_state_dict"):
        if not hasattr(data, attr):
            raise ValueError(
                f"data has no {attr}(); wrap arrays in adaptjax.ArrayDataset or an "
                "iterable in adaptjax.IterableDataset"
            )


def replica_rows(config: RunConfig) -> int:
    """The rows of one replica's micro-batch: what one call of ``loss_fn`` sees."""
    return max(1, config.batch_size // (config.devices * config.microbatches))


def check_loss_signature(loss_fn) -> None:
    """One-line ``ValueError`` unless ``loss_fn`` can be called as ``loss_fn(model, batch)``.

    A loss written for a loop of its own often takes the batch's parts one by
    one (optax's ``loss(params, batch, labels)``); tracing it on a batch would
    blame the data's shapes. A callable without a signature is left for its
    first call.
    """
    if not callable(loss_fn):
        raise ValueError("loss_fn must be callable as loss_fn(model_or_params, batch), got "
                         f"{type(loss_fn).__name__}")
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, None)
    except TypeError as e:
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        raise ValueError(
            f"loss_fn is called as loss_fn(model_or_params, batch), but {name}{signature} "
            f"cannot be ({e}); take the batch as one pytree, e.g. "
            "lambda params, batch: loss(params, *batch) for (inputs, labels) batches"
        ) from None


def check_loss_shapes(model, loss_fn, batch, rows: int, has_aux: bool) -> None:
    """One-line ``ValueError`` when ``loss_fn`` cannot run on ``rows`` rows of ``batch``,
    or returns other than a scalar loss (``has_aux``: a ``(scalar loss, aux)`` pair).

    The loss is traced with :func:`jax.eval_shape` on the shapes alone (one
    replica's micro-batch: ``rows`` rows of each leaf): nothing is computed or
    compiled. A shape, dtype or structure mismatch (a ``TypeError``,
    ``ValueError`` or ``KeyError`` while tracing: the batch lacks a key the loss
    reads) is reported with the line of ``loss_fn`` that failed and the batch's
    leaves; any other error (a collective over an axis only the step binds) is
    left for the step to raise.
    """

    def struct(x):
        shape = tuple(np.shape(x))
        return jax.ShapeDtypeStruct((rows, *shape[1:]) if shape else shape, np.dtype(x.dtype))

    batch = jax.tree.map(struct, batch)
    graphdef, params, model_state = split_model(model)

    def loss(params, model_state, batch):
        return loss_fn(merge_model(graphdef, params, model_state), batch)

    try:
        out = jax.eval_shape(loss, params, model_state, batch)
    except (TypeError, ValueError, KeyError) as e:
        leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
        shown = [f"{_leaf_name(path)}: {x.dtype}[{', '.join(map(str, x.shape))}]"
                 for path, x in leaves[:6]] + (["..."] if len(leaves) > 6 else [])
        if isinstance(e, KeyError):
            text = f"the batch has no key {e.args[0]!r}" if e.args else "KeyError"
        else:
            text = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
        raise ValueError(
            f"loss_fn cannot run on this data's batches ({', '.join(shown)} per replica)"
            f"{_user_line(e)}: {text}; make the data's shapes match the model's"
        ) from None
    check_loss_output(out, has_aux)


def check_loss_output(out, has_aux: bool) -> None:
    """One-line ``ValueError`` unless ``out`` (shapes) is a scalar loss, or with ``has_aux``
    a ``(scalar loss, aux)`` pair."""
    pair = isinstance(out, tuple | list) and len(out) == 2
    if has_aux and not pair:
        raise ValueError(
            "RunSpec(has_aux=True) but loss_fn returned a single value, not (loss, aux); "
            "pass has_aux=False or return (loss, aux)")
    if not has_aux and isinstance(out, tuple | list):
        raise ValueError(
            f"loss_fn returned a {len(out)}-tuple but RunSpec.has_aux is False; pass "
            "RunSpec(has_aux=True) if it returns (loss, aux)")
    loss = out[0] if has_aux else out
    if getattr(loss, "shape", None) != ():
        raise ValueError(
            f"loss_fn must return a scalar loss, got shape {getattr(loss, 'shape', type(loss))}; "
            "reduce it over the batch (e.g. jnp.mean)")


def _leaf_name(path) -> str:
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]
    return ".".join(str(k) for k in keys) or "batch"


def _user_line(error: BaseException) -> str:
    """`` at FILE:LINE (`code`)`` of the innermost frame outside jax and adaptjax, or ``''``."""
    files = (jax.__file__, np.__file__, ajp.__file__)
    skip = tuple(os.path.dirname(f) + os.sep for f in files if f) + (
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    )
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(skip) and not f.filename.startswith("<")]
    if not frames:
        return ""
    f = frames[-1]
    code = f" (`{f.line.strip()}`)" if f.line else ""
    return f" at {os.path.basename(f.filename)}:{f.lineno}{code}"


def check_run_dir(run_dir: str, resume: bool) -> None:
    """Writable (all the run writes), not owned by a live controller, checkpoints iff resuming."""
    check_writable_run_dir(run_dir)
    if is_primary():
        RunLock.check_free(run_dir)  # a live owner is the first thing to report
    if resume:
        check_resumable(run_dir)
        return
    ckpt_dir = os.path.join(run_dir, CHECKPOINTS)
    if os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir)):
        raise ValueError(
            f"run_dir {run_dir} already holds checkpoints; use Controller.resume(...) "
            "to continue that run or choose a new run_dir"
        )


def check_monitors(monitors, devices: int, microbatches: int, resume: bool) -> tuple:
    """The monitors (default: noise scale, SNR, gradient norm), able to measure here."""
    if monitors is None:
        # One gradient sample per step (one device, no micro-batches): the noise
        # scale then comes from consecutive steps' gradients.
        one = one_gradient_sample(devices, microbatches)
        monitors = (
            GradientNoiseScale(differencing=one), GradientSNR(differencing=one), GradientNorm(),
        )
    monitors = tuple(monitors)
    min_samples, min_replicas = monitor_sample_needs(monitors)
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
    return monitors


def warn_unproducible_metrics(policy, monitors, link_bandwidth, evaluates: bool) -> None:
    """Warns once per metric a policy needs that this controller never produces."""
    produced_by = {
        "comm_share": link_bandwidth is not None,
        "comm_time": link_bandwidth is not None,
    }
    builtin = (GradientNoiseScale, GradientSNR, GradientNorm)
    if all(isinstance(m, builtin) for m in monitors):  # a user's monitor may produce any
        for key, cls in (("noise_scale", GradientNoiseScale), ("grad_snr", GradientSNR)):
            produced_by[key] = any(isinstance(m, cls) for m in monitors)
    for metric in sorted(required_metrics(policy)):
        if metric.startswith("eval_") and not evaluates:
            reason = "no adaptjax.Evaluate hook was given"
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


def warn_unreachable_schedules(policies, max_devices: int) -> None:
    """Warns once per :class:`adaptjax.policies.ElasticScale` whose schedule asks for more
    devices than ``max_devices``: it caps such an entry without a word."""
    for policy in find_held(list(policies), lambda o: isinstance(o, ajp.ElasticScale)):
        over = {s: d for s, d in (policy.schedule or {}).items()
                if (d.get("data", 0) if isinstance(d, Mapping) else d) > max_devices}
        if not over:
            continue
        entries = ", ".join(f"{s}: {d}" for s, d in over.items())
        warnings.warn(
            f"ElasticScale: schedule entr{'y' if len(over) == 1 else 'ies'} {{{entries}}} "
            f"ask{'s' if len(over) == 1 else ''} for more devices than max_devices="
            f"{max_devices}; it will ask for {max_devices} at most (pass a larger "
            "max_devices or change the schedule)",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
