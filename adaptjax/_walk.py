"""Finding the objects a policy holds (codecs, strategies) without knowing its class."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


def find_held(obj: Any, match: Callable[[Any], bool], *, max_depth: int = 8) -> list[Any]:
    """Every object ``match`` accepts among ``obj`` and what it holds, depth first.

    Descends through mappings, lists, tuples, dataclass fields and other
    objects' ``__dict__``, at most ``max_depth`` levels; does not descend into a
    match, nor into ``None``, strings and numbers.

    Example:
      >>> from adaptjax._walk import find_held
      >>> policy = {"when": "always", "actions": [{"codec": "bf16"}, ({"codec": "onebit"},)]}
      >>> find_held(policy, lambda o: isinstance(o, dict) and "codec" in o)
      [{'codec': 'bf16'}, {'codec': 'onebit'}]
    """
    found: list[Any] = []

    def visit(o: Any, depth: int) -> None:
        if depth > max_depth or o is None or isinstance(o, str | int | float | bool):
            return
        if match(o):
            found.append(o)
            return
        if isinstance(o, Mapping):
            values = list(o.values())
        elif isinstance(o, list | tuple):
            values = list(o)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            values = [getattr(o, f.name, None) for f in dataclasses.fields(o)]
        else:
            values = list((getattr(o, "__dict__", None) or {}).values())
        for v in values:
            visit(v, depth + 1)

    visit(obj, 0)
    return found
