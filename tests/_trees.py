"""Comparing pytrees of arrays in tests: leafwise closeness with an error message naming the leaf."""

import jax
import numpy as np


def max_abs(tree) -> float:
    return max((float(np.max(np.abs(leaf))) for leaf in jax.tree.leaves(tree)), default=0.0)


def assert_trees_close(actual, expected, rtol, atol_fraction, what):
    """Leafwise allclose, with atol a fraction of each expected leaf's largest magnitude."""
    flat_actual = jax.tree_util.tree_leaves_with_path(actual)
    flat_expected = jax.tree.leaves(expected)
    assert len(flat_actual) == len(flat_expected)
    for (path, a), e in zip(flat_actual, flat_expected):
        a, e = np.asarray(a), np.asarray(e)
        atol = atol_fraction * float(np.max(np.abs(e))) if e.size else 0.0
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"{what} {jax.tree_util.keystr(path)}")
