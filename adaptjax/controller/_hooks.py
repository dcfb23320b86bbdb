"""What a :class:`adaptjax.Controller` calls besides its step: hooks, each with its cadence.

As Levanter's trainer hooks: a hook is a callable with ``every``; the loop
calls it with the controller after each dispatched step whose number is a
multiple of ``every``, and :meth:`Hook.start` / :meth:`Hook.end` around
:meth:`adaptjax.Controller.run`. Evaluation (:class:`Evaluate`), the progress
bar (:class:`ProgressBar`) and TensorBoard (:class:`TensorBoard`) are hooks;
the last two are on by default (:func:`default_hooks`): ``hooks=[]`` turns
them off, ``hooks=[*adaptjax.default_hooks(), more]`` adds to them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

from adaptjax._data import check_count
from adaptjax.controller._progress import ProgressBar as _Bar

if TYPE_CHECKING:  # annotations only
    from adaptjax.controller._controller import Controller


class Hook:
    """Calls ``fn(controller)`` after every ``every``-th step (``fn``: or override ``__call__``).

    Args:
      fn: ``fn(controller)``, called with the :class:`adaptjax.Controller` after the step
        is dispatched. Metrics are read behind dispatch, so ``controller.latest_metrics``
        are then an earlier step's; ``controller.drain()`` reads up to this step first.
      every: the cadence in steps.

    Example:
      >>> import adaptjax
      >>> seen = []
      >>> hook = adaptjax.Hook(lambda ctrl: seen.append(ctrl), every=10)
      >>> hook.every
      10
      >>> adaptjax.Hook(print, every=0)
      Traceback (most recent call last):
      ...
      ValueError: Hook.every must be a positive integer, got 0
    """

    def __init__(self, fn: Callable[[Any], Any] | None = None, *, every: int = 1):
        self.fn = fn
        self.every = check_count(every, f"{type(self).__name__}.every", positive=True)

    def start(self, ctrl: Controller, steps: int) -> None:
        """:meth:`adaptjax.Controller.run` begins, to end at step ``steps``."""

    def __call__(self, ctrl: Controller) -> None:
        if self.fn is not None:
            self.fn(ctrl)

    def end(self, ctrl: Controller) -> None:
        """:meth:`adaptjax.Controller.run` ends (normally or by an exception)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(every={self.every})"


class Evaluate(Hook):
    """Runs ``fn(model_or_params) -> {name: float}`` on the model of every ``every``-th step.

    Its values join that step's metrics (logged, and seen by policies)
    prefixed ``eval_``, and an ``eval`` event is logged. ``fn`` receives the
    model on this process's first device, the same before and after a
    rescale, so state it keeps between calls (an ``nnx.MultiMetric`` made
    once) stays usable (``on_one_device``).

    Example:
      >>> import adaptjax
      >>> adaptjax.Evaluate(lambda params: {"loss": 0.0}, every=50)
      Evaluate(every=50)
    """

    def __init__(self, fn: Callable[[Any], Mapping[str, float]], *, every: int):
        if not callable(fn):
            raise ValueError(f"Evaluate needs a function fn(model) -> {{name: float}}, got {fn!r}")
        super().__init__(fn, every=every)

    def __call__(self, ctrl: Controller) -> None:
        """Nothing: the controller evaluates when it records the step (:meth:`results`)."""

    def results(self, model: Any) -> dict[str, float]:
        """``fn(model)``'s values, prefixed ``eval_`` (the model ``on_one_device``)."""
        assert self.fn is not None
        return {f"eval_{k}": float(v) for k, v in self.fn(on_one_device(model)).items()}


def on_one_device(model: Any) -> Any:
    """``model`` (an NNX module or a pytree) with its arrays on this process's first device.

    An evaluation function often closes over state made once, such as an
    ``nnx.MultiMetric`` whose arrays are placed where its first update ran. On
    the mesh's devices, a rescale would leave them on devices the model no
    longer uses ("incompatible devices" at the next update); on the first
    local device, which every mesh keeps, they stay where the model is. A
    model sharded over several processes stays where it is.
    """
    graph, state = (nnx.split(model) if isinstance(model, nnx.Module) else (None, model))
    leaves = jax.tree.leaves(state)
    if not all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return model
    state = jax.device_put(state, jax.local_devices()[0])
    return state if graph is None else nnx.merge(graph, state)


class ProgressBar(Hook):
    """A tqdm bar of the run's steps with the loss, batch and devices (process 0 only).

    Example:
      >>> import adaptjax
      >>> adaptjax.ProgressBar(every=10)  # redrawn every 10 steps
      ProgressBar(every=10)
    """

    def __init__(self, *, every: int = 1):
        super().__init__(every=every)
        self._bar: _Bar | None = None
        self._at = 0

    def start(self, ctrl: Controller, steps: int) -> None:
        self._bar, self._at = _Bar(total=steps, initial=ctrl.step, show=True), ctrl.step

    def __call__(self, ctrl: Controller) -> None:
        if self._bar is not None:
            self._bar.update(ctrl.latest_metrics, ctrl.config, steps=ctrl.step - self._at)
            self._at = ctrl.step

    def end(self, ctrl: Controller) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class TensorBoard(Hook):
    """Writes every ``every``-th step's metrics as TensorBoard scalars in ``run_dir/tensorboard``.

    (The loop's ``RunLog`` writes them as it logs each row.)

    Example:
      >>> import adaptjax
      >>> adaptjax.TensorBoard(every=5)
      TensorBoard(every=5)
    """

    def __call__(self, ctrl: Controller) -> None:
        """Nothing: the run log writes the rows (``RunLog(tensorboard_every=every)``)."""


def default_hooks() -> list[Hook]:
    """The hooks a controller has when ``hooks`` is not given: a progress bar and TensorBoard.

    Example:
      >>> import adaptjax
      >>> adaptjax.default_hooks()
      [ProgressBar(every=1), TensorBoard(every=1)]
    """
    return [ProgressBar(), TensorBoard()]


def check_hooks(hooks) -> list[Hook]:
    """``hooks`` (``None``: :func:`default_hooks`) as a list of hooks; one line otherwise."""
    hooks = default_hooks() if hooks is None else list(hooks)
    for h in hooks:
        if not isinstance(h, Hook):
            raise ValueError(
                f"hooks must be adaptjax.Hook objects, got {type(h).__name__}; wrap a function "
                "as adaptjax.Hook(fn, every=N)")
    for cls in (ProgressBar, TensorBoard):
        if sum(isinstance(h, cls) for h in hooks) > 1:
            raise ValueError(f"hooks hold two {cls.__name__}s; pass one")
    return hooks
