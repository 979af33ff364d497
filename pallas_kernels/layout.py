"""Index helpers between the two groupings of kept blocks (pure jax.numpy, jit-friendly).

Both kernels take kept blocks ``values (cap, bm, bk)`` grouped by one block axis, with a pointer
array delimiting the groups and an id array for the other axis:

* column-grouped (``bsr_t_matmul``, ``x.T @ dy``): ``row_ids (cap,)`` and ``col_ptr (Kb + 1,)``;
  block-column ``j`` holds slots ``col_ptr[j]:col_ptr[j + 1]``.
* row-grouped (``bsr_matmul``, ``x @ w``): ``col_ids (cap,)`` and ``row_ptr (Mb + 1,)``;
  block-row ``i`` holds slots ``row_ptr[i]:row_ptr[i + 1]``.

Pointers are non-decreasing int32 with ``ptr[0] == 0``; slots from ``ptr[-1]`` to ``cap`` are unused.
``column_to_row_major`` converts the first into the second with one stable argsort (a permutation of
the ``cap`` blocks; gathering ``values`` by it copies them once).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ids_from_ptr(ptr: jax.Array, capacity: int) -> jax.Array:
    """``(capacity,)`` int32 group of each slot; unused slots (from ``ptr[-1]``) get ``len(ptr) - 1``."""
    slots = jnp.arange(capacity, dtype=jnp.int32)
    return (jnp.searchsorted(ptr.astype(jnp.int32), slots, side="right") - 1).astype(jnp.int32)


def ptr_from_ids(ids: jax.Array, num_groups: int) -> jax.Array:
    """``(num_groups + 1,)`` int32 pointer of sorted group ids (ids >= ``num_groups`` are left out)."""
    groups = jnp.arange(num_groups + 1, dtype=jnp.int32)
    return jnp.searchsorted(ids.astype(jnp.int32), groups, side="left").astype(jnp.int32)


def column_to_row_major(
    values: jax.Array, row_ids: jax.Array, col_ptr: jax.Array, num_block_rows: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Regroup column-grouped kept blocks by block-row, for ``bsr_matmul``.

    Args:
      values: ``(cap, bm, bk)`` kept blocks grouped by block-column.
      row_ids: ``(cap,)`` integer block-row of each slot, in ``[0, num_block_rows)``.
      col_ptr: ``(Kb + 1,)`` int32 column pointer.
      num_block_rows: ``Mb``, rows of the padded matrix divided by ``bm``.

    Returns:
      ``(values, col_ids, row_ptr)``: ``(cap, bm, bk)`` blocks grouped by block-row with columns
      ascending inside a row (the column order is kept by the stable sort), ``(cap,)`` int32
      block-column ids and the ``(Mb + 1,)`` int32 row pointer. Unused slots stay at the end.
    """
    capacity, num_block_cols = values.shape[0], col_ptr.shape[0] - 1
    col_ids = ids_from_ptr(col_ptr, capacity)
    rows = jnp.where(col_ids < num_block_cols, row_ids.astype(jnp.int32), num_block_rows)
    order = jnp.argsort(rows, stable=True)
    return values[order], col_ids[order], ptr_from_ids(rows[order], num_block_rows)


def scatter_blocks(values: jax.Array, row_ids: jax.Array, col_ids: jax.Array, grid: tuple[int, int]) -> jax.Array:
    """The dense ``(Mb * bm, Kb * bk)`` matrix holding ``values`` at their blocks (ids out of range
    are dropped, duplicates add up), in ``values``' dtype."""
    (mb, kb), (bm, bk) = grid, values.shape[1:]
    dense = jnp.zeros((mb, kb, bm, bk), values.dtype).at[row_ids, col_ids].add(values, mode="drop")
    return dense.transpose(0, 2, 1, 3).reshape(mb * bm, kb * bk)
