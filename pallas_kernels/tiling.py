"""Tile configurations, input checks and the pieces shared by the block-sparse kernels.

Triton (the Pallas GPU backend) needs every tensor a kernel touches to have a power-of-two number
of elements, and its ``dot`` needs each of the three matmul dims to be at least 16. Blocks of 16
and more therefore multiply on tensor cores with ``dot``; blocks of 4 and 8 (on either side) use a
broadcast-multiply-sum over the block instead (CUDA cores, f32), which Triton lowers for any
power-of-two shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

# The smallest matmul dim Triton's tensor-core ``dot`` lowers; smaller blocks take the CUDA-core path.
MIN_DOT_DIM = 16
SUPPORTED_BLOCK_SIDES = (4, 8, 16, 32, 64, 128)
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


def _is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TileConfig:
    """Launch parameters of a block-sparse kernel.

    Attributes:
      bn: columns of the dense operand (and of the output) one program computes; a power of two
        >= 16. Clamped to the next power of two of N, so small N wastes no work.
      num_warps: warps (32 threads each) per program.
      num_stages: software-pipelining depth of the kept-block loop (Triton ``num_stages``).
    """

    bn: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if not _is_power_of_two(self.bn) or self.bn < MIN_DOT_DIM:
            raise ValueError(f"bn must be a power of two >= {MIN_DOT_DIM}, got {self.bn}")
        if not _is_power_of_two(self.num_warps) or not 1 <= self.num_warps <= 32:
            raise ValueError(f"num_warps must be a power of two in [1, 32], got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in [1, 8], got {self.num_stages}")


# Keyed by (larger block side, dtype name). The output tile of one program is (block side, bn):
# a 16-row tile needs a wide bn to give each warp enough work; 64-row blocks already load
# 64 x 64 operands per step, so bn stays at 64 to keep the f32 accumulator in registers. Small
# blocks run on CUDA cores, where the (bm, bk, bn) product tensor bounds bn. These are first
# guesses from Triton's matmul heuristics, not GPU-tuned: no GPU timings exist yet.
TILE_CONFIGS: dict[tuple[int, str], TileConfig] = {
    (4, "float32"): TileConfig(bn=64, num_warps=2, num_stages=2),
    (4, "bfloat16"): TileConfig(bn=64, num_warps=2, num_stages=2),
    (8, "float32"): TileConfig(bn=64, num_warps=4, num_stages=2),
    (8, "bfloat16"): TileConfig(bn=64, num_warps=4, num_stages=2),
    (16, "float32"): TileConfig(bn=128, num_warps=4, num_stages=3),
    (16, "bfloat16"): TileConfig(bn=128, num_warps=4, num_stages=3),
    (32, "float32"): TileConfig(bn=64, num_warps=4, num_stages=3),
    (32, "bfloat16"): TileConfig(bn=128, num_warps=4, num_stages=3),
    (64, "float32"): TileConfig(bn=64, num_warps=4, num_stages=2),
    (64, "bfloat16"): TileConfig(bn=64, num_warps=8, num_stages=3),
    (128, "float32"): TileConfig(bn=32, num_warps=8, num_stages=2),
    (128, "bfloat16"): TileConfig(bn=64, num_warps=8, num_stages=2),
}


def tile_config_for(block: tuple[int, int], dtype) -> TileConfig:
    """The table entry for ``(max(block), dtype)``; float16 uses bfloat16's entries."""
    name = jnp.dtype(dtype).name
    name = "bfloat16" if name == "float16" else name
    return TILE_CONFIGS[max(block), name]


def check_values(values: jax.Array, dense: jax.Array, dense_name: str) -> tuple[int, int]:
    """Validate ``values (cap, bm, bk)`` and its dense partner; return the block ``(bm, bk)``."""
    if values.ndim != 3:
        raise ValueError(f"values must be (capacity, bm, bk), got shape {values.shape}")
    block = values.shape[1:]
    for side in block:
        if side not in SUPPORTED_BLOCK_SIDES:
            raise ValueError(
                f"block sides must be powers of two in {SUPPORTED_BLOCK_SIDES} (Triton tiles are powers of two), "
                f"got block {block}; zero-pad other sides up to the next supported one"
            )
    if values.dtype.name not in SUPPORTED_DTYPES or dense.dtype != values.dtype:
        raise ValueError(
            f"values and {dense_name} must share a dtype in {SUPPORTED_DTYPES}, got {values.dtype} and {dense.dtype}"
        )
    if dense.ndim != 2:
        raise ValueError(f"{dense_name} must be 2-D, got shape {dense.shape}")
    return block


def check_index(name: str, a: jax.Array, length: int) -> jax.Array:
    """``a`` as int32, checked to be 1-D of ``length`` integers."""
    if a.ndim != 1 or a.shape[0] != length or not jnp.issubdtype(a.dtype, jnp.integer):
        raise ValueError(f"{name} must be a 1-D integer array of length {length}, got {a.dtype}{list(a.shape)}")
    return a.astype(jnp.int32)


def column_tile(n: int, config: TileConfig) -> int:
    """Columns per program: ``config.bn`` clamped to the next power of two >= max(n, 16)."""
    return min(config.bn, max(MIN_DOT_DIM, 1 << (n - 1).bit_length()))


def pad_columns(a: jax.Array, bn: int) -> jax.Array:
    """Zero-pad the columns of ``a`` to a multiple of ``bn`` (no copy when already a multiple)."""
    extra = -a.shape[1] % bn
    return a if extra == 0 else jnp.pad(a, ((0, 0), (0, extra)))


def block_product(lhs: jax.Array, rhs: jax.Array, lhs_contract: int, precision: lax.PrecisionLike) -> jax.Array:
    """``f32`` product of a ``(bm, bk)`` block (contracted on axis ``lhs_contract``) with ``rhs``.

    Tensor-core ``dot`` when every matmul dim is >= 16; otherwise the broadcast-multiply-sum that
    Triton lowers for small power-of-two tiles (products of bf16 values are exact in f32).
    """
    if min(*lhs.shape, rhs.shape[1]) >= MIN_DOT_DIM:
        dims = (((lhs_contract,), (0,)), ((), ()))
        return lax.dot_general(lhs, rhs, dims, precision=precision, preferred_element_type=jnp.float32)
    lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    if lhs_contract == 0:  # (c, m) x (c, n) -> (m, n)
        return jnp.sum(lhs[:, :, None] * rhs[:, None, :], axis=0)
    return jnp.sum(lhs[:, :, None] * rhs[None, :, :], axis=1)  # (m, c) x (c, n)


def result_like(operand: jax.Array, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    """A kernel result's type: inside ``shard_map`` it varies over the mesh axes ``operand`` does."""
    kind = jax.typeof(operand)
    return kind.update(shape=shape, dtype=dtype) if kind.manual_axis_type.varying else jax.ShapeDtypeStruct(shape, dtype)


def run_by_lowering_platform(call: Callable[..., jax.Array], *args: jax.Array, interpret: bool) -> jax.Array:
    """``call(*args, interpret=...)`` compiled by Triton when lowered for a GPU, interpreted elsewhere.

    The choice is made per lowering platform (``lax.platform_dependent``), not by
    ``jax.default_backend()``, so one jitted function runs interpreted on CPU and lowers to the
    Triton custom call when lowered for ``cuda`` or ``rocm``. ``interpret=True`` forces the
    interpreter everywhere (debugging on a GPU).
    """
    interpreted = lambda *a: call(*a, interpret=True)
    if interpret:
        return interpreted(*args)
    compiled = lambda *a: call(*a, interpret=False)
    return lax.platform_dependent(*args, cuda=compiled, rocm=compiled, default=interpreted)
