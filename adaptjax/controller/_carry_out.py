"""Carrying out a transition: ``(state, config, transition) -> (state, config, events)``.

:func:`carry_out` changes nothing but the state and configuration it returns
(and the step cache's registry of codecs and strategies): it records no
metrics, writes no checkpoint and logs no event. The controller's loop
assigns what it returns, logs its events and, when the configuration moved
to another mesh, writes the checkpoint that records the move
(:attr:`Carried.transition`). :func:`roll_back` is the one transition that
reads the disk: it returns the latest checkpoint's state and configuration.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from adaptjax import policies as ajp
from adaptjax._loss_scale import split_loss_scale
from adaptjax._per_replica import merge_replicas
from adaptjax._run_config import RunConfig
from adaptjax._state import train_state_shardings
from adaptjax._transition import Transition
from adaptjax.controller._checkpoint import RunCheckpoints
from adaptjax.controller._hyperparams import hyperparams_of as optimizer_hyperparams
from adaptjax.controller._hyperparams import write_hyperparams as set_hyperparams
from adaptjax.controller._persistence import config_from
from adaptjax.controller._rebuild import rebuild_state
from adaptjax.controller._replica_lr import (
    check_replica_values,
    replica_hyperparams,
    split_replica_values,
    write_replica_lr,
)
from adaptjax.controller._step_cache import (
    OPTIMIZER,
    SYNC,
    StepCache,
    chain_state,
    with_chain_state,
)
from adaptjax.launch._distributed import max_processes, processes_for
from adaptjax.sync._replicas import replica_count


@dataclasses.dataclass(frozen=True)
class Carried:
    """What carrying out a transition gives the loop.

    Attributes:
      state: the train state to continue with.
      config: the configuration to continue in.
      events: events to log now, in order (``{"kind": ..., field: value}``).
      transition: a move to another mesh (a ``rescale`` event): the loop writes a
        checkpoint that records :attr:`config`, and logs this event with it once
        that checkpoint is complete; ``None`` when the mesh stays.
      relaunch: the process count the run continues on when it differs from
        this job's: the state stays on the old mesh, and the loop checkpoints and
        exits with ``EXIT_RESCALE``; else ``None``.
      restore: a move to or from a sharded mesh: the state stays on the old
        mesh, the loop checkpoints it (recording :attr:`config`) and restores
        that checkpoint onto the new mesh's shardings (:func:`restore_latest`),
        as a resume would.
    """

    state: Any
    config: RunConfig
    events: tuple[dict, ...] = ()
    transition: dict | None = None
    relaunch: int | None = None
    restore: bool = False


def carry_out(state, config: RunConfig, plan: Transition, steps: StepCache) -> Carried:
    """Carries out ``plan`` (not its rollback: see :func:`roll_back`) from ``state``/``config``.

    In the order of :class:`Transition`: hyperparameters are written into the
    state (no compilation); a new codec or strategy rebuilds the parts of the
    state it owns; a new precision is a ``set_precision`` event and, to or
    from float16, wraps or unwraps the optimizer state's loss scale
    (:func:`swap_precision`; float32 master weights and optimizer state in
    every precision); then the batch, micro-batches and devices of ``plan.config`` (a rounded
    batch is a ``batch_rounded`` event). A new
    device count on the 1-D mesh moves the state to the new mesh in memory by
    the rule a restore applies (:func:`adaptjax.sync.merge_replicas`); a move to or
    from a sharded mesh goes through a checkpoint and an Orbax restore onto
    the new shardings (:attr:`Carried.restore`); either waits for a relaunch
    when it needs another process count (:attr:`Carried.relaunch`). Under
    ``micro_batch_size`` the state's number of micro-steps is set to the new
    batch's (:meth:`StepCache.with_micro_steps`: a batch change compiles nothing).
    """
    events: list[dict] = []
    if plan.hyperparams:
        state = write_hyperparams(state, plan.hyperparams, steps.mesh(config))
        events.append({"kind": "set_hyperparams", **plan.hyperparams})
    if plan.codec_changed:
        state, config = swap_codec(state, config, plan.codec, steps)
        events.append({"kind": "set_codec", "codec": config.codec})
    if plan.sync_changed:
        state, config = swap_sync(state, config, plan.sync, steps)
        events.append({"kind": "set_sync", "sync": repr(steps.strategy(config.sync))})
    new = plan.config
    if plan.precision_changed:
        state = swap_precision(state, config, new.precision, steps)
        events.append({"kind": "set_precision", "precision": new.precision_name,
                       "precision_from": config.precision_name})
        config = config.replace(precision=new.precision)
    if plan.requested_batch is not None:
        events.append({
            "kind": "batch_rounded", "requested": plan.requested_batch,
            "batch_size": new.batch_size, "replicas": new.devices,
            "microbatches": new.microbatches,
        })
    state = steps.with_micro_steps(state, new)  # between optimizer steps: micro_step is 0
    if (new.devices, new.mesh_shape) == (config.devices, config.mesh_shape):
        return Carried(state, new, tuple(events))
    move = {"kind": "rescale", "devices_from": config.devices, "devices_to": new.devices}
    sharded = new.mesh_shape is not None or config.mesh_shape is not None
    if sharded:
        move.update(mesh_from=config.axes, mesh_to=new.axes)
    processes = processes_for(new.device_count)
    relaunched = jax.process_count() > 1 or max_processes() > 1
    if relaunched and processes != jax.process_count():
        move.update(processes_from=jax.process_count(), processes_to=processes)
        return Carried(state, new, tuple(events), move, relaunch=processes)
    if sharded:
        return Carried(state, new, tuple(events), move, restore=True)
    return Carried(reshard(state, new.devices, steps), new, tuple(events), move)


def hyperparams_of(state) -> dict[str, float]:
    """What a policy may read and set in ``state``: its optimizer's hyperparameters (see
    :mod:`adaptjax.controller._hyperparams`) and, under local SGD or DiLoCo, each replica's
    rate factor ``replica_lr/i`` (see :mod:`adaptjax.controller._replica_lr`)."""
    found = optimizer_hyperparams(chain_state(state.opt_state)[OPTIMIZER])
    return {**found, **replica_hyperparams(state.opt_state)}


def hyperparam_names(state, actions: Sequence[ajp.Action]) -> list[str]:
    """The hyperparameters ``state`` has, once the ``replica_lr/...`` values that
    ``actions`` set are checked (a one-line ``ValueError`` naming the replicas there are)."""
    names = list(hyperparams_of(state))
    asked = {k: v for a in actions if isinstance(a, ajp.SetHyperparams)
             for k, v in a.values.items()}
    check_replica_values(asked, replica_count(state.opt_state), names)
    return names


def write_hyperparams(state, values: Mapping[str, float], mesh):
    """``state`` with ``values`` set: in its optimizer (injected, or the rate's factor), and
    ``replica_lr/i`` in the strategy's per-replica knobs."""
    replica, rest = split_replica_values(values)
    if rest:
        optimizer = chain_state(state.opt_state)[OPTIMIZER]
        state = _with_link(state, OPTIMIZER, set_hyperparams(optimizer, rest, mesh))
    if replica:
        state = dataclasses.replace(state, opt_state=write_replica_lr(state.opt_state, replica))
    return state


def _with_link(state, name: str, value):
    """``state`` with ``value`` as the state of its chain's link ``name``."""
    links = chain_state(state.opt_state)
    changed = type(links)({**links, name: value})
    return dataclasses.replace(state, opt_state=with_chain_state(state.opt_state, changed))


def swap_precision(state, config: RunConfig, precision: str | None, steps: StepCache):
    """``state`` (of ``config``) for steps in ``precision`` (a :attr:`RunConfig.precision`).

    float32 and bfloat16 share one state. Into float16 the optimizer's state
    is wrapped in a ``LossScaleState`` at the loss scale's
    ``initial_scale`` (``good_steps`` 0); out of float16 it is unwrapped and
    the scale is dropped (a later return to float16 starts from
    ``initial_scale`` again). Parameters, optimizer moments, hyperparameters,
    the step and everything else pass through as they are (the same arrays).
    """
    inner, scaled = split_loss_scale(chain_state(state.opt_state)[OPTIMIZER])
    into = steps.loss_scaled(config.replace(precision=precision))
    if (scaled is None) == (into is None):
        return state  # no loss scale on either side, or one on both: kept as it is
    if into is None:
        return _with_link(state, OPTIMIZER, inner)
    fresh = into.wrap_state(inner)
    replicated = NamedSharding(steps.mesh(config), P())
    fresh = fresh._replace(scale=jax.device_put(fresh.scale, replicated),
                           good_steps=jax.device_put(fresh.good_steps, replicated))
    return _with_link(state, OPTIMIZER, fresh)


def swap_codec(state, config: RunConfig, codec, steps: StepCache):
    """``(state, config)`` with ``codec``: its own state fresh, the rest carried over."""
    key = steps.add_codec(codec)
    new = config.replace(codec=key)
    if config.sync is not None:  # a strategy with local models: one rebuild
        tx = steps.tx(new.codec, new.sync, new.precision)
        mesh = steps.mesh(new)
        return rebuild_state(state, tx, mesh, carry_sync=False, sharding=steps.sharding), new
    fresh = chain_state(steps.init_state(new).opt_state)[SYNC]
    old = chain_state(state.opt_state)[SYNC]
    sync = fresh._replace(
        count=old.count, monitor_states=old.monitor_states, metrics=old.metrics
    )
    return _with_link(state, SYNC, sync), new


def swap_sync(state, config: RunConfig, strategy, steps: StepCache):
    """``(state, config)`` under another synchronisation strategy, nothing lost."""
    key = steps.add_sync(strategy)
    new = config.replace(sync=key)
    tx = steps.tx(new.codec, new.sync, new.precision)
    carry = key is None and config.sync is None
    return rebuild_state(
        state, tx, steps.mesh(new), carry_sync=carry, sharding=steps.sharding
    ), new


def reshard(state, devices: int, steps: StepCache):
    """``state`` on a 1-D mesh of ``devices`` replicas, merged as a restore would."""
    state = merge_replicas(state, devices)
    return jax.device_put(state, train_state_shardings(state, steps.mesh(devices)))


def restore_latest(checkpoints: RunCheckpoints, steps: StepCache, config: RunConfig) -> Carried:
    """The latest checkpoint's state restored onto ``config``'s mesh (its shardings).

    The second half of a move to or from a sharded mesh (:attr:`Carried.restore`):
    the state lands on the new mesh exactly as a resume from that checkpoint would.
    """
    state, _ = checkpoints.restore(
        target_state=steps.abstract_state(config), mesh=steps.mesh(config)
    )
    return Carried(state, config)


def roll_back(checkpoints: RunCheckpoints, steps: StepCache, reason: str) -> Carried:
    """The latest checkpoint's state and configuration, and a ``rollback`` event.

    Raises a one-line ``ValueError`` when there is no checkpoint to return to.
    """
    latest = checkpoints.latest_step()
    if latest is None:
        raise ValueError(
            "Rollback needs a checkpoint; set RunSpec(checkpoint=CheckpointOptions(every=N)) "
            "or return Checkpoint() first"
        )
    t0 = time.perf_counter()
    config = config_from(checkpoints.read_meta(latest), steps)
    state, _ = checkpoints.restore(
        latest, target_state=steps.abstract_state(config), mesh=steps.mesh(config)
    )
    event = {"kind": "rollback", "latency_s": time.perf_counter() - t0, "reason": reason,
             "to_checkpoint": latest}
    return Carried(state, config, (event,))
