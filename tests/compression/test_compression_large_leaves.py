"""Codecs on leaves of realistic sizes: lanes of more than ``BUCKET_MAX`` elements.

A lane of at most ``BUCKET_MAX`` (2^20) elements is packed whole into one view;
a larger one (any model with a leaf over a million elements beside another
compressed leaf) goes as one view per leaf plus a packed view of the tails.
The owner-compute transport of several views once concatenated the owners'
rows along an axis they do not have, so every block codec crashed on its
first step on every such model. Here, a GPT-2-small shape (768×3072), a
second leaf over a million elements with a tail that goes packed (1031×1031),
and biases:

* each codec syncs the whole model and a model in which one leaf (the packed
  tail's, or a bias packed whole) is the only compressed one (every other leaf a scalar, under
  ``min_size``, so the leaf keeps its index and with it its seeds): the decoded
  mean of every leaf is the same (a leaf's blocks and random streams are its
  own; :mod:`adaptjax.compression._views`), and so is the mean over replicas
  of its per-replica state. Which replica owns a packed block depends on the
  lane, and the owner folds its re-encoding error into its own residual, so
  the residuals are spread over the replicas differently while their mean,
  what error feedback owes (``mean_i(x_i) = mean + mean_i(residual_i)``), is not;
* a step through ``data_parallel_step`` equals SGD on the codec's own mean of
  the replicas' gradients, worked out outside the step.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import adaptjax
from adaptjax import compression as ajc
from adaptjax._per_replica import stack_replicas, state_partition_specs

N = 8
# two leaves over 2^20 elements, one of them with a tail past its whole 8 x 512
# units (packed with the biases), and biases under and over min_size (1024)
SHAPES = {"fc": (768, 3072), "odd": (1031, 1031), "b_fc": (3072,), "b_proj": (768,)}
# the layouts: in place with a packed tail (the in-place part as "fc" lies), packed whole
ALONE = ("odd", "b_fc")


# (codec, mesh shape): every codec on the owner-compute transport (which a lane this
# large takes by default, and where the crash was), the all-gather one (deterministic;
# a stochastic codec bucketed), bucketed, in two levels
CODECS = {
    **{f"{name}/owner": (make(transport="owner"), None)
       for name, make in {"bf16": ajc.bf16, "fp16": ajc.fp16, "onebit": ajc.onebit,
                          "terngrad": ajc.terngrad, "qsgd": lambda **k: ajc.qsgd(7, **k),
                          "natural": ajc.natural}.items()},
    "onebit/allgather": (ajc.onebit(transport="allgather"), None),
    "onebit/owner/bucketed": (ajc.onebit(transport="owner", bucket_bytes=4 << 20), None),
    "qsgd+ef/allgather/bucketed": (
        ajc.qsgd(7, error_feedback="ef14", transport="allgather", bucket_bytes=4 << 20), None),
    "onebit/2-level": (ajc.onebit(fast_axis="fast"), (2, 4)),
    "topk": (ajc.topk(0.01), None),
    "randomk+ef": (ajc.randomk(0.01, error_feedback="ef14"), None),
    "dgc": (ajc.dgc(0.01), None),
    "powersgd": (ajc.powersgd(4), None),
}


def _mesh(shape):
    devs = np.array(jax.devices()[:N])
    if shape is None:
        return Mesh(devs, ("data",)), "data"
    return Mesh(devs.reshape(shape), ("slow", "fast")), ("slow", "fast")


@functools.cache
def _full_grads():
    """Per-replica gradients ``(N, *shape)`` of every leaf of ``SHAPES`` (seed 0), drawn once:
    27M normals, which every sync of this file would otherwise draw again."""
    rng = np.random.default_rng(0)
    out = {k: rng.normal(size=(N, *full)).astype(np.float32) for k, full in SHAPES.items()}
    for g in out.values():
        g.flags.writeable = False
    return out


def _grads(shapes):
    """Per-replica gradients ``(N, *shape)``; a leaf shaped (1,) takes its first elements."""
    full = _full_grads()
    return {k: g if shapes[k] == SHAPES[k] else g.reshape(N, -1)[:, :1] for k, g in full.items()}


def _sync(codec, mesh_shape, shapes):
    """The codec's mean and state after one sync of :func:`_grads` (numpy)."""
    mesh, axis = _mesh(mesh_shape)
    state = stack_replicas(codec.init({k: jnp.zeros(s) for k, s in shapes.items()}), N)
    specs = state_partition_specs(state, axis)

    def f(g, s):
        g = jax.tree.map(lambda x: x[0], g)
        out, s = codec.sync(g, adaptjax.sync.to_local(s), axis_name=axis, step=jnp.int32(0))
        return out, adaptjax.sync.to_global(s)

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(axis), specs),
                               out_specs=(P(), specs), check_vma=False))
    return jax.tree.map(np.asarray, fn(_grads(shapes), state))


def _leaf(tree, key):
    """Every array of ``tree`` under dict key ``key`` (a leaf's mean and its buffers)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [x for path, x in flat
            if any(getattr(p, "key", None) == key for p in path)]


def _over_replicas(state):
    """Per-replica buffers (leading axis ``N``) as their mean over the replicas."""
    return jax.tree.map(
        lambda x: x.astype(np.float64).mean(axis=0) if x.ndim and x.shape[0] == N else x, state)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_each_leaf_syncs_as_it_does_alone(name):
    codec, mesh_shape = CODECS[name]
    mean, state = _sync(codec, mesh_shape, SHAPES)
    assert set(mean) == set(SHAPES)
    state = _over_replicas(state)  # once, not once per leaf of ALONE
    for key in ALONE:
        alone = {k: (s if k == key else (1,)) for k, s in SHAPES.items()}
        mean1, state1 = _sync(codec, mesh_shape, alone)
        pairs = zip(_leaf(mean, key) + _leaf(state, key),
                    _leaf(mean1, key) + _leaf(_over_replicas(state1), key), strict=True)
        for a, b in pairs:
            assert a.shape == b.shape
            scale = max(1.0, float(np.abs(a).max()))
            np.testing.assert_allclose(a, b, rtol=0, atol=4 * np.finfo(np.float32).eps * scale,
                                       err_msg=f"{name}: leaf {key}")
        assert np.all(np.isfinite(mean[key]))


# a codec of each kind (sign, stochastic, sparse, low-rank) through the user-facing step
STEP_CODECS = {"onebit": ajc.onebit(), "qsgd": ajc.qsgd(7), "topk": ajc.topk(0.01),
               "powersgd": ajc.powersgd(4)}


@pytest.mark.parametrize("name", sorted(STEP_CODECS))
def test_data_parallel_step_is_sgd_on_the_codecs_mean(name):
    """loss = Σ_k <c_k, p_k>·mean(batch): replica r's gradient is c_k·m_r exactly."""
    codec, lr = STEP_CODECS[name], 0.5
    rng = np.random.default_rng(1)
    c = {k: jnp.asarray(rng.normal(size=s).astype(np.float32)) for k, s in SHAPES.items()}
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    batch = jnp.asarray(rng.normal(size=(4 * N,)).astype(np.float32))

    def loss(p, b):
        return sum(jnp.vdot(c[k], p[k]) for k in SHAPES) * jnp.mean(b)

    tx = optax.chain(adaptjax.sync_gradients("data", codec=codec), optax.sgd(lr))
    mesh = adaptjax.make_mesh()
    step = adaptjax.data_parallel_step(loss, tx, mesh)
    state, _ = step(adaptjax.init_state(params, tx, mesh), batch)

    m = np.asarray(batch).reshape(N, -1).mean(axis=1)
    grads = {k: np.asarray(c[k])[None] * m.reshape(N, *[1] * len(s)) for k, s in SHAPES.items()}
    mesh1, axis = _mesh(None)
    cstate = stack_replicas(codec.init(params), N)
    specs = state_partition_specs(cstate, axis)

    def f(g, s):
        out, _ = codec.sync(jax.tree.map(lambda x: x[0], g), adaptjax.sync.to_local(s),
                            axis_name=axis, step=jnp.int32(0))
        return out

    mean = jax.jit(jax.shard_map(f, mesh=mesh1, in_specs=(P(axis), specs), out_specs=P(),
                                 check_vma=False))(grads, cstate)
    for k in SHAPES:
        want = -lr * np.asarray(mean[k])
        got = np.asarray(state.params[k])
        np.testing.assert_allclose(got, want, rtol=0,
                                   atol=4 * np.finfo(np.float32).eps * max(1.0, np.abs(want).max()))
        assert np.abs(got).max() > 0


def test_the_lanes_are_over_bucket_max():
    """The layout this file is about: each model's lane is over 2^20 elements."""
    from adaptjax.compression._views import BUCKET_MAX

    big = [k for k, s in SHAPES.items() if np.prod(s) > BUCKET_MAX]
    assert len(big) >= 2
