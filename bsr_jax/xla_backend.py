"""The ``xla`` dW backend: block-sparse ``x.T @ dy`` in pure jax.numpy (CPU/TPU default)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bsr_jax.format import BlockSparse


def xla_dw(bsr: BlockSparse, dy: jax.Array) -> jax.Array:
    """``(Kb*bk, N)`` f32 ``x.T @ dy`` from the kept blocks; ``dy`` is ``(Mb*bm, N)``."""
    (_, kb), (bm, bk) = bsr.grid, bsr.block
    dy_rows = dy.reshape(-1, bm, dy.shape[-1])[bsr.row_ids]  # (cap, bm, N)
    partial = jnp.einsum("pab,pan->pbn", bsr.values, dy_rows, preferred_element_type=jnp.float32)
    dw = jax.ops.segment_sum(partial, bsr.col_ids, num_segments=kb, indices_are_sorted=True)
    return dw.reshape(kb * bk, -1)
