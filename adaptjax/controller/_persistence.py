"""What a controller's checkpoint holds besides the arrays, and how a resume reads it back.

A checkpoint's ``meta`` (:func:`checkpoint_meta`) is everything the loop needs
to continue exactly where it was: the step, the samples seen, the non-finite
count, the configuration, the data cursor, the policies' state, the metrics
snapshots still to decide on, and the run's clock. :func:`resume_from` restores
the newest intact checkpoint of a run directory; the controller then takes
its values over.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from adaptjax._run_config import RunConfig
from adaptjax.controller._arguments import check_loss_shapes, replica_rows
from adaptjax.controller._metrics_reader import Snapshot
from adaptjax.controller._run_dir import RunDirectory, user_stacklevel
from adaptjax.controller._step_cache import StepCache
from adaptjax.launch._distributed import (
    EXIT_RESCALE,
    max_processes,
    processes_for,
    write_rescale_request,
)


def checkpoint_meta(*, step: int, samples_seen: int, nonfinite_count: int, config: RunConfig,
                    data, policy, to_decide: Sequence[Snapshot], clock: Mapping) -> dict:
    """A checkpoint's ``meta``: the loop's position, as plain JSON values."""
    return {
        "step": step,
        "samples_seen": samples_seen,
        "nonfinite_count": nonfinite_count,
        "config": dataclasses.asdict(config),
        "data": data.state_dict(),
        "policy": json.loads(json.dumps(policy.state_dict())),
        "to_decide": [{"step": s.step, "metrics": s.metrics} for s in to_decide],
        **clock,  # what RunClock.from_state continues from after a resume
    }


def config_from(meta: Mapping, steps: StepCache) -> RunConfig:
    """A checkpoint's configuration, once its codec and strategy are known to ``steps``."""
    config = RunConfig(**meta["config"])
    if config.codec not in steps.codecs:
        raise ValueError(
            f"the checkpoint was written with codec {config.codec!r}; pass that codec "
            "as codec= or inside a policy"
        )
    if config.sync not in steps.strategies:
        raise ValueError(
            f"the checkpoint was written with sync strategy {config.sync}; pass it as sync= "
            "or inside a policy"
        )
    return config


@dataclasses.dataclass(frozen=True)
class Resumed:
    """The newest intact checkpoint of a run, restored (see :func:`resume_from`)."""

    step: int
    config: RunConfig
    state: Any
    meta: dict
    skipped: list[dict]  # a checkpoint_skipped event for each checkpoint that failed


def resume_from(run_dir: RunDirectory, steps: StepCache, data, policy) -> Resumed:
    """Restores ``run_dir``'s newest intact checkpoint onto its own configuration's mesh.

    ``data`` and ``policy`` take their state from it (``load_state_dict``).

    Across processes, a checkpoint whose configuration needs another process
    count asks the launcher for it and exits with ``EXIT_RESCALE``.
    """

    def load(step: int):
        meta = run_dir.checkpoints.read_meta(step)
        config = config_from(meta, steps)
        wanted = processes_for(config.device_count)
        if (jax.process_count() > 1 or max_processes() > 1) and wanted != jax.process_count():
            # The run continues on another process count: ask the launcher for it.
            write_rescale_request(wanted, config.device_count)
            raise SystemExit(EXIT_RESCALE)
        state, _ = run_dir.checkpoints.restore(
            step, target_state=steps.abstract_state(config), mesh=steps.mesh(config)
        )
        return config, state, meta

    step, (config, state, meta), skipped = run_dir.restore_newest_intact(load)
    if hasattr(data, "batch_at"):  # checked here, once the checkpoint's model was
        rows = replica_rows(config)
        check_loss_shapes(steps.model, steps.loss_fn, data.batch_at(0, rows), rows,
                          steps.has_aux)
    passed = data.state_dict()
    data.load_state_dict(meta["data"])
    warn_data_overrides(passed, meta["data"])
    policy.load_state_dict(meta["policy"])
    events = [{"kind": "checkpoint_skipped", "skipped_step": s["step"], "reason": s["reason"],
               "moved_to": s["moved_to"]} for s in skipped]
    return Resumed(step, config, state, meta, events)


def snapshots_of(meta: Mapping, config: RunConfig) -> list[Snapshot]:
    """The metrics snapshots a checkpoint kept for policies to decide on."""
    return [Snapshot(int(s["step"]), config, dict(s["metrics"]))
            for s in meta.get("to_decide", [])]


def warn_overrides(hyperparams: Mapping[str, Any], held: Mapping[str, float]) -> None:
    """Warns, once each, of a hyperparameter the passed optimizer sets (``hyperparams``:
    :func:`injected_values`) that the checkpoint's (``held``) overrides."""
    for key, value in hyperparams.items():
        numeric = isinstance(value, int | float | np.number) and not isinstance(value, bool)
        if key in held and numeric and np.float32(value) != np.float32(held[key]):
            _warn_override(key, value, held[key])


def warn_data_overrides(passed: Mapping, saved: Mapping) -> None:
    """Warns, once each, of the dataset's ``seed`` or ``shuffle`` the checkpoint's replace."""
    if not isinstance(passed, Mapping) or not isinstance(saved, Mapping):
        return
    for key in ("seed", "shuffle"):
        if key in passed and key in saved and passed[key] != saved[key]:
            _warn_override(key, passed[key], saved[key], "the data stream goes on as it was saved")


def _warn_override(key, passed, kept,
                   why: str = "its state decides; change it with an action after resuming") -> None:
    warnings.warn(
        f"resume: {key}={passed!r} was passed, but the run continues with the checkpoint's "
        f"{key}={kept!r} ({why})",
        UserWarning,
        stacklevel=user_stacklevel(),
    )
