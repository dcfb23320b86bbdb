"""1-bit Adam under the Controller: it syncs the gradients itself, and a freeze keeps its state.

The controller recognises an optimizer that syncs the gradients itself (an
``OnebitAdamState`` in its state, through ``inject_hyperparams`` and
``optax.chain``) and gives it each replica's gradient: its chain's ``"sync"``
link passes the gradients through, so the step's collectives are
``onebit_adam``'s own (a dense all-reduce of the gradients during the
warm-up, the 1-bit momentum after it) and the non-finite guard's two scalars.
Identities checked (``K`` the step whose metrics a ``Schedule`` entry fires
on; it lands after step ``K + 1``):

* with ``freeze_step = 2**30`` the run is the controller's ``optax.adam`` run, bit for bit;
* ``SetHyperparams({"freeze_step": K})`` compiles nothing; ``nu`` stops after
  ``K + 1`` dense updates, and the first compressed update is
  ``-lr · clip(m̂ / (√(ν / (1 − b2^(K+1))) + eps), ±bound)``;
* a rescale keeps ``count``, ``mu`` and ``nu`` and the mean of the
  replicas' error-feedback residuals (the ``"mean"`` merge rule); a resume keeps
  every bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax
from adaptjax import compression as ajc
from adaptjax import policies as ajp

LR = 0.01
B1, B2, EPS = 0.9, 0.999, 1e-8
SHAPES = {"w": (64, 40), "b": (40,)}  # w (2560) is compressed, b (40) goes in a float32 psum


def _params():
    return {"w": jax.random.normal(jax.random.key(0), SHAPES["w"]) * 0.1,
            "b": jnp.zeros(SHAPES["b"])}


def _loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def _data(nan_row=None):
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(512, 64)).astype(np.float32),
            "y": rng.normal(size=(512, 40)).astype(np.float32)}
    if nan_row is not None:
        data["x"][nan_row, 0] = np.nan
    return adaptjax.ArrayDataset(data, shuffle=False)


def _onebit(freeze_step=2**30):
    return optax.inject_hyperparams(ajc.onebit_adam, hyperparam_dtype=jnp.float32)(
        LR, freeze_step=freeze_step)


def _controller(run_dir, optimizer, data=None, hooks=(), **spec):
    spec = adaptjax.RunSpec(run_dir=run_dir, devices=8, batch_size=32, policy_every=1, **spec)
    return adaptjax.Controller(_params(), _loss, optimizer, data or _data(), spec,
                               hooks=list(hooks))


def _adam():
    return optax.inject_hyperparams(optax.adam, hyperparam_dtype=jnp.float32)(LR)


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _onebit_state(ctrl):
    """The ``OnebitAdamState`` in the controller's state (host copy, global view)."""
    injected = ctrl.state.opt_state["optimizer"].inner_state
    return _host(injected.inner_state)


def test_warm_up_is_the_controllers_adam_bit_for_bit(tmp_path):
    """Bit for bit against Adam with its rate injected too; within rounding against a plain
    ``optax.adam(lr)``, whose rate XLA folds in as a constant (as injected Adam differs)."""
    runs = {"onebit": _onebit(), "adam": _adam(), "plain": optax.adam(LR)}
    ctrls = {name: _controller(tmp_path / name, opt) for name, opt in runs.items()}
    assert ctrls["onebit"].hyperparams["freeze_step"] == 2**30  # an int32 a policy may set
    for ctrl in ctrls.values():
        ctrl.run(4)
        ctrl.close()
    onebit, adam, plain = (_host(c.state.params) for c in ctrls.values())
    for k in SHAPES:  # the same mean gradient (one psum each), the same scale_by_adam
        np.testing.assert_array_equal(onebit[k], adam[k])
        # 4 steps of at most ~lr each, every one rounded a few ulps apart
        np.testing.assert_allclose(onebit[k], plain[k], rtol=0, atol=4 * LR * 1e-5)
    # no monitor reads a mean gradient the controller no longer forms (as under local SGD)
    metrics = ctrls["onebit"].latest_metrics
    assert "noise_scale" not in metrics and "noise_scale" in ctrls["adam"].latest_metrics


def test_the_step_sends_onebit_adams_collectives_only(tmp_path):
    """Branch by branch, what onebit_adam's own step sends (adaptjax.data_parallel_step):
    the warm-up's one dense all-reduce, not two."""
    tx = _onebit()
    mesh = adaptjax.make_mesh(8)
    own = adaptjax.data_parallel_step(_loss, tx, mesh, donate=False)
    state = adaptjax.init_state(_params(), tx, mesh)
    reports = {"own": adaptjax.wire_bytes(own, state, _data().batch_at(0, 32))}
    for name, opt in (("onebit", tx), ("adam", _adam())):
        ctrl = _controller(tmp_path / name, opt)
        args = ctrl.steps.abstract_args(ctrl.config, ctrl.data)
        reports[name] = adaptjax.wire_bytes(ctrl.steps.step(ctrl.config).jitted, *args)
        ctrl.close()
    compressed, warm_up = reports["onebit"].branch_totals()  # onebit_adam's lax.cond
    assert (compressed, warm_up) == pytest.approx(reports["own"].branch_totals(), rel=1e-12)
    ring = 2 * (8 - 1) / 8
    dense = ring * 4 * (64 * 40 + 40)  # every gradient once, in float32
    guard = ring * 4 * 2  # the non-finite guard's two scalars, a collective of their own
    assert warm_up == pytest.approx(dense + guard, rel=1e-9)
    assert compressed < dense / 4
    # the controller's Adam: the same dense all-reduce (the guard and monitors ride in it)
    assert dense < reports["adam"].total < dense + 8 * ring * 4


def test_set_hyperparams_freezes_with_the_state_and_no_compile(tmp_path):
    k = 3
    policy = ajp.Schedule({k: ajp.SetHyperparams({"freeze_step": k})})
    onebit = _controller(tmp_path / "onebit", _onebit(), policies=[policy])
    adam = _controller(tmp_path / "adam", _adam())
    onebit.run(k + 1)  # the entry fires on step k's metrics, once step k + 1 is dispatched
    adam.run(k + 1)
    assert onebit.hyperparams["freeze_step"] == k and onebit.compilations == 1
    for key in SHAPES:  # until then, Adam's updates
        np.testing.assert_array_equal(onebit.state.params[key], adam.state.params[key])
    before, frozen = _host(onebit.state.params), _onebit_state(onebit)
    assert int(frozen.count) == int(frozen.nu_count) == k + 1  # every step so far dense
    onebit.run(k + 2)  # the first compressed step
    after, s = _host(onebit.state.params), _onebit_state(onebit)
    bound = max(1.0, (1 - B1) / np.sqrt(1 - B2))
    for key in SHAPES:
        mu_hat = s.mu[key].astype(np.float64) / (1 - B1 ** (k + 2))
        nu_hat = s.nu[key].astype(np.float64) / (1 - B2 ** (k + 1))  # nu's own K + 1 updates
        want = -LR * np.clip(mu_hat / (np.sqrt(nu_hat) + EPS), -bound, bound)
        np.testing.assert_allclose(after[key] - before[key], want, rtol=1e-4, atol=1e-8)
    onebit.run(k + 5)
    s = _onebit_state(onebit)
    for key in SHAPES:
        np.testing.assert_array_equal(s.nu[key], frozen.nu[key])  # frozen
    assert int(s.count) == k + 5 and int(s.nu_count) == k + 1
    assert np.abs(s.feedback.worker.value["ef"]["w"]).max() > 0  # the 1-bit path ran
    assert onebit.compilations == 1  # the freeze is a value in the state
    onebit.close()
    adam.close()


def _assert_kept(new, old, n_to):
    assert int(new.count) == int(old.count) and int(new.nu_count) == int(old.nu_count)
    for k in SHAPES:
        np.testing.assert_array_equal(new.mu[k], old.mu[k])
        np.testing.assert_array_equal(new.nu[k], old.nu[k])
    ef_old, ef_new = old.feedback.worker.value["ef"]["w"], new.feedback.worker.value["ef"]["w"]
    assert ef_new.shape == (n_to, *SHAPES["w"]) and np.abs(ef_old.mean(0)).max() > 1e-4
    # the "mean" merge rule keeps the debt mean_i(e_i) (rounded once to float32)
    tol = 4 * np.finfo(np.float32).eps * np.abs(ef_old).max()
    np.testing.assert_allclose(ef_new.mean(0), ef_old.mean(0, dtype=np.float64), rtol=0, atol=tol)


def test_rescale_8_4_8_and_resume_keep_the_state(tmp_path):
    seen = []  # the state of the latest step, before that turn's decision is carried out

    def keep(ctrl):
        seen[:] = [_onebit_state(ctrl)]

    hook = adaptjax.Hook(keep)
    policy = ajp.Schedule({4: ajp.Rescale(devices=4), 6: ajp.Rescale(devices=8)})
    ctrl = _controller(tmp_path, _onebit(freeze_step=2), hooks=[hook], policies=[policy])
    ctrl.run(5)  # 8 -> 4 after step 5
    assert ctrl.config.devices == 4
    _assert_kept(_onebit_state(ctrl), seen[0], 4)
    ctrl.run(7)  # 4 -> 8 after step 7
    assert ctrl.config.devices == 8
    _assert_kept(_onebit_state(ctrl), seen[0], 8)
    state = _host(ctrl.state)
    ctrl.close()
    resumed = adaptjax.Controller.resume(tmp_path, model=_params(), loss_fn=_loss,
                                         optimizer=_onebit(freeze_step=2), data=_data(),
                                         spec=ctrl.spec, hooks=[])
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(_host(resumed.state)), strict=True):
        np.testing.assert_array_equal(a, b)
    resumed.close()


def test_a_nan_batch_is_skipped_on_every_replica(tmp_path):
    ctrl = _controller(tmp_path, _onebit(freeze_step=2), data=_data(nan_row=3 * 32 + 5))
    ctrl.run(3)  # compressed from step 3 on: residuals in the state
    ctrl.drain()
    before = _host(ctrl.state)
    with pytest.warns(RuntimeWarning, match="step 4 had a non-finite"):
        ctrl.run(4)  # one row of replica 1's share of step 4's batch is NaN
        ctrl.drain()
    assert ctrl.nonfinite_count == 1
    for k in SHAPES:  # every replica's copy of the params
        for shard in ctrl.state.params[k].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), before.params[k])
    after = _host(ctrl.state.opt_state)
    for a, b in zip(jax.tree.leaves(before.opt_state), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)  # counts, moments, each replica's residual
    ctrl.run(5)  # a clean batch: training goes on
    assert not np.array_equal(np.asarray(ctrl.state.params["w"]), before.params["w"])
    ctrl.close()


def test_a_codec_or_local_models_with_it_are_one_line_errors(tmp_path):
    clipped = optax.chain(optax.clip(1.0), _onebit())
    errors = [
        (dict(codec=ajc.onebit()), r"^codec=onebit\(.*\) cannot run with an optimizer that "
                                   r"syncs the gradients itself .*; drop codec=$"),
        (dict(sync=adaptjax.sync.LocalSGD(H=4)), r"^sync=LocalSGD\(.*; drop sync=$"),
        (dict(monitors=[adaptjax.GradientNorm()]), r"^monitors= cannot run .*; drop monitors=$"),
    ]
    for spec, message in errors:
        with pytest.raises(ValueError, match=message):
            _controller(tmp_path / "refused", clipped, **spec)
    assert not (tmp_path / "refused").exists()  # nothing written
    ctrl = _controller(tmp_path / "run", clipped, checkpoint=adaptjax.CheckpointOptions(every=2))
    ctrl.run(2)
    state, config = ctrl.state, ctrl.config
    for action in (ajp.SetCodec(ajc.onebit()), ajp.SetSync(adaptjax.sync.LocalSGD(H=4))):
        with pytest.raises(ValueError, match=r"^Set(Codec|Sync)\(.*\) cannot run with an "
                                             r"optimizer that syncs .*; keep .* while it runs$"):
            ctrl.apply([action])
    assert ctrl.state is state and ctrl.config == config and ctrl.checkpoints.all_steps() == [2]
    ctrl.run(3)  # and the run goes on
    ctrl.close()
