"""Gradient-statistics monitors that run inside the sync transformation.

A monitor never adds a full-size collective. The sync transformation computes
each replica's squared gradient norm (or the sum over its micro-batches) and
the squared norm of the averaged gradient; scalars a monitor needs from every
replica ride in the same all-reduce as the gradients (XLA emits one tuple
all-reduce). Monitors then update small float32 EMAs.

References:
  McCandlish, Kaplan, Amodei, "An Empirical Model of Large-Batch Training",
  2018, appendix A.1. Qiao et al., "Pollux", OSDI 2021 (preconditioned noise
  scale). Mai et al., "KungFu", OSDI 2020 (in-step monitors).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from adaptjax._tree import tree_sq_norm

_TINY = 1e-30


class GradStats(NamedTuple):
    """What the sync transformation hands to every monitor (inside ``shard_map``).

    Attributes:
      local_grads: this replica's gradient (mean over its local batch).
      mean_grads: the gradient averaged over replicas (what the optimizer sees).
      local_sq: the psum over replicas of each replica's sum of ``‖g‖²`` over its
        gradient samples (one sample per micro-batch when micro-batch norms were
        supplied, else one).
      mean_sq: ``‖mean_grads‖²``.
      n_replicas: replicas on the axis (static).
      samples_per_replica: gradient samples per replica (``k`` micro-batches): static,
        or an int32 when the micro-steps are set at run time (``adaptjax.accumulate``).
      local_batch_size: examples per replica per step, or ``None`` if unknown.
      summed: the psum over replicas of every scalar returned by a monitor's
        ``local_scalars``, keyed like the monitor returned them.
      mean_sample: with a codec, ``(indices, exact mean values, weight)`` per
        leaf (leaf order) at coordinates shared by all replicas; ``mean_sq`` is
        then estimated from them (``mean_grads`` is the codec's output). ``None``
        when the sync is dense.
    """

    local_grads: Any
    mean_grads: Any
    local_sq: jax.Array
    mean_sq: jax.Array
    n_replicas: int
    samples_per_replica: int | jax.Array
    local_batch_size: int | None
    summed: dict
    mean_sample: tuple | None = None


@runtime_checkable
class GradientMonitor(Protocol):
    """What :func:`adaptjax.sync_gradients` asks of a monitor: write your own with these four.

    A monitor is a plain object (it need not inherit from this class). Inside
    the sync's ``update``, for each step:

    1. ``local_scalars(local_grads, state)`` runs on every replica *before* the
       collective; the scalars it returns travel in the gradients' own
       all-reduce (summed over replicas), so a monitor never adds a collective;
    2. ``update(stats, state)`` runs after it, with a ``GradStats`` that
       holds this replica's gradient, the averaged one, the sync's squared norms
       and, in ``stats.summed``, the psum of this monitor's local scalars.

    Optionally, ``shares_state_with(other)`` and ``from_shared(metrics, stats)``
    let a monitor that would keep the same state as another one in the same
    sync (as :class:`GradientSNR` next to an identical
    :class:`GradientNoiseScale`) keep none and derive its metrics from the
    other's.

    All of it is traced inside ``jit``/``shard_map``: use ``jnp``, not Python
    control flow on values. The state must be a pytree whose structure never
    changes, replicated (the same on every replica), and ``update`` must return
    exactly ``metric_names()`` as float32 scalars.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, adaptjax
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from adaptjax._tree import tree_sq_norm
      >>> class MeanReplicaNorm:  # mean over replicas of ‖g_i‖, and how often measured
      ...     def metric_names(self):
      ...         return ("replica_norm", "replica_norm_steps")
      ...     def init(self, params):
      ...         return jnp.zeros((), jnp.int32)
      ...     def local_scalars(self, local_grads, state):
      ...         return {"norm": jnp.sqrt(tree_sq_norm(local_grads))}
      ...     def update(self, stats, state, **extra):
      ...         state = state + 1
      ...         mean = stats.summed["norm"] / stats.n_replicas
      ...         return state, {"replica_norm": mean, "replica_norm_steps": state}
      >>> isinstance(MeanReplicaNorm(), adaptjax.GradientMonitor)
      True
      >>> mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
      >>> tx = adaptjax.sync_gradients("data", monitors=(MeanReplicaNorm(),))
      >>> from adaptjax._metrics import collect_metrics
      >>> f = jax.shard_map(lambda g: collect_metrics(tx.update(g, tx.init(g))[1]),
      ...                   mesh=mesh, in_specs=P("data"), out_specs=P())
      >>> {k: float(v) for k, v in jax.jit(f)(jnp.arange(4.0)).items()}  # replica i holds i
      {'replica_norm': 1.5, 'replica_norm_steps': 1.0}
    """

    def metric_names(self) -> tuple[str, ...]:
        """The names of the metrics ``update`` reports; fixed, and unique across monitors."""
        ...

    def init(self, params: Any) -> Any:
        """The monitor's initial state (a pytree; ``()`` for none) for ``params``."""
        ...

    def local_scalars(self, local_grads: Any, state: Any) -> dict:
        """Scalars from this replica's gradient, psummed into ``GradStats.summed``.

        Args:
          local_grads: this replica's gradient (before the collective).
          state: the monitor's state.

        Returns:
          ``{key: scalar}`` (may be empty); keys are private to this monitor.
        """
        ...

    def update(self, stats: GradStats, state: Any, **extra: Any) -> tuple[Any, dict]:
        """One measurement.

        Args:
          stats: what the sync saw this step (``GradStats``).
          state: the monitor's state.
          **extra: e.g. ``params``; ignore what you do not use.

        Returns:
          ``(new_state, {name: scalar for name in metric_names()})``.
        """
        ...


def _check_decay(decay: float) -> None:
    if not 0.0 < decay < 1.0:
        raise ValueError(f"EMA decay must be in (0, 1), got {decay}; try 0.95")


def _ema(old, new, decay):
    return decay * old + (1.0 - decay) * new


def _debias(ema, count, decay):
    return ema / jnp.maximum(1.0 - decay ** count.astype(jnp.float32), _TINY)


class NoiseScaleState(NamedTuple):
    """State of :class:`GradientNoiseScale`.

    The scalars are packed into two vectors, ``counts`` and ``values``
    (each array leaf costs a buffer per device where a step crosses ``jit``);
    the properties name them. Build one with :meth:`make`.
    """

    counts: jax.Array  # int32 (3,): count, calls, nu_count
    values: jax.Array  # float32 (7,): the three EMAs, held (3), valid
    prev_grads: Any  # previous gradient, all leaves in one float32 vector (differencing) or ()
    nu: Any  # second-moment EMA of the averaged gradient (preconditioning) or ()

    @classmethod
    def make(
        cls,
        *,
        count: ArrayLike,
        calls: ArrayLike,
        nu_count: ArrayLike,
        sqnorm_ema: ArrayLike,
        variance_ema: ArrayLike,
        sqnorm_sq_ema: ArrayLike,
        held: ArrayLike,
        valid: ArrayLike,
        prev_grads: Any,
        nu: Any,
    ) -> NoiseScaleState:
        """A state from its named parts (scalars, and ``held`` of shape (3,))."""
        counts = jnp.stack([jnp.asarray(c, jnp.int32) for c in (count, calls, nu_count)])
        scalars = [jnp.asarray(v, jnp.float32).reshape(1)
                   for v in (sqnorm_ema, variance_ema, sqnorm_sq_ema)]
        flag = jnp.asarray(valid, jnp.float32).reshape(1)
        values = jnp.concatenate([*scalars, jnp.asarray(held, jnp.float32), flag])
        return cls(counts, values, prev_grads, nu)

    @property
    def count(self) -> jax.Array:
        """int32: EMA updates so far."""
        return self.counts[0]

    @property
    def calls(self) -> jax.Array:
        """int32: measured steps so far."""
        return self.counts[1]

    @property
    def nu_count(self) -> jax.Array:
        """int32: gradients the preconditioner has seen."""
        return self.counts[2]

    @property
    def sqnorm_ema(self) -> jax.Array:
        """EMA of the unbiased ``‖G‖²`` estimate."""
        return self.values[0]

    @property
    def variance_ema(self) -> jax.Array:
        """EMA of the unbiased ``tr(Σ)`` estimate."""
        return self.values[1]

    @property
    def sqnorm_sq_ema(self) -> jax.Array:
        """EMA of the square of the ``‖G‖²`` estimate (its standard error)."""
        return self.values[2]

    @property
    def held(self) -> jax.Array:
        """float32 (3,): the last valid (noise scale, ``‖G‖²``, ``tr Σ``)."""
        return self.values[3:6]

    @property
    def valid(self) -> jax.Array:
        """bool: whether the latest reading is valid."""
        return self.values[6] > 0


class _Samples(NamedTuple):
    """One step's gradient samples, as :class:`GradientNoiseScale`'s estimators read them."""

    local_g: Any  # this replica's gradient (preconditioned when asked)
    s_bar: Any  # the mean over the samples of their squared norms
    mean_sq: Any  # ‖Ḡ‖², the squared norm of their mean
    n: int | jax.Array  # samples per step: replicas x micro-batches (replicas when preconditioned)
    sample_b: Any  # examples per sample
    ok: Any  # bool: this step can be measured (the preconditioner has warmed up)
    nu: Any  # the preconditioner's second-moment EMA after this step (or ())
    nu_count: Any  # gradients it has seen after this step


class GradientNoiseScale:
    """The simple gradient noise scale ``B_simple = tr(Σ) / ‖G‖²``.

    With ``n`` gradient samples of ``b`` examples each (``n`` = replicas × micro-
    batches, ``s̄`` the mean of their squared norms, ``Ḡ`` their mean)::

        ‖G‖²_est  = (n·‖Ḡ‖² − s̄) / (n − 1)
        tr(Σ)_est = (s̄ − ‖Ḡ‖²) · n·b / (n − 1)

    Both are unbiased; their ratio is not, so each is smoothed by its own EMA
    with bias correction before dividing. With one sample per step (one
    replica, one micro-batch) set ``differencing=True``: consecutive steps are
    used as the two samples (``‖G‖² ≈ g_t·g_{t−1}``, ``tr(Σ) ≈ b‖g_t − g_{t−1}‖²/2``),
    which keeps a copy of the previous gradient.

    **Validity.** A reading is *valid* when the smoothed ``‖G‖²`` exceeds
    ``significance`` of its own standard errors (estimated from an EMA of the
    squared per-step estimates; from the second measured step on) and the ratio
    is finite. On a noise-dominated problem the smoothed ``‖G‖²`` can dip to ≤ 0
    or near it; dividing by it would report a meaningless number (≈ 1e31
    against a 1e-30 floor, or 1e3–1e4 × the truth just above 0). Instead the
    monitor holds its last valid ``noise_scale``, ``grad_sqnorm`` and
    ``grad_variance`` and reports ``noise_scale_valid = 0.0`` (``1.0`` when the
    reading is fresh). Before the first valid reading the values are 0.0 and
    the flag is 0.0. Policies (e.g. :class:`adaptjax.policies.AdaptiveBatchSize`)
    skip decisions on invalid readings. A zero ``tr(Σ)`` (a noiseless problem)
    is a valid ``B_simple = 0``.

    ``preconditioned=True`` gives Pollux's variant for Adam-like optimizers: the
    gradients are first divided elementwise by ``√v̂ + eps``, ``v`` an EMA of the
    averaged squared gradient kept by the monitor (an extra replicated buffer;
    each replica's preconditioned norm rides the one all-reduce as a scalar).
    The preconditioner used at step ``t`` is built from steps ``< t`` only, so it
    is independent of the samples it weights and both estimates stay unbiased
    for it. Steps are measured only once it has seen ``precond_warmup``
    gradients: an empty preconditioner is ``eps`` (a 1e16-fold weight) and one
    built from one or two gradients has heavy-tailed inverse (``E[1/χ²₁] = ∞``),
    either of which would swamp the EMAs for hundreds of steps.

    Reports ``noise_scale``, ``grad_sqnorm`` (‖G‖²), ``grad_variance``
    (tr Σ, per example) and ``noise_scale_valid``, prefixed with ``precond_``
    when preconditioned.

    Args:
      decay: EMA decay in (0, 1).
      preconditioned: divide by an Adam-style ``√v̂ + eps`` first.
      b2: decay of the preconditioner's second-moment EMA.
      eps: preconditioner epsilon.
      precond_warmup: gradients the preconditioner must have seen before a
        step is measured (``>= 1``; only with ``preconditioned``). Built from
        ``k`` gradients, ``1/v̂`` over-weights noise-dominated coordinates by
        about ``k/(k−2)``, so the default 50 keeps that bias near 4%.
      significance: standard errors by which the smoothed ``‖G‖²`` must exceed
        0 for a reading to be valid (``>= 0``; 0 accepts any positive value).
      differencing: keep the previous gradient so one sample per step works.
      local_batch_size: examples per replica per step; if ``None`` it must be
        passed to ``update`` as the extra argument ``local_batch_size`` (the step
        builder does).

    Example:
      >>> import jax.numpy as jnp, adaptjax
      >>> tx = adaptjax.sync_gradients("data", monitors=(adaptjax.GradientNoiseScale(),))
      >>> sorted(adaptjax.read_metrics(tx.init({"w": jnp.zeros(3)})))
      ['grad_sqnorm', 'grad_variance', 'noise_scale', 'noise_scale_valid']

    References:
      McCandlish et al., "An Empirical Model of Large-Batch Training", 2018.
      Qiao et al., "Pollux", OSDI 2021 (preconditioned noise scale).
    """

    def __init__(
        self,
        decay: float = 0.95,
        *,
        preconditioned: bool = False,
        b2: float = 0.999,
        eps: float = 1e-8,
        precond_warmup: int = 50,
        significance: float = 1.0,
        differencing: bool = False,
        local_batch_size: int | None = None,
    ):
        _check_decay(decay)
        if preconditioned:
            _check_decay(b2)
        if local_batch_size is not None and local_batch_size < 1:
            raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")
        if int(precond_warmup) < 1:
            raise ValueError(f"precond_warmup must be >= 1, got {precond_warmup}; try 50")
        if not float(significance) >= 0.0:
            raise ValueError(f"significance must be >= 0, got {significance}; try 1.0")
        self.decay = decay
        self.preconditioned = preconditioned
        self.b2 = b2
        self.eps = eps
        self.precond_warmup = int(precond_warmup)
        self.significance = float(significance)
        self.differencing = differencing
        self.local_batch_size = local_batch_size
        self.prefix = "precond_" if preconditioned else ""
        self.name = self.prefix + "noise_scale"

    def _config(self) -> tuple:
        """Everything that determines this monitor's state and values."""
        return (self.decay, self.preconditioned, self.b2, self.eps, self.precond_warmup,
                self.significance, self.differencing, self.local_batch_size)

    def metric_names(self) -> tuple[str, ...]:
        """The metrics this monitor reports, in order (fixed at construction)."""
        p = self.prefix
        return (self.name, p + "grad_sqnorm", p + "grad_variance", self.name + "_valid")

    def init(self, params: Any) -> NoiseScaleState:
        """The zero state for gradients shaped like ``params``."""
        f32 = lambda p: jnp.zeros(jnp.shape(p), jnp.float32)
        zero = jnp.zeros((), jnp.float32)
        return NoiseScaleState.make(
            count=0,
            calls=0,
            sqnorm_ema=zero,
            variance_ema=zero,
            sqnorm_sq_ema=zero,
            prev_grads=(
                jnp.zeros((sum(int(np.size(p)) for p in jax.tree.leaves(params)),), jnp.float32)
                if self.differencing
                else ()
            ),
            nu=jax.tree.map(f32, params) if self.preconditioned else (),
            nu_count=0,
            held=jnp.zeros((3,), jnp.float32),
            valid=False,
        )

    def _precond(self, state):
        """``√v̂ + eps`` from the gradients seen so far (steps before this one)."""
        c = jnp.maximum(state.nu_count, 1).astype(jnp.float32)
        return jax.tree.map(lambda v: jnp.sqrt(v / (1.0 - self.b2**c)) + self.eps, state.nu)

    def local_scalars(self, local_grads: Any, state: Any) -> dict:
        """This replica's preconditioned ``‖g‖²`` (psummed by the sync), else nothing."""
        if not self.preconditioned:
            return {}
        pre = self._precond(state)
        g = jax.tree.map(lambda x, p: x.astype(jnp.float32) / p, local_grads, pre)
        return {"sq": tree_sq_norm(g)}

    def update(
        self, stats: GradStats, state: NoiseScaleState, **_: Any
    ) -> tuple[NoiseScaleState, dict]:
        """Folds this step's unbiased estimates into the EMAs; returns ``(state, metrics)``."""
        b = self.local_batch_size if stats.local_batch_size is None else stats.local_batch_size
        if b is None:
            raise ValueError(
                "GradientNoiseScale needs the per-replica batch size: pass "
                "local_batch_size= to the monitor or to tx.update (data_parallel_step does)"
            )
        samples = self._samples(stats, state, b)
        g2, var, sample_ok, prev = self._estimates(samples, state)
        new = self._fold(state, samples, g2, var, sample_ok, prev)
        return new, self.metrics(new)

    def _samples(self, stats: GradStats, state: NoiseScaleState, b) -> _Samples:
        """This step's gradient samples (preconditioned when asked) and their norms."""
        n_rep, k = stats.n_replicas, stats.samples_per_replica
        nu_count, nu = state.nu_count, state.nu
        if not self.preconditioned:
            return _Samples(
                local_g=stats.local_grads,
                s_bar=stats.local_sq / (n_rep * k),
                mean_sq=stats.mean_sq,
                n=n_rep * k,
                sample_b=b / k,
                ok=jnp.bool_(True),
                nu=nu,
                nu_count=nu_count,
            )
        # Preconditioned norms come from whole-replica gradients (n = replicas).
        pre = self._precond(state)
        mean_g = jax.tree.map(lambda x, p: x.astype(jnp.float32) / p, stats.mean_grads, pre)
        local_g = jax.tree.map(lambda x, p: x.astype(jnp.float32) / p, stats.local_grads, pre)
        s_bar = stats.summed["sq"] / n_rep
        if stats.mean_sample is None:
            mean_sq = tree_sq_norm(mean_g)
        else:  # a codec: the exact mean at shared coordinates
            mean_sq = sum(
                scale * jnp.sum(jnp.square(v / p.reshape(-1)[idx]))
                for (idx, v, scale), p in zip(stats.mean_sample, jax.tree.leaves(pre), strict=True)
            )
        sample_ok = state.nu_count >= self.precond_warmup
        nu = jax.tree.map(
            lambda v, g: self.b2 * v + (1 - self.b2) * jnp.square(g.astype(jnp.float32)),
            nu,
            stats.mean_grads,
        )
        return _Samples(local_g, s_bar, mean_sq, n_rep, b, sample_ok, nu, nu_count + 1)

    def _estimates(self, samples: _Samples, state: NoiseScaleState):
        """``(‖G‖² estimate, tr(Σ) estimate, measured, previous gradient to keep)``."""
        n, s_bar, mean_sq, sample_b = samples.n, samples.s_bar, samples.mean_sq, samples.sample_b
        if not isinstance(n, int):  # samples counted at run time: valid from two on
            m = jnp.maximum(n, 2).astype(jnp.float32)
            g2 = (m * mean_sq - s_bar) / (m - 1)
            var = (s_bar - mean_sq) * m * sample_b / (m - 1)
            return g2, var, samples.ok & (n >= 2), state.prev_grads
        if n >= 2:
            g2 = (n * mean_sq - s_bar) / (n - 1)
            var = (s_bar - mean_sq) * n * sample_b / (n - 1)
            return g2, var, samples.ok, state.prev_grads
        if not self.differencing:
            raise ValueError(
                "the noise scale needs two gradient samples per step: use >= 2 replicas, "
                "microbatches >= 2, or GradientNoiseScale(differencing=True)"
            )
        # One vector: two reductions and one buffer instead of two kernels and a
        # buffer per leaf (a fixed ~1 ms of an H200 LM step at 64 windows).
        g_now = jnp.concatenate(
            [x.reshape(-1).astype(jnp.float32) for x in jax.tree.leaves(samples.local_g)]
        )
        g2 = jnp.vdot(g_now, state.prev_grads)
        var = jnp.sum(jnp.square(g_now - state.prev_grads)) * sample_b / 2.0
        # The first step has no previous gradient yet.
        return g2, var, samples.ok & (state.calls > 0), g_now

    def _fold(self, state: NoiseScaleState, samples: _Samples, g2, var, sample_ok, prev):
        """The new state: the estimates in the EMAs, the reading held when it is valid."""
        d = self.decay
        count = jnp.where(sample_ok, state.count + 1, state.count)
        sqnorm_ema = jnp.where(sample_ok, _ema(state.sqnorm_ema, g2, d), state.sqnorm_ema)
        variance_ema = jnp.where(sample_ok, _ema(state.variance_ema, var, d), state.variance_ema)
        sq_sq_ema = jnp.where(
            sample_ok, _ema(state.sqnorm_sq_ema, jnp.square(g2), d), state.sqnorm_sq_ema
        )
        g2_s = _debias(sqnorm_ema, count, d)
        var_s = _debias(variance_ema, count, d)
        b_simple = jnp.maximum(var_s, 0.0) / jnp.where(g2_s > 0, g2_s, 1.0)
        fresh = jnp.stack([b_simple, g2_s, var_s]).astype(jnp.float32)
        valid = (count > 0) & (g2_s > 0) & jnp.all(jnp.isfinite(fresh))
        if self.significance > 0:
            # Standard error of the smoothed ‖G‖² (independent per-step estimates):
            # the per-step variance times Σw²/(Σw)² of the debiased EMA weights.
            per_step = jnp.maximum(_debias(sq_sq_ema, count, d) - jnp.square(g2_s), 0.0)
            dc = d ** count.astype(jnp.float32)
            shrink = (1 - d) * (1 + dc) / jnp.maximum((1 + d) * (1 - dc), _TINY)
            enough = count >= 2  # one estimate says nothing about its spread
            valid = valid & enough & (jnp.square(g2_s) >= self.significance**2 * per_step * shrink)
        return NoiseScaleState.make(
            count=count,
            calls=state.calls + 1,
            sqnorm_ema=sqnorm_ema,
            variance_ema=variance_ema,
            sqnorm_sq_ema=sq_sq_ema,
            prev_grads=prev,
            nu=samples.nu,
            nu_count=samples.nu_count,
            held=jnp.where(valid, fresh, state.held),
            valid=valid,
        )

    def metrics(self, state: NoiseScaleState) -> dict:
        """The reported values: the last valid reading and whether it is this step's."""
        p = self.prefix
        return {
            self.name: state.held[0],
            p + "grad_sqnorm": state.held[1],
            p + "grad_variance": state.held[2],
            self.name + "_valid": state.valid.astype(jnp.float32),
        }


class SNRState(NamedTuple):
    """State of :class:`GradientSNR` (the noise-scale EMAs it builds on)."""

    inner: NoiseScaleState


class GradientSNR:
    """Whole-batch gradient signal-to-noise ratio ``‖G‖² / (tr(Σ)/B)``.

    ``B`` is the global batch (replicas × examples per replica), so the SNR is
    ``B / B_simple``: above 1 the batch gradient is mostly signal. Uses the same
    unbiased, EMA-smoothed estimates as :class:`GradientNoiseScale`, and the
    same validity rule: an invalid reading holds the last valid SNR and reports
    ``grad_snr_valid = 0.0``.

    Args:
      decay: EMA decay in (0, 1).
      differencing: as in :class:`GradientNoiseScale`.
      local_batch_size: examples per replica per step (or the ``update`` extra arg).

    Example:
      >>> import jax.numpy as jnp, adaptjax
      >>> tx = adaptjax.sync_gradients("data", monitors=(adaptjax.GradientSNR(),))
      >>> adaptjax.read_metrics(tx.init({"w": jnp.zeros(3)}))
      {'grad_snr': 0.0, 'grad_snr_valid': 0.0}
    """

    name = "grad_snr"

    def __init__(
        self,
        decay: float = 0.95,
        *,
        differencing: bool = False,
        local_batch_size: int | None = None,
    ) -> None:
        self._inner = GradientNoiseScale(
            decay, differencing=differencing, local_batch_size=local_batch_size
        )
        self.differencing = differencing
        self.local_batch_size = local_batch_size

    def metric_names(self) -> tuple[str, ...]:
        """``("grad_snr", "grad_snr_valid")``."""
        return (self.name, self.name + "_valid")

    def init(self, params: Any) -> SNRState:
        """The zero state for gradients shaped like ``params``."""
        return SNRState(self._inner.init(params))

    def local_scalars(self, local_grads: Any, state: Any) -> dict:
        """Nothing: the sync's own squared norms are enough."""
        del local_grads, state
        return {}

    def update(self, stats: GradStats, state: SNRState, **_: Any) -> tuple[SNRState, dict]:
        """Updates the noise-scale EMAs; returns ``(state, {"grad_snr", "grad_snr_valid"})``."""
        inner, m = self._inner.update(stats, state.inner)
        return SNRState(inner), self.from_shared(m, stats)

    def shares_state_with(self, other: object) -> bool:
        """Whether ``other`` keeps exactly the EMAs this monitor would keep.

        :func:`adaptjax.sync_gradients` then gives this monitor no state and
        derives the SNR from ``other``'s metrics (:meth:`from_shared`):
        the same values, without a second copy of the EMAs and their updates.
        """
        return isinstance(other, GradientNoiseScale) and other._config() == self._inner._config()

    def from_shared(self, metrics: dict, stats: GradStats) -> dict:
        """The SNR from this step's metrics of the :class:`GradientNoiseScale` it shares."""
        b = self.local_batch_size if stats.local_batch_size is None else stats.local_batch_size
        assert b is not None  # else the GradientNoiseScale whose metrics these are has raised
        g2, var = metrics["grad_sqnorm"], metrics["grad_variance"]
        snr = jnp.maximum(g2, 0.0) * (b * stats.n_replicas) / jnp.where(var > 0, var, 1.0)
        return {
            self.name: jnp.where(var > 0, snr, 0.0),
            self.name + "_valid": metrics["noise_scale_valid"] * (var > 0),
        }


class GradientNorm:
    """Norm of the averaged gradient, ``‖Ḡ‖`` (free: the sync already has ``‖Ḡ‖²``).

    With ``norm_chunks > 1`` in :func:`adaptjax.sync_gradients` this is the
    square root of an unbiased estimate of ``‖Ḡ‖²`` (exact over a full rotation).

    Example:
      >>> import jax.numpy as jnp, adaptjax
      >>> tx = adaptjax.sync_gradients("data", monitors=(adaptjax.GradientNorm(),))
      >>> adaptjax.read_metrics(tx.init({"w": jnp.zeros(3)}))
      {'grad_norm': 0.0}
    """

    name = "grad_norm"

    def metric_names(self) -> tuple[str, ...]:
        """``("grad_norm",)``."""
        return (self.name,)

    def init(self, params: Any) -> tuple[()]:
        """No state: ``()``."""
        del params
        return ()

    def local_scalars(self, local_grads: Any, state: Any) -> dict:
        """Nothing: the sync's own squared norms are enough."""
        del local_grads, state
        return {}

    def update(self, stats: GradStats, state: Any, **_: Any) -> tuple[Any, dict]:
        """Returns ``(state, {"grad_norm": ‖Ḡ‖})``."""
        return state, {self.name: jnp.sqrt(jnp.maximum(stats.mean_sq, 0.0))}
