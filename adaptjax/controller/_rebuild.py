"""Rebuilding the train state under another synchronisation strategy or codec."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from adaptjax._loss_scale import split_loss_scale
from adaptjax._per_replica import PerReplica, stack_replicas
from adaptjax._state import init_state, train_state_shardings
from adaptjax.controller._hyperparams import RateFactorState
from adaptjax.controller._step_cache import chain_state, with_chain_state
from adaptjax.sync._strategy import _mark, consensus_params


def rebuild_state(state, new_tx, mesh, *, carry_sync: bool, sharding=None):
    """Host side: the train state under ``new_tx`` (another strategy or codec), nothing lost.

    The new global parameters are :func:`consensus_params` of the old state;
    the optimizer state (``opt_state["optimizer"]``) carries over, averaged
    over replicas when the new strategy keeps it replicated and copied to
    every replica when it keeps it per replica; local models start at the new
    global parameters. With ``carry_sync`` (S-SGD to S-SGD) the sync's count,
    monitor states and metrics carry over too; the codec's state and a DiLoCo
    outer momentum start afresh. A float16 run's loss scale (a
    ``LossScaleState`` around the optimizer's state) is looked
    through: the optimizer's own state is carried as above, and the scale and
    its count carry over as they are (replicated). ``new_tx`` is the controller's named chain
    (``"sync"``, ``"optimizer"``, ...) or a :func:`sync_chain` (a tuple).
    ``sharding``: how parameters lie on a sharded ``mesh`` (as in
    :func:`adaptjax.init_state`). Under micro-batching (the chain inside
    :func:`adaptjax.accumulate`) the chain's state is carried as above and the
    accumulator starts afresh (a transition comes between optimizer steps).
    """
    n = int(mesh.shape["data"] if "data" in mesh.axis_names else np.prod(mesh.devices.shape))
    old = jax.device_get(state)
    params = jax.device_get(consensus_params(old.params, old.opt_state))
    fresh = jax.device_get(init_state(params, new_tx, mesh, sharding=sharding))
    old_links, fresh_links = chain_state(old.opt_state), chain_state(fresh.opt_state)
    named = isinstance(fresh_links, dict)
    opt_key, sync_slot = ("optimizer", "sync") if named else (1, 0)
    opt_state: Any = dict(fresh_links) if named else list(fresh_links)
    old_opt, old_scale = split_loss_scale(old_links[opt_key])
    new_opt, new_scale = split_loss_scale(fresh_links[opt_key])
    carried = _carried_optimizer(old_opt, new_opt, n)
    if new_scale is not None:
        kept = new_scale if old_scale is None else old_scale
        carried = kept._replace(inner_state=carried)
    opt_state[opt_key] = carried
    if carry_sync:
        sync = fresh_links[sync_slot]
        opt_state[sync_slot] = sync._replace(
            count=old_links[sync_slot].count,
            monitor_states=old_links[sync_slot].monitor_states,
            metrics=old_links[sync_slot].metrics,
        )
    links = type(fresh_links)(opt_state) if named else tuple(opt_state)
    new = dataclasses.replace(
        fresh,
        step=old.step,
        nonfinite_count=old.nonfinite_count,
        model_state=old.model_state,
        graphdef=old.graphdef,
        opt_state=with_chain_state(fresh.opt_state, links),
    )
    new = jax.tree.map(np.array, new)
    return jax.device_put(new, train_state_shardings(new, mesh, sharding=sharding))


def _carried_optimizer(old_opt, new_opt, n: int):
    """The optimizer's state carried from ``old_opt`` into ``new_opt``'s layout (``n`` replicas)."""
    if isinstance(old_opt, RateFactorState):  # the controller's wrapper: replicated, kept
        inner = _carried_optimizer(old_opt.inner_state, new_opt.inner_state, n)
        return old_opt._replace(inner_state=inner)
    if _is_marked(old_opt) and _is_marked(new_opt):
        return old_opt  # per replica before and after: kept as it is
    replicated = jax.tree.map(
        lambda node: jax.tree.map(_mean0, node.value) if isinstance(node, PerReplica) else node,
        old_opt,
        is_leaf=lambda x: isinstance(x, PerReplica),
    )
    if _is_marked(new_opt):
        replicated = jax.device_get(stack_replicas(_mark(replicated), n))
    return replicated


def _is_marked(opt_state) -> bool:
    """Whether the optimizer's state (not its loss scale: see :func:`split_loss_scale`) is
    per replica, whole or inside ``inject_hyperparams``."""
    return isinstance(opt_state, PerReplica) or isinstance(
        getattr(opt_state, "inner_state", None), PerReplica
    )


def _mean0(x):
    x = np.asarray(x)
    return x.mean(axis=0, dtype=np.float64).astype(x.dtype)
