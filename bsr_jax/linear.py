"""``bsr_linear``: a dense linear layer whose weight gradient sees only the largest input blocks."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from bsr_jax import backends
from bsr_jax.format import Pruning, as_pruning, check_key


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
    pruning: Pruning | None = None,
    key: jax.Array | None = None,
    backend: str | None = None,
    precision: lax.PrecisionLike = None,
    **options: Any,
) -> jax.Array:
    """``x @ w + b`` with an exact forward and input gradient, and a block-pruned weight gradient.

    Args:
      x: ``(..., K)`` floating input; all leading dims are flattened to ``M`` rows for pruning.
      w: ``(K, N)`` kernel of the same floating dtype as ``x``.
      b: optional ``(N,)`` bias.
      pruning: the options (``bsr_jax.Pruning``: sparsity, block, criterion, selection,
        storage_dtype, stochastic, rounding). Or give them as keywords instead, the shorthand
        ``bsr_linear(x, w, b, sparsity=0.7, block=16)``.
      key: PRNG key of stochastic sampling or rounding (needed when differentiated; the forward
        pass does not use it).
      backend: dW backend, ``"cpu"``, ``"xla"``, ``"pallas"`` or ``"reference"``; ``None`` picks
        ``$BSR_JAX_BACKEND`` or the platform default (see ``bsr_jax.backends``).
      precision: passed to ``lax.dot_general`` for y and dx.

    Returns:
      ``(..., N)`` array, equal to the dense layer's output. Gradients: dx and db are exact; dW is
      ``mask(x).T @ dy`` where ``mask`` zeroes the pruned blocks (f32 accumulation, cast to w's
      dtype; with ``storage_dtype``, the kept blocks are rounded; with ``stochastic``, rescaled so
      that dW is unbiased). Where the compressed residual would not be smaller than x (e.g.
      sparsity 0 without a storage dtype), x itself is kept and dW is exact. Under ``vmap`` each
      mapped instance is pruned on its own.
    """
    pruning = as_pruning(pruning, options)
    check_key(pruning, key)
    check_floating("x", x)
    check_floating("w", w)
    if jnp.ndim(x) < 1 or jnp.ndim(w) != 2 or jnp.shape(x)[-1] != jnp.shape(w)[0]:
        raise ValueError(f"expected x (..., K) and w (K, N), got x {jnp.shape(x)} and w {jnp.shape(w)}")
    if jnp.result_type(x) != jnp.result_type(w):
        raise ValueError(f"x and w must share a dtype, got {jnp.result_type(x)} and {jnp.result_type(w)}")
    backend = backends.resolve_backend(backend)
    if pruning.saves_memory(x):
        y = _pruned_matmul(x, w, key, _Config(pruning, backend, precision))
    else:
        y = _matmul(x, w, precision)
    if b is not None:
        y += jnp.reshape(b, (1,) * (y.ndim - 1) + (-1,))
    return y
