"""A run's settings in one frozen dataclass, checked when built and saved in its run directory.

:class:`RunSpec` holds everything about a controller's run that is neither
code the user writes (model, loss, optimizer, data, hooks) nor state a
checkpoint keeps. Its fields are checked in ``__post_init__`` (the checks
that need the devices or the data run with the other arguments, still before
anything touches the disk). :meth:`RunSpec.to_json` is what the run directory
keeps in ``spec.json``; a field that cannot be written as JSON (policies, a
sharding function, a codec object, a schedule, monitors) is saved by name only, and
:meth:`RunSpec.from_json` asks for it again in one line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from adaptjax import policies as ajp
from adaptjax._data import check_count
from adaptjax._run_config import precision_key
from adaptjax.controller._options import CheckpointOptions, CompileOptions, every_or_none
from adaptjax.controller._run_dir import user_stacklevel
from adaptjax.launch._distributed import is_primary

if TYPE_CHECKING:  # annotations only
    from adaptjax._codec import GradientCodec
    from adaptjax._precision import Precision
    from adaptjax.sync._strategy import SyncStrategy

SPEC_FILE = "spec.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Everything a :class:`adaptjax.Controller` runs with, besides its code and its state.

    Attributes:
      run_dir: logs, checkpoints and this spec (``spec.json``).
      batch_size: the initial global batch.
      devices: the initial replica count (``None``: every device, or ``mesh_shape``'s
        ``"data"`` size).
      mesh_shape: a sharded mesh such as ``{"data": 2, "fsdp": 4}`` (``None``: 1-D).
      microbatches: gradient accumulation steps (``None``: 1, or 2 on one device
        with an even batch, so that the noise scale has two gradient samples).
      micro_batch_size: the global samples one compiled step takes (``None``:
        the whole batch). Set, each step accumulates ``batch_size /
        micro_batch_size`` micro-steps of it (:func:`adaptjax.accumulate`), so
        a batch change to another multiple of it compiles nothing and the
        memory per device stays that of one micro-batch. ``"auto"``: the
        controller chooses at each batch change between compiling the new
        batch whole and accumulating micro-steps of a program it has compiled,
        by what fits a device's memory (``CompileOptions.device_memory``) and
        whether the compile pays for itself in the steps left
        (``carry_batch`` events say which and why).
      learning_rate: the rate (a float or optax schedule) the optimizer was built
        with, if not injected: policies set it as a factor on the updates.
      has_aux: ``loss_fn`` returns ``(loss, aux)``: aux's scalars join each step's
        metrics as ``aux['name']``; its per-example arrays (logits) are not fetched.
      codec: the initial gradient codec (``None``: dense fp32 sync).
      sync: the initial :class:`adaptjax.sync.SyncStrategy` or its name (``None``: S-SGD).
      precision: :class:`adaptjax.Precision` or its key (``None``: float32).
      sharding: how parameters lie on a sharded mesh (``None``: :class:`adaptjax.FSDP`).
      monitors: :func:`adaptjax.sync_gradients`' monitors (``None``: noise scale,
        SNR, norm); norm_chunks: its ``norm_chunks``.
      loss_scale: float16's :func:`adaptjax.dynamic_loss_scale` options.
      policies: the :class:`adaptjax.policies.Policy` objects that adapt the run
        (``()``: none); they are code, so :meth:`adaptjax.Controller.resume` needs them again.
      policy_every: ask the policies every this many steps.
      max_devices: the most replicas a policy may ask for (``None``: all devices).
      link_bandwidth: bytes/s of the link: steps then report ``comm_time`` and
        ``comm_share``.
      max_nonfinite_steps: raise :class:`adaptjax.NonFiniteTraining` after this many
        skipped steps in a row (``None``: never).
      checkpoint: :class:`adaptjax.CheckpointOptions`.
      compile: :class:`adaptjax.CompileOptions`.

    Example:
      >>> import adaptjax
      >>> spec = adaptjax.RunSpec(run_dir="/tmp/run", batch_size=64, devices=4)
      >>> adaptjax.RunSpec.from_json(spec.to_json()) == spec
      True
      >>> adaptjax.RunSpec(run_dir="/tmp/run", batch_size=64, policy_every=0)
      Traceback (most recent call last):
      ...
      ValueError: RunSpec.policy_every must be a positive integer, got 0
    """

    run_dir: str | os.PathLike
    batch_size: int
    devices: int | None = None
    mesh_shape: Mapping[str, int] | None = None
    microbatches: int | None = None
    micro_batch_size: int | Literal["auto"] | None = None
    learning_rate: float | Callable[[Any], Any] | None = None
    has_aux: bool = False
    codec: GradientCodec | None = None
    sync: SyncStrategy | str | None = None
    precision: Precision | str | None = None
    sharding: Any = None
    monitors: Sequence[Any] | None = None
    norm_chunks: int | None = None
    loss_scale: Mapping[str, Any] | None = None
    policies: Sequence[Any] = ()
    policy_every: int = 10
    max_devices: int | None = None
    link_bandwidth: float | None = None
    max_nonfinite_steps: int | None = 100
    checkpoint: CheckpointOptions = CheckpointOptions()
    compile: CompileOptions = CompileOptions()

    def __post_init__(self) -> None:
        if not isinstance(self.run_dir, str | os.PathLike):
            raise ValueError(f"RunSpec.run_dir must be a path, got {self.run_dir!r}")
        object.__setattr__(self, "run_dir", os.fspath(self.run_dir))
        for name in ("devices", "microbatches", "norm_chunks", "max_devices"):
            object.__setattr__(self, name, every_or_none(getattr(self, name), f"RunSpec.{name}"))
        if isinstance(self.micro_batch_size, str) and self.micro_batch_size != "auto":
            raise ValueError("RunSpec.micro_batch_size must be a positive integer, 'auto' or "
                             f"None, got {self.micro_batch_size!r}")
        if self.micro_batch_size != "auto":
            object.__setattr__(self, "micro_batch_size", every_or_none(
                self.micro_batch_size, "RunSpec.micro_batch_size"))
        _check_micro_batch(self.batch_size, self.micro_batch_size)
        object.__setattr__(self, "policies", _check_policies(self.policies))
        object.__setattr__(self, "policy_every",
                           check_count(self.policy_every, "RunSpec.policy_every", positive=True))
        object.__setattr__(self, "max_nonfinite_steps", every_or_none(
            self.max_nonfinite_steps, "RunSpec.max_nonfinite_steps"))
        if not isinstance(self.has_aux, bool):
            raise ValueError(f"RunSpec.has_aux must be True or False, got {self.has_aux!r}")
        if self.mesh_shape is not None:
            object.__setattr__(self, "mesh_shape", dict(self.mesh_shape))
        if self.monitors is not None:
            object.__setattr__(self, "monitors", tuple(self.monitors))
        if isinstance(self.loss_scale, Mapping):  # anything else: refused with the step's
            object.__setattr__(self, "loss_scale", dict(self.loss_scale))
        object.__setattr__(self, "precision", precision_key(self.precision))  # its key
        _check_bandwidth(self.link_bandwidth)
        for name, cls in (("checkpoint", CheckpointOptions), ("compile", CompileOptions)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"RunSpec.{name} must be an adaptjax.{cls.__name__}, "
                                 f"got {type(getattr(self, name)).__name__}")

    def unsaved(self) -> list[str]:
        """The fields set to a value that JSON cannot hold (they must be passed again)."""
        return [f.name for f in dataclasses.fields(self)
                if _saved(f.name, getattr(self, f.name)) is _UNSAVED]

    def to_json(self) -> str:
        """The spec as JSON; an unsaveable field (:meth:`unsaved`) is written by name only."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = _saved(f.name, getattr(self, f.name))
            if value is not _UNSAVED:
                out[f.name] = value
        out["unsaved"] = self.unsaved()
        return json.dumps(out, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str = "the saved spec") -> RunSpec:
        """The spec :meth:`to_json` wrote; one-line ``ValueError`` if it held an unsaveable
        field (pass the spec again with it)."""
        data = json.loads(text)
        unsaved = data.pop("unsaved", [])
        if unsaved:
            raise ValueError(
                f"{source} set {', '.join(unsaved)}, which cannot be saved; pass "
                f"spec=RunSpec(..., {unsaved[0]}=...) again")
        data["checkpoint"] = CheckpointOptions(**data["checkpoint"])
        data["compile"] = CompileOptions(**data["compile"])
        return cls(**data)

    def differences(self, other: RunSpec) -> list[str]:
        """The names of the fields whose values differ from ``other``'s."""
        return [f.name for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]

    def replace(self, **changes: Any) -> RunSpec:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


_UNSAVED = object()
_JSON = (type(None), bool, int, float, str)


def _saved(name: str, value: Any) -> Any:
    """``value`` as JSON holds it, or ``_UNSAVED`` (objects and functions)."""
    if isinstance(value, CheckpointOptions | CompileOptions):
        fields = dataclasses.asdict(value)
        if isinstance(fields.get("cache_dir"), os.PathLike):
            fields["cache_dir"] = os.fspath(fields["cache_dir"])
        return fields
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, _JSON):
        return value
    if isinstance(value, dict) and all(isinstance(v, _JSON) for v in value.values()):
        return value
    if isinstance(value, tuple) and all(isinstance(v, _JSON) for v in value):
        return list(value)  # monitors=(): none
    return _UNSAVED


def _check_policies(policies) -> tuple:
    if isinstance(policies, ajp.Policy):
        policies = (policies,)
    if not isinstance(policies, Sequence) or isinstance(policies, str):
        raise ValueError(f"RunSpec.policies must be a sequence of adaptjax.policies.Policy, "
                         f"got {type(policies).__name__}")
    for p in policies:
        if not isinstance(p, ajp.Policy):
            raise ValueError("RunSpec.policies must hold adaptjax.policies.Policy objects, "
                             f"got {type(p).__name__}")
    return tuple(policies)


def _check_micro_batch(batch_size, micro_batch_size: int | str | None) -> None:
    """``batch_size`` is whole micro-batches (when ``micro_batch_size`` is a number)."""
    if not isinstance(micro_batch_size, int):  # None or "auto"
        return
    batch = check_count(batch_size, "RunSpec.batch_size", positive=True)
    if batch % micro_batch_size:
        raise ValueError(
            f"RunSpec.batch_size {batch} is not a multiple of micro_batch_size "
            f"{micro_batch_size}: a step accumulates whole micro-batches; use a multiple of "
            f"{micro_batch_size}")


def _check_bandwidth(bandwidth) -> None:
    if bandwidth is not None and (
        isinstance(bandwidth, bool) or not isinstance(bandwidth, int | float)
        or not (math.isfinite(bandwidth) and bandwidth > 0)
    ):
        raise ValueError(
            f"RunSpec.link_bandwidth must be a positive number of bytes/s, got {bandwidth!r}")


def save_spec(run_dir: str, spec: RunSpec) -> None:
    """Writes ``spec`` to ``run_dir/spec.json`` (process 0; replaced whole, never torn)."""
    if not is_primary():
        return
    path = os.path.join(run_dir, SPEC_FILE)
    with open(path + ".tmp", "w") as f:
        f.write(spec.to_json() + "\n")
    os.replace(path + ".tmp", path)


def resumed_spec(run_dir: str | os.PathLike | None, spec: RunSpec | None) -> RunSpec:
    """The spec :meth:`adaptjax.Controller.resume` continues with.

    ``None``: the one saved in ``run_dir`` (its ``run_dir`` set to where the
    run now is). A passed spec is used as it is, with one warning naming the
    fields in which it differs from the saved one.
    """
    if spec is not None and not isinstance(spec, RunSpec):
        raise ValueError(f"spec must be an adaptjax.RunSpec, got {type(spec).__name__}")
    if run_dir is None:
        if spec is None:
            raise ValueError("Controller.resume needs run_dir")
        run_dir = spec.run_dir
    run_dir = os.fspath(run_dir)
    if spec is not None and spec.run_dir != run_dir:
        raise ValueError(
            f"Controller.resume got two run_dirs ({run_dir} and spec.run_dir={spec.run_dir}); "
            "pass one")
    path = os.path.join(run_dir, SPEC_FILE)
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        if spec is None:
            raise ValueError(f"{path} does not exist: pass spec=RunSpec(...) to "
                             "Controller.resume") from None
        return spec
    if spec is None:
        saved = json.loads(text)
        saved["run_dir"] = run_dir
        return RunSpec.from_json(json.dumps(saved), source=path)
    _warn_differences(spec, json.loads(text), path)
    return spec


def _warn_differences(spec: RunSpec, saved: Mapping[str, Any], path: str) -> None:
    passed = json.loads(spec.to_json())
    unsaved = set(passed.pop("unsaved")) | set(saved.get("unsaved", []))
    differ = [f.name for f in dataclasses.fields(spec)  # in the spec's order
              if f.name != "run_dir" and f.name not in unsaved
              and saved.get(f.name) != passed[f.name]]
    if differ:
        warnings.warn(
            f"resume: the spec passed differs from {path} in {', '.join(differ)}; the passed "
            "values are used (the configuration continues as checkpointed)",
            UserWarning, stacklevel=user_stacklevel())
