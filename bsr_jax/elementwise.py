"""Per-channel scale/shift layers (ResMLP's Affine and LayerScale) with block-pruned residuals.

``y = x * scale + shift`` needs x in the backward pass only for ``dscale = sum_rows(x * dy)``;
``dx = dy * scale`` and ``dshift = sum_rows(dy)`` are exact without it. So, like ``bsr_linear``,
``bsr_scale_shift`` keeps only the largest blocks of x, and only ``dscale`` is approximate.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype

from bsr_jax.format import BlockSpec, BlockSparse, Criterion, Selection, from_dense
from bsr_jax.linear import check_pruning_args


@dataclasses.dataclass(frozen=True)
class _Config:
    sparsity: float
    block: tuple[int, int]
    criterion: Criterion
    selection: Selection


def blocksparse_column_dot(bsr: BlockSparse, dy: jax.Array) -> jax.Array:
    """``sum_rows(x * dy)`` over the kept blocks of x: ``(K,)`` float32 from ``dy (M, K)``.

    Gathers the ``(bm, bk)`` tile of dy under each kept block, so work and temporaries are
    ``capacity * bm * bk``, the size of the kept values.
    """
    (mb, kb), (bm, bk) = bsr.grid, bsr.block
    dy4 = jnp.pad(dy, ((0, mb * bm - dy.shape[0]), (0, kb * bk - dy.shape[1]))).reshape(mb, bm, kb, bk)
    dy_blocks = dy4[bsr.row_ids, :, bsr.col_ids, :]  # (cap, bm, bk)
    partial = jnp.einsum("pab,pab->pb", bsr.values, dy_blocks, preferred_element_type=jnp.float32)
    per_column = jax.ops.segment_sum(partial, bsr.col_ids, num_segments=kb, indices_are_sorted=True)
    return per_column.reshape(-1)[: bsr.shape[1]]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _pruned_scale(x: jax.Array, scale: jax.Array, config: _Config) -> jax.Array:
    return x * scale


def _pruned_scale_fwd(x, scale, config):
    blocks = from_dense(
        x.reshape(-1, x.shape[-1]), config.sparsity, config.block, criterion=config.criterion, selection=config.selection
    )
    return x * scale, (blocks, scale)


def _pruned_scale_bwd(config, residuals, dy):
    blocks, scale = residuals
    dscale = blocksparse_column_dot(blocks, dy.reshape(-1, dy.shape[-1]))
    return (dy * scale).astype(blocks.values.dtype), dscale.astype(scale.dtype)


_pruned_scale.defvjp(_pruned_scale_fwd, _pruned_scale_bwd)


def bsr_scale_shift(
    x: jax.Array,
    scale: jax.Array,
    shift: jax.Array | None = None,
    *,
    sparsity: float,
    block: BlockSpec = 16,
    criterion: Criterion = "l2",
    selection: Selection = "global",
) -> jax.Array:
    """``x * scale + shift`` over the last axis, keeping only the largest blocks of x for ``dscale``.

    Args:
      x: ``(..., K)`` floating input, flattened to ``(M, K)`` for pruning.
      scale: ``(K,)``, same dtype as x.
      shift: optional ``(K,)``.
      sparsity, block, criterion, selection: as in ``bsr_linear``.

    Returns:
      ``(..., K)``, bit-identical to ``x * scale + shift``. ``dx`` and ``dshift`` are exact;
      ``dscale = sum_rows(mask(x) * dy)`` (f32 accumulation, cast to scale's dtype).
    """
    block = check_pruning_args(x, sparsity, block, criterion, selection)
    if jnp.shape(scale) != (jnp.shape(x)[-1],) or jnp.result_type(scale) != jnp.result_type(x):
        raise ValueError(f"scale must be ({jnp.shape(x)[-1]},) of x's dtype, got {jnp.shape(scale)} {jnp.result_type(scale)}")
    if sparsity == 0.0:
        y = x * scale
    else:
        y = _pruned_scale(x, scale, _Config(sparsity, block, criterion, selection))
    return y if shift is None else y + shift


class _ScaleShiftOptions(nn.Module):
    sparsity: float = 0.0
    block: BlockSpec = 16
    criterion: Criterion = "l2"
    selection: Selection = "global"
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32

    def _apply(self, x, scale, shift, sparsity):
        x, scale, shift = promote_dtype(x, scale, shift, dtype=self.dtype)
        return bsr_scale_shift(
            x,
            scale,
            shift,
            sparsity=self.sparsity if sparsity is None else sparsity,
            block=self.block,
            criterion=self.criterion,
            selection=self.selection,
        )


class Affine(_ScaleShiftOptions):
    """ResMLP's ``alpha * x + beta`` over the last axis; params ``alpha (K,)`` (ones), ``beta (K,)`` (zeros).

    With ``sparsity > 0`` the alpha gradient sees only the largest blocks of x; everything else is
    exact. ``sparsity`` may be overridden per call, as in ``Dense``.
    """

    @nn.compact
    def __call__(self, x: jax.Array, sparsity: float | None = None) -> jax.Array:
        alpha = self.param("alpha", nn.initializers.ones_init(), (x.shape[-1],), self.param_dtype)
        beta = self.param("beta", nn.initializers.zeros_init(), (x.shape[-1],), self.param_dtype)
        return self._apply(x, alpha, beta, sparsity)


class LayerScale(_ScaleShiftOptions):
    """Per-channel ``x * scale`` of a residual branch; param ``scale (K,)`` initialised to ``init_value``."""

    init_value: float = 0.1

    @nn.compact
    def __call__(self, x: jax.Array, sparsity: float | None = None) -> jax.Array:
        scale = self.param("scale", nn.initializers.constant(self.init_value), (x.shape[-1],), self.param_dtype)
        return self._apply(x, scale, None, sparsity)
