"""``bsr_linear``: a dense linear layer whose weight gradient sees only the largest input blocks."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from bsr_jax import backends
from bsr_jax.format import BlockSpec, Criterion, Pruning, Selection, StorageDtype


@dataclasses.dataclass(frozen=True)
class _Config:
    pruning: Pruning
    backend: str
    precision: lax.PrecisionLike


def _matmul(x: jax.Array, w: jax.Array, precision: lax.PrecisionLike) -> jax.Array:
    # The same call as flax.linen.Dense, so sparsity 0 and the sparse forward are bit-identical to it.
    return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


def check_floating(name: str, a: jax.Array) -> None:
    if not jnp.issubdtype(jnp.result_type(a), jnp.floating):
        raise ValueError(f"{name} must have a floating dtype, got {jnp.result_type(a)}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pruned_matmul(x: jax.Array, w: jax.Array, key: jax.Array | None, config: _Config) -> jax.Array:
    return _matmul(x, w, config.precision)


def _pruned_matmul_fwd(x, w, key, config):
    # The dense x is deliberately not a residual: only its kept blocks (and w, needed for dx) are.
    return _matmul(x, w, config.precision), (config.pruning.compress(x, key), w)


def _pruned_matmul_bwd(config, residuals, dy):
    blocks, w = residuals
    blocks = blocks.dequantized()
    dx = lax.dot_general(dy, w, (((dy.ndim - 1,), (1,)), ((), ())), precision=config.precision)
    dy2 = dy.reshape(-1, dy.shape[-1])
    dy2 = jnp.pad(dy2, ((0, blocks.padded_shape[0] - dy2.shape[0]), (0, 0)))
    dw = backends.dw_from_blocks(blocks, dy2, config.backend)[: w.shape[0]]
    return dx.astype(blocks.values.dtype), dw.astype(w.dtype), None


_pruned_matmul.defvjp(_pruned_matmul_fwd, _pruned_matmul_bwd)


def bsr_linear(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    sparsity: float,
    block: BlockSpec = 16,
    criterion: Criterion = "l2",
    selection: Selection = "global",
    storage_dtype: StorageDtype | None = None,
    stochastic: bool = False,
    key: jax.Array | None = None,
    backend: str | None = None,
    precision: lax.PrecisionLike = None,
) -> jax.Array:
    """``x @ w + b`` with an exact forward and input gradient, and a block-pruned weight gradient.

    Args:
      x: ``(..., K)`` floating input; all leading dims are flattened to ``M`` rows for pruning.
      w: ``(K, N)`` kernel of the same floating dtype as ``x``.
      b: optional ``(N,)`` bias.
      sparsity: fraction of ``(bm, bk)`` blocks of the flattened x dropped from the residual, a
        Python float in ``[0, 1)``. ``0.0`` is exactly the dense layer (dense residual, dense dW).
      block: ``bm`` (rows of M) by ``bk`` (columns of K); an int means square blocks. M and K are
        zero-padded to whole blocks.
      criterion: block magnitude, ``"l2"`` or ``"l1"``.
      selection: ``"global"`` keeps the largest blocks of the whole matrix; ``"column"`` keeps the
        same number per block-column (balanced kernel work).
      storage_dtype: store kept blocks as ``"bfloat16"``, ``"int8"`` or ``"float8_e4m3fn"`` (per-block
        scales), dequantized in the backward pass; ``None`` keeps x's dtype.
      stochastic: sample blocks with probability by magnitude and rescale them, so dW is unbiased
        (see ``from_dense``); needs ``key`` when differentiated (the forward pass does not use it).
      key: PRNG key of the stochastic sampling.
      backend: dW backend, ``"cpu"``, ``"xla"``, ``"pallas"`` or ``"reference"``; ``None`` picks
        ``$BSR_JAX_BACKEND`` or the platform default (see ``bsr_jax.backends``).
      precision: passed to ``lax.dot_general`` for y and dx.

    Returns:
      ``(..., N)`` array, equal to the dense layer's output. Gradients: dx and db are exact; dW is
      ``mask(x).T @ dy`` where ``mask`` zeroes the pruned blocks (f32 accumulation, cast to w's
      dtype; with ``storage_dtype``, the kept blocks are rounded; with ``key``, rescaled so that
      dW is unbiased). Under ``vmap`` each mapped instance is pruned on its own.
    """
    pruning = Pruning(sparsity, block, criterion, selection, storage_dtype, stochastic)
    if key is not None and not stochastic:
        raise ValueError("key is only used with stochastic=True")
    check_floating("x", x)
    check_floating("w", w)
    if jnp.ndim(x) < 1 or jnp.ndim(w) != 2 or jnp.shape(x)[-1] != jnp.shape(w)[0]:
        raise ValueError(f"expected x (..., K) and w (K, N), got x {jnp.shape(x)} and w {jnp.shape(w)}")
    if jnp.result_type(x) != jnp.result_type(w):
        raise ValueError(f"x and w must share a dtype, got {jnp.result_type(x)} and {jnp.result_type(w)}")
    backend = backends.resolve_backend(backend)
    if sparsity == 0.0:
        y = _matmul(x, w, precision)
    else:
        y = _pruned_matmul(x, w, key, _Config(pruning, backend, precision))
    if b is not None:
        y += jnp.reshape(b, (1,) * (y.ndim - 1) + (-1,))
    return y
