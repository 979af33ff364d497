"""The ``pallas`` dW backend (interpreted on CPU) against the reference backend and dense jax.grad."""

import functools

import jax
import jax.numpy as jnp
import pytest
from numerics import assert_close_scaled, bf16_exact_normal

from bsr_jax import bsr_linear, from_dense
from bsr_jax.backends import reference_dw
from bsr_jax.pallas_backend import pallas_dw


@pytest.mark.parametrize(
    "dtype,shape,block,selection,storage_dtype",
    [
        (jnp.float32, (37, 45), 16, "global", None),  # M and K padded to whole blocks
        (jnp.bfloat16, (37, 45), 16, "column", None),
        (jnp.float32, (21, 30), (8, 4), "global", None),  # small blocks: no tensor-core dot
        (jnp.float32, (30, 26), 12, "column", None),  # non-power-of-two block, padded to 16
        (jnp.bfloat16, (40, 48), 16, "global", "int8"),  # dequantized before the kernel
    ],
)
def test_pallas_dw_matches_reference_dw(dtype, shape, block, selection, storage_dtype):
    kx, kdy = jax.random.split(jax.random.key(1))

    @jax.jit
    def both_backends():
        bsr = from_dense(bf16_exact_normal(kx, shape, dtype), 0.6, block, selection=selection, storage_dtype=storage_dtype)
        dy = bf16_exact_normal(kdy, (bsr.padded_shape[0], 19), dtype)  # padding rows of dy need not be zero
        return pallas_dw(bsr, dy), reference_dw(bsr, dy)

    dw, expected = both_backends()
    assert dw.shape == expected.shape and dw.dtype == jnp.float32
    assert_close_scaled(dw, expected, dtype)


def _loss(y):
    return jnp.sum(jnp.sin(y.astype(jnp.float32)) * jnp.linspace(-1.0, 1.0, y.shape[-1]))


@functools.partial(jax.jit, static_argnames="selection")
def _masked_dense_grads(x, w, selection):
    """dx of the dense layer and dW = mask(x).T @ dy, in f32 at highest precision."""
    dy = jax.grad(_loss)(x @ w).reshape(-1, w.shape[1])
    kept = from_dense(x.reshape(-1, x.shape[-1]), 0.6, 16, selection=selection).to_dense()
    return dy @ w.T, jnp.matmul(kept.T, dy, precision="highest")


@pytest.mark.parametrize("selection,dtype", [("global", jnp.float32), ("column", jnp.bfloat16)])
def test_bsr_linear_pallas_gradient_is_masked_dense(selection, dtype):
    kx, kw = jax.random.split(jax.random.key(3))
    x = bf16_exact_normal(kx, (3, 13, 37), dtype)  # M = 39 and K = 37 are padded to whole blocks
    w = bf16_exact_normal(kw, (37, 19), dtype) * 0.3
    layer = functools.partial(bsr_linear, sparsity=0.6, block=16, selection=selection, backend="pallas")
    dx, dw = jax.jit(jax.grad(lambda x, w: _loss(layer(x, w)), (0, 1)))(x, w)
    dx_dense, dw_masked = _masked_dense_grads(x.astype(jnp.float32), w.astype(jnp.float32), selection)
    assert dw.dtype == dx.dtype == dtype
    assert_close_scaled((dx.reshape(-1, 37), dw), (dx_dense, dw_masked), dtype)


def test_bsr_linear_pallas_gradient_lowers_to_triton_for_cuda():
    x, w = jnp.zeros((64, 48), jnp.bfloat16), jnp.zeros((48, 32), jnp.bfloat16)
    grad = jax.grad(lambda x, w: _loss(bsr_linear(x, w, sparsity=0.5, block=16, backend="pallas")), argnums=1)
    text = jax.jit(grad).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text
    cpu_text = jax.jit(grad).trace(x, w).lower(lowering_platforms=("cpu",)).as_text()
    assert "xla.gpu.triton" not in cpu_text
