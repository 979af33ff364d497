"""Kept-block test inputs built from an explicit (Mb, Kb) keep mask, with the dense x they encode."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class KeptBlocks:
    """Column-grouped kept blocks of ``x`` and ``x`` itself with the dropped blocks zeroed."""

    values: jax.Array  # (cap, bm, bk)
    row_ids: jax.Array  # (cap,) int32
    col_ptr: jax.Array  # (Kb + 1,) int32
    masked_x: np.ndarray  # (Mb * bm, Kb * bk), float64


# Keep masks (Mb, Kb) shared by the kernel tests: one kept block; several with an empty column.
ONE_BLOCK = np.zeros((3, 4), bool)
ONE_BLOCK[1, 2] = True
SEVERAL_WITH_EMPTY_COLUMN = np.array([[1, 0, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]], bool)


def kept_blocks(mask: np.ndarray, block: tuple[int, int], dtype, seed: int = 0) -> KeptBlocks:
    """Blocks of a bf16-exact random x where ``mask[i, j]``, grouped by column, rows ascending."""
    (mb, kb), (bm, bk) = mask.shape, block
    x = bf16_exact_normal_np((mb * bm, kb * bk), seed)
    x4 = x.reshape(mb, bm, kb, bk)
    kept = [(i, j) for j in range(kb) for i in range(mb) if mask[i, j]]
    values = np.stack([x4[i, :, j, :] for i, j in kept]) if kept else np.zeros((0, bm, bk), np.float32)
    col_ptr = np.searchsorted([j for _, j in kept], np.arange(kb + 1), side="left")
    masked = (x4 * mask[:, None, :, None]).reshape(x.shape)
    return KeptBlocks(
        values=jnp.asarray(values, dtype),
        row_ids=jnp.asarray([i for i, _ in kept], jnp.int32).reshape(-1),
        col_ptr=jnp.asarray(col_ptr, jnp.int32),
        masked_x=masked.astype(np.float64),
    )


def bf16_exact_normal_np(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Normal float32 samples rounded through bf16 (numpy: no per-shape compilation in tests)."""
    return np.random.default_rng(seed).standard_normal(shape).astype(jnp.bfloat16).astype(np.float32)


def random_mask(shape: tuple[int, int], keep: float, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(shape) < keep


def dense_operand(rows: int, cols: int, dtype, seed: int = 1) -> jax.Array:
    return jnp.asarray(bf16_exact_normal_np((rows, cols), seed), dtype)
