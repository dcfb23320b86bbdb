"""Argument checks shared by the policies: each raises a one-line ``ValueError``.

Every message starts with the owner (the class or function being configured),
names the argument, states what it must be, and shows what was given, so the fix
is in the message itself.
"""

import math
import operator
from collections.abc import Callable, Mapping
from typing import Any


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` on one line, cut to ``limit`` characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_int(value: Any, *, owner: str, name: str, minimum: int | None = None) -> int:
    """Returns ``value`` as a Python int (numpy ints accepted; bools and floats rejected)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise ValueError(f"{owner}: {name} must be an int, got {short_repr(value)}")
    result = operator.index(value)
    if minimum is not None and result < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {result}")
    return result


def check_optional_int(
    value: Any, *, owner: str, name: str, minimum: int | None = None
) -> int | None:
    """Like :func:`check_int`, but ``None`` passes through."""
    if value is None:
        return None
    return check_int(value, owner=owner, name=name, minimum=minimum)


def check_float(
    value: Any,
    *,
    owner: str,
    name: str,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Returns ``value`` as a finite Python float inside the given bounds."""
    result = None
    if not isinstance(value, bool | str | bytes):
        try:
            result = float(value)
        except (TypeError, ValueError, OverflowError):
            result = None
    if result is None:
        raise ValueError(f"{owner}: {name} must be a number, got {short_repr(value)}")
    if not math.isfinite(result):
        raise ValueError(f"{owner}: {name} must be finite, got {result}")
    too_low = low is not None and (result <= low if low_open else result < low)
    too_high = high is not None and (result >= high if high_open else result > high)
    if too_low or too_high:
        left = "(" if low_open or low is None else "["
        right = ")" if high_open or high is None else "]"
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        raise ValueError(f"{owner}: {name} must be in {left}{lo}, {hi}{right}, got {result:g}")
    return result


def check_choice(value: Any, choices: tuple[str, ...], *, owner: str, name: str) -> str:
    """Returns ``value`` if it is one of ``choices``."""
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{owner}: unknown {name} {short_repr(value)}; use one of {allowed}")
    return value


def check_str(value: Any, *, owner: str, name: str, allow_empty: bool = True) -> str:
    """Returns ``value`` if it is a string (non-empty unless ``allow_empty``)."""
    if not isinstance(value, str):
        raise ValueError(f"{owner}: {name} must be a str, got {short_repr(value)}")
    if not allow_empty and not value:
        raise ValueError(f"{owner}: {name} must be a non-empty str")
    return value


def check_callable(value: Any, *, owner: str, name: str, signature: str) -> Callable:
    """Returns ``value`` if it is callable; the message shows the expected ``signature``."""
    if not callable(value):
        raise ValueError(
            f"{owner}: {name} must be a callable {signature}, got {short_repr(value)}"
        )
    return value


def check_mapping(value: Any, *, owner: str, name: str) -> Mapping:
    """Returns ``value`` if it is a mapping."""
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{owner}: {name} must be a mapping (e.g. a dict), got {short_repr(value)}"
        )
    return value


def read_metric(metrics: Mapping[str, Any] | None, key: str) -> float | None:
    """The metric ``key`` as a finite float, or ``None`` when absent or unusable.

    Policies call this instead of indexing, so a metric the controller has not
    produced yet (or a NaN from an early step) makes them do nothing rather
    than crash.

    Args:
      metrics: the metrics mapping given to ``decide`` (``None`` is treated as empty).
      key: the metric's name.

    Returns:
      ``float(metrics[key])`` when present and finite, else ``None``.

    Example:
      >>> read_metric({"loss": 0.5, "noise_scale": float("nan")}, "loss")
      0.5
      >>> read_metric({"noise_scale": float("nan")}, "noise_scale") is None
      True
      >>> read_metric({}, "loss") is None
      True
    """
    if metrics is None:
        return None
    try:
        value = metrics[key]
    except (KeyError, TypeError, IndexError):
        return None
    if value is None or isinstance(value, bool | str | bytes):
        return None
    try:
        result = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return result if math.isfinite(result) else None


def check_planner(planner, owner: str) -> None:
    """A ``planner=`` argument is ``None`` or has a callable ``step_time``."""
    if planner is not None and not callable(getattr(planner, "step_time", None)):
        raise ValueError(
            f"{owner}: planner must have a step_time(candidate) method (e.g. "
            f"adaptjax.costs.Planner), got {short_repr(planner)}; or pass planner=None"
        )


def check_metric_gate(policy, owner: str) -> None:
    """A gate ``metric`` with exactly one of ``below``/``above``, checked and set.

    For policies whose move waits on ``metrics[metric] < below`` (or ``> above``);
    one-line ``ValueError``s name ``owner``.
    """
    check_str(policy.metric, owner=owner, name="metric", allow_empty=False)
    if (policy.below is None) == (policy.above is None):
        raise ValueError(f"{owner}: with metric=, give exactly one of below= and above=")
    for name in ("below", "above"):
        value = getattr(policy, name)
        if value is not None:
            object.__setattr__(policy, name, check_float(value, owner=owner, name=name))
