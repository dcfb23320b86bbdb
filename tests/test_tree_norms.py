"""tree_sq_norm and tree_sq_norm_sampled against NumPy on trees of small and large leaves."""

import jax.numpy as jnp
import numpy as np
import pytest

from adaptjax._tree import tree_sq_norm, tree_sq_norm_sampled


def _tree(seed=0):
    # Small leaves (joined into one reduction), large ones (reduced one by one), a
    # bf16 leaf and a leaf just under and just over the 4096-element boundary.
    rng = np.random.default_rng(seed)
    shapes = [(3,), (128,), (7, 5), (4095,), (4096,), (64, 130), (9000,)]
    tree = {f"l{i}": rng.normal(size=s).astype(np.float32) for i, s in enumerate(shapes)}
    tree["half"] = rng.normal(size=(300,)).astype(np.float32)
    return {k: jnp.asarray(v, jnp.bfloat16 if k == "half" else jnp.float32)
            for k, v in tree.items()}


def _exact(tree):
    return sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in tree.values())


def test_tree_sq_norm_is_the_sum_of_squares_of_every_leaf():
    tree = _tree()
    assert float(tree_sq_norm(tree)) == pytest.approx(_exact(tree), rel=1e-6)
    assert float(tree_sq_norm({})) == 0.0
    assert float(tree_sq_norm({"a": jnp.ones(5)})) == 5.0


@pytest.mark.parametrize("chunks", [2, 7, 32])
def test_sampled_norm_is_exact_over_a_rotation_and_reads_small_leaves_whole(chunks):
    # Averaged over `chunks` consecutive indices every element counts once: the mean of
    # the estimates is the exact norm (the clipped last chunk is masked, not doubled).
    tree = _tree(1)
    est = [float(tree_sq_norm_sampled(tree, jnp.int32(i), chunks)) for i in range(chunks)]
    assert np.mean(est) == pytest.approx(_exact(tree), rel=1e-5)
    small = {k: v for k, v in tree.items() if v.size < 4096}
    one = float(tree_sq_norm_sampled(small, jnp.int32(3), chunks))
    assert one == pytest.approx(_exact(small), rel=1e-6)  # below min_size: read whole
