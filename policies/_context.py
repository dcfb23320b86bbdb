"""What a policy knows about the run besides its metrics."""

import dataclasses
from collections.abc import Mapping

from adaptjax.policies._checks import (
    check_float,
    check_int,
    check_mapping,
    check_optional_int,
    check_str,
    short_repr,
)
from adaptjax.policies._mapping import FrozenMapping


@dataclasses.dataclass(frozen=True)
class Context:
    """The training configuration at the moment a policy decides.

    Built by the controller before every evaluation; policies only read it.
    ``hyperparams`` is copied into a read-only mapping of floats.

    Args:
      step: the optimizer step the metrics belong to, >= 0.
      batch_size: the current global batch size (all devices, all micro-batches), >= 1.
      microbatches: gradient-accumulation micro-batches per step, >= 1.
      devices: devices currently training, >= 1.
      max_devices: devices that could be used, >= ``devices``.
      hyperparams: current scalar hyperparameters, e.g. ``{"learning_rate": 1e-3}``.
      codec: the active compression codec (opaque), or ``None`` when uncompressed.
      samples_seen: training samples consumed so far, >= 0.
      base_batch_size: the batch size the hyperparameters were tuned for (M₀), if known.
      sync: the active synchronisation strategy (opaque, e.g. ``adaptjax.sync.DiLoCo``),
        or ``None`` for S-SGD.
      precision: the running compute precision: its key (``"float32"``,
        ``"bfloat16"``; the controller passes one) or an opaque precision
        object, or ``None`` when unknown.
      compiled_batch_sizes: the batch sizes whose step is compiled for the
        current devices, micro-batches, codec, sync and precision (run, or
        compiled ahead): a move to one waits for no compile. Any iterable of
        ints >= 1, kept as a ``frozenset``; empty when unknown.
      micro_batch_sizes: the compiled steps whose micro-steps a batch can be
        accumulated in (``RunSpec.micro_batch_size`` set): a move to a multiple
        of one waits for no compile. Kept as a ``frozenset``; empty when none.
      mesh_shape: the sharded mesh's axes in order, ``{"data": devices, "fsdp": f, ...}``
        (a read-only mapping), or ``None`` on a 1-D data-parallel mesh. On a
        sharded mesh ``devices`` and ``max_devices`` count replicas (the
        ``"data"`` axis) at the current model axes.

    Example:
      >>> ctx = Context(step=0, batch_size=64, microbatches=1, devices=8, max_devices=8,
      ...               hyperparams={"learning_rate": 0.1})
      >>> ctx.batch_size // (ctx.devices * ctx.microbatches)
      8
      >>> Context(step=0, batch_size=64, microbatches=1, devices=2, max_devices=2,
      ...         hyperparams={}, mesh_shape={"data": 2, "fsdp": 4}).mesh_shape["fsdp"]
      4
    """

    step: int
    batch_size: int
    microbatches: int
    devices: int
    max_devices: int
    hyperparams: Mapping[str, float]
    codec: object | None = None
    samples_seen: int = 0
    base_batch_size: int | None = None
    sync: object | None = None
    precision: object | None = None
    compiled_batch_sizes: frozenset[int] = frozenset()
    micro_batch_sizes: frozenset[int] = frozenset()
    mesh_shape: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        owner = "Context"
        ints = {
            "step": check_int(self.step, owner=owner, name="step", minimum=0),
            "batch_size": check_int(self.batch_size, owner=owner, name="batch_size", minimum=1),
            "microbatches": check_int(
                self.microbatches, owner=owner, name="microbatches", minimum=1
            ),
            "devices": check_int(self.devices, owner=owner, name="devices", minimum=1),
            "max_devices": check_int(
                self.max_devices, owner=owner, name="max_devices", minimum=1
            ),
            "samples_seen": check_int(
                self.samples_seen, owner=owner, name="samples_seen", minimum=0
            ),
            "base_batch_size": check_optional_int(
                self.base_batch_size, owner=owner, name="base_batch_size", minimum=1
            ),
        }
        if ints["max_devices"] < ints["devices"]:
            raise ValueError(
                f"{owner}: max_devices={ints['max_devices']} is below devices={ints['devices']}; "
                "max_devices must be >= devices"
            )
        for name, value in ints.items():
            object.__setattr__(self, name, value)
        check_mapping(self.hyperparams, owner=owner, name="hyperparams")
        hyper = {}
        for key, value in self.hyperparams.items():
            check_str(key, owner=owner, name="every key of hyperparams", allow_empty=False)
            hyper[key] = check_float(value, owner=owner, name=f"hyperparams[{key!r}]")
        object.__setattr__(self, "hyperparams", FrozenMapping(hyper))
        for name, each in (("compiled_batch_sizes", "every compiled batch size"),
                           ("micro_batch_sizes", "every micro-batch size")):
            object.__setattr__(self, name, _batch_sizes(getattr(self, name), owner, name, each))
        if self.mesh_shape is not None:
            object.__setattr__(self, "mesh_shape", self._checked_mesh(self.mesh_shape, owner))

    def _checked_mesh(self, mesh_shape: Mapping[str, int], owner: str) -> FrozenMapping:
        check_mapping(mesh_shape, owner=owner, name="mesh_shape")
        shape = {}
        for axis, size in mesh_shape.items():
            check_str(axis, owner=owner, name="every axis of mesh_shape", allow_empty=False)
            shape[axis] = check_int(size, owner=owner, name=f"mesh_shape[{axis!r}]", minimum=1)
        if shape.get("data") != self.devices:
            raise ValueError(
                f"{owner}: mesh_shape {shape} must have 'data' = devices = {self.devices} "
                "(devices counts replicas)"
            )
        return FrozenMapping(shape)


def _batch_sizes(sizes, owner: str, name: str, each: str) -> frozenset[int]:
    """``sizes`` as a frozenset of ints >= 1; else a one-line error naming ``name``."""
    if isinstance(sizes, str | bytes | Mapping) or not hasattr(sizes, "__iter__"):
        raise ValueError(f"{owner}: {name} must be an iterable of ints, got {short_repr(sizes)}")
    return frozenset(check_int(b, owner=owner, name=each, minimum=1) for b in sizes)
