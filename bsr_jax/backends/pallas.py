"""The ``pallas`` dW backend: ``pallas_kernels.bsr_t_matmul`` on the kept blocks (GPU default).

On a GPU the kernel compiles with Triton; on any other platform it runs in the Pallas interpreter
(correct but slow: use it there for tests only). Blocks whose sides are not powers of two are
zero-padded to the next power of two (at least 4) first, at the cost of one copy of the blocks
and of ``dy``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from bsr_jax.storage.format import BlockSparse


def _power_of_two_at_least(n: int, floor: int = 4) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def pallas_dw(bsr: BlockSparse, dy: jax.Array) -> jax.Array:
    """``(Kb*bk, N)`` float32 ``x.T @ dy`` from the kept blocks; ``dy`` is ``(Mb*bm, N)``."""
    bsr = bsr.dequantized()
    (mb, kb), (bm, bk) = bsr.grid, bsr.block
    dtype = jnp.result_type(bsr.values, dy)
    values, dy = bsr.values.astype(dtype), dy.astype(dtype)
    pbm, pbk = _power_of_two_at_least(bm), _power_of_two_at_least(bk)
    if (pbm, pbk) != (bm, bk):
        values = jnp.pad(values, ((0, 0), (0, pbm - bm), (0, pbk - bk)))
        dy = jnp.pad(dy.reshape(mb, bm, -1), ((0, 0), (0, pbm - bm), (0, 0))).reshape(mb * pbm, -1)
    dw = pallas_kernels.bsr_t_matmul(values, bsr.row_ids, bsr.col_ptr, dy)
    if pbk != bk:
        dw = dw.reshape(kb, pbk, -1)[:, :bk].reshape(kb * bk, -1)
    return dw
