"""Cost model, simulator and planner: predict a step's time before trying it.

A step's time is its computation (a fixed plus a per-sample cost fitted on this
model), each codec's own work, and the collectives of its compiled step
(:func:`adaptjax.wire_bytes`) through an α–β model per collective kind,
calibrated by a few timed micro-collectives at start-up and refitted on the
step times the controller records anyway. A configuration the model has no
measurement for raises :class:`CannotPredict` with a one-line reason.

Example:
  >>> from adaptjax.costs import LinkModel
  >>> link = LinkModel.from_bandwidth(10e9 / 8)  # pin a 10 Gbit/s link
  >>> link.time("all-reduce", 8, 7e6) == 7e6 * 8 / 10e9
  True
"""

from typing import TYPE_CHECKING

from adaptjax._lazy import attach

# Public name -> the private module that defines it (a test checks this table,
# __all__ and the TYPE_CHECKING imports agree).
_NAMES = {
    "StepTimeModel": "adaptjax.costs._model",
    "CannotPredict": "adaptjax.costs._model",
    "Prediction": "adaptjax.costs._model",
    "rescale_report": "adaptjax.costs._model",
    "reshape_report": "adaptjax.costs._model",
    "ComputeModel": "adaptjax.costs._compute",
    "LinkModel": "adaptjax.costs._links",
    "Planner": "adaptjax.costs._planner",
    "Cluster": "adaptjax.costs._simulate",
    "Simulation": "adaptjax.costs._simulate",
    "simulate": "adaptjax.costs._simulate",
    "read_run": "adaptjax.costs._simulate",
    "predicted_times": "adaptjax.costs._simulate",
    "Catalogue": "adaptjax.costs._deploy",
    "Deployment": "adaptjax.costs._deploy",
    "search_deployment": "adaptjax.costs._deploy",
    "state_bytes_per_device": "adaptjax.costs._meshes",
    "choose_bucket_bytes": "adaptjax.costs._schedule",
    "choose_dense_lane": "adaptjax.costs._schedule",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time names load lazily
    from adaptjax.costs._compute import ComputeModel
    from adaptjax.costs._deploy import Catalogue, Deployment, search_deployment
    from adaptjax.costs._links import LinkModel
    from adaptjax.costs._meshes import state_bytes_per_device
    from adaptjax.costs._model import (
        CannotPredict,
        Prediction,
        StepTimeModel,
        rescale_report,
        reshape_report,
    )
    from adaptjax.costs._planner import Planner
    from adaptjax.costs._schedule import choose_bucket_bytes, choose_dense_lane
    from adaptjax.costs._simulate import Cluster, Simulation, predicted_times, read_run, simulate

__all__ = [
    "StepTimeModel",
    "CannotPredict",
    "Prediction",
    "rescale_report",
    "reshape_report",
    "ComputeModel",
    "LinkModel",
    "Planner",
    "Cluster",
    "Simulation",
    "simulate",
    "read_run",
    "predicted_times",
    "Catalogue",
    "Deployment",
    "search_deployment",
    "state_bytes_per_device",
    "choose_bucket_bytes",
    "choose_dense_lane",
]

__getattr__, __dir__ = attach(__name__, _NAMES)
