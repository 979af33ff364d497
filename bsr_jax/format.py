"""Static-capacity block-sparse (BSR) storage of a 2-D activation matrix.

A ``BlockSparse`` keeps ``capacity`` blocks of shape ``(bm, bk)`` out of an ``(M, K)`` matrix,
zero-padded to ``(Mb * bm, Kb * bk)``. Blocks are grouped by block-column and sorted by block-row
inside a column, so the weight gradient ``dW = x.T @ dy`` computes output row-tile ``j`` of dW from
the contiguous run ``values[col_ptr[j]:col_ptr[j + 1]]`` with no atomics.

Array fields (``cap = capacity``, ``Kb = ceil(K / bk)``):

==========  ==============  =============  ==================================================
field       shape           dtype          meaning
==========  ==============  =============  ==================================================
values      (cap, bm, bk)   x's dtype      the kept blocks, in block-column-major order
block_rows  (cap,)          int16 / int32  block-row index of each kept block, in [0, Mb)
col_ptr     (Kb + 1,)       int32          kept blocks of block-column j: col_ptr[j]:col_ptr[j+1]
==========  ==============  =============  ==================================================

Only these are stored, because they are what the backward pass keeps alive. ``block_rows`` is
int16 whenever ``Mb`` fits (at block 4 an int32 row and column id per block would add 12.5% to
the 64 values of an f32 block; int16 rows alone add 3%). Kernels read the int32 views
``row_ids`` and ``col_ids`` (derived from ``col_ptr``), computed in the backward pass.

Static metadata (``shape``, ``block``) is pytree aux data, so jit specialises on it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

Criterion = Literal["l2", "l1"]
Selection = Literal["global", "column"]
BlockSpec = int | tuple[int, int]

CRITERIA = ("l2", "l1")
SELECTIONS = ("global", "column")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockSparse:
    """Kept blocks of an ``(M, K)`` matrix; see the module docstring for the field layout."""

    values: jax.Array
    block_rows: jax.Array
    col_ptr: jax.Array
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    block: tuple[int, int] = dataclasses.field(metadata=dict(static=True))

    @property
    def capacity(self) -> int:
        return self.values.shape[0]

    @property
    def row_ids(self) -> jax.Array:
        """``(cap,)`` int32 block-row index of each kept block."""
        return self.block_rows.astype(jnp.int32)

    @property
    def col_ids(self) -> jax.Array:
        """``(cap,)`` int32 block-column index of each kept block (expanded from ``col_ptr``)."""
        kb = self.grid[1]
        counts = jnp.diff(self.col_ptr)
        return jnp.repeat(jnp.arange(kb, dtype=jnp.int32), counts, total_repeat_length=self.capacity)

    @property
    def grid(self) -> tuple[int, int]:
        """Number of block-rows and block-columns ``(Mb, Kb)`` of the padded matrix."""
        return block_grid(self.shape, self.block)

    @property
    def padded_shape(self) -> tuple[int, int]:
        (mb, kb), (bm, bk) = self.grid, self.block
        return mb * bm, kb * bk

    @property
    def nbytes(self) -> int:
        """Bytes held by the stored arrays (values and indices)."""
        return sum(a.size * a.dtype.itemsize for a in (self.values, self.block_rows, self.col_ptr))

    def to_dense(self, padded: bool = False) -> jax.Array:
        """The ``(M, K)`` matrix (``padded_shape`` if ``padded``) with pruned blocks as zeros."""
        (mb, kb), (bm, bk) = self.grid, self.block
        dense = jnp.zeros((mb, kb, bm, bk), self.values.dtype)
        dense = dense.at[self.row_ids, self.col_ids].set(self.values, unique_indices=True)
        dense = dense.transpose(0, 2, 1, 3).reshape(mb * bm, kb * bk)
        return dense if padded else dense[: self.shape[0], : self.shape[1]]


def normalize_block(block: BlockSpec) -> tuple[int, int]:
    """``16 -> (16, 16)``; ``(bm, bk)`` is checked and returned as a tuple of ints."""
    pair = (block, block) if isinstance(block, int) else tuple(block)
    if len(pair) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in pair):
        raise ValueError(f"block must be a positive int or a pair of positive ints (rows, cols), got {block!r}")
    return pair


def block_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def check_sparsity(sparsity: float) -> float:
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be a Python float in [0, 1), got {sparsity!r}")
    return float(sparsity)


def capacity_for(grid: tuple[int, int], sparsity: float, selection: Selection = "global") -> int:
    """Number of kept blocks: ``ceil((1 - sparsity) * blocks)``, at least one block (per column).

    With ``selection="column"`` every block-column keeps ``ceil((1 - sparsity) * Mb)`` blocks, so
    the capacity is a multiple of ``Kb``.
    """
    check_sparsity(sparsity)
    mb, kb = grid
    # The 1e-9 keeps (1 - 0.7) * 100 = 30.000000000000004 from rounding up to 31.
    keep = lambda n: max(1, math.ceil((1.0 - sparsity) * n - 1e-9))
    if selection == "column":
        return keep(mb) * kb
    if selection == "global":
        return keep(mb * kb)
    raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")


def block_magnitudes(x: jax.Array, block: tuple[int, int], criterion: Criterion = "l2") -> jax.Array:
    """Per-block magnitude of a padded ``(Mb*bm, Kb*bk)`` matrix, as an f32 ``(Kb, Mb)`` array.

    L2 returns the squared norm (same ranking, no sqrt). The result is column-major so that a flat
    index ``col * Mb + row`` sorts kept blocks by column. NaN ranks above every number, so a NaN
    block is kept and its NaN reaches dW, exactly as it would in dense training.
    """
    (bm, bk), (rows, cols) = block, x.shape
    x4 = x.reshape(rows // bm, bm, cols // bk, bk)
    if criterion == "l2":
        x4 = x4.astype(jnp.float32)
        mags = jnp.einsum("ibjc,ibjc->ji", x4, x4)
    elif criterion == "l1":
        mags = jnp.einsum("ibjc->ji", jnp.abs(x4).astype(jnp.float32))
    else:
        raise ValueError(f"criterion must be one of {CRITERIA}, got {criterion!r}")
    return jnp.where(jnp.isnan(mags), jnp.inf, mags)


def pad_to_blocks(x: jax.Array, block: tuple[int, int]) -> jax.Array:
    (mb, kb), (bm, bk) = block_grid(x.shape, block), block
    return jnp.pad(x, ((0, mb * bm - x.shape[0]), (0, kb * bk - x.shape[1])))


def from_dense(
    x: jax.Array,
    sparsity: float,
    block: BlockSpec,
    *,
    criterion: Criterion = "l2",
    selection: Selection = "global",
) -> BlockSparse:
    """Keep the largest blocks of a 2-D float array ``x`` of shape ``(M, K)``.

    ``selection="global"`` keeps the top ``capacity_for(...)`` blocks of the whole matrix (the
    paper's choice); ``"column"`` keeps the same number in every block-column, which balances
    kernel work. M and K need not divide the block: the matrix is zero-padded and padding blocks
    rank last. Ties are broken towards lower indices (``lax.top_k``). Runs under jit: the capacity
    is a static function of ``x.shape``, ``block`` and ``sparsity``.
    """
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must have a floating dtype, got {x.dtype}")
    block = normalize_block(block)
    grid = block_grid(x.shape, block)
    capacity = capacity_for(grid, sparsity, selection)
    xp = pad_to_blocks(x, block)
    mags = block_magnitudes(xp, block, criterion)  # (Kb, Mb)
    mb, kb = grid
    if selection == "global":
        _, flat = jax.lax.top_k(mags.reshape(-1), capacity)
        flat = jnp.sort(flat)
        col_ids, row_ids = flat // mb, flat % mb
        col_ptr = jnp.searchsorted(col_ids, jnp.arange(kb + 1, dtype=col_ids.dtype), side="left")
    else:
        per_col = capacity // kb
        _, rows = jax.lax.top_k(mags, per_col)  # (Kb, per_col)
        row_ids = jnp.sort(rows, axis=1).reshape(-1)
        col_ids = jnp.repeat(jnp.arange(kb, dtype=jnp.int32), per_col)
        col_ptr = jnp.arange(kb + 1, dtype=jnp.int32) * per_col
    # Gather straight from the (Mb, bm, Kb, bk) view: the advanced indices move the kept-block axis
    # first and no transpose of x is materialised.
    values = xp.reshape(mb, block[0], kb, block[1])[row_ids, :, col_ids, :]
    return BlockSparse(
        values=values,
        block_rows=row_ids.astype(jnp.int16 if mb <= jnp.iinfo(jnp.int16).max + 1 else jnp.int32),
        col_ptr=col_ptr.astype(jnp.int32),
        shape=tuple(x.shape),
        block=block,
    )
