"""The :class:`adaptjax.Controller`'s read-only views of its run.

Each view is a function of the controller, made a property there
(``model = property(_views.model)``), so the class lists what a user can
read in one line per name and each view keeps its type and docstring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from adaptjax._state import merge_model
from adaptjax.controller._carry_out import hyperparams_of
from adaptjax.sync._strategy import consensus_params

if TYPE_CHECKING:  # annotations only
    from adaptjax.controller._checkpoint import RunCheckpoints
    from adaptjax.controller._controller import Controller
    from adaptjax.controller._run_log import NullRunLog, RunLog


def model(ctrl: Controller) -> Any:
    """The current model (NNX module) or params; under local models, their mean."""
    params = consensus_params(ctrl.state.params, ctrl.state.opt_state)
    return merge_model(ctrl.state.graphdef, params, ctrl.state.model_state)


def hyperparams(ctrl: Controller) -> dict[str, float]:
    """The optimizer's numeric hyperparameters as the state holds them."""
    return hyperparams_of(ctrl.state)


def run_dir(ctrl: Controller) -> str:
    """The run directory's path."""
    return ctrl._dir.path


def log(ctrl: Controller) -> RunLog | NullRunLog:
    """The :class:`adaptjax.RunLog` (``log.events``: this session's events).

    On processes other than 0 of a multi-process job, a stand-in that keeps
    ``events`` in memory and writes nothing.
    """
    assert ctrl._dir.log is not None  # set when the run directory is opened
    return ctrl._dir.log


def checkpoints(ctrl: Controller) -> RunCheckpoints:
    """The run's :class:`adaptjax.RunCheckpoints`."""
    return ctrl._dir.checkpoints


def nonfinite_count(ctrl: Controller) -> int:
    """Steps skipped so far for non-finite values (recorded)."""
    return ctrl.reader.nonfinite_count
