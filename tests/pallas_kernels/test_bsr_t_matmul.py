"""bsr_t_matmul (x.T @ dy from column-grouped blocks) in interpret mode against its reference."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from block_cases import ONE_BLOCK, SEVERAL_WITH_EMPTY_COLUMN, dense_operand, kept_blocks, random_mask
from numerics import assert_close_scaled

from pallas_kernels import TileConfig, bsr_t_matmul, bsr_t_matmul_reference

CASES = {
    "one block": (ONE_BLOCK, (16, 16), 40, None),
    "several, empty column": (SEVERAL_WITH_EMPTY_COLUMN, (16, 16), 40, None),
    "all kept, non-square": (np.ones((2, 3), bool), (32, 16), 24, None),
    "block 8x4 (no dot)": (random_mask((5, 6), 0.5, seed=3), (8, 4), 20, None),
    "three column tiles": (SEVERAL_WITH_EMPTY_COLUMN, (16, 16), 40, TileConfig(bn=16, num_warps=2, num_stages=1)),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_and_masked_dense(case, dtype):
    mask, block, n, config = CASES[case]
    kept = kept_blocks(mask, block, dtype)
    dy = dense_operand(kept.masked_x.shape[0], n, dtype)
    out = jax.jit(functools.partial(bsr_t_matmul, config=config))(kept.values, kept.row_ids, kept.col_ptr, dy)
    expected = jax.jit(bsr_t_matmul_reference)(kept.values, kept.row_ids, kept.col_ptr, dy)
    assert out.shape == (kept.masked_x.shape[1], n) and out.dtype == jnp.float32
    assert_close_scaled(out, expected, dtype)
    dense = kept.masked_x.T @ np.asarray(dy, np.float64)
    np.testing.assert_allclose(expected, dense, atol=1e-5, rtol=1e-5)


def test_empty_column_gives_exact_zeros():
    kept = kept_blocks(SEVERAL_WITH_EMPTY_COLUMN, (16, 16), jnp.float32)
    dy = dense_operand(48, 32, jnp.float32)
    out = jax.jit(bsr_t_matmul)(kept.values, kept.row_ids, kept.col_ptr, dy)
    assert jnp.all(out[16:32] == 0.0) and jnp.all(jnp.any(out[:16] != 0.0))


def test_slots_past_the_last_pointer_are_not_read():
    kept = kept_blocks(SEVERAL_WITH_EMPTY_COLUMN, (16, 16), jnp.float32)
    values = jnp.concatenate([kept.values, jnp.full((2, 16, 16), jnp.nan)])
    row_ids = jnp.concatenate([kept.row_ids, jnp.zeros((2,), jnp.int32)])
    dy = dense_operand(48, 32, jnp.float32)
    out = jax.jit(bsr_t_matmul)(values, row_ids, kept.col_ptr, dy)
    assert jnp.all(jnp.isfinite(out))
    chex.assert_trees_all_close(bsr_t_matmul_reference(values, row_ids, kept.col_ptr, dy), out, atol=1e-5, rtol=1e-5)


def test_zero_capacity_and_out_dtype():
    dy = dense_operand(32, 24, jnp.bfloat16)
    empty = bsr_t_matmul(jnp.zeros((0, 16, 16), jnp.bfloat16), jnp.zeros((0,), jnp.int32), jnp.zeros((4,), jnp.int32), dy)
    chex.assert_trees_all_equal(empty, jnp.zeros((48, 24), jnp.float32))
    kept = kept_blocks(np.ones((2, 1), bool), (16, 16), jnp.bfloat16)
    t_matmul = jax.jit(functools.partial(bsr_t_matmul, out_dtype=jnp.bfloat16))
    out = t_matmul(kept.values, kept.row_ids.astype(jnp.int16), kept.col_ptr, dy)
    assert out.dtype == jnp.bfloat16
    assert_close_scaled(out, bsr_t_matmul_reference(kept.values, kept.row_ids, kept.col_ptr, dy), jnp.bfloat16)


@pytest.mark.parametrize(
    "values_shape,values_dtype,dy_shape,ptr_len,match",
    [
        ((2, 12, 16), jnp.float32, (24, 8), 2, "block sides must be powers of two"),
        ((2, 256, 16), jnp.float32, (512, 8), 2, "block sides must be powers of two"),
        ((2, 16, 16), jnp.float32, (40, 8), 2, "multiple of bm=16"),
        ((2, 16, 16), jnp.int32, (32, 8), 2, "share a dtype"),
        ((2, 16), jnp.float32, (32, 8), 2, r"values must be \(capacity, bm, bk\)"),
        ((2, 16, 16), jnp.float32, (32, 8), 0, "col_ptr must be 1-D"),
    ],
)
def test_bad_inputs_raise(values_shape, values_dtype, dy_shape, ptr_len, match):
    values = jnp.zeros(values_shape, values_dtype)
    dy = jnp.zeros(dy_shape, jnp.float32 if values_dtype == jnp.int32 else values_dtype)
    with pytest.raises(ValueError, match=match):
        bsr_t_matmul(values, jnp.zeros((2,), jnp.int32), jnp.zeros((ptr_len,), jnp.int32), dy)


def test_mismatched_dtypes_and_index_lengths_raise():
    values, dy = jnp.zeros((2, 16, 16), jnp.bfloat16), jnp.zeros((32, 8), jnp.float32)
    with pytest.raises(ValueError, match="values and dy must share a dtype"):
        bsr_t_matmul(values, jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32), dy)
    with pytest.raises(ValueError, match="row_ids must be a 1-D integer array of length 2"):
        bsr_t_matmul(values, jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32), dy.astype(jnp.bfloat16))


@pytest.mark.parametrize(
    "kwargs,match", [({"bn": 24}, "bn must be a power of two"), ({"bn": 8}, "bn"), ({"num_warps": 3}, "num_warps"), ({"num_stages": 0}, "num_stages")]
)
def test_tile_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TileConfig(**kwargs)
