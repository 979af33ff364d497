"""matmul_quantizing and quantized_t_matmul (the fused backend's kernels) in interpret mode against
their references and bsr_jax's own quantizer; both compiled deviceless for H100 (Triton, shared memory
included) and counted by the roofline."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close_scaled, bf16_exact_normal

from bsr_jax.storage import quantize
from pallas_kernels import matmul_quantizing, quantize_reference, quantized_t_matmul, quantized_t_matmul_reference
from pallas_kernels.quantized_matmul import dequantize_reference, token_splits


def _operands(m, k, n, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = bf16_exact_normal(keys[0], (m, k), dtype) * 3
    w = bf16_exact_normal(keys[1], (k, n), dtype) * 0.1
    dy = bf16_exact_normal(keys[2], (m, n), dtype)
    return x, w, dy


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("storage,tile", [("int8", 128), ("int4", 128), ("int4", 64)])
def test_codes_are_bsr_jaxs_blocks_and_products_match(storage, tile, dtype):
    m, k, n = 48, 2 * tile, 80  # M and N not multiples of the default tiles: the kernels halve theirs
    x, w, dy = _operands(m, k, n, dtype)
    x = x.at[5].set(0.0)  # a zero row: scale 1, codes 0
    run = jax.jit(functools.partial(matmul_quantizing, storage=storage, tile=tile))
    y, codes, scales = run(x, w)
    # The codes and scales are exactly those of bsr_jax's blocks layout for (1, tile) blocks.
    expected_codes, expected_scales = quantize.quantize_blocks(quantize.to_blocks(x, (1, tile)), storage)
    chex.assert_trees_all_equal(codes.reshape(-1), expected_codes.reshape(-1))
    chex.assert_trees_all_equal(scales.reshape(-1), expected_scales)
    chex.assert_trees_all_equal((codes, scales), quantize_reference(x, storage, tile))
    assert jnp.all(scales[:, 5] == 1.0)
    assert_close_scaled(y, jnp.matmul(x, w, precision="highest"), dtype)
    assert y.dtype == dtype
    dw = jax.jit(quantized_t_matmul)(codes, scales, dy)
    assert dw.shape == (k, n) and dw.dtype == jnp.float32
    assert_close_scaled(dw, quantized_t_matmul_reference(codes, scales, dy), dtype)
    # ...which is x rounded to its codes against dy, in float64.
    x_rounded = np.asarray(dequantize_reference(codes, scales, dtype), np.float64)
    np.testing.assert_allclose(quantized_t_matmul_reference(codes, scales, dy), x_rounded.T @ np.asarray(dy, np.float64), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("splits,columns", [(None, None), (2, None), (4, None), (None, 256), (2, 32)])
@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_dw_split_over_the_tokens_sums_to_the_reference(storage, splits, columns):
    """dW's token loop shared by ``splits`` programs (``None``: ``token_splits``, here 2: a grid of one
    tile, partial sums within dy's bytes), added after, over tiles of ``columns`` of dy: the reference's
    product up to the order of f32 sums."""
    m, k, n = 256, 128, 64
    x, w, dy = _operands(m, k, n, jnp.float32)
    codes, scales = quantize_reference(x, storage)
    assert token_splits(1 * 1, m // 64) == 4  # as many as M / bm = 4 trips allow, short of TARGET_PROGRAMS
    assert token_splits(1 * 1, m // 64, m * 4 // (4 * k)) == 2  # f32 partial sums within dy's bytes
    run = functools.partial(quantized_t_matmul, splits=splits, columns=columns, num_warps=8 if columns else 4, out_dtype=jnp.bfloat16)
    dw = jax.jit(run)(codes, scales, dy)
    assert dw.shape == (k, n) and dw.dtype == jnp.bfloat16
    assert_close_scaled(dw, quantized_t_matmul_reference(codes, scales, dy), jnp.bfloat16)
    with pytest.raises(ValueError, match="splits must be a power of two dividing M / 64 = 4, got 3"):
        quantized_t_matmul(codes, scales, dy, splits=3)
    with pytest.raises(ValueError, match="got 8"):
        quantized_t_matmul(codes, scales, dy, splits=8)
    with pytest.raises(ValueError, match=r"quantized_t_matmul: columns must be a power of two in 16..256 \(or None\), got 48"):
        quantized_t_matmul(codes, scales, dy, columns=48)
    with pytest.raises(ValueError, match=r"quantized_t_matmul: rows must be a power of two in 16..256 \(or None\), got 512"):
        quantized_t_matmul(codes, scales, dy, rows=512)
    with pytest.raises(ValueError, match="quantized_t_matmul: num_warps must be 4 or 8, got 2"):
        quantized_t_matmul(codes, scales, dy, num_warps=2)


@pytest.mark.parametrize("rows,columns", [(128, None), (None, 256), (128, 256), (16, 16)])
def test_every_tiling_gives_the_reference(rows, columns):
    """The tilings benchmarks/kernels/fused_gpu.py times: taller and wider programs give the same
    products (forward exactly the reference's codes; y and dW up to the order of f32 sums)."""
    m, k, n = 256, 256, 256
    x, w, dy = _operands(m, k, n, jnp.float32)
    y, codes, scales = matmul_quantizing(x, w, storage="int4", rows=rows, columns=columns, num_warps=8)
    expected_codes, expected_scales = quantize_reference(x, "int4")
    chex.assert_trees_all_equal((codes, scales), (expected_codes, expected_scales))
    chex.assert_trees_all_close(y, x @ w, rtol=1e-5, atol=1e-4)
    dw = quantized_t_matmul(codes, scales, dy, rows=rows, columns=columns, num_warps=8)
    assert_close_scaled(dw, quantized_t_matmul_reference(codes, scales, dy), jnp.float32)
    with pytest.raises(ValueError, match=r"matmul_quantizing: rows must be a power of two in 16..256 \(or None\), got 100"):
        matmul_quantizing(x, w, storage="int4", rows=100)


def test_ties_round_to_even_and_nan_rows_get_a_nan_scale():
    # Row 0 has max 127: its scale is 1, so the halves below round half to even as jnp.round does.
    row = jnp.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 122, jnp.float32)
    x = jnp.stack([row, row.at[3].set(jnp.nan)] + [row] * 14)
    w = jnp.ones((128, 16), jnp.float32)
    _, codes, scales = matmul_quantizing(x, w, storage="int8")
    assert codes[0, 0, :6].tolist() == [127, 0, 2, 2, 0, -2]
    assert scales[0, 0] == 1.0 and jnp.isnan(scales[0, 1])


def test_shapes_the_kernels_do_not_take_are_named():
    x, w, _ = _operands(32, 96, 32, jnp.float32)
    with pytest.raises(ValueError, match="K must be a multiple of tile=128, got 96"):
        matmul_quantizing(x, w, storage="int8")
    with pytest.raises(ValueError, match="storage must be one of"):
        matmul_quantizing(x[:, :64], w[:64], storage="int2", tile=64)
    with pytest.raises(ValueError, match="M \\(rows\\) must be a multiple of 16, got 40"):
        matmul_quantizing(jnp.zeros((40, 64)), w[:64], storage="int8", tile=64)
    with pytest.raises(ValueError, match="expected codes"):
        quantized_t_matmul(jnp.zeros((1, 32, 128), jnp.int8), jnp.zeros((1, 16), jnp.float32), jnp.zeros((32, 16)))


def _h100_kernels(storage, dtype, m, k, n):
    """Both kernels (x (m, k), w (k, n), dy (m, n)) compiled deviceless for H100: the roofline's
    account of each, by kernel name."""
    import bsr_jax

    def both(x, w, dy):
        y, codes, scales = matmul_quantizing(x, w, storage=storage)
        return y, quantized_t_matmul(codes, scales, dy)

    shapes = [jax.ShapeDtypeStruct(s, dtype) for s in ((m, k), (k, n), (m, n))]
    step = bsr_jax.compiled_memory(both, *shapes, target="h100", breakdown=True)
    return {k.op.rsplit("/", 2)[-2]: k for k in step.kernels}


@pytest.mark.parametrize("storage,dtype", [("int8", jnp.bfloat16), ("int4", jnp.bfloat16), ("int4", jnp.float32)])
def test_both_compile_for_h100_and_are_not_free_to_the_roofline(storage, dtype):
    m, k, n = 256, 256, 384
    kernels = _h100_kernels(storage, dtype, m, k, n)  # f32: the most shared memory per stage
    forward, weight_grad = kernels["matmul_quantizing"], kernels["quantized_t_matmul"]
    assert forward.flops == weight_grad.flops == 2 * m * k * n
    code_bytes = m * k // (2 if storage == "int4" else 1) + m * (k // 128) * 4
    item = jnp.dtype(dtype).itemsize
    assert forward.bytes == item * (m * k + k * n + m * n) + code_bytes  # reads x and w, writes y and the codes
    assert weight_grad.bytes == code_bytes + item * m * n + 4 * k * n  # K = M: partial sums would outweigh dy, no split


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_roofline_prices_each_kernel_in_whole_waves_at_its_measured_efficiency(dtype):
    """A grid of fewer programs than the H100's 132 SMs takes a whole wave's time, at the share of
    peak the kernels were measured to reach (pallas_kernels.KERNEL_EFFICIENCY)."""
    from bsr_jax.measure.hardware import H100
    from pallas_kernels import KERNEL_EFFICIENCY

    m, k, n = 1024, 128, 384  # partial sums of dW's 8 token splits (f32: 4; bf16: 2) as large as dy
    kernels = _h100_kernels("int4", dtype, m, k, n)
    hlo_dtype = "bf16" if dtype == jnp.bfloat16 else "f32"
    rate = H100.matmul_flops[hlo_dtype]
    bn = 128 if dtype == jnp.bfloat16 else 64  # f32 tiles: half as wide
    splits = m * jnp.dtype(dtype).itemsize // (4 * k)
    assert token_splits((k // 128) * (n // bn), m // 64, splits) == splits
    programs = {"matmul_quantizing": (m // 64) * (n // bn), "quantized_t_matmul": (k // 128) * (n // bn) * splits}
    for kernel, count in programs.items():
        efficiency = KERNEL_EFFICIENCY[kernel][hlo_dtype]
        assert efficiency < 1
        roof = max(kernels[kernel].bytes / H100.hbm_bytes_per_s, kernels[kernel].flops / rate)
        expected = roof * (132 / count) / efficiency + H100.launch_s  # one wave: 132 SMs for `count` programs
        assert kernels[kernel].seconds == pytest.approx(expected, rel=1e-6), kernel
