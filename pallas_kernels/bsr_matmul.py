"""``x @ w`` for a block-sparse ``x``: a sparse activation times a dense weight.

One program per output tile ``(bm, bn)`` of the ``(Mb * bm, N)`` result: program ``(i, n)`` loops
over the kept blocks of block-row ``i`` (slots ``row_ptr[i]:row_ptr[i + 1]``), loads the ``bk`` rows
of ``w`` each block multiplies (rows ``col_ids[p] * bk`` onwards, columns of tile ``n``) and
accumulates ``block @ w_rows`` in f32; one writer per tile, no atomics. Blocks must be grouped by
block-row: ``pallas_kernels.layout.column_to_row_major`` regroups the column-grouped blocks that
``bsr_t_matmul`` (and ``bsr_jax.BlockSparse``) use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import layout
from pallas_kernels.block_loop import grouped_block_matmul
from pallas_kernels.tiling import TileConfig


def bsr_matmul(
    values: jax.Array,
    col_ids: jax.Array,
    row_ptr: jax.Array,
    w: jax.Array,
    *,
    config: TileConfig | None = None,
    precision: lax.PrecisionLike = lax.Precision.HIGHEST,
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
      float32 inputs on GPU with ``precision=DEFAULT``).
    """
    return grouped_block_matmul(
        values, col_ids, row_ptr, w, contract=1, names=("col_ids", "row_ptr", "w"), config=config,
        precision=precision, out_dtype=out_dtype, interpret=interpret, kernel_name="bsr_matmul",
    )  # fmt: skip


def bsr_matmul_reference(
    values: jax.Array, col_ids: jax.Array, row_ptr: jax.Array, w: jax.Array, out_dtype=jnp.float32
) -> jax.Array:
    """``bsr_matmul`` by densifying ``x`` and one float32 matmul at ``HIGHEST`` precision."""
    bk = values.shape[2]
    grid = (row_ptr.shape[0] - 1, w.shape[0] // bk)
    row_ids = layout.ids_from_ptr(row_ptr, values.shape[0])
    x = layout.scatter_blocks(values.astype(jnp.float32), row_ids, col_ids, grid)
    return jnp.matmul(x, w.astype(jnp.float32), precision=lax.Precision.HIGHEST).astype(out_dtype)
