"""``x @ w`` for a block-sparse ``x``: a sparse activation times a dense weight.

One program per output tile ``(bm, bn)`` of the ``(Mb * bm, N)`` result: program ``(i, n)`` loops
over the kept blocks of block-row ``i`` (slots ``row_ptr[i]:row_ptr[i + 1]``), loads the ``bk`` rows
of ``w`` each block multiplies (rows ``col_ids[p] * bk`` onwards, columns of tile ``n``) and
accumulates ``block @ w_rows`` in f32; one writer per tile, no atomics. Blocks must be grouped by
block-row: ``pallas_kernels.layout.column_to_row_major`` regroups the column-grouped blocks that
``bsr_t_matmul`` (and ``bsr_jax.BlockSparse``) use.
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


def _bsr_matmul_kernel(row_ptr_ref, col_ids_ref, values_ref, w_ref, out_ref, *, precision):
    bm, bk = values_ref.shape[1:]
    i = pl.program_id(0)

    def accumulate(p, acc):
        first_row = pl.multiple_of(col_ids_ref[p] * bk, bk)
        w_rows = w_ref[pl.ds(first_row, bk), :]  # (bk, bn) of this program's column tile
        return acc + block_product(values_ref[p], w_rows, 1, precision)

    acc = jnp.zeros((bm, out_ref.shape[1]), jnp.float32)
    acc = lax.fori_loop(row_ptr_ref[i], row_ptr_ref[i + 1], accumulate, acc)
    out_ref[...] = acc.astype(out_ref.dtype)


def _launch(row_ptr, col_ids, values, w, *, bn, config, precision, out_dtype, interpret):
    bm = values.shape[1]
    num_block_rows, (rows, cols) = row_ptr.shape[0] - 1, w.shape
    whole = pl.no_block_spec  # index arrays and blocks are read at data-dependent slots
    return pl.pallas_call(
        functools.partial(_bsr_matmul_kernel, precision=precision),
        out_shape=jax.ShapeDtypeStruct((num_block_rows * bm, cols), out_dtype),
        grid=(num_block_rows, cols // bn),
        in_specs=[whole, whole, whole, pl.BlockSpec((rows, bn), lambda i, n: (0, n))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, n: (i, n)),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="bsr_matmul",
    )(row_ptr, col_ids, values, w)


def bsr_matmul(
    values: jax.Array,
    col_ids: jax.Array,
    row_ptr: jax.Array,
    w: jax.Array,
    *,
    config: TileConfig | None = None,
    precision: lax.PrecisionLike = None,
    out_dtype=jnp.float32,
    interpret: bool = False,
) -> jax.Array:
    """``x @ w`` where ``x`` is given by its kept blocks, grouped by block-row.

    Args:
      values: ``(cap, bm, bk)`` kept blocks of ``x (Mb * bm, Kb * bk)``, float32/bfloat16/float16;
        block sides are powers of two in 4..128.
      col_ids: ``(cap,)`` integer block-column of each block, in ``[0, Kb)`` (not bounds-checked on GPU).
      row_ptr: ``(Mb + 1,)`` integer; block-row ``i`` owns slots ``row_ptr[i]:row_ptr[i + 1]``.
        An empty block-row gives zero rows of the result.
      w: ``(Kb * bk, N)`` dense operand in ``values``' dtype (the caller pads K to whole blocks).
      config, precision, out_dtype, interpret: as in ``bsr_t_matmul``.

    Returns:
      ``(Mb * bm, N)`` array ``x @ w``, exact up to float32 reassociation (and TF32 rounding of
      float32 inputs on GPU with ``precision=None``).
    """
    bm, bk = check_values(values, w, "w")
    if row_ptr.ndim != 1 or row_ptr.shape[0] < 1:
        raise ValueError(f"row_ptr must be 1-D of length Mb + 1 >= 1, got shape {row_ptr.shape}")
    capacity, num_block_rows, (rows, cols) = values.shape[0], row_ptr.shape[0] - 1, w.shape
    col_ids = check_index("col_ids", col_ids, capacity)
    row_ptr = check_index("row_ptr", row_ptr, num_block_rows + 1)
    if rows % bk:
        raise ValueError(f"w must have a multiple of bk={bk} rows (pad K to whole blocks), got {rows}")
    if capacity == 0 or num_block_rows == 0 or cols == 0 or rows == 0:
        return jnp.zeros((num_block_rows * bm, cols), out_dtype)
    config = config or tile_config_for((bm, bk), values.dtype)
    bn = column_tile(cols, config)
    call = functools.partial(
        _launch, bn=bn, config=config, precision=precision, out_dtype=jnp.dtype(out_dtype)
    )
    out = run_by_lowering_platform(call, row_ptr, col_ids, values, pad_columns(w, bn), interpret=interpret)
    return out[:, :cols]


def bsr_matmul_reference(
    values: jax.Array, col_ids: jax.Array, row_ptr: jax.Array, w: jax.Array, out_dtype=jnp.float32
) -> jax.Array:
    """``bsr_matmul`` by densifying ``x`` and one float32 matmul at ``HIGHEST`` precision."""
    bk = values.shape[2]
    grid = (row_ptr.shape[0] - 1, w.shape[0] // bk)
    row_ids = layout.ids_from_ptr(row_ptr, values.shape[0])
    x = layout.scatter_blocks(values.astype(jnp.float32), row_ids, col_ids, grid)
    return jnp.matmul(x, w.astype(jnp.float32), precision=lax.Precision.HIGHEST).astype(out_dtype)
