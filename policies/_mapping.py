"""An immutable, hashable mapping used inside actions and contexts."""

from collections.abc import Iterator, Mapping
from typing import Any


class FrozenMapping(Mapping):
    """A read-only copy of a mapping that hashes by its items.

    Actions are frozen dataclasses meant to be compared and hashed (``any_of``
    and ``hysteresis`` compare them); a plain ``dict`` field would make them
    unhashable and let a policy mutate a decision after it was made. Compares
    equal to any mapping with the same items, including a plain ``dict``.

    Args:
      items: the mapping to copy (a mapping or an iterable of pairs).

    Example:
      >>> m = FrozenMapping({"learning_rate": 0.1})
      >>> m["learning_rate"], m == {"learning_rate": 0.1}, hash(m) == hash(FrozenMapping(m))
      (0.1, True, True)
    """

    __slots__ = ("_data", "_hash")

    def __init__(self, items: Mapping[Any, Any] | Any = ()) -> None:
        self._data = dict(items)
        self._hash: int | None = None

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._data == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._data)

    def __reduce__(self):
        return (FrozenMapping, (self._data,))
