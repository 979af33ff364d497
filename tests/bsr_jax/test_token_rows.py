"""``block="row"``: one scale per row of x (per token), codes in x's own layout on every platform
(int4 as ``jnp.int4``), and dW as ``codes.T @ (scales * dy)`` where dy is no wider than x.

References: ``quantize_blocks`` on ``(1, K)`` blocks (the documented scale and rounding rule), the
densified residual's ``x.T @ dy`` in float64, and plain ``jax.grad`` of the dense layer."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bsr_jax
from bsr_jax.backends.dispatch import full_dw
from bsr_jax.measure import compiled
from bsr_jax.storage.format import array_bytes
from bsr_jax.storage.pruning import Pruning
from bsr_jax.storage.quantize import quantize_blocks


def _normal(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.parametrize("storage_dtype", ["int8", "int4", "float8_e4m3fn"])
def test_row_blocks_hold_what_one_by_k_blocks_hold_in_x_layout(storage_dtype):
    x = _normal((24, 40)).at[3].set(0.0).at[5, 7].set(jnp.nan)  # a zero row (scale 1) and a NaN row (NaN scale)
    stored = Pruning(0.0, block="row", storage_dtype=storage_dtype).compress(x)
    codes, scales = quantize_blocks(x.reshape(24, 1, 40), storage_dtype)
    assert stored.block == (1, 40) and stored.is_full
    assert stored.values.shape == (24, 1, 40) and stored.values.dtype == (jnp.int4 if storage_dtype == "int4" else codes.dtype)
    chex.assert_trees_all_equal(stored.scales, scales)
    expected = (codes if storage_dtype != "int4" else _int4_reference_codes(x, scales)).astype(jnp.float32) * scales[:, None, None]
    chex.assert_trees_all_equal(stored.to_dense(), expected.reshape(24, 40))
    assert np.isnan(stored.scales[5]) and stored.scales[3] == 1.0


def _int4_reference_codes(x, scales):
    return np.clip(np.round(np.asarray(x) * (1.0 / np.asarray(scales))[:, None]), -7, 7)[:, None, :]


def test_int4_codes_count_half_a_byte_and_the_residual_is_smaller_than_int8():
    x = _normal((64, 96))
    int8, int4 = (Pruning(0.0, block="row", storage_dtype=d).compress(x) for d in ("int8", "int4"))
    assert array_bytes(int4.values) == 64 * 96 // 2 and int4.nbytes == 64 * 96 // 2 + 64 * 4
    assert int8.nbytes == 64 * 96 + 64 * 4


@pytest.mark.parametrize("width_of_dy", [16, 200])  # narrower than x: scales on dy; wider: x dequantized
@pytest.mark.parametrize("storage_dtype", ["int8", "int4"])
def test_dw_from_row_codes_is_the_densified_product(storage_dtype, width_of_dy):
    x, dy = _normal((48, 96)), _normal((48, width_of_dy), 1)
    stored = Pruning(0.0, block="row", storage_dtype=storage_dtype).compress(x)
    reference = np.asarray(stored.to_dense(), np.float64).T @ np.asarray(dy, np.float64)
    chex.assert_trees_all_close(full_dw(stored, dy), reference.astype(np.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("storage_dtype,bound", [("int8", 0.01), ("int4", 0.2)])
def test_gradients_exact_except_dw_within_the_format_bound(storage_dtype, bound):
    x, w, c = _normal((4, 32, 64)), _normal((64, 48), 1) * 0.1, _normal((4, 32, 48), 2)
    layer = bsr_jax.Dense(48, pruning=Pruning(0.0, block="row", storage_dtype=storage_dtype))
    params = {"params": {"kernel": w, "bias": jnp.zeros(48)}}
    loss = lambda p, x: jnp.vdot(layer.apply(p, x), c)
    (grads, dx) = jax.grad(loss, (0, 1))(params, x)
    dense_dx, dense_dw = jax.grad(lambda x, w: jnp.vdot(x @ w, c), (0, 1))(x, w)
    chex.assert_trees_all_close(dx, dense_dx, rtol=1e-6, atol=1e-6)
    error = jnp.linalg.norm(grads["params"]["kernel"] - dense_dw) / jnp.linalg.norm(dense_dw)
    assert 0 < error <= bound


def _step(storage_dtype):
    pruning = Pruning(0.0, block="row", storage_dtype=storage_dtype)

    def loss(w, x):
        h = jax.nn.gelu(x @ w[0])
        return jnp.sum(bsr_jax.bsr_linear(h, w[1], pruning=pruning).astype(jnp.float32) ** 2)

    shapes = ((jax.ShapeDtypeStruct((128, 512), jnp.bfloat16), jax.ShapeDtypeStruct((512, 128), jnp.bfloat16)),
              jax.ShapeDtypeStruct((1024, 128), jnp.bfloat16))  # fmt: skip
    return jax.grad(loss), shapes


def test_h100_dw_gemm_reads_the_stored_codes_and_tpu_lowers():
    step, args = _step("int8")
    text = compiled.compile_for(step, *args, target="h100").as_text()
    # The fc2-like layer's dW: a Triton GEMM fusion takes the int8 codes as they are stored (split
    # over K into a batch: a bitcast); no bf16 copy of x is made for it.
    gemm_params = re.findall(r"^%gemm_fusion[\w.]*_computation \(([^)]*)\)", text, re.MULTILINE)
    assert any("s8[" in params for params in gemm_params), gemm_params
    step, args = _step("int4")
    assert compiled.compile_for(step, *args, target="tpu-v5p").memory_analysis().peak_memory_in_bytes > 0
