"""Per-channel scale/shift (ResMLP's Affine and LayerScale) with block-pruned residuals.

``y = x * scale + shift`` needs x in the backward pass only for ``dscale = sum_rows(x * dy)``;
``dx = dy * scale`` and ``dshift = sum_rows(dy)`` are exact without it. So, like ``bsr_linear``,
``bsr_scale_shift`` keeps only the largest blocks of x, and only ``dscale`` is approximate.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from bsr_jax.storage import barriers
from bsr_jax.core import sharding
from bsr_jax.storage.format import BlockSparse
from bsr_jax.storage.pruning import Pruning, as_pruning, check_key
from bsr_jax.ops.linear import check_floating


def blocksparse_column_dot(bsr: BlockSparse, dy: jax.Array) -> jax.Array:
    """``sum_rows(x * dy)`` over the kept blocks of x: ``(K,)`` float32 from ``dy (M, K)``.

    Gathers the ``(bm, bk)`` tile of dy under each kept block, so work and temporaries are
    ``capacity * bm * bk``, the size of the kept values; every block kept, x itself (``to_dense``).
    Blocks stored in low precision are dequantized here.
    """
    (mb, kb), (bm, bk) = bsr.grid, bsr.block
    if bsr.is_full:  # every block: x itself (a whole quantized matrix is read in its platform's layout)
        return jnp.einsum("mk,mk->k", bsr.to_dense(), dy, preferred_element_type=jnp.float32)
    bsr = bsr.dequantized()
    dy4 = jnp.pad(dy, ((0, mb * bm - dy.shape[0]), (0, kb * bk - dy.shape[1]))).reshape(mb, bm, kb, bk)
    dy_blocks = dy4[bsr.row_ids, :, bsr.col_ids, :]  # (cap, bm, bk)
    partial = jnp.einsum("pab,pab->pb", bsr.values, dy_blocks, preferred_element_type=jnp.float32)
    per_column = jax.ops.segment_sum(partial, bsr.col_ids, num_segments=kb, indices_are_sorted=True)
    return per_column.reshape(-1)[: bsr.shape[1]]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pruned_scale(x: jax.Array, scale: jax.Array, key: jax.Array | None, pruning: Pruning) -> jax.Array:
    return x * scale


def _pruned_scale_fwd(x, scale, key, pruning):
    y, blocks = barriers.materialize(x * scale, pruning.compress(x, key))
    return y, (blocks, scale)


def _pruned_scale_bwd(pruning, residuals, dy):
    blocks, scale = residuals
    blocks, dy = barriers.when_needed(blocks, dy)
    dscale = blocksparse_column_dot(blocks, dy.reshape(-1, dy.shape[-1]))
    dx, dscale = barriers.together(dy * scale, dscale)
    return dx.astype(blocks.dense_dtype or blocks.values.dtype), dscale.astype(scale.dtype), None


_pruned_scale.defvjp(_pruned_scale_fwd, _pruned_scale_bwd)


def bsr_scale_shift(
    x: jax.Array,
    scale: jax.Array,
    shift: jax.Array | None = None,
    *,
    pruning: Pruning | None = None,
    key: jax.Array | None = None,
    **options: Any,
) -> jax.Array:
    """``x * scale + shift`` over the last axis, keeping only the largest blocks of x for ``dscale``.

    Args:
      x: ``(..., K)`` floating input, flattened to ``(M, K)`` for pruning.
      scale: ``(K,)``, same dtype as x.
      shift: optional ``(K,)``.
      pruning, key, and the shorthand options: as in ``bsr_linear``.

    Returns:
      ``(..., K)``, bit-identical to ``x * scale + shift``. ``dx`` and ``dshift`` are exact;
      ``dscale = sum_rows(mask(x) * dy)`` (f32 accumulation, cast to scale's dtype), exact where
      x itself is kept (see ``bsr_linear``). Under a mesh each device prunes its own rows and
      dscale is summed over the row shards (``bsr_jax.core.sharding``).
    """
    pruning = as_pruning(pruning, options)
    check_key(pruning, key)
    check_floating("x", x)
    if jnp.shape(scale) != (jnp.shape(x)[-1],) or jnp.result_type(scale) != jnp.result_type(x):
        raise ValueError(f"scale must be ({jnp.shape(x)[-1]},) of x's dtype, got {jnp.shape(scale)} {jnp.result_type(scale)}")
    if not pruning.saves_memory(x):
        # Nothing to prune (e.g. sparsity 0): the plain product, left to XLA's own partitioning.
        y = x * scale
        return y if shift is None else y + shift

    def local(x, params, key, _):
        # Runs on each device's rows under a mesh (bsr_jax.core.sharding), so capacities follow the local shape.
        (scale,) = params
        return _pruned_scale(x, scale, key, pruning) if pruning.saves_memory(x) else x * scale

    rows = tuple(f"row{i}" for i in range(jnp.ndim(x) - 1))
    y = sharding.map_row_shards(local, x, [scale], x_labels=(*rows, "k"), param_labels=[("k",)], out_labels=(*rows, "k"), key=key)
    return y if shift is None else y + shift
