"""The critical-batch probe: branches trained from the live state, the main run untouched.

A :class:`adaptjax.policies.Probe` (``batch_sizes``, ``steps``, ``lr_rule``)
asks the controller how much a step at each batch size B is worth now. From
the state the run is in (its dispatched steps recorded), every branch

* trains on the same T = ``steps`` x max(B) samples, read ahead of the data
  cursor with ``batch_at`` (the cursor never moves): K_B = T // B steps of its
  own batch, at the configuration a ``SetBatchSize(B)`` would lead to (so its
  compiled step is the one the main run would use, and the one the
  background compiler prepares when the probe is announced);
* at the learning rate lr x ``lr_scale(lr_rule, B / M)`` (M the current
  batch; for ``"adascale"`` the gain from the recorded ``grad_variance`` and
  ``grad_sqnorm``, taken whole for an optimizer without a second moment (no
  ``nu`` in its state: SGD, momentum) and as its square root for every other
  optimizer, as ``lr_scale`` does for Adam);
* for ``"adascale"`` and an optimizer with a second moment, with the
  second-moment estimate ν of every Adam-like state (a ``nu`` field) divided
  by the same gain r (see below);
* on a copy of the state (the step donates its input; random streams advance
  in the copy only);

and is then evaluated on the E samples that follow the T (E = T, at least
:data:`MIN_EVAL_SAMPLES`), as is the state the branches started from. With
``lr_multipliers`` a batch trains once per factor on its rate and its lowest
loss counts. The drops L0 - L_B are fitted by
``fit_critical_batch``.
Nothing of the main run changes: its state, data cursor, metrics and step
count are those of a run that never probed.

**What the measurement rests on.** A branch's drop follows the model
ΔL(B) = ΔL_max / (1 + B_crit / B) per step when its learning rate is near the
best one for B and its K_B steps leave the loss's landscape about where it
was. At a learning rate far below the best, the drop is first order in the
learning rate and follows the rule's ratios instead: the probe then measures
``lr_rule`` (for ``"adascale"``: the noise scale the rule was given), not the
batch. Short branches (small ``steps``) and a rule close to the best one are
what make the fit the batch's.

**Adam's moments in a branch.** Adam's ν (b2 = 0.999: a memory of ~1000
steps) holds E[g²] of the run's batch M; a branch of a few dozen steps cannot
refit it. With σ² and μ² as AdaScale reads them, E[g²] at batch B is
∝ μ² + σ²M/B, which is ν x 1/r with r = (σ² + μ²) / (σ²M/B + μ²) the
AdaScale gain; ``"adascale"`` for Adam scales the rate by √r on the premise
that ν is the batch's, so the branch gets that ν (ν / r), and its update is
r times the run's: AdaScale's SGD gain, the ratio of the best rates ε*(B) /
ε*(M). Measured on the byte-level LM (the adaptive-batch benchmark, 8-step
probes): from a batch-32 state, a batch-8 branch lost 0.075 with ν kept and
0.018 with ν / r; from a batch-16 state it gained 0.014 and 0.029. Other
rules leave ν as it is (they are rules for a run that keeps its moments).
Evaluation noise is small beside the drops (1,024 and 8,192 evaluation
samples gave drops within 0.004); what remains is the training noise of one
short trajectory (the run's own continuation over 1,024 samples from the
batch-32 state moved the loss by -0.002 to +0.026, depending on the
samples), so branches must be long enough for their drops to stand above it:
16 steps of the largest did there.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from adaptjax import policies as ajp
from adaptjax._run_config import RunConfig
from adaptjax._state import merge_model
from adaptjax.controller._background import BackgroundCompiler
from adaptjax.controller._carry_out import hyperparams_of, write_hyperparams
from adaptjax.controller._metrics_reader import MetricsReader
from adaptjax.controller._run_clock import RunClock
from adaptjax.controller._step_cache import OPTIMIZER, StepCache, chain_state
from adaptjax.policies._critical_batch import CriticalBatchFit, fit_critical_batch
from adaptjax.policies._goodput import lr_scale
from adaptjax.sync._strategy import consensus_params

#: The fewest samples a probe evaluates its branches on (they share them, so their
#: evaluation noise is mostly common to all; the rest must stay below the drops).
MIN_EVAL_SAMPLES = 1024
#: The hyperparameter a branch's learning rate is written into.
LR_KEY = "learning_rate"


@dataclasses.dataclass(frozen=True)
class Branch:
    """One branch of a probe: its configuration, optimizer steps and learning rate."""

    config: RunConfig
    steps: int
    learning_rate: float | None  # None: the rule is "none" and the state's rate stays
    nu_scale: float | None = None  # the factor on Adam's ν; None: ν stays
    lr_multiplier: float = 1.0  # the probe's factor on the rule's rate (in learning_rate)


def branch_lr_factor(rule: str, scale: float, metrics: Mapping[str, float],
                     batch_size: int, sgd: bool) -> float | None:
    """``lr_scale(rule, scale)`` with AdaScale's gain from ``metrics``; ``None`` without them.

    ``"adascale"`` reads σ² = ``grad_variance`` / M (the variance of a batch-M
    gradient) and μ² = ``grad_sqnorm``, else the noise scale φ = σ²M/μ² alone;
    ``sgd`` takes the gain whole, otherwise its square root.

    Example:
      >>> from adaptjax.controller._probe_branch import branch_lr_factor
      >>> branch_lr_factor("sqrt", 4.0, {}, 32, sgd=False)
      2.0
      >>> branch_lr_factor("adascale", 4.0, {"grad_variance": 32.0, "grad_sqnorm": 1.0}, 32,
      ...                  sgd=True)  # gain (1 + 1) / (1/4 + 1)
      1.6
    """
    kind = "sgd" if sgd else "adam"
    if rule != "adascale":
        return lr_scale(rule, scale)
    variance, sqnorm = metrics.get("grad_variance"), metrics.get("grad_sqnorm")
    phi = metrics.get("noise_scale")
    if _finite(variance) and _finite(sqnorm) and sqnorm > 0:
        sigma_sq, mu_sq = variance / batch_size, sqnorm
    elif _finite(phi) and metrics.get("noise_scale_valid", 1.0) > 0:
        sigma_sq, mu_sq = max(phi, 0.0) / batch_size, 1.0
    else:
        return None
    return lr_scale(rule, scale, optimizer_kind=kind, sigma_sq=sigma_sq, mu_sq=mu_sq)


def _is_moment(x) -> bool:
    return isinstance(x, tuple) and "nu" in getattr(x, "_fields", ())


def has_second_moment(opt_state) -> bool:
    """Whether a state in ``opt_state`` has a ``nu`` (Adam's ν): the optimizer is Adam-like."""
    return any(_is_moment(x) for x in jax.tree.leaves(opt_state, is_leaf=_is_moment))


def scale_second_moment(opt_state, factor: float):
    """``opt_state`` with the ``nu`` of every state that has one (Adam's ν) times ``factor``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from adaptjax.controller._probe_branch import scale_second_moment
      >>> state = optax.adam(0.1).init(jnp.zeros(2))
      >>> state = state[0]._replace(nu=jnp.ones(2)), state[1]
      >>> scale_second_moment(state, 0.5)[0].nu.tolist()
      [0.5, 0.5]
    """
    def scale(x):
        if not _is_moment(x):
            return x
        return x._replace(nu=jax.tree.map(lambda v: v * jnp.asarray(factor, v.dtype), x.nu))

    return jax.tree.map(scale, opt_state, is_leaf=_is_moment)


def best_per_batch(branches: list[Branch], losses: list[float]) -> tuple[list[Branch], list[float]]:
    """Per batch size (in order), the branch of lowest loss and that loss (NaN counts as worst).

    Example:
      >>> from adaptjax.controller._probe_branch import Branch, best_per_batch
      >>> from adaptjax._run_config import RunConfig
      >>> c8, c16 = RunConfig(devices=1, batch_size=8), RunConfig(devices=1, batch_size=16)
      >>> branches = [Branch(c8, 4, 0.1, None, 1.0), Branch(c8, 4, 0.2, None, 2.0),
      ...             Branch(c16, 2, 0.1, None, 1.0), Branch(c16, 2, 0.2, None, 2.0)]
      >>> best, losses = best_per_batch(branches, [2.0, 1.5, 1.8, float("nan")])
      >>> [(b.config.batch_size, b.lr_multiplier) for b in best], losses
      ([(8, 2.0), (16, 1.0)], [1.5, 1.8])
    """
    def rank(loss: float) -> tuple[bool, float]:
        return math.isnan(loss), loss

    chosen: dict[int, tuple[Branch, float]] = {}
    for branch, loss in zip(branches, losses, strict=True):
        b = branch.config.batch_size
        if b not in chosen or rank(loss) < rank(chosen[b][1]):
            chosen[b] = (branch, loss)
    return [c[0] for c in chosen.values()], [c[1] for c in chosen.values()]


def _finite(x: object) -> TypeGuard[float]:
    return isinstance(x, int | float) and math.isfinite(x)


def plan_branches(probe: ajp.Probe, config: RunConfig, plan: Callable[[list], RunConfig],
                  hyperparams: Mapping[str, float], metrics: Mapping[str, float],
                  sgd: bool) -> tuple[list[Branch], int] | str:
    """``(branches, T)`` of ``probe`` from ``config``, or the reason it cannot run.

    Each size goes through ``plan`` (the controller's transition planning:
    rounded to a multiple of replicas x micro-batches); sizes that round alike
    are one batch. Each batch has one branch per ``probe.lr_multipliers``
    factor, in the order of the factors.
    """
    configs = sorted({plan([ajp.SetBatchSize(b)]) for b in probe.batch_sizes},
                     key=lambda c: c.batch_size)
    if len(configs) < 3:
        return (f"its batch sizes {list(probe.batch_sizes)} round to "
                f"{[c.batch_size for c in configs]} on {config.devices} replicas x "
                f"{config.microbatches} micro-batches: fewer than 3 branches")
    lr = hyperparams.get(LR_KEY)
    sweep = probe.lr_multipliers != (1.0,)
    if (probe.lr_rule != "none" or sweep) and lr is None:
        what = (f"lr_multipliers={probe.lr_multipliers}" if probe.lr_rule == "none"
                else f"lr_rule={probe.lr_rule!r}")
        return (f"{what} scales the hyperparameter {LR_KEY!r}, which this optimizer does not "
                f"have ({sorted(hyperparams)}); use lr_rule='none' and lr_multipliers=(1.0,)")
    total = probe.steps * configs[-1].batch_size
    branches = []
    for c in configs:
        factor = branch_lr_factor(probe.lr_rule, c.batch_size / config.batch_size, metrics,
                                  config.batch_size, sgd)
        if factor is None:
            return ("lr_rule='adascale' needs grad_variance and grad_sqnorm (or a valid "
                    "noise_scale) in the recorded metrics; monitor the noise scale or use "
                    "lr_rule='sqrt'")
        # "adascale" for Adam: lr x sqrt(r) and nu / r, i.e. nu at batch B (module docstring)
        nu = 1.0 / factor**2 if probe.lr_rule == "adascale" and not sgd else None
        for m in probe.lr_multipliers:
            rate = None if lr is None or (probe.lr_rule == "none" and not sweep) \
                else lr * factor * m
            branches.append(Branch(c, total // c.batch_size, rate, nu, m))
    return branches, total


class ProbeRunner:
    """Runs a controller's probes: branches on copies of its state, a fit, events.

    Args:
      steps: the controller's :class:`StepCache`.
      data: its dataset (a probe needs ``batch_at``).
      compiler: its :class:`BackgroundCompiler` (a branch waits for a compile
        of its configuration under way there, as a step does).
      clock: its :class:`RunClock`, which keeps the probes' seconds and the
        latest fit for the metrics rows.
      reader: its :class:`MetricsReader`, whose step clock restarts after a
        probe (the probe's time is no step's).
      plan: ``actions -> Transition`` from the configuration in force (the
        controller's transition planning).
    """

    def __init__(self, steps: StepCache, data, compiler: BackgroundCompiler, clock: RunClock,
                 reader: MetricsReader, plan: Callable[[list], Any]):
        self.steps, self.data, self.compiler, self.clock, self.plan = (
            steps, data, compiler, clock, plan)
        self.reader = reader
        self._losses: dict[Any, Callable] = {}  # jitted evaluation loss per precision

    def run(self, probe: ajp.Probe, state, config: RunConfig, metrics: Mapping[str, float],
            step: int) -> list[dict]:
        """Runs ``probe`` from ``state`` (left untouched); returns the events to log.

        A ``compile`` event (``probe=True``) for each branch step that
        compiled, then one ``probe`` event, or one ``probe_skipped`` event
        that says why (a dataset without ``batch_at``, several processes,
        fewer than 3 distinct branches, a learning-rate rule without what it
        reads).
        """
        why = _unsupported(self.data, self.steps.accumulates)
        planned = why or plan_branches(
            probe, config, lambda a: self.plan(a).config, hyperparams_of(state), metrics,
            sgd=not has_second_moment(chain_state(state.opt_state)[OPTIMIZER]))
        if isinstance(planned, str):
            return [{"kind": "probe_skipped", "reason": f"{probe!r}: {planned}"}]
        branches, total = planned
        t0 = time.perf_counter()
        cursor = self.data.cursor
        chunk = branches[-1].config.batch_size
        evaluate, eval_samples = self._evaluator(config, state, cursor + total,
                                                 max(total, MIN_EVAL_SAMPLES), chunk)
        start = evaluate(state)
        events, all_losses = [], []
        for branch in branches:
            end, compiled = self._train(branch, state, cursor)
            all_losses.append(evaluate(end))
            if compiled is not None:
                events.append(compiled)
        best, losses = best_per_batch(branches, all_losses)
        drops = [start - loss for loss in losses]
        sizes = [b.config.batch_size for b in best]
        event: dict[str, Any] = {
            "kind": "probe", "batch_sizes": sizes, "branch_steps": [b.steps for b in best],
            "learning_rates": [b.learning_rate for b in best], "lr_rule": probe.lr_rule,
            "samples": total, "eval_samples": eval_samples, "loss_start": start,
            "losses": losses, "drops": drops, "noise_scale": metrics.get("noise_scale"),
        }
        if probe.lr_multipliers != (1.0,):  # the sweep: every branch's loss, by batch
            event["lr_multipliers"] = [b.lr_multiplier for b in best]
            event["sweep"] = {str(b.config.batch_size): [] for b in best}
            for b, loss in zip(branches, all_losses, strict=True):
                event["sweep"][str(b.config.batch_size)].append([b.lr_multiplier, loss])
        try:
            fit = fit_critical_batch(sizes, drops, steps=[b.steps for b in best])
        except ValueError as error:  # e.g. a branch that diverged: nothing to fit
            fit = CriticalBatchFit(math.nan, math.nan, math.nan)
            event["error"] = str(error)
        event.update(critical_batch=fit.critical_batch, max_improvement=fit.max_improvement,
                     fit_rmse=fit.rmse, latency_s=time.perf_counter() - t0)
        self.clock.probed(event["latency_s"], fit.critical_batch, step)
        self.reader.restart_clock()
        return [*events, event]

    def _train(self, branch: Branch, state, cursor: int) -> tuple[Any, dict | None]:
        """``branch``'s end state from a copy of ``state``; its compile event or ``None``."""
        config = branch.config
        fn = self.steps.step(config)
        self.compiler.wait_for(config)
        # the step donates its input: the branch runs on a copy, the main state stays
        copy = jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, state)
        if branch.learning_rate is not None:
            copy = write_hyperparams(copy, {LR_KEY: branch.learning_rate},
                                     self.steps.mesh(config.devices))
        if branch.nu_scale is not None:
            copy = dataclasses.replace(copy, opt_state=scale_second_moment(copy.opt_state,
                                                                           branch.nu_scale))
        b = config.batch_size
        event = None
        for k in range(branch.steps):
            before, t0 = fn.jitted._cache_size(), time.perf_counter()
            copy, _ = fn(copy, self.data.batch_at(cursor + k * b, b))
            if k == 0 and fn.jitted._cache_size() > before:  # this call compiled
                event = {"kind": "compile", "probe": True, "latency_s": time.perf_counter() - t0,
                         "config": dataclasses.asdict(config)}
                if config in self.compiler.compiled_ahead:
                    event["compiled_ahead"] = True
        return copy, event

    def _evaluator(self, config: RunConfig, state, at: int, samples: int,
                   chunk: int) -> tuple[Callable[[Any], float], int]:
        """``(state -> mean loss, samples)`` on ``samples`` (whole chunks) from ``at``."""
        mesh = self.steps.mesh(config.devices)
        rows = NamedSharding(mesh, P("data"))
        chunks = [jax.device_put(self.data.batch_at(at + k * chunk, chunk), rows)
                  for k in range(-(-samples // chunk))]
        loss = self._loss(config, state.graphdef)

        def evaluate(s) -> float:
            params = consensus_params(s.params, s.opt_state)
            values = [loss(params, s.model_state, batch) for batch in chunks]
            return float(np.mean(jax.device_get(values)))

        return evaluate, len(chunks) * chunk

    def _loss(self, config: RunConfig, graphdef) -> Callable:
        """The jitted mean loss of ``config``'s precision (the step's decode included)."""
        key = config.precision
        if key not in self._losses:
            loss, has_aux = self.steps.loss(config), self.steps.has_aux

            def mean_loss(params, model_state, batch):
                out = loss(merge_model(graphdef, params, model_state), batch)
                return out[0] if has_aux else out

            self._losses[key] = jax.jit(mean_loss)
        return self._losses[key]


def _unsupported(data, accumulates: bool = False) -> str | None:
    """Why a probe cannot read its samples here, or ``None``."""
    if accumulates:
        return ("a probe's branches do not run accumulated micro-steps yet "
                "(RunSpec.micro_batch_size is set)")
    if not hasattr(data, "batch_at"):
        return (f"{type(data).__name__} has no batch_at: a probe reads its samples ahead of "
                "the data cursor without moving it (use adaptjax.ArrayDataset)")
    if jax.process_count() > 1:
        return "a probe runs in one process only for now"
    return None

