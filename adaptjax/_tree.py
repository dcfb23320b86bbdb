"""Small tree helpers shared by the sync transformation, monitors and codecs."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_sq_norm(tree) -> jax.Array:
    """Sum of squares of every leaf, accumulated in float32.

    Example:
        >>> import jax.numpy as jnp
        >>> from adaptjax import tree_sq_norm
        >>> float(tree_sq_norm({"a": jnp.array([3.0]), "b": jnp.array([4.0])}))
        25.0
    """
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)


def tree_vdot(a, b) -> jax.Array:
    """Inner product of two trees of the same structure, in float32."""
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
                    f"{jax.tree_util.keystr(path) or 'the root'}; cast integer parameters to float32"
            )


def axis_size(axis_name) -> int:
    """Size of a bound mesh axis, or of a tuple of axes (their product)."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    size = 1
    for name in names:
        size *= jax.lax.axis_size(name)
    return size
