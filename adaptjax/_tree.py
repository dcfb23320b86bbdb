"""Small tree helpers shared by the sync transformation, monitors and codecs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Leaves under this many elements are concatenated and reduced together: on
# XLA:CPU each reduction is its own kernel, and one of fewer than 4096 elements
# is three (a multiply, a reduce-window, a reduce), so a model's many biases
# and norm scales would cost more in kernels than in bytes.
_SMALL_LEAF = 4096


def _sq_sum(x: jax.Array) -> jax.Array:
    """``Σx²`` of a flat float32 vector, in one kernel on XLA:CPU (zero-padded to 4096)."""
    if x.shape[0] < _SMALL_LEAF:
        x = jnp.pad(x, (0, _SMALL_LEAF - x.shape[0]))
    return jnp.sum(jnp.square(x))


def _sum_squares(leaves) -> jax.Array:
    """``Σ‖x‖²`` over ``leaves`` in float32: a reduction per large leaf, one for the small."""
    flat = [x.reshape(-1).astype(jnp.float32) for x in leaves]
    small = [x for x in flat if x.shape[0] < _SMALL_LEAF]
    parts = [_sq_sum(x) for x in flat if x.shape[0] >= _SMALL_LEAF]
    if small:
        parts.append(_sq_sum(jnp.concatenate(small)))
    if not parts:
        return jnp.zeros((), jnp.float32)
    return parts[0] if len(parts) == 1 else jnp.sum(jnp.stack(parts))


def tree_sq_norm(tree) -> jax.Array:
    """Sum of squares of every leaf, accumulated in float32.

    Leaves under 4096 elements are concatenated and reduced in one kernel
    (a transformer's biases and norm scales would otherwise cost one or more
    kernels each); larger leaves are reduced one by one.

    Example:
        >>> import jax.numpy as jnp
        >>> from adaptjax import tree_sq_norm
        >>> float(tree_sq_norm({"a": jnp.array([3.0]), "b": jnp.array([4.0])}))
        25.0
    """
    return _sum_squares(jax.tree.leaves(tree))


def tree_vdot(a, b) -> jax.Array:
    """Inner product of two trees of the same structure, in float32.

    Example:
        >>> import jax.numpy as jnp
        >>> from adaptjax import tree_vdot
        >>> float(tree_vdot({"a": jnp.array([1.0, 2.0])}, {"a": jnp.array([3.0, 4.0])}))
        11.0
    """
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return sum(
        (jnp.vdot(x.astype(jnp.float32), y.astype(jnp.float32)) for x, y in pairs),
        jnp.zeros((), jnp.float32),
    )


def check_float_tree(tree, what: str = "gradients") -> None:
    """Raises ``ValueError`` when a leaf is not floating point (at trace time)."""
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise ValueError(
                f"{what} must be floating point, got {jnp.result_type(x)} at "
                f"{jax.tree_util.keystr(path) or 'the root'}; "
                "cast integer parameters to float32"
            )


def axis_size(axis_name) -> int:
    """Size of a bound mesh axis, or of a tuple of axes (their product)."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    size = 1
    for name in names:
        size *= jax.lax.axis_size(name)
    return size


def tree_sq_norm_sampled(tree, index: jax.Array, chunks: int, *, min_size: int = 4096):
    """An unbiased, cheaper estimate of :func:`tree_sq_norm` from one chunk per leaf.

    Each leaf of ``d >= min_size`` elements is cut into ``chunks`` contiguous
    chunks of ``ceil(d / chunks)`` elements; only chunk ``index % chunks`` is
    read, and its sum of squares is multiplied by ``chunks``. Averaged over a
    full rotation of ``index`` every element is counted exactly once, so the
    estimate is unbiased for a uniformly random ``index`` and exact on average
    over any ``chunks`` consecutive indices. Smaller leaves are summed whole.
    It reads about ``1/chunks`` of the memory that :func:`tree_sq_norm` reads.

    Args:
      tree: a pytree of arrays.
      index: int32 scalar (e.g. the step counter).
      chunks: the number of chunks; 1 gives the exact norm.
      min_size: leaves smaller than this are read whole.

    Returns:
      A float32 scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> from adaptjax import tree_sq_norm, tree_sq_norm_sampled
      >>> x = {"w": jnp.arange(8192.0) % 3}
      >>> est = [float(tree_sq_norm_sampled(x, jnp.int32(i), 4)) for i in range(4)]
      >>> sum(est) / 4 == float(tree_sq_norm(x))
      True
    """
    if chunks <= 1:
        return tree_sq_norm(tree)
    i = jnp.asarray(index, jnp.int32) % chunks
    whole, chunked = [], []
    for x in jax.tree.leaves(tree):
        flat = x.reshape(-1).astype(jnp.float32)
        d = flat.shape[0]
        if d < min_size:
            whole.append(flat)
            continue
        c = -(-d // chunks)
        start = i * c
        offset = jnp.minimum(start, d - c)
        part = jax.lax.dynamic_slice(flat, (offset,), (c,))
        # Mask out the elements the clipped last chunk shares with its neighbour.
        pos = offset + jnp.arange(c, dtype=jnp.int32)
        chunked.append(jnp.where(pos >= start, part, 0.0))
    # The chunks are joined and reduced in one kernel, like the small leaves.
    total = _sum_squares(whole)
    if chunked:
        total = total + chunks * _sq_sum(jnp.concatenate(chunked))
    return total
