"""``x.T @ dy`` for a block-sparse ``x``: the weight gradient of a linear layer from kept input blocks.

One program per output tile ``(bk, bn)`` of the ``(Kb * bk, N)`` result: program ``(j, n)`` loops
over the kept blocks of block-column ``j`` (slots ``col_ptr[j]:col_ptr[j + 1]``), loads the ``bm``
rows of ``dy`` each block multiplies (rows ``row_ids[p] * bm`` onwards, columns of tile ``n``) and
accumulates ``block.T @ dy_rows`` in f32. Every output tile has exactly one writer: no atomics, and
the result is deterministic. See docs/kernels.md for the design and a roofline estimate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import layout
from pallas_kernels.block_loop import grouped_block_matmul
from pallas_kernels.tiling import TileConfig


def bsr_t_matmul(
    values: jax.Array,
    row_ids: jax.Array,
    col_ptr: jax.Array,
    dy: jax.Array,
    *,
    config: TileConfig | None = None,
    precision: lax.PrecisionLike = lax.Precision.HIGHEST,
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
      precision: of the block products. The default, ``HIGHEST``, multiplies float32 blocks in
        full float32 (Triton's IEEE input precision), so the weight gradient matches the CPU
        backends and a float32 reference to float32 rounding on every platform. ``DEFAULT`` (or
        ``None``) lets a GPU use TF32 tensor cores instead: faster on Ampere and later, but with
        10-bit mantissas (relative error ~1e-3). bfloat16/float16 blocks are unaffected.
      out_dtype: dtype of the result; accumulation is float32 regardless.
      interpret: run the Pallas interpreter even when lowering for a GPU. Without it, the kernel
        is compiled by Triton on CUDA/ROCm and interpreted on every other platform.

    Returns:
      ``(Kb * bk, N)`` array ``x.T @ dy``, exact up to float32 reassociation (and TF32 rounding
      of float32 inputs on GPU with ``precision=DEFAULT``).
    """
    return grouped_block_matmul(
        values, row_ids, col_ptr, dy, contract=0, names=("row_ids", "col_ptr", "dy"), config=config,
        precision=precision, out_dtype=out_dtype, interpret=interpret, kernel_name="bsr_t_matmul",
    )  # fmt: skip


def bsr_t_matmul_reference(
    values: jax.Array, row_ids: jax.Array, col_ptr: jax.Array, dy: jax.Array, out_dtype=jnp.float32
) -> jax.Array:
    """``bsr_t_matmul`` by densifying ``x`` and one float32 matmul at ``HIGHEST`` precision."""
    bm = values.shape[1]
    grid = (dy.shape[0] // bm, col_ptr.shape[0] - 1)
    col_ids = layout.ids_from_ptr(col_ptr, values.shape[0])
    x = layout.scatter_blocks(values.astype(jnp.float32), row_ids, col_ids, grid)
    return jnp.matmul(x.T, dy.astype(jnp.float32), precision=lax.Precision.HIGHEST).astype(out_dtype)
