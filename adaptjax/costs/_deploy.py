"""Deployment search: the cheapest cluster that meets a deadline, or the fastest within a budget.

A :class:`Catalogue` lists device kinds with their price per device-hour, the
device counts on offer and a step-time model per kind, fed into the cost
model (:class:`~adaptjax.costs.StepTimeModel`): either a roofline (a compute
rate in FLOP/s and a link bandwidth) or measured steps ``[[devices, batch,
seconds], ...]`` the model is fitted on. A deployment is ``(kind, devices,
mesh shape, batch)`` on a ``data`` × ``fsdp`` mesh; its step's collectives are
the data-parallel all-reduce of each device's gradient shard and, with
``fsdp > 1``, FSDP's two all-gathers of the weights and one reduce-scatter of
the gradients. A mesh whose per-device state does not fit a kind's memory is
never offered.

:func:`search_deployment` answers from the model alone (``probe=None``), or,
given a ``probe`` that runs a few steps of a deployment and returns its
seconds per step, searches by Bayesian optimisation with the model as the
Gaussian process's prior mean and expected improvement per dollar of
probing (HeterBO, ``method="heterbo"``), against CherryPick's plain expected
improvement with a constant mean (``"ei"``) and random search (``"random"``).
The Gaussian process is scikit-learn's :class:`GaussianProcessRegressor`
(Matérn 5/2 with one length scale per feature plus a white-noise term, its
hyperparameters fitted by maximum likelihood after each probe): a
well-tested, widely used implementation that is already a test dependency,
small next to BoTorch (no torch) and, unlike scikit-optimize's or Optuna's
loops, lets the acquisition be our own (a prior mean, a per-probe price, a
constraint in closed form).

The model is of log step time ``s``; with ``log s ~ N(μ, σ²)`` and an
objective ``k·s`` (the job's dollars for a deadline, its hours for a budget)
that is feasible while ``s ≤ s_max``, the expected improvement over the best
feasible value ``f*`` is, with ``u = min(f*/k, s_max)`` and ``z = (ln u − μ)/σ``::

    EI = f*·Φ(z) − k·exp(μ + σ²/2)·Φ(z − σ)

References:
  Yi, Zhang, Zhang, Yang, Qi, Wu and Xiao, "Optimizing Distributed Training
  Deployment in Heterogeneous GPU Clusters" (MLCD, HeterBO), IPDPS 2020.
  Alipourfard et al., "CherryPick: Adaptively Unearthing the Best Cloud
  Configurations for Big Data Analytics", NSDI 2017.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import numpy as np

from adaptjax._wire import Collective, WireReport
from adaptjax.costs._compute import ComputeModel
from adaptjax.costs._links import LinkModel
from adaptjax.costs._meshes import mesh_shapes
from adaptjax.costs._model import Observation, StepTimeModel, _sent

_AXES = ("data", "fsdp")
_METHODS = ("heterbo", "ei", "random")
_PRIOR_SIGMA = 0.3  # the model's error in log step time before any probe (30 %)


class Infeasible(ValueError):
    """No deployment meets the deadline (or the budget); the message names the nearest one."""


class _Config(NamedTuple):
    """A RunConfig-like configuration for :meth:`StepTimeModel.predict`."""

    devices: int  # replicas (the "data" axis)
    device_count: int
    batch_size: int
    microbatches: int = 1
    codec: None = None
    sync: None = None


@dataclasses.dataclass(frozen=True)
class Deployment:
    """A deployment with its step time, the job's hours and dollars on it.

    Attributes:
      kind: the device kind's name.
      devices: how many devices.
      mesh: ``{"data": replicas, "fsdp": shards}``.
      batch_size: the global batch.
      step_time: seconds per step (predicted, or measured by a probe).
      hours: the job's remaining steps at that speed.
      cost: dollars for those hours.
      probes: what the search probed, in order (each with its measured time).
      exploration_cost: dollars the probes cost.
    """

    kind: str
    devices: int
    mesh: Mapping[str, int]
    batch_size: int
    step_time: float
    hours: float
    cost: float
    probes: tuple[Deployment, ...] = ()
    exploration_cost: float = 0.0

    @property
    def label(self) -> str:
        """``"8 x a100 (data=4,fsdp=2) batch 512"``."""
        shape = ",".join(f"{a}={n}" for a, n in self.mesh.items())
        return f"{self.devices} x {self.kind} ({shape}) batch {self.batch_size}"

    def __str__(self) -> str:
        return (f"{self.label}: {self.step_time:.4g} s/step, {self.hours:.3g} h, "
                f"${self.cost:.2f}")


@dataclasses.dataclass(frozen=True)
class _Kind:
    name: str
    price_per_hour: float
    counts: tuple[int, ...]
    model: StepTimeModel
    memory: float | None  # bytes per device


class _Candidate(NamedTuple):
    kind: int
    devices: int
    fsdp: int
    batch_size: int


@dataclasses.dataclass(frozen=True)
class Catalogue:
    """Device kinds on offer, and the model they would train.

    Build it with :meth:`from_json` (a file or a dict)::

      {"model": {"parameters": 1.2e8, "flops_per_sample": 7.2e11},
       "batch_sizes": [256, 512, 1024],
       "kinds": [{"name": "a100", "price_per_hour": 3.0, "devices": [1, 64],
                  "flops": 1.5e14, "bandwidth": 2.5e10, "memory_gb": 40},
                 {"name": "t4", "price_per_hour": 0.5, "devices": [1, 16, 64],
                  "measured": [[1, 64, 0.31], [4, 512, 0.65]], "bandwidth": 1.25e9}]}

    ``devices`` is ``[lo, hi]`` (the powers of two between, and ``hi``) or a
    list of three or more counts. Optional per kind: ``latency`` (seconds per
    message step), ``step_overhead`` (fixed seconds per step of the roofline),
    ``memory_gb``. Optional in ``model``: ``gradient_bytes_per_parameter``
    (default 4) and ``state_bytes_per_parameter`` (default 16: weights,
    gradients and Adam's two moments in float32); activations are not counted.

    Attributes:
      kinds: the device kinds.
      batch_sizes: the global batches to choose from.
      parameters: the model's parameters.
      state_bytes_per_parameter: bytes of state per parameter, split by ``fsdp``.
    """

    kinds: tuple[_Kind, ...]
    batch_sizes: tuple[int, ...]
    parameters: float
    state_bytes_per_parameter: float = 16.0
    gradient_bytes_per_parameter: float = 4.0

    @classmethod
    def from_json(cls, source: str | os.PathLike | Mapping[str, Any]) -> Catalogue:
        """A catalogue from a JSON file's path or its parsed dict (one-line errors)."""
        if isinstance(source, Mapping):
            data = source
        else:
            try:
                with open(source) as f:
                    data = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"catalogue {source}: cannot read it as JSON ({e})") from None
        try:
            model = data["model"]
            params = float(model["parameters"])
            flops = float(model.get("flops_per_sample", 0.0))
            grad = float(model.get("gradient_bytes_per_parameter", 4.0))
            batches = tuple(int(b) for b in data["batch_sizes"])
            raw_kinds = data["kinds"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"catalogue: needs 'model' (with 'parameters'), 'batch_sizes' and 'kinds'; {e!r}"
            ) from None
        if not raw_kinds or not batches or min(batches) < 1 or params <= 0:
            raise ValueError("catalogue: needs >= 1 kind, batch sizes >= 1 and parameters > 0")
        kinds = tuple(_kind(k, flops, params * grad) for k in raw_kinds)
        return cls(kinds, batches, params, float(model.get("state_bytes_per_parameter", 16.0)),
                   grad)

    def step_time(self, kind: str, mesh: Mapping[str, int], batch_size: int) -> float:
        """The cost model's seconds per step of ``kind`` on ``mesh`` at ``batch_size``.

        Example:
          >>> from adaptjax.costs import Catalogue
          >>> cat = Catalogue.from_json({"model": {"parameters": 1e6, "flops_per_sample": 1e9},
          ...     "batch_sizes": [64], "kinds": [{"name": "x", "price_per_hour": 1.0,
          ...     "devices": [1, 8], "flops": 1e12, "bandwidth": 1e9}]})
          >>> cat.step_time("x", {"data": 1, "fsdp": 1}, 64)  # 64 samples x 1 ms
          0.064
        """
        names = [k.name for k in self.kinds]
        if kind not in names or set(mesh) - set(_AXES):
            raise ValueError(f"catalogue: no deployment {kind!r} on {dict(mesh)}: kinds are "
                             f"{', '.join(names)}, mesh axes {', '.join(_AXES)}")
        index = names.index(kind)
        shape = {a: int(mesh.get(a, 1)) for a in _AXES}
        return self._predict(_Candidate(index, shape["data"] * shape["fsdp"], shape["fsdp"],
                                        int(batch_size)))

    def _predict(self, c: _Candidate) -> float:
        kind = self.kinds[c.kind]
        data = c.devices // c.fsdp
        config = _Config(data, c.devices, c.batch_size)
        wire = _wire(data, c.fsdp, self.parameters * self.gradient_bytes_per_parameter)
        return kind.model.predict(config, wire).step_time

    def _candidates(self) -> list[_Candidate]:
        """Every deployment whose state fits its kind's memory."""
        out = []
        for i, kind in enumerate(self.kinds):
            for n in kind.counts:
                for b in self.batch_sizes:
                    for shape in mesh_shapes(n, _AXES, b):
                        state = self.parameters * self.state_bytes_per_parameter / shape["fsdp"]
                        if kind.memory is None or state <= kind.memory:
                            out.append(_Candidate(i, n, shape["fsdp"], b))
        if not out:
            raise ValueError(
                "catalogue: no deployment holds the model's state in its devices' memory; offer "
                "more devices (FSDP splits the state) or kinds with more memory"
            )
        return out


def _kind(raw: Mapping[str, Any], flops_per_sample: float, gradient_bytes: float) -> _Kind:
    """One device kind of a catalogue, with its step-time model."""
    name = raw.get("name", "?")
    try:
        price = float(raw["price_per_hour"])
        counts = _counts(raw["devices"])
        link = LinkModel.from_bandwidth(float(raw["bandwidth"]), float(raw.get("latency", 0.0)))
    except (KeyError, TypeError) as e:
        raise ValueError(
            f"catalogue kind {name!r}: needs price_per_hour, devices ([lo, hi] or a list of "
            f"counts) and bandwidth (bytes/s); {e!r}"
        ) from None
    except ValueError as e:
        raise ValueError(f"catalogue kind {name!r}: {e}") from None
    links = {"*": link}
    if "measured" in raw:
        obs = [Observation(_Config(int(n), int(n), int(b)),
                           WireReport(tuple(_wire(int(n), 1, gradient_bytes))),
                           float(t)) for n, b, t in raw["measured"]]
        model = StepTimeModel.fit(links, obs)
        if model.compute is None:
            raise ValueError(f"catalogue kind {name!r}: 'measured' needs steps at >= 2 "
                             "per-device batch sizes; measure another batch")
        model = dataclasses.replace(model, compute=model.compute.on_own_devices())
    elif "flops" in raw and flops_per_sample > 0:
        compute = ComputeModel(fixed=float(raw.get("step_overhead", 0.0)),
                               per_sample=flops_per_sample / float(raw["flops"]))
        model = StepTimeModel(links, compute)
    else:
        raise ValueError(f"catalogue kind {name!r}: give 'measured' steps, or 'flops' (FLOP/s) "
                         "with the model's flops_per_sample")
    memory = raw.get("memory_gb")
    return _Kind(str(name), price, counts, model, None if memory is None else memory * 2**30)


def _counts(devices: Sequence[int]) -> tuple[int, ...]:
    if len(devices) != 2:
        counts = sorted({int(n) for n in devices})
    else:
        lo, hi = int(devices[0]), int(devices[1])
        counts = sorted({n for n in (2**i for i in range(hi.bit_length())) if lo <= n} | {hi})
    if not counts or counts[0] < 1:
        raise ValueError(f"device counts must be >= 1, got {list(devices)}")
    return tuple(counts)


def _wire(data: int, fsdp: int, gradient_bytes: float) -> list[Collective]:
    """A data × fsdp step's collectives: the gradient sync, FSDP's gathers and scatter."""

    def coll(kind, n, message, axis):
        sent = _sent(kind, n, message)
        return Collective(kind, "f32", (), 0, n, sent, sent, "f32", axes=(axis,))

    out = []
    if data > 1:
        out.append(coll("all-reduce", data, gradient_bytes / fsdp, "data"))
    if fsdp > 1:
        out += [coll("all-gather", fsdp, gradient_bytes, "fsdp")] * 2
        out.append(coll("reduce-scatter", fsdp, gradient_bytes, "fsdp"))
    return out


class _Problem(NamedTuple):
    """A job's candidates; per candidate an objective ``k·s``, feasible while ``s ≤ s_max``."""

    candidates: list[_Candidate]
    prior: np.ndarray  # the cost model's seconds per step
    price: np.ndarray  # dollars per hour of the whole deployment
    steps: np.ndarray  # the job's steps at the candidate's batch
    k: np.ndarray
    s_max: np.ndarray


def _problem(catalogue: Catalogue, steps, samples, deadline, budget) -> _Problem:
    if (steps is None) == (samples is None):
        raise ValueError("search_deployment: give the job's remaining steps= or samples=, not both")
    if (deadline is None) == (budget is None):
        raise ValueError("search_deployment: give a deadline= (hours) or a budget= ($), not both")
    for name, v in (("steps", steps), ("samples", samples), ("deadline", deadline),
                    ("budget", budget)):
        if v is not None and not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
            raise ValueError(f"search_deployment: {name} must be a positive number, got {v!r}")
    cands = catalogue._candidates()
    prior = np.array([catalogue._predict(c) for c in cands])
    price = np.array([catalogue.kinds[c.kind].price_per_hour * c.devices for c in cands])
    n = np.array([steps if steps is not None else math.ceil(samples / c.batch_size)
                  for c in cands], dtype=np.float64)
    if deadline is not None:  # minimise dollars, hours <= deadline
        return _Problem(cands, prior, price, n, n * price / 3600, deadline * 3600 / n)
    return _Problem(cands, prior, price, n, n / 3600, budget * 3600 / (n * price))


def _deployment(catalogue: Catalogue, p: _Problem, i: int, seconds: float) -> Deployment:
    c = p.candidates[i]
    hours = float(p.steps[i] * seconds / 3600)
    return Deployment(catalogue.kinds[c.kind].name, c.devices,
                      {"data": c.devices // c.fsdp, "fsdp": c.fsdp}, c.batch_size, seconds,
                      hours, hours * float(p.price[i]))


def _infeasible(catalogue: Catalogue, p: _Problem, seen: Mapping[int, float], deadline, steps,
                samples) -> Infeasible:
    """The one-line answer when nothing seen meets the deadline (or budget)."""
    what = f"{steps} steps" if steps is not None else f"{samples} samples"
    if deadline is not None:
        i = min(seen, key=lambda j: p.steps[j] * seen[j])
        d = _deployment(catalogue, p, i, seen[i])
        return Infeasible(f"no deployment finishes {what} in {deadline:g} h: the fastest, "
                          f"{d.label}, takes {d.hours:.3g} h; extend the deadline or offer "
                          "faster devices")
    i = min(seen, key=lambda j: p.steps[j] * p.price[j] * seen[j])
    d = _deployment(catalogue, p, i, seen[i])
    return Infeasible(f"no deployment finishes {what} within the budget: the cheapest, "
                      f"{d.label}, costs ${d.cost:.2f}; raise the budget or offer cheaper devices")


def search_deployment(
    catalogue: Catalogue,
    *,
    steps: int | None = None,
    samples: int | None = None,
    deadline: float | None = None,
    budget: float | None = None,
    probe: Callable[[str, dict[str, int], int], float] | None = None,
    method: str = "heterbo",
    probe_steps: int = 20,
    max_probes: int = 30,
    tolerance: float = 0.01,
    seed: int = 0,
) -> Deployment:
    """The cheapest deployment finishing a job by ``deadline``, or the fastest within ``budget``.

    Args:
      catalogue: the device kinds on offer (:meth:`Catalogue.from_json`).
      steps: the job's remaining steps (whatever the batch), or
      samples: its remaining samples (``ceil(samples / batch)`` steps).
      deadline: hours the job may take (minimise dollars), or
      budget: dollars it may cost (minimise hours).
      probe: ``probe(kind, mesh, batch_size) -> seconds per step``, measured by
        running ``probe_steps`` steps there; ``None``: answer from the cost
        model alone, probing nothing.
      method: ``"heterbo"`` (the model as the prior mean, expected improvement
        per dollar of probing), ``"ei"`` (CherryPick: constant mean, plain
        expected improvement, three random probes first) or ``"random"``.
      probe_steps: steps one probe runs (what it costs: their time × price).
      max_probes: the most probes.
      tolerance: stop once no deployment's expected improvement exceeds this
        fraction of the best value found (0: probe until ``max_probes``).
      seed: of the random choices.

    Returns:
      The best deployment found (measured when probed), with its ``probes`` and
      their ``exploration_cost``.

    Raises:
      ValueError: (``Infeasible``) nothing seen meets the deadline or budget:
        one line naming the fastest (or cheapest) deployment and its time (cost).

    Example:
      >>> from adaptjax.costs import Catalogue, search_deployment
      >>> cat = Catalogue.from_json({"model": {"parameters": 1e6, "flops_per_sample": 1e9},
      ...     "batch_sizes": [64], "kinds": [{"name": "x", "price_per_hour": 1.0,
      ...     "devices": [1, 8], "flops": 1e12, "bandwidth": 1e9}]})
      >>> # 1 device: 0.064 h; 2: 32 ms of compute + a 4 MB all-reduce at 1 GB/s (4 ms)
      >>> print(search_deployment(cat, steps=3600, deadline=0.05))
      2 x x (data=2,fsdp=1) batch 64: 0.036 s/step, 0.036 h, $0.07
    """
    if method not in _METHODS:
        raise ValueError(f"search_deployment: method must be one of {_METHODS}, got {method!r}")
    p = _problem(catalogue, steps, samples, deadline, budget)
    if probe is None:
        if method != "heterbo":
            raise ValueError(f"search_deployment: method={method!r} needs a probe; without one "
                             "the answer is the cost model's")
        seen = dict(enumerate(p.prior.tolist()))
        return _best(catalogue, p, seen, (), 0.0, deadline, steps, samples)
    rng = np.random.default_rng(seed)
    seen: dict[int, float] = {}
    probes, spent = [], 0.0
    while len(seen) < min(max_probes, len(p.candidates)):
        i = _next(method, p, seen, rng, tolerance, catalogue, seed)
        if i is None:
            break
        c = p.candidates[i]
        seconds = float(probe(catalogue.kinds[c.kind].name,
                              {"data": c.devices // c.fsdp, "fsdp": c.fsdp}, c.batch_size))
        seen[i] = seconds
        probes.append(_deployment(catalogue, p, i, seconds))
        spent += probe_steps * seconds * float(p.price[i]) / 3600
    return _best(catalogue, p, seen, tuple(probes), spent, deadline, steps, samples)


def _best(catalogue, p, seen, probes, spent, deadline, steps, samples) -> Deployment:
    ok = [i for i, s in seen.items() if s <= p.s_max[i]]
    if not ok:
        raise _infeasible(catalogue, p, seen, deadline, steps, samples)
    i = min(ok, key=lambda j: (p.k[j] * seen[j], p.candidates[j].devices))
    return dataclasses.replace(_deployment(catalogue, p, i, seen[i]), probes=probes,
                               exploration_cost=spent)


def _next(method, p: _Problem, seen, rng, tolerance, catalogue, seed) -> int | None:
    """The next candidate to probe, or ``None`` when none is worth it."""
    left = np.array([i for i in range(len(p.candidates)) if i not in seen])
    if method == "random" or (method == "ei" and len(seen) < 3):
        return int(rng.choice(left))
    mu, sigma = _posterior(method, p, seen, catalogue, seed)
    mu, sigma = mu[left], np.maximum(sigma[left], 1e-6)
    feasible = [p.k[i] * s for i, s in seen.items() if s <= p.s_max[i]]
    best = min(feasible) if feasible else float(np.max(p.k * p.s_max))
    ei = _expected_improvement(mu, sigma, p.k[left], p.s_max[left], best)
    if feasible and ei.max() <= tolerance * best:
        return None
    score = ei
    if method == "heterbo":  # per dollar of probing: probe_steps × E[s] × price
        score = ei / (np.exp(mu + sigma**2 / 2) * p.price[left])
    return int(left[int(np.argmax(score))])


def _expected_improvement(mu, sigma, k, s_max, best) -> np.ndarray:
    """``E[(best − k·s)⁺ · 1[s ≤ s_max]]`` for ``log s ~ N(mu, sigma²)`` (module docstring)."""
    from scipy.stats import norm  # scipy comes with jax

    z = (np.log(np.minimum(best / k, s_max)) - mu) / sigma
    return np.maximum(best * norm.cdf(z) - k * np.exp(mu + sigma**2 / 2) * norm.cdf(z - sigma),
                      0.0)


def _posterior(method, p: _Problem, seen, catalogue, seed) -> tuple[np.ndarray, np.ndarray]:
    """Mean and deviation of log seconds per step at every candidate, from the probes."""
    log_prior = np.log(p.prior)
    if not seen:  # HeterBO before its first probe: the model, with its prior error
        return log_prior, np.full(len(log_prior), _PRIOR_SIGMA)
    import warnings

    try:
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel
    except ImportError:
        raise ImportError("search_deployment with a probe needs scikit-learn: pip install "
                          "scikit-learn") from None
    x = _features(p.candidates, len(catalogue.kinds))
    idx = list(seen)
    y = np.log([seen[i] for i in idx])
    mean = log_prior if method == "heterbo" else np.zeros(len(log_prior))
    kernel = (ConstantKernel(_PRIOR_SIGMA**2, (1e-4, 4.0))
              * Matern(cast(Any, np.ones(x.shape[1])), (0.05, 50.0), nu=2.5)
              + WhiteKernel(0.05**2, (1e-6, 0.1)))
    gp = GaussianProcessRegressor(kernel, normalize_y=method != "heterbo",
                                  n_restarts_optimizer=1, random_state=seed)
    with warnings.catch_warnings():  # a length scale at its bound is no error of the search
        warnings.simplefilter("ignore", ConvergenceWarning)
        gp.fit(x[idx], y - mean[idx])
    mu, sigma = cast(tuple[np.ndarray, np.ndarray], gp.predict(x, return_std=True))
    return mean + mu, sigma


def _features(cands: Sequence[_Candidate], kinds: int) -> np.ndarray:
    """Kind (one-hot), log2 devices, log2 batch and log2 FSDP shards, each about unit range."""
    out = np.zeros((len(cands), kinds + 3))
    for row, c in zip(out, cands, strict=True):
        row[c.kind] = 1.0
        row[kinds:] = (math.log2(c.devices) / 6, math.log2(c.batch_size) / 6, math.log2(c.fsdp) / 6)
    return out
