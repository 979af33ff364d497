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

Blocks one row high and as wide as x (``block="row"``: one scale per row of x, per token) are stored
in x's own layout on every platform, ``"int4"`` as XLA's own 4-bit integers (``jnp.int4``, two to a
byte on GPU and TPU) rather than packed bytes: ``quantize_token_rows``. It is the layout XLA:GPU fuses
(measured deviceless on H100 with Triton GEMMs): the row maxima into x's producer (a multi-output
reduction), and the codes into the weight-gradient GEMM, which reads them as they are stored because
the scales multiply dy's rows instead (``codes.T @ (scales * dy)``, the same sum): no dequantized copy.

A whole matrix (every block kept: ``bsr_jax.from_dense`` at sparsity 0) is quantized by
``quantize_matrix`` and read back by ``dequantize_matrix``, with the same per-block scales and
values but a layout that follows the platform lowered for:

* CPU: the blocks above, in block-column-major order, as the C++ kernels read them (int8 and int4
  rounded to nearest are written by one C++ pass over x, ``cpu_kernels.quantize_blocks``);
* every other platform: x's own row order (``quantize_rows``), unless blocks are a multiple of
  128 values wide (XLA:TPU's lane tile: such blocks are lane-dense as they are). XLA:TPU tiles an array's two minor
  dimensions to (8, 128), so cutting x into 16 x 16 blocks materialises ``(Mb, bm, Kb, bk)`` copies
  padded 8x: in the rows layout nothing narrower than x's own rows exists (a tiny ResMLP step with
  every residual int4 in 16 x 16 blocks: 1.44x of dense's compiled TPU peak in blocks, 0.66x in rows).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

import cpu_kernels
from bsr_jax.core import platforms

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


def _integer_codes(scaled: jax.Array, limit: float, key: jax.Array | None) -> jax.Array:
    """``scaled`` values rounded to integers in ``[-limit, limit]`` (float32): to nearest, or with
    ``key`` stochastically (``floor(v + u)``, ``u ~ U[0, 1)``: unbiased)."""
    rounded = jnp.round(scaled) if key is None else jnp.floor(scaled + jax.random.uniform(key, scaled.shape, jnp.float32))
    return jnp.clip(rounded, -limit, limit)


def whole_rows(block: tuple[int, int], width: int) -> bool:
    """Whether ``block`` cuts a matrix ``width`` columns wide into whole rows (``block="row"``)."""
    return block[0] == 1 and block[1] >= width


def quantize_token_rows(
    x: jax.Array, storage_dtype: StorageDtype, key: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """``x (M, K)`` with one scale per row: ``(M, 1, K)`` codes (``"int4"``: ``jnp.int4``) and
    ``(M,)`` float32 scales, by ``quantize_blocks``' rule (the same scales and rounding as blocks of
    ``(1, K)``), in x's row order on every platform."""
    if storage_dtype == "bfloat16":
        return x.astype(jnp.bfloat16)[:, None, :], None
    limit = _LIMITS[storage_dtype]
    v = x.astype(jnp.float32)
    scales = _block_scales(v[:, None, :], limit)
    scaled = v * (1.0 / scales)[:, None]
    if storage_dtype == "float8_e4m3fn":
        return scaled.astype(jnp.float8_e4m3fn)[:, None, :], scales
    codes = _integer_codes(scaled, limit, key).astype(jnp.int8 if storage_dtype == "int8" else jnp.int4)
    return codes[:, None, :], scales


def dequantize_token_rows(stored: jax.Array, scales: jax.Array | None, shape: tuple[int, int], dtype) -> jax.Array:
    """The ``(M, K)`` matrix in ``dtype`` from what ``quantize_token_rows`` stored."""
    values = stored.reshape(shape).astype(jnp.float32)
    if scales is not None:
        values = values * scales[:, None]
    return values.astype(dtype)


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


# Jitted, as from_dense is: an eager call compiles one program instead of one per op.
@functools.partial(jax.jit, static_argnames=("storage_dtype",))
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
    q = _integer_codes(scaled, limit, key)
    if storage_dtype == "int8":
        return q.astype(jnp.int8), scales
    return _pack_int4(q.astype(jnp.int32)), scales


@functools.partial(jax.jit, static_argnames=("storage_dtype", "block", "dtype"))
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


def _rows_fit(block: tuple[int, int], storage_dtype: StorageDtype | None) -> bool:
    # Blocks whose rows are whole 128-lane tiles (1 x 128, 8 x 128) are lane-dense as blocks
    # already: they stay blocks everywhere (rows measured 0.91x of dense's ViT-B TPU peak for
    # 1 x 128 int4, blocks 0.83x). The rows layout must hold exactly the bytes of the blocks
    # layout: int4 blocks of an odd number of values pad each block to whole bytes, so those too.
    if storage_dtype is None or platforms.tpu_lane_dense(block):
        return False
    return storage_dtype != "int4" or block[0] * block[1] % 2 == 0


def pad_to_blocks(x: jax.Array, block: tuple[int, int]) -> jax.Array:
    """``x (M, K)`` zero-padded to whole ``(bm, bk)`` blocks: ``(Mb * bm, Kb * bk)``."""
    (m, k), (bm, bk) = x.shape, block
    return jnp.pad(x, ((0, -m % bm), (0, -k % bk)))


def to_blocks(xp: jax.Array, block: tuple[int, int]) -> jax.Array:
    """A padded ``(Mb * bm, Kb * bk)`` matrix as ``(Kb * Mb, bm, bk)`` blocks in block-column-major
    order (block ``(i, j)`` at ``j * Mb + i``)."""
    (bm, bk), (mp, kp) = block, xp.shape
    return xp.reshape(mp // bm, bm, kp // bk, bk).transpose(2, 0, 1, 3).reshape(-1, bm, bk)


def from_blocks(values: jax.Array, grid: tuple[int, int]) -> jax.Array:
    """Inverse of ``to_blocks``: ``(Kb * Mb, bm, bk)`` blocks -> the ``(Mb * bm, Kb * bk)`` matrix."""
    (mb, kb), (bm, bk) = grid, values.shape[1:]
    return values.reshape(kb, mb, bm, bk).transpose(1, 2, 0, 3).reshape(mb * bm, kb * bk)


def _block_rows(v: jax.Array, bm: int) -> jax.Array:
    """``(Mp, Kp)`` as ``(Mb, bm, Kp)``: per-block scales then broadcast over the middle axis inside
    one fusion. The barrier keeps the 3-D form: XLA:TPU otherwise multiplies in 2-D by a
    materialised x-sized broadcast of the scales (modelled quantize time 1.9x). Rows of one value
    stay 2-D (a unit middle axis would be padded 8x on TPU)."""
    if bm == 1:
        return v
    rows = lambda v: v.reshape(-1, bm, v.shape[-1])  # noqa: E731
    return platforms.by_lowering_platform(rows, {"tpu": lambda v: lax.optimization_barrier(rows(v))}, v)


def _across_columns(per_block: jax.Array, bk: int, like: jax.Array) -> jax.Array:
    """``(Mb, Kb)`` repeated over each block's columns, broadcastable against ``like``."""
    wide = jnp.repeat(per_block, bk, axis=1)
    return wide if like.ndim == 2 else wide[:, None, :]


def _int4_pair_axis(block: tuple[int, int]) -> int:
    # Rows i and i + bm/2 of each block-row share a byte; blocks of an odd number of rows pair
    # columns c and c + Kp/2 instead (Kp is then even: _rows_fit).
    return -2 if block[0] % 2 == 0 else -1


def quantize_rows(
    x: jax.Array, block: tuple[int, int], storage_dtype: StorageDtype, key: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """``quantize_matrix``'s storage in x's row order (the layout off the CPU): the same shapes,
    scales and rounding as in blocks, in row order too (the scales ``(Mb, Kb)`` row-major, where
    the blocks layout orders them by block-column: no transpose kernel on either side); the values
    are x's padded ``(Mp, Kp)`` codes in row-major order, int4 packed two to a byte: rows ``i`` (low nibble) and ``i + bm/2`` of each block-row
    (blocks of odd ``bm``: columns ``c`` and ``c + Kp/2``). ``block`` must hold an even number of
    values for int4."""
    check_storage_dtype(storage_dtype)
    if not _rows_fit(block, storage_dtype):
        raise ValueError(
            "the rows layout needs a storage_dtype, blocks narrower than 128 values (wider ones are stored as blocks) and an even "
            f"number of values per int4 block; got {storage_dtype!r} in {block}"
        )
    xp = pad_to_blocks(x, block)
    (mp, kp), (bm, bk) = xp.shape, block
    n = (mp // bm) * (kp // bk)
    if storage_dtype == "bfloat16":
        return xp.astype(jnp.bfloat16).reshape(n, bm, bk), None
    limit = _LIMITS[storage_dtype]
    v = _block_rows(xp.astype(jnp.float32), bm)
    # Per-block max|x| by reductions over x itself (no (Mb, bm, Kb, bk) view): _block_scales' bit for bit.
    amax = jnp.abs(v) if bm == 1 else jnp.max(jnp.abs(v), axis=1)
    amax = lax.reduce_window(amax, -jnp.inf, lax.max, (1, bk), (1, bk), "VALID")
    amax = jnp.where(jnp.isfinite(amax), amax, jnp.nan)
    scales = jnp.where(amax > 0, amax * (1.0 / limit), jnp.where(amax == 0, 1.0, amax))  # (Mb, Kb)
    scaled = v * _across_columns(1.0 / scales, bk, v)
    if storage_dtype == "float8_e4m3fn":
        return scaled.astype(jnp.float8_e4m3fn).reshape(n, bm, bk), scales.reshape(-1)
    q = _integer_codes(scaled, limit, key).astype(jnp.int32)
    if storage_dtype == "int8":
        return q.astype(jnp.int8).reshape(n, bm, bk), scales.reshape(-1)
    low, high = jnp.split(q & 0xF, 2, axis=_int4_pair_axis(block))
    return (low | (high << 4)).astype(jnp.uint8).reshape(n, bm * bk // 2), scales.reshape(-1)


def dequantize_rows(
    stored: jax.Array, scales: jax.Array | None, storage_dtype: StorageDtype, block: tuple[int, int], grid: tuple[int, int], dtype
) -> jax.Array:
    """The padded ``(Mb * bm, Kb * bk)`` matrix in ``dtype`` from what ``quantize_rows`` stored."""
    (mb, kb), (bm, bk) = grid, block
    shape = (mb * bm, kb * bk) if bm == 1 else (mb, bm, kb * bk)
    if storage_dtype == "int4":
        axis = _int4_pair_axis(block)
        packed = stored.reshape(*shape[:axis], shape[axis] // 2, *shape[len(shape) + axis + 1 :]).astype(jnp.int32)
        low, high = ((packed & 0xF) ^ 8) - 8, (((packed >> 4) & 0xF) ^ 8) - 8  # sign-extend 4-bit two's complement
        values = jnp.concatenate([low, high], axis=axis)
    else:
        values = stored.reshape(shape)
    values = values.astype(jnp.float32)
    if scales is not None:
        values = values * _across_columns(scales.reshape(mb, kb), bk, values)
    return values.astype(dtype).reshape(mb * bm, kb * bk)


def quantize_matrix(
    x: jax.Array, block: tuple[int, int], storage_dtype: StorageDtype | None, key: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """``quantize_blocks`` of every ``(bm, bk)`` block of ``x (M, K)`` (zero-padded to whole blocks):
    ``from_dense``'s storage when every block is kept. ``block`` must fit in x. Read it back with
    ``dequantize_matrix``: the layout follows the platform lowered for (module docstring). On the
    CPU, in block-column-major order (block ``(i, j)`` at ``j * Mb + i``); elsewhere
    ``quantize_rows``.

    Lowered for a CPU, int8 and int4 rounded to nearest from float32 or bfloat16 run
    ``cpu_kernels.quantize_blocks``: one pass over x, which XLA cannot fuse into x's producer (XLA:CPU
    recomputed ResMLP's GELU in both the scale reduction and the int4 packing, whose loop then took
    longer than the layer's matmul)."""

    if storage_dtype is not None and whole_rows(block, x.shape[1]):
        return quantize_token_rows(x, storage_dtype, key)

    def in_blocks(x):
        return quantize_blocks(to_blocks(pad_to_blocks(x, block), block), storage_dtype, key)

    cpu = in_blocks
    if key is None and storage_dtype in cpu_kernels.QUANTIZE_BITS and x.dtype in (jnp.float32, jnp.bfloat16):
        cpu = lambda x: cpu_kernels.quantize_blocks(x, block, storage_dtype)  # noqa: E731
    elsewhere = (lambda x: quantize_rows(x, block, storage_dtype, key)) if _rows_fit(block, storage_dtype) else in_blocks
    return platforms.by_lowering_platform(elsewhere, {"cpu": cpu}, x)


def dequantize_matrix(
    stored: jax.Array, scales: jax.Array | None, storage_dtype: StorageDtype | None, block: tuple[int, int], grid: tuple[int, int], dtype
) -> jax.Array:
    """The padded ``(Mb * bm, Kb * bk)`` matrix in ``dtype`` from what ``quantize_matrix`` stored,
    read in the layout of the platform lowered for (``storage_dtype=None``: blocks kept as they are)."""

    if storage_dtype is not None and whole_rows(block, grid[1] * block[1]):
        return dequantize_token_rows(stored, scales, (grid[0], block[1]), dtype)

    def in_blocks(stored, scales):
        return from_blocks(dequantize_blocks(stored, scales, storage_dtype, block, dtype), grid)

    if not _rows_fit(block, storage_dtype):
        return in_blocks(stored, scales)
    rows = lambda stored, scales: dequantize_rows(stored, scales, storage_dtype, block, grid, dtype)  # noqa: E731
    return platforms.by_lowering_platform(rows, {"cpu": in_blocks}, stored, scales)
