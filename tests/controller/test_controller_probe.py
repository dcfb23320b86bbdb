"""The critical-batch probe: branches from the live state that leave the main run bit-exact.

The analytic check is whitened linear regression (as in
``tests/test_noise_scale_analytic.py``): x ~ N(0, I_d), y = ε ~ N(0, σ²),
per-example loss ½(x·w − y)², so at w = δ the gradient has mean G = δ, the
Hessian is I and tr Σ = (d+1)|δ|² + dσ². One SGD step of batch B at learning
rate ε lowers the loss by ε|G|² − ½ε²(|G|² + tr Σ / B) in expectation; at
ε = c·ε*(B), with ε*(B) = 1 / (1 + B_simple / B) the best rate, that is
(c − c²/2)·|G|² ε*(B) = (2c − c²)·ΔL_max / (1 + B_simple / B): McCandlish et
al.'s model with B_crit = B_simple = tr Σ / |G|². AdaScale's gain for SGD,
r(B/M) = (σ² + μ²) / (σ²M/B + μ²), is exactly ε*(B) / ε*(M), so a probe with
``lr_rule="adascale"`` from the rate c·ε*(M) trains every branch at c·ε*(B).
With c small the K_B = T/B steps of a branch leave w about where it was
(the parameters move by a fraction ≈ c·T / B_simple), the drops add up to
K_B times one step's, and the branches' sampling noise is, to first order,
common to all of them (same samples, same evaluation set): the fit recovers
B_simple. (At c this small the drop is first order in ε, so the rule's ratios
— from the monitor's own σ² and μ² — carry most of the answer; the test
checks the probe's branches, learning rates, evaluation and fit end to end
against the analytic value, not that the probe is independent of the rule.)
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _controller_args import make_controller  # noqa: E402
from flax import nnx

import adaptjax
from adaptjax import policies as ajp
from adaptjax._transition import plan_transition
from adaptjax.cli._report import summary_markdown

D, SIGMA = 16, 1.0
TIMING = {"step_time", "throughput", "compile_seconds", "train_seconds", "probe_seconds"}
PROBE_KEYS = {"critical_batch", "critical_batch_step"}


class Net(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.linear(x))))[:, 0]


def _net_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _rows(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _run_net(run_dir, policies, steps=24):
    x = np.random.default_rng(0).normal(size=(2048, 4)).astype(np.float32)
    model = Net(nnx.Rngs(params=0, dropout=1))
    model.train()
    ctrl = make_controller(
        model=model, loss_fn=_net_loss,
        optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
        data=adaptjax.ArrayDataset({"x": x, "y": np.sin(x).sum(1)}, seed=0),
        devices=2, batch_size=16, policies=policies, policy_every=4,
        run_dir=run_dir, progress=False, tensorboard=False, compilation_cache_dir=None,
    )
    ctrl.run(steps)
    state = jax.device_get(ctrl.state)
    out = (state, ctrl.data.cursor, ctrl.samples_seen, list(ctrl.log.events))
    ctrl.close()
    return out


def test_a_probe_leaves_the_main_run_bit_exact(tmp_path):
    probe = ajp.Probe((8, 16, 32), steps=2, lr_rule="sqrt")
    state, cursor, seen, events = _run_net(tmp_path / "probe", [ajp.Schedule({8: probe})])
    plain, plain_cursor, plain_seen, _ = _run_net(tmp_path / "plain", [])
    # params, optimizer state (monitors' averages included), step and non-finite
    # counters and the dropout streams' key data: equal bit for bit
    leaves, plain_leaves = jax.tree.leaves(state), jax.tree.leaves(plain)
    assert len(leaves) == len(plain_leaves)
    for a, b in zip(leaves, plain_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    keys = jax.tree.leaves(state.model_state)
    assert any(np.asarray(k).dtype == np.uint32 for k in keys)  # the RNG key data is compared
    assert (cursor, seen) == (plain_cursor, plain_seen) == (24 * 16, 24 * 16)
    # the metrics rows are the plain run's, but for the probe's own keys and timings
    rows, plain_rows = _rows(tmp_path / "probe"), _rows(tmp_path / "plain")
    assert [r["step"] for r in rows] == [r["step"] for r in plain_rows] == list(range(1, 25))
    for r, p in zip(rows, plain_rows, strict=True):
        assert {k: v for k, v in r.items() if k not in TIMING | PROBE_KEYS} == {
            k: v for k, v in p.items() if k not in TIMING}
    # the probe: decided on step 8's metrics, run from the state after step 9's dispatch
    (event,) = [e for e in events if e["kind"] == "probe"]
    assert event["batch_sizes"] == [8, 16, 32] and event["branch_steps"] == [8, 4, 2]
    assert event["samples"] == 64 and event["eval_samples"] == 1024
    assert event["learning_rates"] == pytest.approx([1e-2 * 0.5**0.5, 1e-2, 1e-2 * 2**0.5])
    assert event["drops"] == pytest.approx([event["loss_start"] - x for x in event["losses"]])
    assert event["latency_s"] > 0
    later = [r for r in rows if r["step"] > event["step"]]
    assert later and all(r["probe_seconds"] > 0 for r in later)
    if np.isfinite(event["critical_batch"]) or event["critical_batch"] == np.inf:
        assert all(r["critical_batch"] == event["critical_batch"]
                   and r["critical_batch_step"] == event["step"] for r in later)
    assert not any("critical_batch" in r for r in rows if r["step"] <= event["step"])
    # adaptjax report's summary.md: the probe beside the noise scale, and its share of the run
    text = summary_markdown(str(tmp_path / "probe"))
    assert "## Critical-batch probes" in text and "Probes took " in text
    assert f"| {event['step']} | 8, 16, 32 | " in text


@pytest.mark.parametrize("multipliers", [(1.0,), (0.5, 1.0, 2.0)], ids=["rule", "sweep"])
def test_the_probe_finds_the_analytic_critical_batch_of_linear_regression(tmp_path, multipliers):
    # a sweep: at c x the best rate, c << 1, a step's drop (2c - c²) ΔL_max / (1 + B_simple / B)
    # grows with c, so every batch's best factor is the largest, and B_crit stays B_simple
    delta = np.full(D, 0.125, np.float32)  # |δ|² = 0.25
    g2 = float(delta @ delta)
    b_simple = ((D + 1) * g2 + D * SIGMA**2) / g2  # 81
    batch, c = 64, 0.02
    rate = c / (1 + b_simple / batch)  # c x the best rate at the main batch
    rng = np.random.default_rng(0)
    n = 32768
    x = rng.normal(size=(n, D)).astype(np.float32)
    y = (SIGMA * rng.normal(size=n)).astype(np.float32)  # w* = 0
    probe = ajp.Probe((4, 8, 16, 32, 64), steps=1, lr_rule="adascale", lr_multipliers=multipliers)
    ctrl = make_controller(
        model={"w": jnp.asarray(delta)},
        loss_fn=lambda p, b: 0.5 * jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
        optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=1e-7),  # w stays at δ meanwhile
        data=adaptjax.ArrayDataset({"x": x, "y": y}, seed=0), devices=4, batch_size=batch,
        monitors=(adaptjax.GradientNoiseScale(decay=0.99),),
        policies=[ajp.Schedule({300: [ajp.SetHyperparams({"learning_rate": rate}), probe]})],
        run_dir=tmp_path / "run", progress=False, tensorboard=False, compilation_cache_dir=None,
    )
    ctrl.run(302)
    (event,) = [e for e in ctrl.log.events if e["kind"] == "probe"]
    ctrl.close()
    assert event["batch_sizes"] == [4, 8, 16, 32, 64]
    assert event["branch_steps"] == [16, 8, 4, 2, 1]
    assert event["critical_batch"] == pytest.approx(b_simple, rel=0.15)
    # each batch's chosen branch at c x m x its own best rate (the monitor's σ², μ² within
    # their error), m the largest factor; its loss the lowest of the batch's branches
    top = max(multipliers)
    best = [top * c / (1 + b_simple / b) for b in event["batch_sizes"]]
    assert event["learning_rates"] == pytest.approx(best, rel=0.15)
    if multipliers == (1.0,):
        assert "sweep" not in event and "lr_multipliers" not in event
        return
    assert event["lr_multipliers"] == [top] * 5
    for b, loss in zip(event["batch_sizes"], event["losses"], strict=True):
        sweep = event["sweep"][str(b)]
        assert [m for m, _ in sweep] == list(multipliers)
        assert loss == min(x for _, x in sweep)


def test_a_dataset_without_batch_at_skips_the_probe_and_says_why(tmp_path):
    def examples(epoch):
        rng = np.random.default_rng(epoch)
        return ({"x": rng.normal(size=4).astype(np.float32)} for _ in range(256))

    ctrl = make_controller(
        model={"w": jnp.zeros(4)}, loss_fn=lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2),
        optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        data=adaptjax.IterableDataset(examples), devices=2, batch_size=8,
        policies=[ajp.Schedule({2: ajp.Probe((4, 8, 16), steps=1)})], policy_every=1,
        run_dir=tmp_path / "run", progress=False, tensorboard=False, compilation_cache_dir=None,
    )
    ctrl.run(5)
    (event,) = [e for e in ctrl.log.events if e["kind"].startswith("probe")]
    ctrl.close()
    assert event["kind"] == "probe_skipped"
    assert "IterableDataset has no batch_at" in event["reason"]
    assert "use adaptjax.ArrayDataset" in event["reason"]


def test_the_transition_carries_the_probe_and_the_later_one_wins():
    config = adaptjax.RunConfig(devices=2, batch_size=16)
    first, second = ajp.Probe((8, 16, 32)), ajp.Probe((4, 8, 16), steps=3)
    t = plan_transition([first, ajp.SetBatchSize(32), second], config, max_devices=8)
    assert t.probe == second and t.config.batch_size == 32
    assert plan_transition([ajp.Checkpoint()], config, max_devices=8).probe is None


def test_adascale_branches_of_adam_take_the_second_moment_of_their_batch():
    # gain r = (σ² + μ²) / (σ²M/B + μ²) with σ² = grad_variance / M: lr x √r and ν / r for Adam
    from adaptjax._run_config import RunConfig
    from adaptjax.controller._probe_branch import plan_branches

    config, m = RunConfig(devices=2, batch_size=16), 16
    metrics = {"grad_variance": 32.0, "grad_sqnorm": 1.0}  # σ² = 2, μ² = 1
    plan = lambda actions: config.replace(batch_size=actions[0].batch_size)  # noqa: E731
    probe = ajp.Probe((8, 16, 64), steps=1, lr_rule="adascale")
    gains = [(2.0 + 1.0) / (2.0 * m / b + 1.0) for b in (8, 16, 64)]
    branches, _ = plan_branches(probe, config, plan, {"learning_rate": 0.1}, metrics, sgd=False)
    assert [b.learning_rate for b in branches] == pytest.approx([0.1 * r**0.5 for r in gains])
    assert [b.nu_scale for b in branches] == pytest.approx([1.0 / r for r in gains])
    for sgd, rule in ((True, "adascale"), (False, "sqrt"), (False, "none")):
        probe = ajp.Probe((8, 16, 64), steps=1, lr_rule=rule)
        branches, _ = plan_branches(probe, config, plan, {"learning_rate": 0.1}, metrics, sgd=sgd)
        assert all(b.nu_scale is None for b in branches)  # ν stays as the run's


def test_a_second_moment_divided_by_r_enters_adams_next_update():
    # Adam: ν' = b2 ν/r + (1 - b2) g², m' = b1 m + (1 - b1) g, update -lr m̂' / √ν̂' (eps = 0);
    # the first moment and the count are left as they were
    from adaptjax.controller._probe_branch import scale_second_moment

    b1, b2, lr, r = 0.9, 0.999, 0.1, 4.0
    opt = optax.chain(optax.clip(10.0), optax.adam(lr, b1=b1, b2=b2, eps=0.0))
    params = {"w": jnp.zeros(3)}
    g = np.asarray([0.5, -1.0, 2.0], np.float32)
    _, state = opt.update({"w": jnp.asarray(g)}, opt.init(params), params)  # one step's moments
    scaled = scale_second_moment(state, 1.0 / r)
    np.testing.assert_array_equal(scaled[1][0].mu["w"], state[1][0].mu["w"])
    np.testing.assert_allclose(scaled[1][0].nu["w"], state[1][0].nu["w"] / r, rtol=1e-7)
    assert int(scaled[1][0].count) == int(state[1][0].count) == 1
    update, _ = opt.update({"w": jnp.asarray(g)}, scaled, params)
    nu = b2 * (1 - b2) * g**2 / r + (1 - b2) * g**2
    mu = b1 * (1 - b1) * g + (1 - b1) * g
    expected = -lr * (mu / (1 - b1**2)) / np.sqrt(nu / (1 - b2**2))
    np.testing.assert_allclose(update["w"], expected, rtol=1e-4)  # float32


def test_a_sweep_branches_every_batch_once_per_factor_on_its_rules_rate():
    from adaptjax._run_config import RunConfig
    from adaptjax.controller._probe_branch import plan_branches

    config = RunConfig(devices=2, batch_size=16)
    plan = lambda actions: config.replace(batch_size=actions[0].batch_size)  # noqa: E731
    sweep = ajp.Probe((8, 16, 64), steps=2, lr_rule="sqrt", lr_multipliers=(0.5, 2.0))
    branches, total = plan_branches(sweep, config, plan, {"learning_rate": 0.1}, {}, sgd=False)
    assert total == 128
    assert [(b.config.batch_size, b.steps, b.lr_multiplier) for b in branches] == [
        (8, 16, 0.5), (8, 16, 2.0), (16, 8, 0.5), (16, 8, 2.0), (64, 2, 0.5), (64, 2, 2.0)]
    rule = [(8 / 16) ** 0.5] * 2 + [1.0] * 2 + [2.0] * 2
    assert [b.learning_rate for b in branches] == pytest.approx(
        [0.1 * r * m for r, m in zip(rule, [0.5, 2.0] * 3, strict=True)])
    # lr_rule="none": the run's rate times each factor
    none = ajp.Probe((8, 16, 64), steps=2, lr_rule="none", lr_multipliers=(0.5, 2.0))
    branches, _ = plan_branches(none, config, plan, {"learning_rate": 0.1}, {}, sgd=False)
    assert [b.learning_rate for b in branches] == pytest.approx([0.05, 0.2] * 3)
    # an optimizer without a learning rate: a reason, not a crash
    why = plan_branches(none, config, plan, {"momentum": 0.9}, {}, sgd=False)
    assert why == ("lr_multipliers=(0.5, 2.0) scales the hyperparameter 'learning_rate', which "
                   "this optimizer does not have (['momentum']); use lr_rule='none' and "
                   "lr_multipliers=(1.0,)")
