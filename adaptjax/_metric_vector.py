"""Named scalar metrics packed into one float32 vector."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_EMPTY = np.zeros((0,), np.float32)


@jax.tree_util.register_pytree_with_keys_class
class Metrics(Mapping):
    """A read-only mapping of scalar metrics held as one float32 vector.

    A step's metrics and the sync's state cross the ``jit`` boundary every
    step, and each array leaf costs its own buffer on every device there: 30
    extra scalar leaves in and out cost a hand-written step of the tiny LM
    0.5-0.9 ms (7-14%) on 8 simulated CPU devices. Packed, the names are
    static structure and the values one leaf: one buffer, one transfer to the
    host. ``extras`` holds values that are not scalars (a loss
    function's ``aux``) as they are.

    Reading a name inside ``jit`` slices the vector (free: it fuses). Outside,
    fetch everything at once with ``jax.device_get(metrics)`` (a ``Metrics``
    of NumPy values) or ``dict(...)`` of that, instead of one device slice per
    name.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from adaptjax import Metrics
      >>> m = Metrics.pack({"loss": jnp.float32(0.5), "grad_norm": 2})
      >>> len(jax.tree.leaves(m)), sorted(m)
      (1, ['grad_norm', 'loss'])
      >>> {k: float(v) for k, v in jax.device_get(m).items()}
      {'loss': 0.5, 'grad_norm': 2.0}
    """

    __slots__ = ("_index", "extras", "names", "values")
    values: Any  # the float32 vector (an attribute, where a Mapping has a method)

    def __init__(
        self, names: tuple[str, ...], values: Any, extras: Mapping[str, Any] | None = None
    ) -> None:
        self.names = tuple(names)
        self.values = values
        self.extras = dict(extras or {})
        self._index = {name: i for i, name in enumerate(self.names)}
        if len(self._index) != len(self.names) or set(self._index) & set(self.extras):
            raise ValueError(f"metric names repeat: {sorted(self.names)} {sorted(self.extras)}")

    @classmethod
    def pack(cls, scalars: Mapping[str, Any], extras: Mapping[str, Any] | None = None) -> Metrics:
        """``Metrics`` of ``scalars`` (each a number or a 0-d/size-1 array), cast to float32."""
        names = tuple(scalars)
        if not names:
            return cls((), _EMPTY, extras)
        parts = [jnp.asarray(v, jnp.float32).reshape(()) for v in scalars.values()]
        return cls(names, jnp.stack(parts), extras)

    def __getitem__(self, key: str) -> Any:
        i = self._index.get(key)
        if i is None:
            if key in self.extras:
                return self.extras[key]
            raise KeyError(key)
        return self.values[i]

    def __iter__(self) -> Iterator[str]:
        yield from self.names
        yield from self.extras

    def __len__(self) -> int:
        return len(self.names) + len(self.extras)

    def __repr__(self) -> str:
        if isinstance(self.values, np.ndarray | np.generic):
            shown = {k: self[k] for k in self}
        else:
            shown = {"names": self.names, "values": self.values, **self.extras}
        return f"Metrics({shown})"

    def tree_flatten_with_keys(self) -> tuple[tuple[tuple[Any, Any], ...], tuple[Any, bool]]:
        """``(children with their keys, (names, has extras))`` for jax."""
        # No names, no leaf: an empty vector would still cost a buffer per device.
        children = ((jax.tree_util.GetAttrKey("values"), self.values),) if self.names else ()
        if self.extras:
            children += ((jax.tree_util.GetAttrKey("extras"), self.extras),)
        return children, (self.names, bool(self.extras))

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, bool], children: Iterable[Any]) -> Metrics:
        """The inverse of :meth:`tree_flatten_with_keys`."""
        names, has_extras = aux
        children = list(children)
        values = children.pop(0) if names else _EMPTY
        return cls(names, values, children.pop(0) if has_extras else None)
