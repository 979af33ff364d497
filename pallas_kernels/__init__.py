"""Block-sparse and quantized-input matmul kernels in Pallas (GPU via Triton; the int8 quantized pair
also for TPU via Mosaic, ``quantized_matmul_tpu``), each beside a pure jax.numpy reference.

Kernels take plain arrays: kept blocks ``values (cap, bm, bk)`` plus int32 index arrays (see
``pallas_kernels.layout``). On CUDA/ROCm they compile with Triton; elsewhere they run in the
Pallas interpreter (slow; for tests).
"""

from pallas_kernels import block_loop, quantized_matmul, quantized_matmul_tpu
from pallas_kernels.bsr_matmul import bsr_matmul, bsr_matmul_reference
from pallas_kernels.bsr_t_matmul import bsr_t_matmul, bsr_t_matmul_reference
from pallas_kernels.quantized_matmul import (
    matmul_quantizing,
    quantize_reference,
    quantized_t_matmul,
    quantized_t_matmul_reference,
)
from pallas_kernels.layout import column_to_row_major, ids_from_ptr, ptr_from_ids
from pallas_kernels.tiling import TILE_CONFIGS, TileConfig, tile_config_for

# FLOPs of each kernel by its name, from the shapes of its operands and result, and the operand whose dtype
# sets the matrix units' rate (None: a cost model's default rate): for cost models that see only
# the compiled custom call (XLA:GPU's Triton calls carry no pl.CostEstimate).
KERNEL_FLOPS = {
    "bsr_matmul": (block_loop.operand_flops, None),
    "bsr_t_matmul": (block_loop.operand_flops, None),
    "matmul_quantizing": (quantized_matmul.matmul_flops, 0),  # (x, w): x's dtype
    "quantized_t_matmul": (quantized_matmul.t_matmul_flops, 2),  # (codes, scales, dy): dequantized to dy's dtype
}

# The share of the matrix units' peak one program of a kernel reaches on its SM, by the dtype that
# sets the rate (KERNEL_FLOPS' operand): what a cost model divides its roofline by, beside the grid's
# waves. Measured (docs/RESULTS.md 13.1: whole steps on an H200, jax 0.11.2, every dW residual through
# the pair; one figure for both kernels, fitted to the 12 x 768 LM in bf16 and to ViT-B/16 (0.25) and
# ResMLP-S12 (0.21) in f32; f16, never run, taken as bf16). Kernels not listed were never timed on a GPU:
# 1 (their roofline, optimistic).
_QUANTIZED_EFFICIENCY = {"bf16": 0.43, "f16": 0.43, "f32": 0.23}
KERNEL_EFFICIENCY = {"matmul_quantizing": _QUANTIZED_EFFICIENCY, "quantized_t_matmul": _QUANTIZED_EFFICIENCY}

__all__ = [
    "KERNEL_EFFICIENCY",
    "KERNEL_FLOPS",
    "TILE_CONFIGS",
    "TileConfig",
    "bsr_matmul",
    "bsr_matmul_reference",
    "bsr_t_matmul",
    "bsr_t_matmul_reference",
    "column_to_row_major",
    "matmul_quantizing",
    "quantize_reference",
    "quantized_t_matmul",
    "quantized_t_matmul_reference",
    "ids_from_ptr",
    "ptr_from_ids",
    "tile_config_for",
]
