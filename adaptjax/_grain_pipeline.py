"""What adaptjax's two grain readers share: grain itself, a pipeline's parents, a batch's stack."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _grain():
    try:
        import grain
    except ImportError:
        raise ImportError(
            "adaptjax.GrainDataset needs grain; install it with pip install 'adaptjax[grain]'"
        ) from None
    return grain


def _chain(dataset) -> list:
    """``dataset`` and every dataset it is built from."""
    seen, todo = [], [dataset]
    while todo:
        ds = todo.pop()
        seen.append(ds)
        todo.extend(getattr(ds, "parents", ()))
    return seen


def _stack(elements: list, positions: np.ndarray) -> Any:
    try:
        return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *elements)
    except ValueError as e:
        raise ValueError(
            f"the elements at positions {positions[0]}..{positions[-1]} do not stack into a "
            f"batch ({e}); every element needs the same structure and shapes"
        ) from None
