"""The controller's reach check on a policy's ``Rescale`` to a named mesh shape (pyright found it).

``Rescale(mesh_shape={"data": 2, "fsdp": 4})`` keeps its shape as a read-only
mapping; the check multiplied the mapping itself (its axis names), so the
action raised a ``TypeError`` instead of being kept or skipped.
"""

import warnings

import pytest

from adaptjax import policies as ajp
from adaptjax.controller._controller import _within_reach


class _Ctrl:  # what _within_reach reads of a Controller
    _policies = ()

    def __init__(self, max_devices: int):
        self.max_devices = max_devices


BUG = "adaptjax/controller/_controller.py _within_reach: math.prod of a mapping's keys"


@pytest.mark.xfail(raises=TypeError, strict=True, reason=BUG)
def test_a_mesh_shape_within_max_devices_is_kept():
    action = ajp.Rescale(mesh_shape={"data": 2, "fsdp": 4})
    assert _within_reach(_Ctrl(8), [action]) == [action]


@pytest.mark.xfail(raises=TypeError, strict=True, reason=BUG)
def test_a_mesh_shape_beyond_max_devices_is_skipped_with_a_warning():
    action = ajp.Rescale(mesh_shape={"data": 4, "fsdp": 4}, reason="Elastic: more")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = _within_reach(_Ctrl(8), [action])  # raises TypeError before the fix
    assert kept == []
    assert ["max_devices is 8" in str(w.message) for w in caught] == [True]


def test_a_tuple_mesh_shape_counts_its_devices():
    kept, skipped = ajp.Rescale(mesh_shape=(2, 4)), ajp.Rescale(mesh_shape=(4, 4), reason="E: x")
    with pytest.warns(UserWarning, match="max_devices is 8"):
        assert _within_reach(_Ctrl(8), [kept, skipped]) == [kept]
