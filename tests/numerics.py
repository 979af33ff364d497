"""Shared test helpers: per-dtype tolerances and bf16-representable random inputs."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

# Error allowed relative to the largest magnitude of the reference: bf16 keeps 8 mantissa bits and
# its reductions may accumulate in bf16, f32 results differ from references only by reassociation.
_SCALED_ATOL = {"float32": 1e-5, "bfloat16": 2e-2}


def tolerances(dtype) -> dict[str, float]:
    """Elementwise atol/rtol for results in ``dtype`` whose entries are O(1)."""
    atol = _SCALED_ATOL[jnp.dtype(dtype).name]
    return dict(atol=atol, rtol=atol)


def assert_close_scaled(actual, expected, dtype) -> None:
    """Every leaf of ``actual`` within ``dtype``'s tolerance of ``expected``, relative to the max |expected|."""

    actual_leaves, expected_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(actual_leaves) == len(expected_leaves)
    for a, e in zip(actual_leaves, expected_leaves):  # in numpy: no XLA program per shape
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        scale = max(float(np.max(np.abs(e), initial=0.0)), 1.0)
        chex.assert_trees_all_close(a / scale, e / scale, atol=_SCALED_ATOL[jnp.dtype(dtype).name], rtol=0.0)


@functools.partial(jax.jit, static_argnums=(1, 2))  # one program per shape, not three
def bf16_exact_normal(key, shape, dtype=jnp.float32) -> jax.Array:
    """Normal samples rounded through bf16, so f32 and bf16 runs see identical values."""
    return jax.random.normal(key, shape).astype(jnp.bfloat16).astype(dtype)
