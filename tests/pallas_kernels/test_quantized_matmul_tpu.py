"""The fused backend's TPU kernels (``pallas_kernels.quantized_matmul_tpu``, Mosaic) in interpret mode
against the GPU kernels' references, and compiled deviceless for TPU v5p, where XLA's cost model
times them from their cost estimates."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close_scaled, bf16_exact_normal

from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import quantize_reference, quantized_matmul_tpu, quantized_t_matmul_reference
from pallas_kernels.quantized_matmul import dequantize_reference


# Mosaic's interpreter, reads past an array's end NaN: a partial row tile that sums them fails.
INTERPRET = pltpu.InterpretParams(out_of_bounds_reads="uninitialized", uninitialized_memory="nan")


def _operands(m, k, n, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (bf16_exact_normal(keys[0], (m, k), dtype) * 3, bf16_exact_normal(keys[1], (k, n), dtype) * 0.1,
            bf16_exact_normal(keys[2], (m, n), dtype))  # fmt: skip


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
# K = one tile narrower than 128; N not a multiple of 128; M not a multiple of 128 (a partial last row
# tile: ViT-B/16's 64 x 197 tokens), and M below 128 (one tile of all of M).
@pytest.mark.parametrize("m,k,n", [(256, 384, 256), (384, 64, 80), (1000, 256, 128), (100, 128, 256)])
def test_codes_and_products_are_the_gpu_kernels_references(m, k, n, dtype):
    x, w, dy = _operands(m, k, n, dtype)
    x = x.at[5].set(0.0)  # a zero row: scale 1, codes 0
    tile = min(128, k)
    y, codes, scales = jax.jit(functools.partial(quantized_matmul_tpu.matmul_quantizing, tile=tile, interpret=INTERPRET))(x, w)
    chex.assert_trees_all_equal((codes, scales), quantize_reference(x, "int8", tile))
    assert jnp.all(scales[:, 5] == 1.0) and jnp.all(codes[:, 5] == 0)
    assert_close_scaled(y, jnp.matmul(x, w, precision="highest"), dtype)
    dw = jax.jit(functools.partial(quantized_matmul_tpu.quantized_t_matmul, interpret=INTERPRET))(codes, scales, dy)
    assert dw.shape == (k, n) and dw.dtype == jnp.float32
    assert_close_scaled(dw, quantized_t_matmul_reference(codes, scales, dy), dtype)
    x_rounded = np.asarray(dequantize_reference(codes, scales, dtype), np.float64)
    np.testing.assert_allclose(dw, x_rounded.T @ np.asarray(dy, np.float64), rtol=1e-4, atol=1e-3)


def test_shapes_the_tpu_kernels_do_not_take_are_named():
    x, w, _ = _operands(256, 256, 128, jnp.bfloat16)
    with pytest.raises(ValueError, match="storage must be 'int8' on TPU"):
        quantized_matmul_tpu.matmul_quantizing(x, w, storage="int4")
    with pytest.raises(ValueError, match=r"N \(columns\) must be small enough for 12 MiB of VMEM with 128 rows a program, got N=32000"):
        quantized_matmul_tpu.matmul_quantizing(x, jnp.zeros((256, 32000), jnp.bfloat16))  # a vocabulary-wide head
    with pytest.raises(ValueError, match="N \\(columns\\) must be a multiple of 128 or at most 512, got 600"):
        quantized_matmul_tpu.matmul_quantizing(x, jnp.zeros((256, 600), jnp.bfloat16))
    with pytest.raises(ValueError, match="expected codes"):
        quantized_matmul_tpu.quantized_t_matmul(jnp.zeros((1, 256, 128), jnp.uint8), jnp.zeros((1, 256), jnp.float32), x[:, :128])


def test_both_compile_for_tpu_and_xla_times_them_from_their_estimates():
    """Deviceless for TPU v5p, both lower to Mosaic custom calls whose cost estimates XLA's model
    reads (a Pallas call without one is a step XLA:TPU cannot time) and the roofline counts: the
    products' FLOPs, and at least every operand and result once."""
    import bsr_jax

    m, k, n = 1000, 256, 512  # M not a multiple of the row tile: Mosaic takes the partial last tile

    def both(x, w, dy):
        y, codes, scales = quantized_matmul_tpu.matmul_quantizing(x, w)
        return y, quantized_matmul_tpu.quantized_t_matmul(codes, scales, dy)

    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (m, n))]
    step = bsr_jax.compiled_memory(both, *shapes, target="tpu-v5p", breakdown=True)
    calls = [kernel for kernel in step.kernels if kernel.flops]
    assert len(calls) == 2 and all(kernel.flops == 2 * m * k * n for kernel in calls), step.kernels
    code_bytes = m * k + m * (k // 128) * 4
    assert min(kernel.bytes for kernel in calls) >= code_bytes + 2 * m * n
    assert step.optimal_seconds is not None and step.optimal_seconds >= 2 * (2 * m * k * n) / 459e12
