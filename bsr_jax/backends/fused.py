"""The ``fused`` backend: compression inside the layer's GEMMs (``pallas_kernels.quantized_matmul``).

For int8 / int4 storage of every block of 1 x 128 (``Pruning(0.0, block=(1, 128),
storage_dtype=...)``, round to nearest), the forward GEMM writes x's codes and scales as it reads
x, and the weight-gradient GEMM dequantizes them in registers: no pass over x of their own. The
stored residual is the same ``BlockSparse`` as the unfused path's, code for code.

Opt in with ``backend="fused"`` (or ``$BSR_JAX_BACKEND=fused``). Lowered for a GPU the kernels
compile with Triton; for the CPU they run in the Pallas interpreter (for tests: slow); for a TPU,
int8 layers run ``pallas_kernels.quantized_matmul_tpu``'s Mosaic kernels where they take the
shapes. For layers the kernels do not take (``why_not``: other storage; K not a multiple of 128, or
below it and not a power of two from 16, or int4 below it; M or N not a multiple of 16; on TPU
int4, ``quantized_matmul_tpu.shape_error``'s, and forward GEMMs re-reading w more than
``REREADS`` reads of x), the layer runs the unfused path of the
platform's default backend, which stores the same codes. The forward
GEMM accumulates in f32 as XLA's does but in its own order: y equals the dense layer's up to f32
rounding, not bit for bit. Float32 int4 layers take dW's products in bfloat16 on a GPU (``DW_PRODUCTS``).
Run on an H200 (docs/RESULTS.md 13.1, 13.2: the LM's step with every dW residual through them 1.11x of dense's,
where XLA's int4 token rows took 1.03x); on TPU deviceless compiles only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

import pallas_kernels
from pallas_kernels import quantized_matmul_tpu
from bsr_jax.core import platforms
from bsr_jax.storage.format import BlockSparse
from bsr_jax.storage.pruning import Pruning
from bsr_jax.storage.quantize import whole_rows

BLOCK = (1, pallas_kernels.quantized_matmul.TILE)
# On TPU the forward kernel reads all of w once per row tile; past this many reads of x in re-reads
# of w, XLA's dot and quantize passes are left the layer. Set between what was measured: ResMLP-S12's
# layers (at most 2.8) made its step faster (docs/RESULTS.md 14.2), ViT-B/16's (6 to 24, f32 with
# N up to 3072: few rows a program) made its step slower, 2.24x -> 2.79x of dense's (14.3).
REREADS = 4.0
# The GPU dW kernel's products for float32 layers in int4: dy and the dequantized codes rounded to
# bfloat16 (f32 sums). Measured on random layers (tests/bsr_jax/test_fused.py bounds it): bf16
# products move dW by 0.0024 (relative), against int4's own 0.12 from dense (int8's 0.006: int8
# keeps x's dtype). TF32 products run at half bf16's rate on an H100 and reached 0.23 of it against
# bf16's 0.43 on an H200 (pallas_kernels.KERNEL_EFFICIENCY): ResMLP-S12's int4-fused step modelled
# 10.69 -> 9.32 ms, ViT-B/16's 62.35 -> 47.61 (docs/RESULTS.md 14.8). TPU's kernel keeps x's dtype.
DW_PRODUCTS = {("int4", jnp.dtype(jnp.float32)): jnp.dtype(jnp.bfloat16)}


def _format_error(pruning: Pruning) -> str | None:
    if pruning.storage_dtype not in pallas_kernels.quantized_matmul.LIMITS:
        return f"storage_dtype must be 'int8' or 'int4', got {pruning.storage_dtype!r}"
    if pruning.sparsity != 0.0 or pruning.block != BLOCK or pruning.rounding != "nearest":
        return f"needs sparsity 0, block {BLOCK} and rounding 'nearest', got {pruning.sparsity}, {pruning.block}, {pruning.rounding!r}"
    return None


def _tile(k: int) -> int:
    return min(BLOCK[1], k)  # blocks wider than x are clamped to it (bsr_jax.storage.format)


def why_not(pruning: Pruning, x: jax.Array, w: jax.Array) -> str | None:
    """Why the kernels cannot run ``x (M, K) @ w (K, N)`` under ``pruning`` (None if they can)."""
    (m, k), n = x.shape, w.shape[1]
    if pruning.storage_dtype == "int4" and whole_rows((1, _tile(k)), k):
        # Bitcasting the kernel's packed bytes to XLA's s4 and back cost ResMLP-S12's step 0.9 ms
        # (token mixing, K 64) where XLA's own dW GEMM reads the s4 codes as stored.
        return f"int4 rows as wide as x (K = {k}) are stored as jnp.int4 codes (block='row'), which XLA's dW GEMM reads as stored"
    return _format_error(pruning) or pallas_kernels.quantized_matmul.shape_error(m, k, n, pruning.storage_dtype, _tile(k))


def forward(x: jax.Array, w: jax.Array, pruning: Pruning, precision: lax.PrecisionLike, unfused) -> tuple[jax.Array, BlockSparse]:
    """``(x @ w, pruning.compress(x))`` for ``x (M, K)``, ``w (K, N)`` the kernels take (``why_not``
    is None); ``unfused(x, w)`` computes the same pair where they do not run (TPU)."""
    stored = pruning.stored_shape(x)

    def stored_as(codes, scales):  # (Kb, M, width) is the blocks layout's (Kb * M, ...)
        return dataclasses.replace(stored, values=codes.reshape(stored.values.shape), scales=scales.reshape(-1))

    def kernels(x, w):
        y, codes, scales = pallas_kernels.matmul_quantizing(x, w, storage=pruning.storage_dtype, tile=stored.block[1], precision=precision)
        return y, stored_as(codes, scales)

    def tpu_kernels(x, w):
        if not tpu_forward_runs(pruning, x, w):
            return unfused(x, w)  # the same codes, by XLA's passes
        y, codes, scales = quantized_matmul_tpu.matmul_quantizing(x, w, storage=pruning.storage_dtype, tile=stored.block[1], precision=precision)
        return y, stored_as(codes, scales)

    return platforms.by_lowering_platform(kernels, {"tpu": tpu_kernels}, x, w)


def tpu_forward_runs(pruning: Pruning, x: jax.Array, w: jax.Array) -> bool:
    """Whether, lowered for a TPU, ``forward`` runs the Mosaic kernel for ``x (M, K) @ w (K, N)``
    (the layer the kernels take, ``why_not``, and w re-read at most ``REREADS`` reads of x)."""
    (m, k), n = x.shape, w.shape[1]
    return not _tpu_error(m, k, n, pruning.storage_dtype, x.dtype) and quantized_matmul_tpu.weight_rereads(m, k, n, _tile(k), x.dtype.itemsize) <= REREADS


def _tpu_error(m: int, k: int, n: int, storage: str, dtype) -> str | None:
    return quantized_matmul_tpu.shape_error(m, k, n, storage, _tile(k), jnp.dtype(dtype).itemsize)


def fused_dw(bsr: BlockSparse, dy: jax.Array, otherwise) -> jax.Array:
    """``(K, N)`` float32 ``x.T @ dy`` by ``quantized_t_matmul`` where ``bsr`` is the fused format
    and the shapes fit; ``otherwise(bsr, dy)`` elsewhere (and on TPU)."""
    (m, k), n = bsr.shape, dy.shape[1]
    if (not bsr.is_full or bsr.block != (1, _tile(k)) or bsr.values.dtype not in (jnp.int8, jnp.uint8)
            or pallas_kernels.quantized_matmul.shape_error(m, k, n, bsr.storage_dtype, _tile(k))):  # fmt: skip
        return otherwise(bsr, dy)
    kb = k // _tile(k)

    def kernel(bsr, dy, t_matmul=pallas_kernels.quantized_t_matmul, products=DW_PRODUCTS):
        codes = bsr.values.reshape(kb, m, -1)
        x_dtype = jnp.dtype(bsr.dense_dtype or dy.dtype)
        return t_matmul(codes, bsr.scales.reshape(kb, m), dy.astype(products.get((bsr.storage_dtype, x_dtype), x_dtype)))

    def tpu_kernel(bsr, dy):
        if _tpu_error(m, k, n, bsr.storage_dtype, bsr.dense_dtype or dy.dtype):  # int4's uint8 codes among its refusals
            return otherwise(bsr, dy)
        return kernel(bsr, dy, quantized_matmul_tpu.quantized_t_matmul, products={})

    return platforms.by_lowering_platform(kernel, {"tpu": tpu_kernel}, bsr, dy)
