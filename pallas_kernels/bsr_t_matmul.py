"""``x.T @ dy`` for a block-sparse ``x``: the weight gradient of a linear layer from kept input blocks.

One program per output tile ``(bk, bn)`` of the ``(Kb * bk, N)`` result: program ``(j, n)`` loops
over the kept blocks of block-column ``j`` (slots ``col_ptr[j]:col_ptr[j + 1]``), loads the ``bm``
rows of ``dy`` each block multiplies (rows ``row_ids[p] * bm`` onwards, columns of tile ``n``) and
accumulates ``block.T @ dy_rows`` in f32. Every output tile has exactly one writer: no atomics, and
the result is deterministic. See docs/kernels.md for the design and a roofline estimate.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import layout
from pallas_kernels.tiling import (
    TileConfig,
    block_product,
    check_index,
    check_values,
    column_tile,
    pad_columns,
    run_by_lowering_platform,
    tile_config_for,
)


def _bsr_t_matmul_kernel(col_ptr_ref, row_ids_ref, values_ref, dy_ref, out_ref, *, precision):
    bm, bk = values_ref.shape[1:]
    j = pl.program_id(0)

    def accumulate(p, acc):
        first_row = pl.multiple_of(row_ids_ref[p] * bm, bm)
        dy_rows = dy_ref[pl.ds(first_row, bm), :]  # (bm, bn) of this program's column tile
        return acc + block_product(values_ref[p], dy_rows, 0, precision)

    acc = jnp.zeros((bk, out_ref.shape[1]), jnp.float32)
    acc = lax.fori_loop(col_ptr_ref[j], col_ptr_ref[j + 1], accumulate, acc)
    out_ref[...] = acc.astype(out_ref.dtype)


def _launch(col_ptr, row_ids, values, dy, *, bn, config, precision, out_dtype, interpret):
    bk = values.shape[2]
    num_block_cols, (rows, cols) = col_ptr.shape[0] - 1, dy.shape
    whole = pl.no_block_spec  # index arrays and blocks are read at data-dependent slots
    return pl.pallas_call(
        functools.partial(_bsr_t_matmul_kernel, precision=precision),
        out_shape=jax.ShapeDtypeStruct((num_block_cols * bk, cols), out_dtype),
        grid=(num_block_cols, cols // bn),
        in_specs=[whole, whole, whole, pl.BlockSpec((rows, bn), lambda j, n: (0, n))],
        out_specs=pl.BlockSpec((bk, bn), lambda j, n: (j, n)),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="bsr_t_matmul",
    )(col_ptr, row_ids, values, dy)


def bsr_t_matmul(
    values: jax.Array,
    row_ids: jax.Array,
    col_ptr: jax.Array,
    dy: jax.Array,
    *,
    config: TileConfig | None = None,
    precision: lax.PrecisionLike = None,
    out_dtype=jnp.float32,
    interpret: bool = False,
) -> jax.Array:
    """``x.T @ dy`` where ``x`` is given by its kept blocks, grouped by block-column.

    Args:
      values: ``(cap, bm, bk)`` kept blocks of ``x (Mb * bm, Kb * bk)``, float32/bfloat16/float16;
        block sides are powers of two in 4..128.
      row_ids: ``(cap,)`` integer block-row of each block, in ``[0, Mb)`` (not bounds-checked on GPU).
      col_ptr: ``(Kb + 1,)`` integer; block-column ``j`` owns slots ``col_ptr[j]:col_ptr[j + 1]``
        (see ``pallas_kernels.layout``). An empty column gives zero rows of the result.
      dy: ``(Mb * bm, N)`` dense operand in ``values``' dtype (the caller pads M to whole blocks).
      config: tile configuration; default ``tile_config_for((bm, bk), dtype)``.
      precision: of the block products. ``None`` on GPU lets float32 use TF32 tensor cores (as
        XLA's default matmul does); ``lax.Precision.HIGHEST`` asks for full float32.
      out_dtype: dtype of the result; accumulation is float32 regardless.
      interpret: run the Pallas interpreter even when lowering for a GPU. Without it, the kernel
        is compiled by Triton on CUDA/ROCm and interpreted on every other platform.

    Returns:
      ``(Kb * bk, N)`` array ``x.T @ dy``, exact up to float32 reassociation (and TF32 rounding
      of float32 inputs on GPU with ``precision=None``).
    """
    bm, bk = check_values(values, dy, "dy")
    if col_ptr.ndim != 1 or col_ptr.shape[0] < 1:
        raise ValueError(f"col_ptr must be 1-D of length Kb + 1 >= 1, got shape {col_ptr.shape}")
    capacity, num_block_cols, (rows, cols) = values.shape[0], col_ptr.shape[0] - 1, dy.shape
    row_ids = check_index("row_ids", row_ids, capacity)
    col_ptr = check_index("col_ptr", col_ptr, num_block_cols + 1)
    if rows % bm:
        raise ValueError(f"dy must have a multiple of bm={bm} rows (pad M to whole blocks), got {rows}")
    if capacity == 0 or num_block_cols == 0 or cols == 0 or rows == 0:
        return jnp.zeros((num_block_cols * bk, cols), out_dtype)
    config = config or tile_config_for((bm, bk), values.dtype)
    bn = column_tile(cols, config)
    call = functools.partial(
        _launch, bn=bn, config=config, precision=precision, out_dtype=jnp.dtype(out_dtype)
    )
    out = run_by_lowering_platform(call, col_ptr, row_ids, values, pad_columns(dy, bn), interpret=interpret)
    return out[:, :cols]


def bsr_t_matmul_reference(
    values: jax.Array, row_ids: jax.Array, col_ptr: jax.Array, dy: jax.Array, out_dtype=jnp.float32
) -> jax.Array:
    """``bsr_t_matmul`` by densifying ``x`` and one float32 matmul at ``HIGHEST`` precision."""
    bm = values.shape[1]
    grid = (dy.shape[0] // bm, col_ptr.shape[0] - 1)
    col_ids = layout.ids_from_ptr(col_ptr, values.shape[0])
    x = layout.scatter_blocks(values.astype(jnp.float32), row_ids, col_ids, grid)
    return jnp.matmul(x.T, dy.astype(jnp.float32), precision=lax.Precision.HIGHEST).astype(out_dtype)
