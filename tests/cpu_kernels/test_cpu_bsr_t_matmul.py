"""cpu_kernels.bsr_t_matmul (the C++ FFI kernel) against the pure-jax reference and masked dense."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from block_cases import ONE_BLOCK, SEVERAL_WITH_EMPTY_COLUMN, dense_operand, kept_blocks, random_mask
from numerics import assert_close_scaled

import cpu_kernels
from bsr_jax import backends, from_dense
from pallas_kernels import bsr_t_matmul_reference

# (keep mask, block, N): N covers whole 64-wide tiles, 16-wide vectors and a scalar tail; bk covers
# whole 4-row groups and a remainder.
CASES = {
    "one block": (ONE_BLOCK, (16, 16), 40),
    "several, empty column": (SEVERAL_WITH_EMPTY_COLUMN, (16, 16), 200),
    "all kept, non-square": (np.ones((2, 3), bool), (32, 16), 64),
    "block 8x4": (random_mask((5, 6), 0.5, seed=3), (8, 4), 20),
    "block 3x6, odd sides": (random_mask((7, 5), 0.4, seed=4), (3, 6), 129),
    "block 64, two tiles": (random_mask((4, 3), 0.5, seed=5), (64, 64), 128),
    "block 1x1": (random_mask((9, 7), 0.3, seed=6), (1, 1), 17),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_and_masked_dense(case, dtype):
    mask, block, n = CASES[case]
    kept = kept_blocks(mask, block, dtype)
    dy = dense_operand(kept.masked_x.shape[0], n, dtype)
    out = jax.jit(cpu_kernels.bsr_t_matmul)(kept.values, kept.row_ids, kept.col_ptr, dy)
    expected = jax.jit(bsr_t_matmul_reference)(kept.values, kept.row_ids, kept.col_ptr, dy)
    assert out.shape == (kept.masked_x.shape[1], n) and out.dtype == jnp.float32
    # The kernel computes in f32 even for bf16 inputs, so it meets the f32 tolerance against the
    # exact product of the (bf16-representable) inputs.
    dense = kept.masked_x.T @ np.asarray(dy, np.float64)
    assert_close_scaled(out, jnp.asarray(dense, jnp.float32), jnp.float32)
    assert_close_scaled(out, expected, dtype)


def test_empty_columns_zero_capacity_and_unused_slots():
    kept = kept_blocks(SEVERAL_WITH_EMPTY_COLUMN, (16, 16), jnp.float32)
    dy = dense_operand(48, 32, jnp.float32)
    # Slots past col_ptr[-1] are unused: NaN values and out-of-range rows there are never read.
    values = jnp.concatenate([kept.values, jnp.full((2, 16, 16), jnp.nan)])
    row_ids = jnp.concatenate([kept.row_ids, jnp.full((2,), 99, jnp.int32)])
    out = jax.jit(cpu_kernels.bsr_t_matmul)(values, row_ids, kept.col_ptr, dy)
    chex.assert_trees_all_close(out, bsr_t_matmul_reference(kept.values, kept.row_ids, kept.col_ptr, dy), atol=1e-5, rtol=1e-5)
    assert jnp.all(out[16:32] == 0.0)
    empty = cpu_kernels.bsr_t_matmul(jnp.zeros((0, 16, 16)), jnp.zeros((0,), jnp.int32), jnp.zeros((4,), jnp.int32), dy)
    chex.assert_trees_all_equal(empty, jnp.zeros((48, 32), jnp.float32))


def test_bad_row_id_fails_naming_the_slot():
    kept = kept_blocks(SEVERAL_WITH_EMPTY_COLUMN, (16, 16), jnp.float32)
    dy = dense_operand(48, 32, jnp.float32)
    with pytest.raises(Exception, match=r"row_ids\[2\] = 3 outside \[0, 3\)"):
        cpu_kernels.bsr_t_matmul(kept.values, kept.row_ids.at[2].set(3), kept.col_ptr, dy).block_until_ready()


@pytest.mark.parametrize(
    "values_shape,dy_shape,match",
    [((2, 16), (32, 8), "want values"), ((2, 16, 16), (40, 8), "whole number of 16-row blocks")],
)
def test_bad_shapes_raise(values_shape, dy_shape, match):
    with pytest.raises(ValueError, match=match):
        cpu_kernels.bsr_t_matmul(jnp.zeros(values_shape), jnp.zeros((2,), jnp.int32), jnp.array([0, 2]), jnp.zeros(dy_shape))


def test_multithreaded_result_is_deterministic():
    """Each output tile has one writer, so two runs (tiles possibly on other threads) are bitwise equal."""
    x = dense_operand(512, 96, jnp.float32)
    bsr = from_dense(x, 0.7, 16)
    dy = dense_operand(512, 640, jnp.float32, seed=2)
    run = jax.jit(lambda: cpu_kernels.bsr_t_matmul(bsr.values, bsr.block_rows, bsr.col_ptr, dy))
    chex.assert_trees_all_equal(run(), run())
    chex.assert_trees_all_close(run(), backends.reference_dw(bsr, dy), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("storage_dtype", [None, "int8"])
@pytest.mark.parametrize("block", [16, (4, 16)])
def test_cpu_backend_matches_float64_reference(block, storage_dtype):
    """Blocks of under CPU_KERNEL_MIN_ROWS rows take the xla path; quantized blocks are dequantized.
    x has full float32 mantissas, so no value lies half-way between two int8 steps."""
    x = jax.random.normal(jax.random.key(0), (96, 80))
    bsr = from_dense(x, 0.5, block, storage_dtype=storage_dtype)
    dy = dense_operand(96, 72, jnp.float32, seed=2)
    kept = reference.kept_input(np.asarray(x), 0.5, block, storage_dtype=storage_dtype)
    expected = jnp.asarray(kept.T @ np.asarray(dy, np.float64), jnp.float32)
    assert_close_scaled(jax.jit(backends.cpu_dw)(bsr, dy), expected, jnp.float32)


def test_inside_shard_map_with_operands_varying_differently():
    """Under shard_map the per-shard blocks vary over the mesh axis while a column-selection col_ptr
    (an iota) does not; the call must still trace, run and match the per-shard reference."""
    mesh = jax.make_mesh((1,), ("data",))
    x = dense_operand(64, 48, jnp.float32)
    dy = dense_operand(64, 40, jnp.float32, seed=2)

    def local(x, dy):
        bsr = from_dense(x, 0.5, 16, selection="column")
        return cpu_kernels.bsr_t_matmul(bsr.values, bsr.block_rows, bsr.col_ptr, dy), backends.reference_dw(bsr, dy)

    spec = jax.sharding.PartitionSpec("data")
    x, dy = jax.device_put((x, dy), jax.sharding.NamedSharding(mesh, spec))
    out, expected = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=spec))(x, dy)
    chex.assert_trees_all_close(out, expected, atol=1e-4, rtol=1e-5)
