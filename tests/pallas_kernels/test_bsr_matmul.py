"""bsr_matmul (x @ w from row-grouped blocks) in interpret mode, and the column -> row regrouping."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from block_cases import dense_operand, kept_blocks, random_mask
from numerics import assert_close_scaled

from pallas_kernels import (
    TileConfig,
    bsr_matmul,
    bsr_matmul_reference,
    column_to_row_major,
    ids_from_ptr,
)

EMPTY_ROW = np.array([[1, 0, 1], [0, 0, 0], [1, 1, 1], [0, 1, 0]], bool)
CASES = {
    "one block": (np.eye(1, 3, 2, dtype=bool), (16, 16), 40, None),
    "several, empty block-row": (EMPTY_ROW, (16, 32), 24, None),
    "all kept": (np.ones((2, 2), bool), (32, 16), 16, None),
    "block 4x8 (no dot)": (random_mask((5, 3), 0.5, seed=4), (4, 8), 17, None),
    "three column tiles": (EMPTY_ROW, (16, 16), 40, TileConfig(bn=16, num_warps=2, num_stages=1)),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_and_masked_dense(case, dtype):
    mask, block, n, config = CASES[case]
    kept = kept_blocks(mask, block, dtype)
    values, col_ids, row_ptr = column_to_row_major(kept.values, kept.row_ids, kept.col_ptr, mask.shape[0])
    w = dense_operand(kept.masked_x.shape[1], n, dtype)
    out = jax.jit(functools.partial(bsr_matmul, config=config))(values, col_ids, row_ptr, w)
    expected = jax.jit(bsr_matmul_reference)(values, col_ids, row_ptr, w)
    assert out.shape == (kept.masked_x.shape[0], n) and out.dtype == jnp.float32
    assert_close_scaled(out, expected, dtype)
    np.testing.assert_allclose(expected, kept.masked_x @ np.asarray(w, np.float64), atol=1e-5, rtol=1e-5)
    empty_rows = np.repeat(~mask.any(axis=1), block[0])
    assert np.all(np.asarray(out)[empty_rows] == 0.0)


def test_column_to_row_major_is_a_regrouping():
    mask = random_mask((6, 5), 0.5, seed=7)
    kept = kept_blocks(mask, (4, 4), jnp.float32)
    values, col_ids, row_ptr = column_to_row_major(kept.values, kept.row_ids, kept.col_ptr, 6)
    row_ids = ids_from_ptr(row_ptr, values.shape[0])
    expected_pairs = [(i, j) for i in range(6) for j in range(5) if mask[i, j]]  # row-major, columns ascending
    assert list(zip(row_ids.tolist(), col_ids.tolist())) == expected_pairs
    x4 = kept.masked_x.reshape(6, 4, 5, 4)
    np.testing.assert_array_equal(values, np.stack([x4[i, :, j, :] for i, j in expected_pairs]))
    np.testing.assert_array_equal(row_ptr, np.concatenate([[0], np.cumsum(mask.sum(axis=1))]))


def test_column_to_row_major_keeps_unused_slots_last():
    values = jnp.arange(3 * 16, dtype=jnp.float32).reshape(3, 4, 4)
    # Two used slots (column 0: row 1, column 1: row 0) and one unused slot past col_ptr[-1].
    out_values, col_ids, row_ptr = column_to_row_major(values, jnp.array([1, 0, 0]), jnp.array([0, 1, 2]), 2)
    np.testing.assert_array_equal(row_ptr, [0, 1, 2])
    np.testing.assert_array_equal(col_ids[:2], [1, 0])
    np.testing.assert_array_equal(out_values, values[jnp.array([1, 0, 2])])


def test_bad_inputs_raise():
    values = jnp.zeros((2, 16, 16), jnp.float32)
    with pytest.raises(ValueError, match="w must have a multiple of bk=16 rows"):
        bsr_matmul(values, jnp.zeros((2,), jnp.int32), jnp.zeros((3,), jnp.int32), jnp.zeros((40, 8), jnp.float32))
    with pytest.raises(ValueError, match="col_ids must be a 1-D integer array of length 2"):
        bsr_matmul(values, jnp.zeros((2, 1), jnp.int32), jnp.zeros((3,), jnp.int32), jnp.zeros((32, 8), jnp.float32))
    with pytest.raises(ValueError, match="block sides must be powers of two"):
        bsr_matmul(jnp.zeros((2, 16, 24)), jnp.zeros((2,), jnp.int32), jnp.zeros((3,), jnp.int32), jnp.zeros((48, 8)))
