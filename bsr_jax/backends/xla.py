"""The ``xla`` dW backend: block-sparse ``x.T @ dy`` in pure jax.numpy (the TPU default; on CPU the
``cpu`` backend's C++ kernel is faster, see ``bsr_jax.backends.dispatch``).

Two paths, chosen statically by the layout:

* every block-column keeps the same number of blocks (``selection="column"``), at most
  ``BATCHED_MAX_KEPT`` of them, and blocks are at least ``BATCHED_MIN_BLOCK`` on each side: the kept blocks of a group of columns and the dy block-rows they
  pair with are gathered into ``(group, count * bm, bk)`` and ``(group, count * bm, N)`` and
  multiplied as one batched matmul, so FLOPs are ``(1 - sparsity)`` of dense. Groups are processed
  one after another (``lax.map``) so the gathered dy stays under ``GATHER_BYTES``;
* otherwise (``selection="global"``: a different count per column, which static shapes cannot
  batch; or a high kept fraction, or small blocks): the kept blocks are placed into a zero ``(Mb * bm, Kb * bk)``
  matrix (``BlockSparse.to_dense``), followed by one dense matmul. Dense FLOPs, but only for the
  duration of this layer's backward; the residual kept between forward and backward is still the
  block-sparse one.

Measured against dense ``x.T @ dy`` on CPU: see benchmarks/kernels.py and docs/RESULTS.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bsr_jax.storage.format import BlockSparse

GATHER_BYTES = 8 << 20
# Every kept block re-reads a (bm, N) slab of dy, so the batched path's gather grows with the kept
# fraction; on the development CPU it beat densify-and-matmul at 30% kept and lost at 50% and above
# (benchmarks/kernels.py, docs/kernels.md), so it runs only up to this kept fraction.
BATCHED_MAX_KEPT = 0.4
# With blocks under 16 the slabs are too thin for the gather and each small matmul to pay off (block
# 4 ran at 3.9-5x of dense at sparsity 0.7), so those blocks always densify.
BATCHED_MIN_BLOCK = 16


def _column_batched_dw(bsr: BlockSparse, dy: jax.Array) -> jax.Array:
    bsr = bsr.dequantized()
    (mb, kb), (bm, bk) = bsr.grid, bsr.block
    count, n = bsr.column_count, dy.shape[-1]
    per_column = count * bm * n * dy.dtype.itemsize
    group = max(1, min(kb, GATHER_BYTES // max(per_column, 1)))
    while kb % group:
        group -= 1
    values = bsr.values.reshape(kb // group, group, count * bm, bk)
    rows = bsr.row_ids.reshape(kb // group, group * count)
    dy_rows = dy.reshape(mb, bm, n)

    def one_group(args):
        group_values, group_rows = args
        gathered = jnp.take(dy_rows, group_rows, axis=0).reshape(group, count * bm, n)
        return jnp.einsum("grk,grn->gkn", group_values, gathered, preferred_element_type=jnp.float32)

    return jax.lax.map(one_group, (values, rows)).reshape(kb * bk, n)


def xla_dw(bsr: BlockSparse, dy: jax.Array) -> jax.Array:
    """``(Kb*bk, N)`` f32 ``x.T @ dy`` from the kept blocks; ``dy`` is ``(Mb*bm, N)``."""
    batched = bsr.column_count and bsr.column_count <= BATCHED_MAX_KEPT * bsr.grid[0]
    if batched and min(bsr.block) >= BATCHED_MIN_BLOCK:
        return _column_batched_dw(bsr, dy)
    return jnp.matmul(bsr.to_dense(padded=True).T, dy, preferred_element_type=jnp.float32)
