"""Static-capacity block-sparse (BSR) storage of a 2-D activation matrix.

A ``BlockSparse`` keeps ``capacity`` blocks of shape ``(bm, bk)`` out of an ``(M, K)`` matrix,
zero-padded to ``(Mb * bm, Kb * bk)``. Blocks are grouped by block-column and sorted by block-row
inside a column, so the weight gradient ``dW = x.T @ dy`` computes output row-tile ``j`` of dW from
the contiguous run ``values[col_ptr[j]:col_ptr[j + 1]]`` with no atomics.

Array fields (``cap = capacity``, ``Kb = ceil(K / bk)``):

==========  ==============  =============  ==================================================
field       shape           dtype          meaning
==========  ==============  =============  ==================================================
values      (cap, bm, bk)   x's dtype [1]  the kept blocks, in block-column-major order
block_rows  (cap,) or None  int16 / int32  block-row index of each kept block, in [0, Mb) [2]
col_ptr     (Kb + 1,)       int32          kept blocks of block-column j: col_ptr[j]:col_ptr[j+1]
            or None                        [2]
scales      (cap,) or None  float32        per-block scale of int8 / int4 / float8 values [1]
==========  ==============  =============  ==================================================

[1] With ``storage_dtype`` (static) the values are stored as ``bsr_jax.storage.quantize`` describes
(bfloat16, float8_e4m3fn, int8, or int4 packed two to a byte as ``(cap, ceil(bm*bk/2))`` uint8);
``dense_dtype`` (static) remembers x's dtype and ``dequantized()`` restores it.
[2] ``None`` when every block is kept (``is_full``): the blocks are then all ``Mb * Kb`` blocks in
block-column-major order, so no indices are stored. This is how ``sparsity=0`` with a
``storage_dtype`` keeps a whole activation in low precision; its values then keep the shapes and
scales above in a layout that follows the platform (blocks on CPU, x's rows elsewhere:
``bsr_jax.storage.quantize``), read with ``to_dense`` or ``dequantized``.

Only these are stored, because they are what the backward pass keeps alive. ``block_rows`` is
int16 whenever ``Mb`` fits (at block 4 an int32 row and column id per block would add 12.5% to
the 64 values of an f32 block; int16 rows alone add 3%). Kernels read the int32 views
``row_ids`` and ``col_ids`` (derived from ``col_ptr``), computed in the backward pass.

Static metadata (``shape``, ``block``, ``storage_dtype``, ``dense_dtype``, and ``column_count``: the number of blocks
every block-column keeps when ``selection="column"``, else None) is pytree aux data, so jit
specialises on it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from bsr_jax.core import platforms
from bsr_jax.storage.selection import Selection, top_blocks

# STORAGE_DTYPES and quantize_blocks are also imported from here by callers of the first version.
from bsr_jax.storage.quantize import (  # noqa: F401
    STOCHASTIC_ROUNDING_DTYPES,
    STORAGE_DTYPES,
    StorageDtype,
    check_storage_dtype,
    dequantize_blocks,
    dequantize_matrix,
    pad_to_blocks,
    quantize_blocks,
    quantize_matrix,
    to_blocks,
)

Criterion = Literal["l2", "l1"]
BlockSpec = int | tuple[int, int] | Literal["row"]
# block="row": blocks this wide are clamped to x's width, one per row (bsr_jax.storage.quantize).
ROW_WIDTH = 2**31 - 1

Rounding = Literal["nearest", "stochastic"]

CRITERIA = ("l2", "l1")
SELECTIONS = ("global", "column")
ROUNDINGS = ("nearest", "stochastic")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockSparse:
    """Kept blocks of an ``(M, K)`` matrix; see the module docstring for the field layout."""

    values: jax.Array
    block_rows: jax.Array | None
    col_ptr: jax.Array | None
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    block: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    scales: jax.Array | None = None
    dense_dtype: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    column_count: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    storage_dtype: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def is_full(self) -> bool:
        """Every block is kept, in block-column-major order, and no indices are stored."""
        return self.block_rows is None

    @property
    def capacity(self) -> int:
        return self.values.shape[0]

    @property
    def row_ids(self) -> jax.Array:
        """``(cap,)`` int32 block-row index of each kept block."""
        if self.is_full:
            return jnp.arange(self.capacity, dtype=jnp.int32) % self.grid[0]
        return self.block_rows.astype(jnp.int32)

    @property
    def col_ids(self) -> jax.Array:
        """``(cap,)`` int32 block-column index of each kept block (expanded from ``col_ptr``)."""
        mb, kb = self.grid
        if self.is_full:
            return jnp.arange(self.capacity, dtype=jnp.int32) // mb
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
        """Bytes held by the stored arrays (values, per-block scales and indices)."""
        arrays = (self.values, self.block_rows, self.col_ptr, self.scales)
        return sum(array_bytes(a) for a in arrays if a is not None)

    def dequantized(self) -> BlockSparse:
        """The same blocks as ``(cap, bm, bk)`` values in the original input dtype and no scales
        (a no-op when ``from_dense`` stored them at full precision). A whole quantized matrix
        (``is_full``) is read through ``to_dense``, its stored layout following the platform
        (``bsr_jax.storage.quantize``); prefer ``to_dense`` there: cutting it into blocks costs a copy."""
        if self.storage_dtype is None:
            return self
        if self.is_full:
            values = to_blocks(self.to_dense(padded=True), self.block)
        else:
            values = dequantize_blocks(self.values, self.scales, self.storage_dtype, self.block, self.dense_dtype)
        return dataclasses.replace(self, values=values, scales=None, storage_dtype=None)

    @functools.partial(jax.jit, static_argnames=("padded",))  # as from_dense
    def to_dense(self, padded: bool = False) -> jax.Array:
        """The ``(M, K)`` matrix (``padded_shape`` if ``padded``) with pruned blocks as zeros, in the
        input's dtype (dequantized if stored in lower precision)."""
        if self.is_full:
            dtype = self.dense_dtype or self.values.dtype
            dense = dequantize_matrix(self.values, self.scales, self.storage_dtype, self.block, self.grid, dtype)
        else:
            values = self.dequantized().values
            # Each kept block scattered as a (bm, bk) window of the (Mp, Kp) matrix: no (Mb, Kb, bm, bk)
            # array, which XLA:TPU pads 8x for 16 x 16 blocks (ResMLP-S12 top-k step on TPU v5p:
            # 1.15x -> 0.99x of dense's compiled peak, with the window gather in from_dense); on
            # XLA:CPU 17.5 ms for an (8192, 1536) x at 30% kept, where gathering every block was 24 ms.
            dense = lax.scatter(jnp.zeros(self.padded_shape, values.dtype), _block_starts(self.row_ids, self.col_ids, self.block),
                                values, _BLOCK_SCATTER, indices_are_sorted=False, unique_indices=True)
        return dense if padded else dense[: self.shape[0], : self.shape[1]]


# A (bm, bk) window of an (Mp, Kp) matrix per kept block, at (row * bm, col * bk).
_BLOCK_GATHER = lax.GatherDimensionNumbers(offset_dims=(1, 2), collapsed_slice_dims=(), start_index_map=(0, 1))
_BLOCK_SCATTER = lax.ScatterDimensionNumbers(update_window_dims=(1, 2), inserted_window_dims=(), scatter_dims_to_operand_dims=(0, 1))


def _gather_from_view(xp: jax.Array, row_ids: jax.Array, col_ids: jax.Array, block: tuple[int, int]) -> jax.Array:
    # Advanced indices on the (Mb, bm, Kb, bk) view: no transpose of x is materialised, and XLA's
    # partitioner gathers per shard where x's columns are split over a mesh axis.
    (mb, kb), (bm, bk) = block_grid(xp.shape, block), block
    return xp.reshape(mb, bm, kb, bk)[row_ids, :, col_ids, :]


def _gather_windows(xp: jax.Array, row_ids: jax.Array, col_ids: jax.Array, block: tuple[int, int]) -> jax.Array:
    # (bm, bk) windows of x itself: XLA:TPU would copy the 4-D view padded 8x for 16 x 16 blocks
    # (blocks a multiple of 128 wide keep the view: on a tiny ResMLP top-k step 0.86x of dense's
    # TPU peak through the view, 0.92x through windows).
    return lax.gather(xp, _block_starts(row_ids, col_ids, block), _BLOCK_GATHER, block)


def _block_starts(row_ids: jax.Array, col_ids: jax.Array, block: tuple[int, int]) -> jax.Array:
    return jnp.stack([row_ids.astype(jnp.int32) * block[0], col_ids.astype(jnp.int32) * block[1]], axis=1)


def array_bytes(a: jax.Array | jax.ShapeDtypeStruct) -> int:
    """Bytes of ``a`` as XLA holds it on an accelerator: 4-bit integers two to a byte (NumPy's
    ``itemsize`` counts them as one byte each)."""
    bits = jnp.iinfo(a.dtype).bits if jnp.issubdtype(a.dtype, jnp.integer) else 8 * a.dtype.itemsize
    return math.ceil(a.size * bits / 8)


def normalize_block(block: BlockSpec) -> tuple[int, int]:
    """``16 -> (16, 16)``; ``"row"`` -> ``(1, ROW_WIDTH)`` (one block per row of x, as wide as x
    once clamped to it); ``(bm, bk)`` is checked and returned as a tuple of ints."""
    if block == "row":
        return 1, ROW_WIDTH
    pair = (block, block) if isinstance(block, int) else tuple(block) if isinstance(block, (tuple, list)) else (block,)
    if len(pair) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in pair):
        raise ValueError(f"block must be a positive int, a pair of positive ints (rows, cols) or 'row', got {block!r}")
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
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {CRITERIA}, got {criterion!r}")
    x = x.astype(jnp.float32)
    elementwise = x * x if criterion == "l2" else jnp.abs(x)
    # reduce_window with the elementwise op fused in writes no x-sized temporary. Measured on XLA:CPU
    # at (8192, 1536) f32, block 16: L2 4 ms here vs 40 ms for the einsum or reshape-and-sum; L1 and
    # bf16 inputs stay near 40 ms either way.
    mags = lax.reduce_window(elementwise, 0.0, lax.add, block, block).T
    return jnp.where(jnp.isnan(mags), jnp.inf, mags)


def from_dense(
    x: jax.Array,
    sparsity: float,
    block: BlockSpec,
    *,
    criterion: Criterion = "l2",
    selection: Selection = "global",
    storage_dtype: StorageDtype | None = None,
    key: jax.Array | None = None,
    rounding_key: jax.Array | None = None,
) -> BlockSparse:
    """Keep the largest blocks of a 2-D float array ``x`` of shape ``(M, K)``.

    ``selection="global"`` keeps the top ``capacity_for(...)`` blocks of the whole matrix (the
    paper's choice); ``"column"`` keeps the same number in every block-column, which balances
    kernel work. M and K need not divide the block: the matrix is zero-padded and padding blocks
    rank last. A block larger than the matrix is clamped to it (``(min(bm, M), min(bk, K))``).
    Ties are broken towards lower indices (as ``lax.top_k`` does). Runs under jit: the capacity
    is a static function of ``x.shape``, ``block`` and ``sparsity``. When the capacity is every
    block (e.g. ``sparsity=0``), nothing is ranked and no indices are stored (``is_full``).

    ``key`` switches to stochastic selection by priority sampling (Duffield, Lund & Thorup 2007):
    block i with magnitude ``w_i`` (L2 norm or L1 sum) gets priority ``w_i / u_i``, ``u_i ~ U(0, 1]``;
    the top-capacity priorities are kept and scaled by ``max(w_i, tau) / w_i``, ``tau`` being the
    next priority. Then ``E[to_dense()] = x`` exactly, so dW is unbiased, at the same capacity.

    ``storage_dtype`` stores kept values in low precision with per-block scales
    (``bsr_jax.storage.quantize``), rounded stochastically (unbiased) with ``rounding_key``; ``to_dense``
    and the backward pass dequantize.
    """
    if not any(isinstance(a, jax.core.Tracer) for a in (x, key, rounding_key)):
        # Called on concrete arrays: one jitted program (not some 30 ops, each compiled and
        # dispatched alone). Under the caller's trace its ops inline as written, not a nested jit
        # call, through which XLA:TPU kept a tiny ResMLP's top-k 8 x 128 blocks at 0.97 of the dense
        # step's peak (0.79 inlined; tests/bsr_jax/test_compiled.py, -m slow).
        return _from_dense_jitted(x, sparsity, block, criterion=criterion, selection=selection, storage_dtype=storage_dtype, key=key,
                                  rounding_key=rounding_key)  # fmt: skip
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must have a floating dtype, got {x.dtype}")
    check_storage_dtype(storage_dtype)
    block = tuple(max(1, min(b, n)) for b, n in zip(normalize_block(block), x.shape))
    grid = block_grid(x.shape, block)
    capacity = capacity_for(grid, sparsity, selection)
    mb, kb = grid
    full = capacity == mb * kb
    if full:
        values, scales = quantize_matrix(x, block, storage_dtype, rounding_key)
        row_ids = col_ptr = None
    else:
        xp = pad_to_blocks(x, block)
        mags = block_magnitudes(xp, block, criterion)  # (Kb, Mb)
        if key is None:
            row_ids, col_ids, col_ptr, _ = top_blocks(mags, capacity, selection, with_threshold=False)
        else:
            weights = jnp.sqrt(mags) if criterion == "l2" else mags
            u = jax.random.uniform(key, weights.shape, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
            row_ids, col_ids, col_ptr, tau = top_blocks(weights / u, capacity, selection, with_threshold=True)
            kept_weights = weights[col_ids, row_ids]
            tau = tau if selection == "global" else tau[col_ids]
            rescale = jnp.where(kept_weights > 0, jnp.maximum(kept_weights, tau) / kept_weights, 1.0)
        view = functools.partial(_gather_from_view, block=block)
        windows = view if platforms.tpu_lane_dense(block) else functools.partial(_gather_windows, block=block)
        values = platforms.by_lowering_platform(view, {"tpu": windows}, xp, row_ids, col_ids)
        if key is not None:
            values = (values.astype(jnp.float32) * rescale[:, None, None]).astype(x.dtype)
        row_ids = row_ids.astype(jnp.int16 if mb <= jnp.iinfo(jnp.int16).max + 1 else jnp.int32)
        col_ptr = col_ptr.astype(jnp.int32)
        values, scales = quantize_blocks(values, storage_dtype, rounding_key)
    return BlockSparse(
        values=values,
        block_rows=row_ids,
        col_ptr=col_ptr,
        shape=tuple(x.shape),
        block=block,
        scales=scales,
        dense_dtype=jnp.dtype(x.dtype).name,
        column_count=capacity // kb if selection == "column" else None,
        storage_dtype=storage_dtype,
    )


_from_dense_jitted = jax.jit(from_dense, static_argnames=("sparsity", "block", "criterion", "selection", "storage_dtype"))
