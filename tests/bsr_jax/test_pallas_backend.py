"""The ``pallas`` dW backend (interpreted on CPU) on its own padding paths, against the float64
reference; bsr_linear with backend="pallas" runs in test_linear.py's suite with every other backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from numerics import assert_close_scaled, bf16_exact_normal

from bsr_jax import bsr_linear, from_dense
from bsr_jax.backends.pallas import pallas_dw


@pytest.mark.parametrize(
    "dtype,shape,block,selection,storage_dtype",
    [
        (jnp.float32, (37, 45), 16, "global", None),  # M and K padded to whole blocks
        (jnp.bfloat16, (37, 45), 16, "column", None),
        # Small blocks (no tensor-core dot), padded: the int8 case below pads both sides of smaller
        # ones, and pallas_kernels/ runs small blocks; this one (8 s of interpreting) with -m slow.
        pytest.param(jnp.float32, (21, 30), (8, 4), "global", None, marks=pytest.mark.slow),
        (jnp.float32, (30, 26), 12, "column", None),  # non-power-of-two block, padded to 16
        (jnp.float32, (21, 30), (3, 6), "global", "int8"),  # both sides padded (to 4, 8); dequantized first
    ],
)
def test_pallas_dw_matches_reference(dtype, shape, block, selection, storage_dtype):
    kx, kdy = jax.random.split(jax.random.key(1))
    # int8 storage: full float32 mantissas, so no value lies exactly half-way between two int8 steps
    # (where XLA's v * (1 / s) and the reference's v / s may round apart).
    x = bf16_exact_normal(kx, shape, dtype) if storage_dtype is None else jax.random.normal(kx, shape, dtype)
    bsr = from_dense(x, 0.6, block, selection=selection, storage_dtype=storage_dtype)
    dy = bf16_exact_normal(kdy, (bsr.padded_shape[0], 19), dtype)  # padding rows of dy need not be zero
    dw = jax.jit(pallas_dw)(bsr, dy)
    kept = reference.kept_input(np.asarray(x, np.float64), 0.6, block, selection=selection, storage_dtype=storage_dtype)
    expected = kept.T @ np.asarray(dy, np.float64)[: shape[0]]
    assert dw.shape == (bsr.padded_shape[1], 19) and dw.dtype == jnp.float32
    assert_close_scaled(dw[: shape[1]], jnp.asarray(expected, jnp.float32), dtype)
    assert not jnp.any(dw[shape[1] :])  # padding columns of x give zero rows


def _loss(y):
    return jnp.sum(jnp.sin(y.astype(jnp.float32)) * jnp.linspace(-1.0, 1.0, y.shape[-1]))


def test_bsr_linear_pallas_gradient_lowers_to_triton_for_cuda():
    x, w = jnp.zeros((64, 48), jnp.bfloat16), jnp.zeros((48, 32), jnp.bfloat16)
    grad = jax.grad(lambda x, w: _loss(bsr_linear(x, w, sparsity=0.5, block=16, backend="pallas")), argnums=1)
    text = jax.jit(grad).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text
    cpu_text = jax.jit(grad).trace(x, w).lower(lowering_platforms=("cpu",)).as_text()
    assert "xla.gpu.triton" not in cpu_text
