"""data_parallel_step: equivalence with one device, accumulation, NNX, aux, donation, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import adaptjax
from adaptjax._chain import chain as guarded_chain  # sync_chain's (and the controller's) chain
from adaptjax._chain import named_chain
from adaptjax._sync import SyncState


def _mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(size=(6, 16)).astype(np.float32) * 0.3),
        "b1": jnp.zeros(16),
        "w2": jnp.asarray(rng.normal(size=(16, 3)).astype(np.float32) * 0.3),
    }


def _loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    logits = h @ p["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def _batches(n, size, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(size, 6)).astype(np.float32),
            "y": rng.integers(0, 3, size=size).astype(np.int32),
        }
        for _ in range(n)
    ]


def _train(devices, microbatches, tx_factory, batches, **kw):
    mesh = adaptjax.make_mesh(devices)
    tx = tx_factory()
    step = adaptjax.data_parallel_step(_loss, tx, mesh, microbatches=microbatches, **kw)
    state = adaptjax.init_state(_mlp_params(), tx, mesh)
    for b in batches:
        state, metrics = step(state, b)
    return state, metrics


def _adam(chain=optax.chain):
    return chain(
        adaptjax.sync_gradients("data", monitors=(adaptjax.GradientNorm(),)), optax.adam(1e-2)
    )


# optax.chain: the guard's own all-reduce, then the whole update in its cond;
# guarded_chain: its scalars in the gradients' all-reduce, the optimizer in the cond.
CHAINS = pytest.mark.parametrize("chain", [optax.chain, guarded_chain], ids=["optax", "adaptjax"])


@pytest.mark.parametrize("devices,microbatches", [(8, 1), (8, 2), (4, 4), (1, 4)])
def test_matches_single_device_full_batch(devices, microbatches):
    batches = _batches(5, 64)
    ref, ref_m = _train(1, 1, _adam, batches)
    got, got_m = _train(devices, microbatches, _adam, batches)
    for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(got.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert float(got_m["loss"]) == pytest.approx(float(ref_m["loss"]), rel=1e-5)
    assert int(got.step) == 5


def test_bf16_wire_mean_is_within_bf16_rounding_of_fp32_mean():
    # Each of the 8 values is rounded to bf16 (relative error 2^-9), and the sum of
    # 8 bf16 values rounds at most 3 more times: |err| <= (1 + 3) * 2^-8 * sum|g|.
    mesh = adaptjax.make_mesh(8)
    g = np.random.default_rng(0).normal(size=(8, 100)).astype(np.float32)
    out = {}
    for name, dt in (("f32", None), ("bf16", jnp.bfloat16)):
        tx = adaptjax.sync_gradients("data", wire_dtype=dt)
        f = jax.jit(
            jax.shard_map(
                lambda x, tx=tx: tx.update(x[0], tx.init(x[0]))[0],
                mesh=mesh,
                in_specs=jax.P("data"),
                out_specs=jax.P(),
            )
        )
        out[name] = np.asarray(f(g))
    np.testing.assert_allclose(out["f32"], g.mean(0), rtol=1e-6, atol=1e-6)
    bound = 4 * 2.0**-8 * np.abs(g).sum(0) / 8
    assert np.all(np.abs(out["bf16"] - out["f32"]) <= bound)
    assert np.any(out["bf16"] != out["f32"])  # it really went through bf16


def test_mesh_on_a_subset_of_devices():
    devices = jax.devices()[4:8]
    mesh = Mesh(np.array(devices), ("data",))
    tx = _adam()
    step = adaptjax.data_parallel_step(_loss, tx, mesh)
    state = adaptjax.init_state(_mlp_params(), tx, mesh)
    state, _ = step(state, _batches(1, 32)[0])
    assert state.params["w1"].sharding.device_set == set(devices)


def test_aux_outputs_are_averaged_over_replicas():
    def loss_aux(p, b):
        loss = _loss(p, b)
        return loss, {"mean_x": jnp.mean(b["x"])}

    mesh = adaptjax.make_mesh(8)
    tx = _adam()
    step = adaptjax.data_parallel_step(loss_aux, tx, mesh, has_aux=True, microbatches=2)
    state = adaptjax.init_state(_mlp_params(), tx, mesh)
    b = _batches(1, 32)[0]
    _, m = step(state, b)
    assert float(m["aux"]["mean_x"]) == pytest.approx(float(b["x"].mean()), rel=1e-5)


def test_state_buffers_are_donated():
    mesh = adaptjax.make_mesh(8)
    tx = _adam()
    step = adaptjax.data_parallel_step(_loss, tx, mesh)
    state = adaptjax.init_state(_mlp_params(), tx, mesh)
    old = state.params["w1"]
    step(state, _batches(1, 32)[0])
    assert old.is_deleted()


class _NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def test_flax_nnx_model_matches_single_device():
    def loss(model, b):
        return optax.softmax_cross_entropy_with_integer_labels(model(b["x"]), b["y"]).mean()

    batches = _batches(3, 32)
    out = []
    for devices in (1, 8):
        mesh = adaptjax.make_mesh(devices)
        tx = _adam()
        step = adaptjax.data_parallel_step(loss, tx, mesh)
        state = adaptjax.init_state(_NNXMLP(nnx.Rngs(0)), tx, mesh)
        for b in batches:
            state, _ = step(state, b)
        out.append(state)
    for a, b in zip(jax.tree.leaves(out[0].params), jax.tree.leaves(out[1].params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    model = out[1].model  # nnx.merge(graphdef, params, model_state)
    assert model(jnp.ones((2, 6))).shape == (2, 3)


@CHAINS
def test_nonfinite_gradient_skips_update_and_is_counted(chain):
    mesh = adaptjax.make_mesh(8)
    tx = _adam(chain)
    step = adaptjax.data_parallel_step(_loss, tx, mesh, donate=False)
    state = adaptjax.init_state(_mlp_params(), tx, mesh)
    b = _batches(1, 32)[0]
    b["x"][3, 0] = np.nan  # one example on one replica
    new, m = step(state, b)
    for a, c in zip(jax.tree.leaves(state.params), jax.tree.leaves(new.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    for a, c in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(new.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    assert float(m["nonfinite"]) == 1.0 and int(new.nonfinite_count) == 1


@CHAINS
def test_a_skipped_step_keeps_donated_state_exactly(chain):
    # With donated buffers (the default) the skip branch passes the old state through in
    # place: nothing of it may be overwritten by the update that did not happen (the
    # monitors' state included, which guarded_chain updates outside the cond).
    mesh = adaptjax.make_mesh(8)
    tx = _adam(chain)
    step = adaptjax.data_parallel_step(_loss, tx, mesh)
    state = adaptjax.init_state(_mlp_params(), tx, mesh)
    good, bad = _batches(2, 32)
    state, _ = step(state, good)  # moments are non-zero from here on
    before = jax.device_get((state.params, state.opt_state))
    bad["x"][5, 1] = np.inf
    state, m = step(state, bad)
    assert float(m["nonfinite"]) == 1.0
    after = jax.device_get((state.params, state.opt_state))
    for a, c in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    state, m = step(state, good)  # and the next finite step updates again
    assert float(m["nonfinite"]) == 0.0 and int(state.nonfinite_count) == 1
    assert not np.array_equal(jax.device_get(state.params["w1"]), before[0]["w1"])


@CHAINS
def test_a_skipped_step_keeps_every_monitor_state_and_count(chain):
    # With guarded_chain the monitors run in a lax.cond on the guard's verdict (their
    # skip branch passes the old state through); either way a non-finite step must leave
    # the noise-scale EMAs, counts, held values and metrics exactly as they were.
    mesh = adaptjax.make_mesh(8)
    mons = (adaptjax.GradientNoiseScale(), adaptjax.GradientSNR(), adaptjax.GradientNorm())
    tx = chain(adaptjax.sync_gradients("data", monitors=mons), optax.adam(1e-2))
    step = adaptjax.data_parallel_step(_loss, tx, mesh)
    state = adaptjax.init_state(_mlp_params(), tx, mesh)
    good, other, bad = _batches(3, 32)
    for b in (good, other, good):
        state, _ = step(state, b)
    before = jax.device_get(state.opt_state[0])
    assert int(before.count) == 3 and int(before.monitor_states[0].count) == 3
    bad["x"][2, 4] = np.nan
    state, m = step(state, bad)
    assert float(m["nonfinite"]) == 1.0
    after = jax.device_get(state.opt_state[0])
    for a, c in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    state, _ = step(state, other)
    assert int(state.opt_state[0].count) == 4
    assert int(state.opt_state[0].monitor_states[0].count) == 4


@CHAINS
def test_finite_loss_with_an_infinite_gradient_on_one_replica_skips_every_replica(chain):
    # d/dw sqrt(|w x|) is infinite at w x = 0 while the loss stays finite; only replica 0's
    # rows have x = 0, yet every replica must skip (the check is global).
    mesh = adaptjax.make_mesh(8)
    tx = chain(adaptjax.sync_gradients("data"), optax.adam(0.1))

    def loss(p, b):
        return jnp.mean(jnp.sqrt(jnp.abs(p["w"] * b["x"])))

    step = adaptjax.data_parallel_step(loss, tx, mesh, donate=False)
    state = adaptjax.init_state({"w": jnp.ones(())}, tx, mesh)
    x = np.ones(16, np.float32)
    x[:2] = 0.0  # replica 0's two rows
    new, m = step(state, {"x": x})
    assert np.isfinite(float(m["loss"])) and float(m["nonfinite"]) == 1.0
    assert float(new.params["w"]) == 1.0 and int(new.nonfinite_count) == 1
    for a, c in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(new.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


@CHAINS
def test_the_guard_changes_nothing_on_a_finite_step(chain):
    mesh = adaptjax.make_mesh(8)
    tx = _adam(chain)
    out = []
    for guard in (True, False):
        step = adaptjax.data_parallel_step(_loss, tx, mesh, skip_nonfinite=guard)
        state = adaptjax.init_state(_mlp_params(), tx, mesh)
        for b in _batches(3, 32):
            state, m = step(state, b)
        out.append((jax.device_get((state.params, state.opt_state)), float(m["loss"])))
    # the update runs unchanged inside the guard's taken branch: the same arithmetic
    for a, c in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def _all_reduces(step, state, batch):
    return step.lower(state, batch).compile().as_text().count(" all-reduce(")


@pytest.mark.parametrize("microbatches", [1, 2])
def test_the_guarded_chains_guard_adds_no_collective_and_matches_optax_chain(microbatches):
    # The same links in optax.chain and guarded_chain: identical states and losses
    # step by step (a skipped step among them), but the guard of guarded_chain sends
    # its scalars in the gradients' all-reduce: one all-reduce per step, not two.
    mesh = adaptjax.make_mesh(8)
    mons = (adaptjax.GradientNoiseScale(), adaptjax.GradientNorm())
    batches = _batches(4, 32)
    batches[2]["x"][7, 2] = np.nan
    out, counts = [], []
    for chain in (optax.chain, guarded_chain):
        tx = chain(adaptjax.sync_gradients("data", monitors=mons), optax.adam(1e-2))
        step = adaptjax.data_parallel_step(_loss, tx, mesh, microbatches=microbatches)
        state = adaptjax.init_state(_mlp_params(), tx, mesh)
        counts.append(_all_reduces(step, state, batches[0]))
        losses = []
        for b in batches:
            state, m = step(state, b)
            losses.append((float(m["loss"]), float(m["nonfinite"])))
        out.append((jax.device_get((state.params, state.opt_state)), losses))
    assert counts == [2, 1]
    np.testing.assert_array_equal(np.array(out[0][1]), np.array(out[1][1]))  # NaN == NaN
    assert [f for _, f in out[1][1]] == [0.0, 0.0, 1.0, 0.0]
    for a, c in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(out[1][0]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-7)


def test_the_guarded_chain_has_optax_chains_state_and_updates():
    params = {"w": jnp.arange(3.0), "b": jnp.ones(2)}
    g = {"w": jnp.array([1.0, -2.0, 0.5]), "b": jnp.array([0.1, 0.2])}
    links = [optax.scale_by_adam(), optax.scale(-0.1)]
    for ours, theirs in (
        (guarded_chain(*links), optax.chain(*links)),
        (named_chain(("a", links[0]), ("s", links[1])),
         optax.named_chain(("a", links[0]), ("s", links[1]))),
    ):
        s1, s2 = ours.init(params), theirs.init(params)
        assert jax.tree.structure(s1) == jax.tree.structure(s2)
        u1, s1 = ours.update(g, s1, params)
        u2, s2 = theirs.update(g, s2, params)
        for a, c in zip(jax.tree.leaves((u1, s1)), jax.tree.leaves((u2, s2)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
        assert ours.sync is None  # no sync link first: the step guards it like optax.chain
    sync = adaptjax.sync_gradients("data")
    tx = named_chain(
        ("sync", sync), ("opt", optax.sgd(0.1)), ("n", adaptjax.update_norm())
    )
    state = tx.init(params)
    first, rest = tx.split_state(state)
    assert tx.sync is sync and isinstance(first, SyncState)
    assert sorted(rest) == ["n", "opt"]
    assert jax.tree.structure(tx.join_state(first, rest)) == jax.tree.structure(state)


# --- bad inputs: one-line ValueErrors before anything compiles -----------------


def _one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_batch_not_divisible_raises_before_compiling():
    mesh = adaptjax.make_mesh(8)
    tx = _adam()
    step = adaptjax.data_parallel_step(_loss, tx, mesh, microbatches=2)
    state = adaptjax.init_state(_mlp_params(), tx, mesh)
    with pytest.raises(ValueError) as e:
        step(state, _batches(1, 24)[0])
    assert "multiple of 16" in _one_line(e)
    assert step.jitted._cache_size() == 0


def test_mesh_without_data_axis():
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    with pytest.raises(ValueError) as e:
        adaptjax.data_parallel_step(_loss, _adam(), mesh)
    assert "no 'data' axis" in _one_line(e)


def test_more_devices_than_exist():
    with pytest.raises(ValueError) as e:
        adaptjax.make_mesh(9)
    assert "only 8 exist" in _one_line(e)


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5, 1.5])
def test_ema_decay_outside_open_unit_interval(decay):
    with pytest.raises(ValueError) as e:
        adaptjax.GradientNoiseScale(decay=decay)
    assert "(0, 1)" in _one_line(e)
    with pytest.raises(ValueError):
        adaptjax.GradientSNR(decay=decay)


def test_integer_gradients_raise_at_trace_time():
    tx = adaptjax.sync_gradients("data")
    mesh = adaptjax.make_mesh(8)
    f = jax.jit(
        jax.shard_map(
            lambda g: tx.update(g, tx.init(g))[0],
            mesh=mesh,
            in_specs=jax.P("data"),
            out_specs=jax.P(),
        )
    )
    with pytest.raises(ValueError) as e:
        f(jnp.arange(8, dtype=jnp.int32))
    assert "floating point" in _one_line(e)
    with pytest.raises(ValueError) as e:
        adaptjax.init_state({"w": jnp.arange(3)}, tx, mesh)
    assert "cast integer parameters" in _one_line(e)


def test_already_reduced_gradients_are_rejected():
    tx = adaptjax.sync_gradients("data")
    mesh = adaptjax.make_mesh(8)

    def f(p, x):
        g = jax.grad(lambda p: jnp.sum(x * p))(p)  # check_vma=True: jax sums g
        return tx.update(g, tx.init(g))[0]

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(jax.P(), jax.P("data")), out_specs=jax.P()))
    with pytest.raises(ValueError) as e:
        fn(jnp.float32(1.0), jnp.arange(8.0))
    assert "already reduced" in _one_line(e)


def test_steps_in_flight_on_cpu_are_bounded(monkeypatch):
    from adaptjax import _step

    waited = []
    real = jax.block_until_ready
    monkeypatch.setattr(_step.jax, "block_until_ready", lambda x: waited.append(x) or real(x))
    mesh = adaptjax.make_mesh(8)
    tx = _adam()
    step = adaptjax.data_parallel_step(_loss, tx, mesh)
    state = adaptjax.init_state(_mlp_params(), tx, mesh)
    losses = []
    for i, b in enumerate(_batches(10, 64)):
        state, metrics = step(state, b)
        losses.append(metrics.values)  # the step's one metrics buffer
        assert len(step._in_flight) == min(i + 1, _step.CPU_MAX_STEPS_IN_FLIGHT)
    # before call i (0-based) the metrics of call i - 4 were waited for, oldest first
    assert [id(x) for x in waited] == [id(x) for x in losses[: 10 - _step.CPU_MAX_STEPS_IN_FLIGHT]]


_DISPATCH_AHEAD = r"""
import os, sys
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                           "--xla_cpu_collective_call_terminate_timeout_seconds=30")
os.environ.pop("PJRT_NPROC", None)  # the client's default pool: max(cores, devices)
import jax, jax.numpy as jnp, numpy as np, optax
import adaptjax
from adaptjax import _step
if sys.argv[1] == "unbounded":
    _step.CPU_MAX_STEPS_IN_FLIGHT = None
mesh = adaptjax.make_mesh(8)
tx = optax.chain(adaptjax.sync_gradients("data"), optax.sgd(1e-4))
def loss(p, b):
    h = b["x"]
    for _ in range(4):
        h = jnp.tanh(h @ p["w"])
    return jnp.mean(h ** 2)
step = adaptjax.data_parallel_step(loss, tx, mesh)
if sys.argv[1] == "unbounded":
    step._max_in_flight = None
state = adaptjax.init_state({"w": jnp.eye(256) * 0.5}, tx, mesh)
batch = {"x": np.ones((512, 256), np.float32)}
for _ in range(200):  # never reads a result back: dispatch runs ahead of the devices
    state, metrics = step(state, batch)
print(float(metrics["loss"]) >= 0)
"""


@pytest.mark.slow
def test_a_loop_that_never_reads_back_does_not_deadlock_xla_cpu(tmp_path):
    # 8 simulated devices on fewer cores: unbounded, XLA:CPU's pool deadlocks
    # (threads parked in a collective rendezvous and in the in-flight semaphore)
    # and the 30 s collective timeout aborts the process.
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _DISPATCH_AHEAD, "bounded"], cwd=tmp_path, capture_output=True,
        text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True"


def test_compiler_options_keep_the_passes_xla_flags_disable(monkeypatch):
    from adaptjax import _xla_options

    monkeypatch.setenv(
        "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_disable_hlo_passes=a,b"
    )
    assert _xla_options._disabled_passes_in_env() == ["a", "b"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert _xla_options._disabled_passes_in_env() == []
    # one process: XLA's defaults, whatever the flags
    assert _xla_options.step_compiler_options(adaptjax.make_mesh(8)) is None


@pytest.mark.parametrize("microbatches", [1, 2])
def test_per_example_aux_is_gathered_in_batch_order(microbatches):
    """Logits come back as the unsharded forward pass computes them, row for row."""

    def loss_aux(p, b):
        logits = b["x"] @ p["w1"]
        return _loss(p, b), {"logits": logits, "mean_x": jnp.mean(b["x"])}

    mesh = adaptjax.make_mesh(8)
    tx = _adam()
    step = adaptjax.data_parallel_step(loss_aux, tx, mesh, has_aux=True,
                                       microbatches=microbatches)
    state = adaptjax.init_state(_mlp_params(), tx, mesh)
    b = _batches(1, 32)[0]
    want = np.asarray(b["x"]) @ np.asarray(state.params["w1"])
    _, m = step(state, b)
    got = np.asarray(m["aux"]["logits"])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert float(m["aux"]["mean_x"]) == pytest.approx(float(b["x"].mean()), rel=1e-5)


def test_aux_neither_scalar_nor_per_example_is_one_line():
    def loss_aux(p, b):
        return _loss(p, b), {"w": p["w1"]}

    mesh = adaptjax.make_mesh(8)
    tx = _adam()
    step = adaptjax.data_parallel_step(loss_aux, tx, mesh, has_aux=True)
    state = adaptjax.init_state(_mlp_params(), tx, mesh)
    with pytest.raises(ValueError) as e:
        step(state, _batches(1, 32)[0])
    shape = tuple(_mlp_params()["w1"].shape)
    assert str(e.value) == (
        f"aux['w'] has shape {shape}, but a replica's batch has 4 rows: aux may hold scalars "
        "(averaged over replicas) and per-example arrays with the batch's leading axis "
        "(gathered in batch order)")
