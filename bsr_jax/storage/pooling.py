"""Pooling compression of a convolution's input (Barley & Fröning, arXiv 2409.11902).

``Pooling(factor).compress(x)`` keeps, for the backward pass, the average of every non-overlapping
``factor x ... x factor`` spatial window of a channels-last ``x (N, *spatial, C)``: ``factor**d``
times fewer values for ``d`` spatial dims. ``PooledMap.upsampled()`` rebuilds an ``x``-shaped map
by nearest-neighbour upsampling (every element of a window gets the window's mean), which the
convolution's weight gradient then uses in place of ``x`` (see ``bsr_jax.ops.conv``).

Spatial dims that ``factor`` does not divide are padded to whole windows; a partial window at the
far edge averages only its valid elements, so upsampling returns their mean and never mixes in
padding zeros.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from bsr_jax.storage.format import BlockSparse
from bsr_jax.storage.pruning import Pruning
from bsr_jax.storage.quantize import StorageDtype, check_storage_dtype

# Block over the pooled (rows, channels) matrix that shares one scale when the map is quantized:
# 256 values per f32 scale adds 1.6% to int8 storage.
QUANTIZATION_BLOCK = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PooledMap:
    """Window means of ``x (N, *spatial, C)``.

    ``pooled`` is ``(N, *ceil(spatial / factor), C)`` in x's dtype, or, with a ``storage_dtype``,
    a ``BlockSparse`` keeping every block of that map flattened to ``(rows, C)`` in low precision
    (``Pruning`` at sparsity 0: no indices stored, per-block scales). ``shape`` and ``factor`` are
    static.
    """

    pooled: jax.Array | BlockSparse
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    factor: int = dataclasses.field(metadata=dict(static=True))

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self.pooled))

    def means(self) -> jax.Array:
        """The ``(N, *ceil(spatial / factor), C)`` window means, dequantized to x's dtype."""
        if isinstance(self.pooled, BlockSparse):
            pooled_shape = (self.shape[0], *_pooled_spatial(self.shape, self.factor), self.shape[-1])
            return self.pooled.to_dense().reshape(pooled_shape)
        return self.pooled

    def upsampled(self) -> jax.Array:
        """The ``shape``-shaped nearest-neighbour upsampling of the window means, in x's dtype."""
        means = self.means()
        n, c, f = self.shape[0], self.shape[-1], self.factor
        out = _pooled_spatial(self.shape, f)
        # (N, o1, o2, .., C) -> (N, o1, 1, o2, 1, .., C) broadcast over each window's f positions.
        expanded = means.reshape(n, *[d for o in out for d in (o, 1)], c)
        tiled = jnp.broadcast_to(expanded, (n, *[d for o in out for d in (o, f)], c))
        full = tiled.reshape(n, *[o * f for o in out], c)
        return full[(slice(None), *[slice(0, s) for s in self.shape[1:-1]])]


def _pooled_spatial(shape: tuple[int, ...], factor: int) -> tuple[int, ...]:
    return tuple(math.ceil(s / factor) for s in shape[1:-1])


def _window_counts(spatial: tuple[int, ...], factor: int) -> np.ndarray:
    """Valid elements of every window, ``(1, *ceil(spatial / factor), 1)`` float32 (static)."""
    per_dim = [np.minimum(factor, s - factor * np.arange(math.ceil(s / factor))) for s in spatial]
    counts = np.ones((), np.float32)
    for c in per_dim:
        counts = np.multiply.outer(counts, c.astype(np.float32))
    return counts[None, ..., None]


def window_means(x: jax.Array, factor: int) -> jax.Array:
    """Means of the non-overlapping ``factor``-wide spatial windows of ``x (N, *spatial, C)``.

    Returns ``(N, *ceil(spatial / factor), C)`` in x's dtype, summed in float32; a partial window
    at the far edge is the mean of its valid elements.
    """
    n, spatial, c = x.shape[0], x.shape[1:-1], x.shape[-1]
    out = _pooled_spatial(x.shape, factor)
    padded = jnp.pad(x.astype(jnp.float32), [(0, 0)] + [(0, o * factor - s) for o, s in zip(out, spatial)] + [(0, 0)])
    windows = padded.reshape(n, *[d for o in out for d in (o, factor)], c)
    sums = jnp.sum(windows, axis=tuple(range(2, 2 * len(out) + 1, 2)))
    return (sums / _window_counts(spatial, factor)).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Pooling:
    """Keep the ``factor``-window means of a convolution's input for its weight gradient.

    Validated and hashable (a static ``custom_vjp`` argument), the sibling of ``bsr_jax.Pruning``.

    Attributes:
      factor: window width along every spatial dim, a positive int; 2 keeps 1/4 of a 2-D map's
        values, 4 keeps 1/16. 1 keeps x itself (useful only with a ``storage_dtype``).
      storage_dtype: ``None`` (x's dtype) or one of ``bsr_jax.storage.quantize.STORAGE_DTYPES``: the window
        means are stored in low precision with one scale per 16 x 16 block of the ``(rows, C)``
        matrix (``bsr_jax.storage.quantize``), dequantized in the backward pass.
    """

    factor: int = 2
    storage_dtype: StorageDtype | None = None

    def __post_init__(self):
        if isinstance(self.factor, bool) or not isinstance(self.factor, int) or self.factor < 1:
            raise ValueError(f"factor must be a positive int (1, 2, 4, ...), got {self.factor!r}")
        check_storage_dtype(self.storage_dtype)

    @property
    def needs_key(self) -> bool:
        """Always ``False``: pooling and round-to-nearest storage draw no random numbers."""
        return False

    def saves_memory(self, x: jax.Array | jax.ShapeDtypeStruct) -> bool:
        """Whether ``compress(x)`` holds fewer bytes than ``x`` (where it does not, the ops keep
        ``x``: the exact dense residual, never a bigger one)."""
        # Shape and dtype only: under Explicit mesh axes x's type also carries a sharding, and the
        # window reshape of a sharded batch does not trace outside the per-shard op.
        kept = jax.eval_shape(self.compress, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return kept.nbytes < math.prod(x.shape) * jnp.dtype(x.dtype).itemsize

    def compress(self, x: jax.Array, key: jax.Array | None = None) -> PooledMap:
        """``PooledMap`` of channels-last ``x (N, *spatial, C)`` (at least one spatial dim).

        ``key`` is accepted for the interface ``Pruning.compress`` shares and must be ``None``.
        The ops name the arrays ``RESIDUAL_NAME`` once materialised (``bsr_jax.storage.barriers``).
        """
        if key is not None:
            raise ValueError("Pooling draws no random numbers: key must be None")
        if x.ndim < 3:
            raise ValueError(f"x must be channels-last (N, *spatial, C) with a spatial dim, got shape {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"x must have a floating dtype, got {x.dtype}")
        means = window_means(x, self.factor)
        if self.storage_dtype is None:
            pooled = means
        else:
            # Sparsity 0 keeps every block: Pruning then only quantizes (no ranking, no indices).
            storage = Pruning(sparsity=0.0, block=QUANTIZATION_BLOCK, storage_dtype=self.storage_dtype)
            pooled = storage.compress(means)
        return PooledMap(pooled=pooled, shape=tuple(x.shape), factor=self.factor)
