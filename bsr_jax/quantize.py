"""Low-precision storage of activation blocks, with one scale per block.

``quantize_blocks(values, storage_dtype, key)`` turns ``(n, bm, bk)`` blocks into what is stored and
``dequantize_blocks`` restores them. Formats:

=================  ==========================  =========  ===========================================
storage_dtype      stored values               scales     rounding
=================  ==========================  =========  ===========================================
``"bfloat16"``     (n, bm, bk) bfloat16        none       round to nearest (a plain cast)
``"float8_e4m3fn"`` (n, bm, bk) float8_e4m3fn  (n,) f32   ``v / s``, ``s = max|block| / 448``
``"int8"``         (n, bm, bk) int8            (n,) f32   ``v / s`` in [-127, 127], ``s = max|block| / 127``
``"int4"``         (n, ceil(bm*bk/2)) uint8    (n,) f32   ``v / s`` in [-7, 7], ``s = max|block| / 7``;
                                                          two values per byte, low nibble first
=================  ==========================  =========  ===========================================

Integer formats round to nearest by default; with a ``key`` they round stochastically
(``floor(v / s + u)``, ``u ~ U[0, 1)``), which is unbiased: ``E[dequantize_blocks(quantize_blocks(v))] = v``.
An all-zero block gets scale 1; a block holding NaN or inf gets a NaN scale, so the NaN still
reaches the weight gradient, as it would in dense training. ``v / s`` and ``max|block| / limit`` are
computed as ``v * (1 / s)`` and ``max|block| * (1 / limit)`` (what XLA compiles them to).

Every block kept (``bsr_jax.from_dense`` at sparsity 0), int8 and int4 rounded to nearest run on
the CPU as one C++ pass over x (``cpu_kernels.quantize_blocks``, chosen by the platform lowered
for: ``quantize_matrix``); other platforms, and stochastic rounding, run the jax.numpy here.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

import cpu_kernels
from bsr_jax import platforms

StorageDtype = Literal["bfloat16", "float8_e4m3fn", "int8", "int4"]
STORAGE_DTYPES = ("bfloat16", "float8_e4m3fn", "int8", "int4")
# Formats whose rounding can be stochastic (integers: floor(v + u) is unbiased on a uniform grid).
STOCHASTIC_ROUNDING_DTYPES = ("int8", "int4")
_LIMITS = {"float8_e4m3fn": 448.0, "int8": 127.0, "int4": 7.0}


def check_storage_dtype(storage_dtype: str | None) -> None:
    if storage_dtype is not None and storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage_dtype must be None or one of {STORAGE_DTYPES}, got {storage_dtype!r}")


def _block_scales(v: jax.Array, limit: float) -> jax.Array:
    amax = jnp.max(jnp.abs(v), axis=(1, 2))
    amax = jnp.where(jnp.isfinite(amax), amax, jnp.nan)
    # Multiplications by reciprocals, as XLA compiles divisions by a constant or a broadcast scale:
    # eager, jitted and cpu_kernels.quantize_blocks results then agree bitwise.
    return jnp.where(amax > 0, amax * (1.0 / limit), jnp.where(amax == 0, 1.0, amax))


def _pack_int4(q: jax.Array) -> jax.Array:
    """``(n, bm, bk)`` integers in [-7, 7] -> ``(n, ceil(bm*bk/2))`` uint8, low nibble first."""
    flat = q.reshape(q.shape[0], -1).astype(jnp.uint8) & 0xF
    if flat.shape[1] % 2:
        flat = jnp.pad(flat, ((0, 0), (0, 1)))
    return flat[:, 0::2] | (flat[:, 1::2] << 4)


def _unpack_int4(packed: jax.Array, block: tuple[int, int]) -> jax.Array:
    """Inverse of ``_pack_int4``: ``(n, bm, bk)`` int32."""
    b = packed.astype(jnp.int32)
    nibbles = jnp.stack([b & 0xF, (b >> 4) & 0xF], axis=-1).reshape(b.shape[0], -1)
    signed = (nibbles ^ 8) - 8  # sign-extend 4-bit two's complement
    return signed[:, : block[0] * block[1]].reshape(-1, *block)


def quantize_blocks(
    values: jax.Array, storage_dtype: StorageDtype | None, key: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """Stored values and ``(n,)`` float32 per-block scales (``None`` when unscaled) of ``(n, bm, bk)``
    blocks; ``key`` selects stochastic rounding (``"int8"``/``"int4"`` only)."""
    check_storage_dtype(storage_dtype)
    if key is not None and storage_dtype not in STOCHASTIC_ROUNDING_DTYPES:
        raise ValueError(f"stochastic rounding needs storage_dtype in {STOCHASTIC_ROUNDING_DTYPES}, got {storage_dtype!r}")
    if storage_dtype is None:
        return values, None
    if storage_dtype == "bfloat16":
        return values.astype(jnp.bfloat16), None
    limit = _LIMITS[storage_dtype]
    v = values.astype(jnp.float32)
    scales = _block_scales(v, limit)
    scaled = v * (1.0 / scales)[:, None, None]
    if storage_dtype == "float8_e4m3fn":
        return scaled.astype(jnp.float8_e4m3fn), scales
    if key is None:
        rounded = jnp.round(scaled)
    else:
        rounded = jnp.floor(scaled + jax.random.uniform(key, scaled.shape, jnp.float32))
    q = jnp.clip(rounded, -limit, limit)
    if storage_dtype == "int8":
        return q.astype(jnp.int8), scales
    return _pack_int4(q.astype(jnp.int32)), scales


def dequantize_blocks(
    stored: jax.Array, scales: jax.Array | None, storage_dtype: StorageDtype | None, block: tuple[int, int], dtype
) -> jax.Array:
    """``(n, bm, bk)`` values in ``dtype`` from what ``quantize_blocks`` stored."""
    if storage_dtype is None:
        return stored.astype(dtype)
    values = _unpack_int4(stored, block) if storage_dtype == "int4" else stored
    values = values.astype(jnp.float32)
    if scales is not None:
        values = values * scales[:, None, None]
    return values.astype(dtype)


def quantize_matrix(
    x: jax.Array, block: tuple[int, int], storage_dtype: StorageDtype | None, key: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """``quantize_blocks`` of every ``(bm, bk)`` block of ``x (M, K)`` (zero-padded to whole blocks), in
    block-column-major order (block ``(i, j)`` at ``j * Mb + i``): ``from_dense``'s storage when every
    block is kept. ``block`` must fit in x.

    Lowered for a CPU, int8 and int4 rounded to nearest from float32 or bfloat16 run
    ``cpu_kernels.quantize_blocks``: one pass over x, which XLA cannot fuse into x's producer (XLA:CPU
    recomputed ResMLP's GELU in both the scale reduction and the int4 packing, whose loop then took
    longer than the layer's matmul). Elsewhere, and for the other formats, the jax.numpy below."""
    (m, k), (bm, bk) = x.shape, block
    mb, kb = -(-m // bm), -(-k // bk)

    def reference(x):
        xp = jnp.pad(x, ((0, mb * bm - m), (0, kb * bk - k)))
        return quantize_blocks(xp.reshape(mb, bm, kb, bk).transpose(2, 0, 1, 3).reshape(kb * mb, bm, bk), storage_dtype, key)

    if key is not None or storage_dtype not in cpu_kernels.QUANTIZE_BITS or x.dtype not in (jnp.float32, jnp.bfloat16):
        return reference(x)
    kernel = lambda x: cpu_kernels.quantize_blocks(x, block, storage_dtype)  # noqa: E731
    return platforms.by_lowering_platform(x, reference, {"cpu": kernel}, x)
