"""Two GEMMs around x's int8 / int4 codes in 1 x 128 tiles: the forward one writes them, the weight
gradient's one reads them. Compression then costs no pass of its own over x.

``matmul_quantizing(x, w)`` computes ``y = x @ w`` and, as it reads x, x's codes and scales: one
scale per row of each 128-column tile (``bsr_jax``'s ``(1, 128)`` blocks, every block kept).
Program ``(i, n)`` computes the ``(bm, bn)`` tile of y over the K loop; programs of the first
column tile (``n == 0``) also quantize each ``(bm, 128)`` tile of x they load and store its codes:
the other programs read x as any GEMM does, and x's codes cost only their writes.

``quantized_t_matmul(codes, scales, dy)`` computes ``dW = x.T @ dy`` from them: program ``(j, n)``
owns the ``(128, bn)`` tile of dW for x's tile column ``j`` and loops over the rows (tokens),
dequantizing each ``(bm, 128)`` tile of codes in registers before the tensor-core product.

Layout (``bsr_jax.storage``'s blocks layout for ``(1, 128)`` blocks, so every other reader of the
format reads these): ``codes (Kb, M, 128)`` int8, or ``(Kb, M, 64)`` uint8 for int4 (columns
``2c`` in the low nibble, ``2c + 1`` in the high one); ``scales (Kb, M)`` float32. Codes follow
``quantize_blocks``: ``amax = max |x|`` over the tile row, ``scale = amax / limit`` (1 for a zero
row, NaN for a row holding NaN or inf), codes ``clip(round_half_even(x / scale), -limit, limit)``
with ``limit`` 127 (int8) or 7 (int4).

Each kernel has a pure jax.numpy reference beside it. On a GPU they compile with Triton; on any
other platform they run in the Pallas interpreter (for tests).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tiling import MIN_DOT_DIM, result_like, run_by_lowering_platform

TILE = 128  # x's columns per scale by default: the contraction tile of the forward GEMM
LIMITS = {"int8": 127.0, "int4": 7.0}
# Rows and columns a program owns; halved until they divide the array (at least MIN_DOT_DIM).
ROWS, COLUMNS = 64, 128
NUM_WARPS = 4
# dW's grid is (Kb, N / bn) programs, few for a narrow layer (36 for 768 x 768): its token loop is split
# over up to MAX_SPLITS programs, the fewest whose grid reaches TARGET_PROGRAMS (two waves of an H100's
# 132 SMs), and their f32 partial sums added after, never more bytes of them than dy's (docs/kernels.md).
TARGET_PROGRAMS, MAX_SPLITS = 264, 16
# Software-pipelining depth: as many stages (at most 3) as fit a budget of shared memory per
# program, counted as the bytes one stage loads. Triton asked ~1.5x that count (bf16, int4
# forward: 3 stages of 64 KiB asked 288 KiB of an H100's 227), so the budget leaves a third free.
MAX_STAGES, STAGE_BUDGET = 3, 150 * 1024


def _stages(stage_bytes: int) -> int:
    return max(1, min(MAX_STAGES, STAGE_BUDGET // stage_bytes))


def _columns(dtype) -> int:
    return COLUMNS if jnp.dtype(dtype).itemsize <= 2 else COLUMNS // 2  # f32 tiles: half as wide


def _tile(n: int, largest: int) -> int | None:
    """The largest power of two <= ``largest`` dividing ``n``, or None below ``MIN_DOT_DIM``."""
    t = largest
    while t >= MIN_DOT_DIM:
        if n % t == 0:
            return t
        t //= 2
    return None


def shape_error(m: int, k: int, n: int, storage: str, tile: int = TILE) -> str | None:
    """Why ``x (m, k) @ w (k, n)`` cannot run these kernels with ``storage`` codes of ``tile``
    columns per scale, or None if it can."""
    if storage not in LIMITS:
        return f"storage must be one of {sorted(LIMITS)}, got {storage!r}"
    if tile not in (16, 32, 64, 128):
        return f"tile must be a power of two in 16..128, got {tile}"
    if k % tile:
        return f"K must be a multiple of tile={tile}, got {k}"
    for name, size, largest in (("M (rows)", m, ROWS), ("N (columns)", n, COLUMNS)):
        if _tile(size, largest) is None:
            return f"{name} must be a multiple of {MIN_DOT_DIM}, got {size}"
    return None


def _scales(amax: jax.Array, limit: float) -> jax.Array:
    amax = jnp.where(amax == jnp.inf, jnp.nan, amax)  # max |x| is inf or NaN when x holds either
    return jnp.where(amax > 0, amax * (1.0 / limit), jnp.where(amax == 0, 1.0, amax))


def _codes(v: jax.Array, scales: jax.Array, limit: float) -> jax.Array:
    """int32 codes of f32 ``v (rows, cols)`` at per-row ``scales (rows,)``."""
    return jnp.clip(_round_half_even(v * (1.0 / scales)[:, None]), -limit, limit).astype(jnp.int32)


def _round_half_even(v: jax.Array) -> jax.Array:
    """``jnp.round`` from ``floor`` (Triton lowers no ``round``): exact for ``|v| < 2**22``, where
    ``v + 0.5`` and ``r - v`` are exact in f32."""
    r = jnp.floor(v + 0.5)
    odd = r - 2.0 * jnp.floor(r * 0.5) != 0.0
    return jnp.where((r - v == 0.5) & odd, r - 1.0, r)


def _quantizing_kernel(x_ref, w_ref, y_ref, codes_ref, scales_ref, *, storage, tile, precision):
    limit = LIMITS[storage]
    quantizes = pl.program_id(1) == 0

    def step(j, acc):
        k0 = pl.multiple_of(j * tile, tile)
        x = x_ref[:, pl.ds(k0, tile)]

        @pl.when(quantizes)
        def _():
            if storage == "int8":
                v = x.astype(jnp.float32)
                scales = _scales(jnp.max(jnp.abs(v), axis=1), limit)
                codes_ref[j] = _codes(v, scales, limit).astype(jnp.int8)
            else:  # the even and odd columns of the tile, loaded apart: no interleave of registers
                even = x_ref[:, pl.ds(k0, tile // 2, stride=2)].astype(jnp.float32)
                odd = x_ref[:, pl.ds(k0 + 1, tile // 2, stride=2)].astype(jnp.float32)
                scales = _scales(jnp.maximum(jnp.max(jnp.abs(even), axis=1), jnp.max(jnp.abs(odd), axis=1)), limit)
                low, high = _codes(even, scales, limit) & 0xF, _codes(odd, scales, limit) & 0xF
                codes_ref[j] = (low | (high << 4)).astype(jnp.uint8)
            scales_ref[j] = scales

        w = w_ref[pl.ds(k0, tile), :]
        return acc + lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, x_ref.shape[1] // tile, step, jnp.zeros(y_ref.shape, jnp.float32))
    y_ref[...] = acc.astype(y_ref.dtype)


def matmul_flops(operands: list[tuple[int, ...]], result: tuple[int, ...]) -> int:
    """FLOPs of ``matmul_quantizing`` from its operands ``(x (M, K), w (K, N))``."""
    (m, k), (_, n) = operands[:2]
    return 2 * m * k * n


def t_matmul_flops(operands: list[tuple[int, ...]], result: tuple[int, ...]) -> int:
    """FLOPs of ``quantized_t_matmul`` from its operands ``(codes, scales, dy (M, N))`` and its
    result ``(K, N)`` (the kernel's, split: ``(splits, K, N)`` partial sums of M / splits rows each)."""
    m, (k, n) = operands[2][0], result[-2:]
    return 2 * m * k * n


def _check_tiling(kernel: str, rows: int | None, columns: int | None, num_warps: int) -> None:
    for name, value in (("rows", rows), ("columns", columns)):
        if value is not None and value not in (16, 32, 64, 128, 256):
            raise ValueError(f"{kernel}: {name} must be a power of two in 16..256 (or None), got {value}")
    if num_warps not in (4, 8):
        raise ValueError(f"{kernel}: num_warps must be 4 or 8, got {num_warps}")


def _code_bytes(m: int, k: int, storage: str, tile: int) -> int:
    return m * k // (2 if storage == "int4" else 1) + m * (k // tile) * 4


def matmul_quantizing(
    x: jax.Array,
    w: jax.Array,
    *,
    storage: str,
    tile: int = TILE,
    precision: lax.PrecisionLike = None,
    rows: int | None = None,
    columns: int | None = None,
    num_warps: int = NUM_WARPS,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x @ w`` and x's codes and scales, in one kernel.

    Args:
      x: ``(M, K)`` float32 / bfloat16 / float16; K a multiple of ``tile``, M of 16.
      w: ``(K, N)`` in x's dtype; N a multiple of 16.
      storage: ``"int8"`` or ``"int4"``.
      tile: x's columns per scale, a power of two in 16..128 (``(1, tile)`` blocks).
      precision: of the products (``lax.dot_general``'s): ``None`` lets a GPU multiply float32 in
        TF32, as XLA's own dot does by default.
      rows, columns: of y each program owns, powers of two in 16..256 (halved until they divide M and
        N); ``None``: 64 rows, 128 columns (64 for f32).
      num_warps: of each program (Triton's): 4 or 8.
      interpret: run the Pallas interpreter even when lowering for a GPU.

    Returns:
      ``y (M, N)`` in x's dtype (f32 accumulation: XLA's dot up to the order of its sums), and
      x's ``codes`` and ``scales`` in the layout of the module docstring (exactly
      ``quantize_reference``'s).
    """
    (m, k), n = x.shape, w.shape[1]
    why = shape_error(m, k, n, storage, tile) if w.shape[0] == k and x.dtype == w.dtype else f"x {x.shape} {x.dtype} and w {w.shape} {w.dtype} must be (M, K) and (K, N) of one dtype"
    if why:
        raise ValueError(f"matmul_quantizing: {why}")
    _check_tiling("matmul_quantizing", rows, columns, num_warps)
    bm, bn, kb = _tile(m, rows or ROWS), _tile(n, columns or _columns(x.dtype)), k // tile
    width = tile // 2 if storage == "int4" else tile
    # A stage loads x's tile and w's (and, where it quantizes int4, x's tile again as two halves).
    stages = _stages((bm * tile * (2 if storage == "int4" else 1) + tile * bn) * x.dtype.itemsize)
    outs = (
        result_like(x, (m, n), x.dtype),
        result_like(x, (kb, m, width), jnp.uint8 if storage == "int4" else jnp.int8),
        result_like(x, (kb, m), jnp.float32),
    )
    item = x.dtype.itemsize
    cost = pl.CostEstimate(  # x and w re-read per tile of the other operand; y, codes and scales written once
        flops=matmul_flops([x.shape, w.shape], (m, n)), transcendentals=0,
        bytes_accessed=(m * k * (n // bn) + k * n * (m // bm) + m * n) * item + _code_bytes(m, k, storage, tile),
    )  # fmt: skip

    def call(x, w, *, interpret):
        return pl.pallas_call(
            functools.partial(_quantizing_kernel, storage=storage, tile=tile, precision=precision),
            out_shape=outs,
            grid=(m // bm, n // bn),
            in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)), pl.BlockSpec((k, bn), lambda i, j: (0, j))],
            out_specs=[
                pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
                pl.BlockSpec((kb, bm, width), lambda i, j: (0, i, 0)),
                pl.BlockSpec((kb, bm), lambda i, j: (0, i)),
            ],
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=stages),
            cost_estimate=cost,
            interpret=interpret,
            name="matmul_quantizing",
        )(x, w)

    return run_by_lowering_platform(call, x, w, interpret=interpret)


def quantize_reference(x: jax.Array, storage: str, tile: int = TILE) -> tuple[jax.Array, jax.Array]:
    """``matmul_quantizing``'s codes and scales by jax.numpy, tile by tile."""
    m, k = x.shape
    limit = LIMITS[storage]
    v = x.astype(jnp.float32).reshape(m, k // tile, tile).transpose(1, 0, 2)  # (Kb, M, tile)
    scales = _scales(jnp.max(jnp.abs(v), axis=2), limit)
    codes = jnp.clip(jnp.round(v * (1.0 / scales)[..., None]), -limit, limit).astype(jnp.int32)
    if storage == "int8":
        return codes.astype(jnp.int8), scales
    return ((codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)).astype(jnp.uint8), scales


def dequantize_reference(codes: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """The ``(M, K)`` matrix in ``dtype`` the codes stand for (``x`` rounded to its codes)."""
    if codes.dtype == jnp.uint8:
        b = codes.astype(jnp.int32)
        codes = jnp.stack([((b & 0xF) ^ 8) - 8, (((b >> 4) & 0xF) ^ 8) - 8], axis=-1).reshape(*b.shape[:2], -1)
    v = (codes.astype(jnp.float32) * scales[..., None]).astype(dtype)  # (Kb, M, tile)
    return v.transpose(1, 0, 2).reshape(v.shape[1], -1)


def _t_kernel(codes_ref, scales_ref, dy_ref, out_ref, *, bm, precision):
    dtype = dy_ref.dtype
    int4 = codes_ref.dtype == jnp.uint8
    contract_rows = (((0,), (0,)), ((), ()))

    def product(values, scales, dy):
        x = (values.astype(jnp.float32) * scales[:, None]).astype(dtype)
        return lax.dot_general(x, dy, contract_rows, precision=precision, preferred_element_type=jnp.float32)

    def step(i, acc):
        m0 = pl.multiple_of(i * bm, bm)
        scales = scales_ref[0, pl.ds(m0, bm)]
        dy = dy_ref[pl.ds(m0, bm), :]
        codes = codes_ref[0, pl.ds(m0, bm), :]
        if not int4:
            return acc + product(codes, scales, dy)
        b = codes.astype(jnp.int32)  # two accumulators: x's even columns (low nibbles) and odd ones
        even, odd = acc
        return (even + product(((b & 0xF) ^ 8) - 8, scales, dy), odd + product((((b >> 4) & 0xF) ^ 8) - 8, scales, dy))

    rows = codes_ref.shape[2]  # of the tile's columns each accumulator holds
    zeros = jnp.zeros((rows, out_ref.shape[1]), jnp.float32)
    acc = lax.fori_loop(0, dy_ref.shape[0] // bm, step, (zeros, zeros) if int4 else zeros)
    if int4:
        out_ref[pl.ds(0, rows, stride=2), :] = acc[0].astype(out_ref.dtype)
        out_ref[pl.ds(1, rows, stride=2), :] = acc[1].astype(out_ref.dtype)
    else:
        out_ref[...] = acc.astype(out_ref.dtype)


def token_splits(programs: int, row_tiles: int, most: int = MAX_SPLITS) -> int:
    """How many programs share dW's token loop: the fewest (a power of two, at most ``most`` and
    ``MAX_SPLITS``, dividing ``row_tiles``, the loop's trips) that give ``TARGET_PROGRAMS`` programs."""
    splits = 1
    while programs * splits < TARGET_PROGRAMS and 2 * splits <= min(most, MAX_SPLITS) and row_tiles % (2 * splits) == 0:
        splits *= 2
    return splits


def quantized_t_matmul(
    codes: jax.Array,
    scales: jax.Array,
    dy: jax.Array,
    *,
    precision: lax.PrecisionLike = None,
    out_dtype=jnp.float32,
    splits: int | None = None,
    rows: int | None = None,
    columns: int | None = None,
    num_warps: int = NUM_WARPS,
    interpret: bool = False,
) -> jax.Array:
    """``x.T @ dy`` where x is given by ``matmul_quantizing``'s codes and scales.

    Args:
      codes: ``(Kb, M, tile)`` int8 or ``(Kb, M, tile / 2)`` uint8 (int4), as ``matmul_quantizing`` writes them.
      scales: ``(Kb, M)`` float32.
      dy: ``(M, N)`` float32 / bfloat16 / float16 (x's dtype: each tile of codes is dequantized to
        it before the product, as ``bsr_jax``'s dequantize-then-multiply path does); M a multiple
        of 16, N of 16.
      precision: of the products, as in ``matmul_quantizing``.
      out_dtype: dtype of the result; accumulation is float32 regardless.
      splits: programs that share each tile's token loop, each over ``M / splits`` rows, their f32
        partial sums added after; a power of two dividing ``M / bm``. ``None``: ``token_splits``, as
        many as keep the partial sums within dy's bytes.
      rows: of the token loop's step, a power of two in 16..256 (halved until it divides M); ``None``: 64.
      columns: of dy (and dW) each program owns, a power of two in 16..256 (halved until it divides
        N); ``None``: 128 (64 for f32). Wider tiles dequantize each tile of codes for more products.
      num_warps: of each program (Triton's): 4 or 8 (wide tiles need 8 for their accumulators).
      interpret: run the Pallas interpreter even when lowering for a GPU.

    Returns:
      ``(Kb * tile, N)`` array: ``dequantize_reference(codes, scales, dy.dtype).T @ dy`` up to the
      order of the f32 sums.
    """
    kb, m = scales.shape
    n = dy.shape[1]
    width = codes.shape[-1]
    storage, tile = ("int4", 2 * width) if codes.dtype == jnp.uint8 else ("int8", width)
    if codes.shape != (kb, m, width) or codes.dtype not in (jnp.int8, jnp.uint8) or dy.shape[0] != m or scales.dtype != jnp.float32:
        raise ValueError(
            f"quantized_t_matmul: expected codes (Kb, M, tile) int8 or (Kb, M, tile / 2) uint8, scales (Kb, M) float32 and dy (M, N); "
            f"got codes {codes.shape} {codes.dtype}, scales {scales.shape} {scales.dtype}, dy {dy.shape}"
        )
    why = shape_error(m, kb * tile, n, storage, tile)
    if why:
        raise ValueError(f"quantized_t_matmul: {why}")
    _check_tiling("quantized_t_matmul", rows, columns, num_warps)
    bm, bn = _tile(m, rows or ROWS), _tile(n, columns or _columns(dy.dtype))
    # The partial sums (splits x K x N f32) no larger than dy (M x N), live beside them anyway.
    splits = token_splits(kb * (n // bn), m // bm, m * dy.dtype.itemsize // (4 * kb * tile)) if splits is None else splits
    if splits < 1 or splits & (splits - 1) or (m // bm) % splits:
        raise ValueError(f"quantized_t_matmul: splits must be a power of two dividing M / {bm} = {m // bm}, got {splits}")
    loop_rows = m // splits  # of the token loop each program runs
    stages = _stages(bm * (width + 4 + bn * dy.dtype.itemsize))  # a stage loads codes, scales and dy's tile
    # Split, each program writes its f32 partial sum: (splits, K, N), added after.
    out = result_like(dy, (kb * tile, n), out_dtype) if splits == 1 else result_like(dy, (splits, kb * tile, n), jnp.float32)
    cost = pl.CostEstimate(  # each program reads its tile column's codes and scales and its columns of dy
        flops=t_matmul_flops([codes.shape, scales.shape, dy.shape], (kb * tile, n)), transcendentals=0,
        bytes_accessed=(_code_bytes(m, kb * tile, storage, tile) * (n // bn)
                        + m * n * dy.dtype.itemsize * kb + math.prod(out.shape) * out.dtype.itemsize),
    )  # fmt: skip
    squeezed = () if splits == 1 else (None,)  # the partial sums' leading axis: one slice per program

    def call(codes, scales, dy, *, interpret):
        return pl.pallas_call(
            functools.partial(_t_kernel, bm=bm, precision=precision),
            out_shape=out,
            grid=(kb, n // bn, splits),
            in_specs=[
                pl.BlockSpec((1, loop_rows, width), lambda j, c, p: (j, p, 0)),
                pl.BlockSpec((1, loop_rows), lambda j, c, p: (j, p)),
                pl.BlockSpec((loop_rows, bn), lambda j, c, p: (p, c)),
            ],
            out_specs=pl.BlockSpec((*squeezed, tile, bn), lambda j, c, p: (p, j, c)[-len(out.shape):]),
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=stages),
            cost_estimate=cost,
            interpret=interpret,
            name="quantized_t_matmul",
        )(codes, scales, dy)

    result = run_by_lowering_platform(call, codes, scales, dy, interpret=interpret)
    return result if splits == 1 else result.sum(axis=0).astype(out_dtype)


def quantized_t_matmul_reference(codes: jax.Array, scales: jax.Array, dy: jax.Array, out_dtype=jnp.float32) -> jax.Array:
    """``quantized_t_matmul`` by dequantizing x and one f32 matmul at ``HIGHEST`` precision."""
    x = dequantize_reference(codes, scales, dy.dtype).astype(jnp.float32)
    return jnp.matmul(x.T, dy.astype(jnp.float32), precision=lax.Precision.HIGHEST).astype(out_dtype)
