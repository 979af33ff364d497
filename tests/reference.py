"""The one independent reference of the library's numerics, in numpy float64.

Nothing here calls bsr_jax: block magnitudes, the capacity, the kept-block mask (explicit top-k
with the library's documented tie rule), priority sampling's rescale, the low-precision round trip
and the masked products are all recomputed from the documented rules:

* blocks are ``(bm, bk)`` tiles of the input flattened to ``(M, K)`` and zero-padded to whole blocks;
  magnitude is the squared L2 norm (``"l2"``) or the L1 sum (``"l1"``);
* capacity is ``max(1, ceil((1 - sparsity) * n))`` blocks, ``n`` being all blocks (``"global"``) or
  the blocks of one block-column (``"column"``, every column keeps that many);
* the largest scores are kept; ties go to the lower flat index ``col * Mb + row``
  (``bsr_jax.storage.selection.top_blocks``);
* stochastic (priority sampling): weight ``w`` is the L2 norm (not squared) or the L1 sum, the
  priority is ``w / u``, the top-capacity priorities are kept, each rescaled by ``max(w, tau) / w``
  (1 when ``w == 0``) where ``tau`` is the largest priority not kept (per column for ``"column"``;
  0 when all are kept);
* storage: ``"bfloat16"`` rounds to nearest; ``"int8"`` stores ``round(v / s)`` clipped to
  [-127, 127] with ``s = max|block| / 127``, ``"float8_e4m3fn"`` casts ``v / s`` with
  ``s = max|block| / 448``; an all-zero block has ``s = 1``. Scales and ``v / s`` are float32 (the
  documented dtype of scales), so the rounding boundaries are the library's; the dequantized
  product is float64. A value exactly half-way between two int8 steps (common when x is
  bf16-representable) may round the other way in the library, where XLA computes ``v * (1 / s)``:
  give storage tests inputs with full float32 mantissas.

The one input shared with the library is the stochastic draw: ``sampling_uniforms`` takes the
uniforms from ``jax.random.uniform`` with the key, ``(Kb, Mb)`` shape and ``(tiny, 1]`` range that
``bsr_jax.from_dense`` documents, because an independent generator cannot reproduce JAX's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

_LIMITS = {"int8": 127.0, "float8_e4m3fn": 448.0}


def _pad(x: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    (m, k), (bm, bk) = x.shape, block
    padded = np.zeros((math.ceil(m / bm) * bm, math.ceil(k / bk) * bk), np.float64)
    padded[:m, :k] = x
    return padded


def _blocks(x: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """``(Mb, Kb, bm, bk)`` view of the zero-padded x."""
    padded, (bm, bk) = _pad(x, block), block
    mb, kb = padded.shape[0] // bm, padded.shape[1] // bk
    return padded.reshape(mb, bm, kb, bk).transpose(0, 2, 1, 3)


def block_scores(x: np.ndarray, block: tuple[int, int], criterion: str) -> np.ndarray:
    """``(Mb, Kb)`` float64 block magnitudes: squared L2 norm or L1 sum."""
    blocks = _blocks(x, block)
    return (blocks**2).sum((2, 3)) if criterion == "l2" else np.abs(blocks).sum((2, 3))


def capacity(grid: tuple[int, int], sparsity: float, selection: str) -> int:
    """Kept blocks: all of them (global) or per column (column, times Kb)."""
    mb, kb = grid
    # The small offset keeps (1 - 0.7) * 100 from rounding up to 31, as documented.
    keep = lambda n: max(1, math.ceil((1.0 - sparsity) * n - 1e-9))
    return keep(mb) * kb if selection == "column" else keep(mb * kb)


def _top(scores: np.ndarray, count: int) -> np.ndarray:
    """Indices of the ``count`` largest of a 1-D array, ties to the lower index."""
    order = sorted(range(scores.size), key=lambda i: (-scores[i], i))
    return np.asarray(order[:count], np.int64)


def keep_mask(scores: np.ndarray, sparsity: float, selection: str) -> tuple[np.ndarray, np.ndarray]:
    """``(Mb, Kb)`` bool mask of the kept blocks and ``(Kb,)`` float64 largest score not kept in
    each block-column's group (the whole matrix for ``"global"``: one value repeated; 0 if none)."""
    mb, kb = scores.shape
    if selection == "global":
        flat = scores.T.reshape(-1)  # flat index col * Mb + row
        kept = _top(flat, capacity((mb, kb), sparsity, selection))
        flat_mask = np.zeros(flat.size, bool)
        flat_mask[kept] = True
        mask = flat_mask.reshape(kb, mb).T
        rest = np.delete(flat, kept)
        return mask, np.full(kb, rest.max() if rest.size else 0.0)
    per_column = capacity((mb, kb), sparsity, selection) // kb
    mask, next_scores = np.zeros((mb, kb), bool), np.zeros(kb)
    for j in range(kb):
        kept = _top(scores[:, j], per_column)
        mask[kept, j] = True
        rest = np.delete(scores[:, j], kept)
        next_scores[j] = rest.max() if rest.size else 0.0
    return mask, next_scores


def sampling_uniforms(key: jax.Array, grid: tuple[int, int]) -> np.ndarray:
    """``(Mb, Kb)`` float64 view of the library's draws (the one shared input; see the module docstring)."""
    mb, kb = grid
    u = jax.random.uniform(key, (kb, mb), minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
    return np.asarray(u, np.float64).T


def kept_factors(
    x: np.ndarray, sparsity: float, block: tuple[int, int], criterion: str = "l2", selection: str = "global", key=None
) -> np.ndarray:
    """``(Mb, Kb)`` float64 factor of each block in the kept residual: 0 (pruned), 1 (kept), or the
    priority-sampling rescale ``max(w, tau) / w`` with ``key``."""
    scores = block_scores(x, block, criterion)
    if key is None:
        return keep_mask(scores, sparsity, selection)[0].astype(np.float64)
    weights = np.sqrt(scores) if criterion == "l2" else scores
    priorities = weights / sampling_uniforms(key, scores.shape)
    mask, tau = keep_mask(priorities, sparsity, selection)
    tau = np.broadcast_to(tau[None, :], weights.shape)
    rescale = np.where(weights > 0, np.maximum(weights, tau) / np.where(weights > 0, weights, 1.0), 1.0)
    return np.where(mask, rescale, 0.0)


def round_trip(blocks: np.ndarray, storage_dtype: str | None) -> np.ndarray:
    """``(..., bm, bk)`` blocks as stored in ``storage_dtype`` and restored, in float64."""
    if storage_dtype is None:
        return blocks
    if storage_dtype == "bfloat16":
        return blocks.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    v = blocks.astype(np.float32)
    amax = np.abs(v).max((-2, -1), keepdims=True)
    scales = np.where(amax > 0, amax / np.float32(_LIMITS[storage_dtype]), np.float32(1.0)).astype(np.float32)
    scaled = v / scales
    if storage_dtype == "int8":
        stored = np.clip(np.round(scaled), -127, 127)
    else:
        stored = scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return stored.astype(np.float64) * scales.astype(np.float64)


def kept_input(
    x,
    sparsity: float,
    block,
    *,
    criterion: str = "l2",
    selection: str = "global",
    storage_dtype: str | None = None,
    key=None,
    dtype=None,
) -> np.ndarray:
    """The ``(M, K)`` float64 matrix the weight gradient sees: pruned blocks zero, kept blocks
    rescaled (stochastic) and rounded through ``storage_dtype``.

    ``dtype`` is x's dtype when the library rescales in float32 and casts back to it (bfloat16 x);
    the reference then rounds the rescaled blocks the same way.
    """
    x = np.asarray(x, np.float64)
    block = (block, block) if isinstance(block, int) else tuple(block)
    factors = kept_factors(x, sparsity, block, criterion, selection, key)
    blocks = _blocks(x, block) * factors[:, :, None, None]
    if key is not None and dtype is not None and jnp.dtype(dtype) != jnp.float32:
        blocks = blocks.astype(np.float32).astype(jnp.dtype(dtype)).astype(np.float64)
    blocks = np.where(factors[:, :, None, None] > 0, round_trip(blocks, storage_dtype), 0.0)
    mb, kb, bm, bk = blocks.shape
    return blocks.transpose(0, 2, 1, 3).reshape(mb * bm, kb * bk)[: x.shape[0], : x.shape[1]]


def linear_grads(x, w, dy, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 ``(dx, dW, db)`` of ``y = x @ w + b`` for cotangent ``dy (..., N)``: exact dx and db,
    ``dW = kept.T @ dy`` from ``kept`` (``kept_input``, ``(M, K)``)."""
    w64, dy64 = np.asarray(w, np.float64), np.asarray(dy, np.float64)
    dy2 = dy64.reshape(-1, dy64.shape[-1])
    return dy64 @ w64.T, kept.T @ dy2, dy2.sum(0)


def scale_shift_grads(scale, dy, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 ``(dx, dscale, dshift)`` of ``y = x * scale + shift``: exact dx and dshift,
    ``dscale = sum_rows(kept * dy)``."""
    s64, dy64 = np.asarray(scale, np.float64), np.asarray(dy, np.float64)
    dy2 = dy64.reshape(-1, dy64.shape[-1])
    return dy64 * s64, (kept * dy2).sum(0), dy2.sum(0)


def op_sampling_key(key: jax.Array) -> jax.Array:
    """The key ``bsr_linear``/``bsr_scale_shift``/the layers pass to ``from_dense`` for block sampling,
    given the ``key`` they were called with: the first half of ``jax.random.split(key)`` (the second
    is reserved for stochastic rounding; ``bsr_jax.storage.pruning.Pruning.compress``)."""
    return jax.random.split(key)[0]
