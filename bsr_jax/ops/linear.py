"""``bsr_linear``: a dense linear layer whose weight gradient sees only the largest input blocks."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from bsr_jax.backends import dispatch as backends
from bsr_jax.backends import fused
from bsr_jax.storage import barriers
from bsr_jax.core import sharding
from bsr_jax.storage.format import BlockSparse
from bsr_jax.storage.pruning import Pruning, as_pruning, check_key


Dims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


@dataclasses.dataclass(frozen=True)
class _Config:
    pruning: Pruning
    backend: str
    precision: lax.PrecisionLike
    dims: Dims  # x's trailing axes contracted with w's leading axes, in order; no batch axes
    x_shape: tuple[int, ...]


def linear_dims(x_ndim: int, contracted: int = 1) -> Dims:
    """``dot_general`` dimension numbers contracting x's last ``contracted`` axes with w's first."""
    return ((tuple(range(x_ndim - contracted, x_ndim)), tuple(range(contracted))), ((), ()))


def is_linear_dims(dims: Dims, x_ndim: int) -> bool:
    """Whether ``dims`` is a plain linear map (the form ``linear_dims`` makes): what the op supports."""
    (x_axes, w_axes), batch = dims
    n = len(x_axes)
    return batch == ((), ()) and n >= 1 and tuple(x_axes) == linear_dims(x_ndim, n)[0][0] and tuple(w_axes) == tuple(range(n))


def merge_contracted(x: jax.Array, contracted: int) -> jax.Array:
    """x with its last ``contracted`` axes merged into one: the ``(..., K)`` matrix pruning sees."""
    return x.reshape(*x.shape[: x.ndim - contracted], -1)


def _dot(x, w, config: _Config):
    # The same call as flax's Dense / DenseGeneral, so the forward is bit-identical to theirs.
    return lax.dot_general(x, w, config.dims, precision=config.precision)


def check_floating(name: str, a: jax.Array) -> None:
    if not jnp.issubdtype(jnp.result_type(a), jnp.floating):
        raise ValueError(f"{name} must have a floating dtype, got {jnp.result_type(a)}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pruned_dot(x: jax.Array, w: jax.Array, key: jax.Array | None, config: _Config) -> jax.Array:
    return _dot(x, w, config)


def _matrices(x: jax.Array, w: jax.Array, contracted: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x with its contracted axes merged, and the ``(M, K) @ (K, N)`` the kernels see."""
    x2 = merge_contracted(x, contracted)
    return x2, x2.reshape(-1, x2.shape[-1]), w.reshape(x2.shape[-1], -1)


def _pruned_dot_fwd(x, w, key, config):
    # The dense x is deliberately not a residual: only its kept blocks (and w, needed for dx) are.
    contracted = len(config.dims[0][0])
    x2, rows, w2 = _matrices(x, w, contracted)
    if config.backend == "fused" and fused.why_not(config.pruning, rows, w2) is None:
        unfused = lambda x, w: (lax.dot_general(x, w, linear_dims(2), precision=config.precision), config.pruning.compress(x))  # noqa: E731
        y2, blocks = fused.forward(rows, w2, config.pruning, config.precision, unfused)
        y, blocks = barriers.materialize(y2.reshape(*x.shape[: x.ndim - contracted], *w.shape[contracted:]), blocks)
        return y, (blocks, w)
    y, blocks = barriers.materialize(_dot(x, w, config), config.pruning.compress(x2, key))
    return y, (blocks, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dot_with_blocks(x: jax.Array, w: jax.Array, blocks: BlockSparse, config: _Config) -> jax.Array:
    """The same product, with x's compressed blocks computed by the caller (shared between the
    layers that read one x: each keeps the same arrays, so they are held once)."""
    return _dot(x, w, config)


def _dot_with_blocks_fwd(x, w, blocks, config):
    return _dot(x, w, config), (blocks, w)


def _pruned_dot_bwd(config, residuals, dy):
    blocks, w = residuals
    # The backend reads the stored blocks as they are (the cpu kernel decodes int8/int4 itself).
    blocks, dy = barriers.when_needed(blocks, dy)
    # dx needs w only: dy contracted with w's output axes, as autodiff of the dense product does
    # (and, unlike a transpose of a fresh function, it varies over the same mesh axes as dy).
    out_axes = w.ndim - len(config.dims[0][1])
    dims = ((tuple(range(dy.ndim - out_axes, dy.ndim)), tuple(range(w.ndim - out_axes, w.ndim))), ((), ()))
    dx = lax.dot_general(dy, w, dims, precision=config.precision)
    k = blocks.shape[1]
    dy2 = dy.reshape(-1, math.prod(w.shape) // k)
    dy2 = jnp.pad(dy2, ((0, blocks.padded_shape[0] - dy2.shape[0]), (0, 0)))
    dw = backends.dw_from_blocks(blocks, dy2, config.backend)[:k].reshape(w.shape)
    dx, dw = barriers.together(dx, dw)
    return dx.astype(blocks.dense_dtype or blocks.values.dtype), dw.astype(w.dtype)


def _pruned_dot_vjp(config, residuals, dy):
    # The third argument (a key, or blocks computed by the caller) gets no cotangent.
    return (*_pruned_dot_bwd(config, residuals, dy), None)


_pruned_dot.defvjp(_pruned_dot_fwd, _pruned_dot_vjp)
_dot_with_blocks.defvjp(_dot_with_blocks_fwd, _pruned_dot_vjp)


def writes_own_codes(x: jax.Array, w: jax.Array, dims: Dims, pruning: Pruning, backend: str | None = None) -> bool:
    """Whether ``pruned_dot_general`` without ``blocks`` would have its forward GEMM write x's codes
    on every platform it may be lowered for (the ``fused`` backend's kernels take the layer on GPU
    and TPU): then compressing x apart costs a pass of its own. Where the TPU kernel would not run,
    the layer's own codes would be XLA's pass there, a second one beside a shared compression."""
    x2, rows, w2 = _matrices(x, w, len(dims[0][0]))
    return (backends.resolve_backend(backend, pruning.backend) == "fused" and pruning.saves_memory(x2)
            and fused.why_not(pruning, rows, w2) is None and fused.tpu_forward_runs(pruning, rows, w2))  # fmt: skip


def pruned_dot_general(
    x: jax.Array,
    w: jax.Array,
    dims: Dims,
    *,
    pruning: Pruning,
    key: jax.Array | None = None,
    blocks: BlockSparse | None = None,
    backend: str | None = None,
    precision: lax.PrecisionLike = None,
) -> jax.Array:
    """``lax.dot_general(x, w, dims)`` for a plain linear map (``is_linear_dims``; x's trailing
    axes against w's leading ones, e.g. ``nn.DenseGeneral``), with the residual of x compressed by
    ``pruning`` (x flattened to ``(M, K)``, w to ``(K, N)``) or given as ``blocks``
    (``pruning.compress`` of that flattened x, computed once by the caller and shared). Forward and
    dx exact; dW as in ``bsr_linear``. Where ``pruning`` would not save memory, it is the plain
    product."""
    if not is_linear_dims(dims, x.ndim):
        raise ValueError(f"pruned_dot_general supports x's trailing axes against w's leading axes only, got {dims}")
    backend = backends.resolve_backend(backend, pruning.backend)
    contracted = len(dims[0][0])

    def local(x, params, key, blocks):
        # Runs on each device's rows under a mesh (bsr_jax.core.sharding), so capacities follow the local shape.
        (w,) = params
        config = _Config(pruning, backend, precision, dims, tuple(x.shape))
        x2 = merge_contracted(x, contracted)
        if blocks is not None:
            if blocks.shape != (math.prod(x2.shape[:-1]), x2.shape[-1]):
                raise ValueError(
                    f"blocks hold a {blocks.shape} matrix but this device's x is {x2.shape}: under a mesh, "
                    "compress per shard of the rows with bsr_jax.core.sharding.compress_rows"
                )
            return _dot_with_blocks(x, w, blocks, config)
        if not pruning.saves_memory(x2):
            return _dot(x, w, config)
        return _pruned_dot(x, w, key, config)

    if blocks is None and not pruning.saves_memory(merge_contracted(x, contracted)) and not sharding.on_explicit_axes(x, w):
        # Nothing to prune (e.g. sparsity 0): the plain product, left to XLA's own partitioning
        # (on Explicit axes it goes through map_row_shards like the pruned op, which names the
        # output placement those types demand, e.g. for a row-parallel layer).
        return _dot(x, w, _Config(pruning, backend, precision, dims, tuple(x.shape)))
    rows = tuple(f"row{i}" for i in range(x.ndim - contracted))
    ks = tuple(f"k{i}" for i in range(contracted))
    outs = tuple(f"out{i}" for i in range(w.ndim - contracted))
    return sharding.map_row_shards(
        local, x, [w], x_labels=rows + ks, param_labels=[ks + outs], out_labels=rows + outs, key=key, row_stacked=blocks
    )


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
      backend: dW backend, ``"cpu"``, ``"xla"``, ``"pallas"``, ``"fused"`` or ``"reference"``;
        ``None`` picks ``$BSR_JAX_BACKEND`` or the platform default (see
        ``bsr_jax.backends.dispatch``). ``"fused"`` also runs the forward product as a kernel that
        writes x's codes (int8 / int4 in 1 x 128 blocks at sparsity 0; ``bsr_jax.backends.fused``):
        y then equals the dense layer's up to f32 rounding, not bit for bit.
      precision: passed to ``lax.dot_general`` for y and dx.

    Under ``jax.jit`` with x and w sharded over a mesh, each device prunes its own rows and dW is
    summed over the row shards (``bsr_jax.core.sharding``, docs/sharding.md).

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
    y = pruned_dot_general(x, w, linear_dims(jnp.ndim(x)), pruning=pruning, key=key, backend=backend, precision=precision)
    if b is not None:
        y += jnp.reshape(b, (1,) * (y.ndim - 1) + (-1,))
    return y
