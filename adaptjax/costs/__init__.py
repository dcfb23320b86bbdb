"""Cost model, simulator and planner: predict a step's time before trying it.

A step's time is its computation (a fixed plus a per-sample cost fitted on this
model), each codec's own work, and the collectives of its compiled step
(:func:`adaptjax.wire_bytes`) through an α–β model per collective kind,
calibrated by a few timed micro-collectives at start-up and refitted on the
step times the controller records anyway. A configuration the model has no
measurement for raises :class:`CannotPredict` with a one-line reason.

Example:
  >>> from adaptjax.costs import LinkModel, message_steps
  >>> link = LinkModel.from_bandwidth(10e9 / 8)  # pin a 10 Gbit/s link
  >>> link.time("all-reduce", 8, 7e6) == 7e6 * 8 / 10e9
  True
"""

from typing import TYPE_CHECKING

from adaptjax._lazy import attach

# Public name -> the private module that defines it (a test checks this table,
# __all__ and the TYPE_CHECKING imports agree).
_NAMES = {
    "calibrate_axis_links": "adaptjax.costs._calibrate",
    "calibrate_links": "adaptjax.costs._calibrate",
    "time_axis_collectives": "adaptjax.costs._calibrate",
    "time_collectives": "adaptjax.costs._calibrate",
    "time_tuple_all_reduce": "adaptjax.costs._calibrate",
    "ComputeModel": "adaptjax.costs._compute",
    "Catalogue": "adaptjax.costs._deploy",
    "Deployment": "adaptjax.costs._deploy",
    "search_deployment": "adaptjax.costs._deploy",
    "fit_compute": "adaptjax.costs._compute",
    "mesh_shapes": "adaptjax.costs._meshes",
    "state_bytes_per_device": "adaptjax.costs._meshes",
    "LinkModel": "adaptjax.costs._links",
    "fit_alpha_beta": "adaptjax.costs._links",
    "fit_operand_alpha": "adaptjax.costs._links",
    "message_steps": "adaptjax.costs._links",
    "CannotPredict": "adaptjax.costs._model",
    "CodecCost": "adaptjax.costs._model",
    "Observation": "adaptjax.costs._model",
    "Prediction": "adaptjax.costs._model",
    "StepTimeModel": "adaptjax.costs._model",
    "config_key": "adaptjax.costs._model",
    "rescale_report": "adaptjax.costs._model",
    "reshape_report": "adaptjax.costs._model",
    "Planner": "adaptjax.costs._planner",
    "buckets": "adaptjax.costs._schedule",
    "choose_bucket_bytes": "adaptjax.costs._schedule",
    "choose_dense_lane": "adaptjax.costs._schedule",
    "Cluster": "adaptjax.costs._simulate",
    "SimEvent": "adaptjax.costs._simulate",
    "Simulation": "adaptjax.costs._simulate",
    "predicted_times": "adaptjax.costs._simulate",
    "read_run": "adaptjax.costs._simulate",
    "simulate": "adaptjax.costs._simulate",
    "wire_for": "adaptjax.costs._simulate",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time names load lazily
    from adaptjax.costs._calibrate import (
        calibrate_axis_links,
        calibrate_links,
        time_axis_collectives,
        time_collectives,
        time_tuple_all_reduce,
    )
    from adaptjax.costs._compute import ComputeModel, fit_compute
    from adaptjax.costs._deploy import Catalogue, Deployment, search_deployment
    from adaptjax.costs._links import LinkModel, fit_alpha_beta, fit_operand_alpha, message_steps
    from adaptjax.costs._meshes import mesh_shapes, state_bytes_per_device
    from adaptjax.costs._model import (
        CannotPredict,
        CodecCost,
        Observation,
        Prediction,
        StepTimeModel,
        config_key,
        rescale_report,
        reshape_report,
    )
    from adaptjax.costs._planner import Planner
    from adaptjax.costs._schedule import buckets, choose_bucket_bytes, choose_dense_lane
    from adaptjax.costs._simulate import (
        Cluster,
        SimEvent,
        Simulation,
        predicted_times,
        read_run,
        simulate,
        wire_for,
    )

__all__ = [
    "CannotPredict",
    "Catalogue",
    "Cluster",
    "CodecCost",
    "ComputeModel",
    "Deployment",
    "LinkModel",
    "Observation",
    "Planner",
    "Prediction",
    "SimEvent",
    "Simulation",
    "StepTimeModel",
    "buckets",
    "calibrate_axis_links",
    "calibrate_links",
    "choose_bucket_bytes",
    "choose_dense_lane",
    "config_key",
    "fit_alpha_beta",
    "fit_compute",
    "fit_operand_alpha",
    "mesh_shapes",
    "message_steps",
    "predicted_times",
    "read_run",
    "rescale_report",
    "reshape_report",
    "search_deployment",
    "simulate",
    "state_bytes_per_device",
    "time_axis_collectives",
    "time_collectives",
    "time_tuple_all_reduce",
    "wire_for",
]

__getattr__, __dir__ = attach(__name__, _NAMES)
