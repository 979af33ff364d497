"""``quantized_matmul``'s two GEMMs for TPU (Pallas Mosaic), int8 codes: the same results, in the
same layout, so ``quantize_reference``, ``dequantize_reference`` and ``quantized_t_matmul_reference``
are their references too.

``matmul_quantizing(x, w)``: program ``(i, k)`` multiplies x's ``(bm, tile)`` tile by w's
``(tile, N)`` rows into an f32 ``(bm, N)`` accumulator in VMEM and, from the x tile it loaded,
writes that tile's codes and its ``bm`` scales; the K loop is the grid's last axis, so x is read
once and w once per row tile. ``quantized_t_matmul(codes, scales, dy)``: program ``(j, n, i)``
owns a ``(tk, bn)`` tile of dW (``tk / tile`` of x's tile columns, as many as VMEM allows, so dy
is read fewer times), dequantizes each ``(bm, tile)`` tile of codes, transposed, and accumulates
``x_tile.T @ dy_tile`` into it over the row tiles ``i`` (the last axis).

Why the shapes differ from the GPU kernels': a TPU block's two minor dimensions are multiples of
(8, 128) or the whole array's, so scales ``(Kb, M)`` are read and written ``(Kb, bm)`` at a time
(``bm`` a multiple of 128), the row of tile column ``j`` picked inside; a scale row multiplies
the codes transposed (tokens along lanes), so no vector is moved from lanes to sublanes. Mosaic
has no strided lane loads, so int4's even/odd nibble packing is not built here (int8 only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.quantized_matmul import LIMITS, TILE, _code_bytes, _round_half_even, _scales, matmul_flops, t_matmul_flops
from pallas_kernels.tiling import result_like

ROWS = (512, 256, 128)  # rows (tokens) per program, the largest that divides M and fits VMEM_BUDGET
COLUMNS = (512, 256, 128)  # dW's columns per program, the largest dividing N (else all of N)
# Bytes of VMEM the blocks, their double buffers and the accumulator may take: under Mosaic's
# default scoped limit (16 MiB), so no compiler parameter raises it.
VMEM_BUDGET = 12 * 2**20


def _forward_vmem(bm: int, kb: int, tile: int, n: int, item: int) -> int:
    """x, w, y, codes and (Kb, bm) scales blocks double-buffered (scales' rows padded to 8), and
    the f32 accumulator."""
    return 2 * (bm * tile * item + tile * n * item + bm * n * item + bm * tile + max(8, kb) * bm * 4) + bm * n * 4


def _row_tile(m: int, fits) -> int | None:
    """Rows (tokens) per program: the largest of ``ROWS`` that divides M and ``fits``, else the one
    that fits with the fewest rows past M in the last tile (a partial tile: Pallas pads what it
    reads there and drops what is written past M), else all of M where M is below 128."""
    fitting = [r for r in ROWS if fits(r)] if m >= ROWS[-1] else [m] if fits(m) else []
    return next((r for r in fitting if m % r == 0), min(fitting, key=lambda r: (-m % r, -r), default=None))


def _rows(m: int, k: int, tile: int, n: int, item: int) -> int | None:
    return _row_tile(m, lambda r: _forward_vmem(r, k // tile, tile, n, item) <= VMEM_BUDGET)


def shape_error(m: int, k: int, n: int, storage: str, tile: int = TILE, itemsize: int = 2) -> str | None:
    """Why ``x (m, k) @ w (k, n)`` (``itemsize`` bytes a value) cannot run these kernels with
    ``storage`` codes of ``tile`` columns per scale, or None if it can."""
    if storage != "int8":
        return f"storage must be 'int8' on TPU (int4's nibble packing needs strided lane loads), got {storage!r}"
    if tile != TILE and tile != k:
        return f"tile must be {TILE} or all of K, got tile {tile} for K {k}"
    if k % tile:
        return f"K must be a multiple of tile={tile}, got {k}"
    if n % 128 and n > max(COLUMNS):
        return f"N (columns) must be a multiple of 128 or at most {max(COLUMNS)}, got {n}"
    if _rows(m, k, tile, n, itemsize) is None:
        return f"N (columns) must be small enough for {VMEM_BUDGET >> 20} MiB of VMEM with {min(m, ROWS[-1])} rows a program, got N={n}"
    return None


def weight_rereads(m: int, k: int, n: int, tile: int = TILE, itemsize: int = 2) -> float:
    """What ``matmul_quantizing`` reads of w beyond once (it reads all of w per row tile), in reads
    of x: large where N is wide for the rows VMEM allows (ViT-B/16's fc1 in f32: 24)."""
    bm = _rows(m, k, tile, n, itemsize)
    return (pl.cdiv(m, bm) - 1) * n / m if bm else float("inf")


def _quantizing_kernel(x_ref, w_ref, y_ref, codes_ref, scales_ref, acc_ref, *, limit, precision):
    k = pl.program_id(1)
    x = x_ref[...]
    v = x.astype(jnp.float32)
    # The same maxima twice: per row as a column (to divide x's rows) and as a row (to store).
    column = _scales(jnp.max(jnp.abs(v), axis=1, keepdims=True), limit)
    codes_ref[...] = jnp.clip(_round_half_even(v * (1.0 / column)), -limit, limit).astype(jnp.int32).astype(jnp.int8)
    scales_ref[pl.ds(k, 1), :] = _scales(jnp.max(jnp.abs(v.T), axis=0, keepdims=True), limit)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += lax.dot_general(x, w_ref[...], (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)

    @pl.when(k == pl.num_programs(1) - 1)
    def _():
        y_ref[...] = acc_ref[...].astype(y_ref.dtype)


def matmul_quantizing(
    x: jax.Array, w: jax.Array, *, storage: str = "int8", tile: int = TILE, precision: lax.PrecisionLike = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """``x @ w`` and x's int8 codes ``(Kb, M, tile)`` and scales ``(Kb, M)`` float32, in one Mosaic
    kernel (``quantized_matmul.matmul_quantizing``'s results; ``shape_error`` says what it takes).

    ``y`` accumulates in f32 in its own order (K tile by K tile): XLA's dot up to f32 rounding.
    ``interpret``: the Pallas interpreter (tests on CPU); ``pltpu.InterpretParams`` the TPU one, whose
    reads past an array's end (a partial last row tile) can be made NaN, as Mosaic leaves them unspecified."""
    (m, k), n = x.shape, w.shape[1]
    why = shape_error(m, k, n, storage, tile, x.dtype.itemsize) if w.shape[0] == k and x.dtype == w.dtype else (
        f"x {x.shape} {x.dtype} and w {w.shape} {w.dtype} must be (M, K) and (K, N) of one dtype")  # fmt: skip
    if why:
        raise ValueError(f"matmul_quantizing (TPU): {why}")
    bm, kb, item = _rows(m, k, tile, n, x.dtype.itemsize), k // tile, x.dtype.itemsize
    cost = pl.CostEstimate(  # x read once, w once per row tile; y, codes and scales written once
        flops=matmul_flops([x.shape, w.shape], (m, n)), transcendentals=0,
        bytes_accessed=(m * k + k * n * pl.cdiv(m, bm) + m * n) * item + _code_bytes(m, k, storage, tile),
    )  # fmt: skip
    return pl.pallas_call(
        functools.partial(_quantizing_kernel, limit=LIMITS[storage], precision=precision),
        out_shape=(result_like(x, (m, n), x.dtype), result_like(x, (kb, m, tile), jnp.int8), result_like(x, (kb, m), jnp.float32)),
        grid=(pl.cdiv(m, bm), kb),
        in_specs=[pl.BlockSpec((bm, tile), lambda i, k: (i, k)), pl.BlockSpec((tile, n), lambda i, k: (k, 0))],
        out_specs=[
            pl.BlockSpec((bm, n), lambda i, k: (i, 0)),
            pl.BlockSpec((None, bm, tile), lambda i, k: (k, i, 0)),
            pl.BlockSpec((kb, bm), lambda i, k: (0, i)),
        ],
        scratch_shapes=[pltpu.VMEM((bm, n), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
        name="matmul_quantizing_tpu",
    )(x, w)


def _t_tiles(m: int, k: int, n: int, tile: int, item: int) -> tuple[int, int, int]:
    """(rows, dW rows, dW columns) per program of the dW GEMM: the least HBM traffic (codes read
    once per column tile, dy once per row tile of dW) whose blocks fit ``VMEM_BUDGET``."""
    bm = _row_tile(m, lambda r: True)
    kb = k // tile
    columns = [c for c in (n, *COLUMNS) if n % c == 0 and (c % 128 == 0 or c == n)]
    best = None
    for bn in columns:
        for tk in (t * tile for t in range(kb, 0, -1) if kb % t == 0):
            vmem = 3 * tk * bn * 4 + 2 * (tk * bm + max(8, kb) * bm * 4 + bm * bn * item)  # dW (and its f32 accumulator), codes, scales, dy
            traffic = m * k * (n // bn) + m * n * item * (k // tk)
            if vmem <= VMEM_BUDGET and (best is None or traffic < best[0]):
                best = (traffic, (bm, tk, bn))
    return best[1] if best else (bm, tile, min(c for c in columns))


def _t_kernel(codes_ref, scales_ref, dy_ref, out_ref, acc_ref, *, rows, precision):
    jk, i = pl.program_id(0), pl.program_id(2)
    tiles, tile = codes_ref.shape[0], codes_ref.shape[2]
    bm = dy_ref.shape[0]

    @pl.when(i == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    dy = dy_ref[...]
    # A partial last row tile holds unspecified values past M (Pallas pads its reads), summed over
    # here: zeroed in dy and in the scales (the codes are finite int8; 0 * NaN would be NaN).
    valid = None if rows % bm == 0 else rows - i * bm
    if valid is not None:
        dy = jnp.where(lax.broadcasted_iota(jnp.int32, dy.shape, 0) < valid, dy, jnp.zeros_like(dy))
    for t in range(tiles):
        # x's tile transposed (tile, bm): each token's scale multiplies a lane, as stored.
        scales = scales_ref[pl.ds(jk * tiles + t, 1), :]
        if valid is not None:
            scales = jnp.where(lax.broadcasted_iota(jnp.int32, scales.shape, 1) < valid, scales, 0.0)
        x_t = (codes_ref[t].astype(jnp.float32).T * scales).astype(dy.dtype)
        product = lax.dot_general(x_t, dy, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
        acc_ref[pl.ds(t * tile, tile), :] += product

    @pl.when(i == pl.num_programs(2) - 1)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def quantized_t_matmul(
    codes: jax.Array, scales: jax.Array, dy: jax.Array, *, precision: lax.PrecisionLike = None, out_dtype=jnp.float32,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # fmt: skip
    """``x.T @ dy`` (``(K, N)``, f32 accumulation) from ``matmul_quantizing``'s int8 codes
    ``(Kb, M, tile)`` and scales ``(Kb, M)`` float32, for ``dy (M, N)``: each tile of codes is
    dequantized to dy's dtype before its product (``quantized_t_matmul_reference``'s values, up to
    the order of the f32 sums). A program owns a ``(tk, bn)`` tile of dW, several of x's tile
    columns where they fit, so that dy is read as few times as VMEM allows."""
    kb, m = scales.shape
    n, tile = dy.shape[1], codes.shape[-1]
    if codes.shape != (kb, m, tile) or codes.dtype != jnp.int8 or dy.shape[0] != m or scales.dtype != jnp.float32:
        raise ValueError(f"quantized_t_matmul (TPU): expected codes (Kb, M, tile) int8, scales (Kb, M) float32 and dy (M, N); got "
                         f"codes {codes.shape} {codes.dtype}, scales {scales.shape} {scales.dtype}, dy {dy.shape}")  # fmt: skip
    why = shape_error(m, kb * tile, n, "int8", tile, dy.dtype.itemsize)
    if why:
        raise ValueError(f"quantized_t_matmul (TPU): {why}")
    bm, tk, bn = _t_tiles(m, kb * tile, n, tile, dy.dtype.itemsize)
    out = result_like(dy, (kb * tile, n), out_dtype)
    cost = pl.CostEstimate(  # codes and scales once per column tile of dW, dy once per row tile
        flops=t_matmul_flops([codes.shape, scales.shape, dy.shape], out.shape), transcendentals=0,
        bytes_accessed=(m * kb * tile + kb * m * 4 * (kb * tile // tk)) * (n // bn) + m * n * dy.dtype.itemsize * (kb * tile // tk)
        + kb * tile * n * jnp.dtype(out_dtype).itemsize,
    )  # fmt: skip
    return pl.pallas_call(
        functools.partial(_t_kernel, rows=m, precision=precision),
        out_shape=out,
        grid=(kb * tile // tk, n // bn, pl.cdiv(m, bm)),
        in_specs=[
            pl.BlockSpec((tk // tile, bm, tile), lambda j, c, i: (j, i, 0)),
            pl.BlockSpec((kb, bm), lambda j, c, i: (0, i)),
            pl.BlockSpec((bm, bn), lambda j, c, i: (i, c)),
        ],
        out_specs=pl.BlockSpec((tk, bn), lambda j, c, i: (j, c)),
        scratch_shapes=[pltpu.VMEM((tk, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
        name="quantized_t_matmul_tpu",
    )(codes, scales, dy)
