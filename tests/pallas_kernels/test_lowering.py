"""Both kernels lower to the Triton custom call for CUDA on this CPU, for every tile table entry.

Lowering runs Pallas -> Triton IR (power-of-two shapes, supported ops); PTX compilation by Triton
happens only on a GPU and is not covered here.
"""

import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import pytest
from jax import lax

from pallas_kernels import (
    TILE_CONFIGS,
    TileConfig,
    bsr_matmul,
    bsr_t_matmul,
    tile_config_for,
)

TRITON_CALL = "xla.gpu.triton"
NUM_BLOCKS, CAPACITY = 3, 4  # the block grid is NUM_BLOCKS x NUM_BLOCKS with CAPACITY kept blocks


def _launch_params(kernel, block, dtype, n, **kwargs) -> dict[str, int]:
    """Lower ``kernel`` for CUDA and return the Triton call's grid and launch parameters."""
    (bm, bk), dense_rows = block, NUM_BLOCKS * (block[0] if kernel is bsr_t_matmul else block[1])
    args = (
        jax.ShapeDtypeStruct((CAPACITY, bm, bk), dtype),
        jax.ShapeDtypeStruct((CAPACITY,), jnp.int32),
        jax.ShapeDtypeStruct((NUM_BLOCKS + 1,), jnp.int32),
        jax.ShapeDtypeStruct((dense_rows, n), dtype),
    )
    text = jax.jit(functools.partial(kernel, **kwargs)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert TRITON_CALL in text
    keys = ("grid_x", "grid_y", "num_stages", "num_warps")
    return {k: int(re.search(rf"{k} = (\d+) : i32", text).group(1)) for k in keys}


@pytest.mark.parametrize("kernel", [bsr_t_matmul, bsr_matmul], ids=lambda k: k.__name__)
@pytest.mark.parametrize("side,dtype", sorted(TILE_CONFIGS))
def test_every_tile_config_lowers_for_cuda(kernel, side, dtype):
    config = TILE_CONFIGS[side, dtype]
    params = _launch_params(kernel, (side, side), jnp.dtype(dtype), 2 * config.bn)
    assert params == {"grid_x": NUM_BLOCKS, "grid_y": 2, "num_stages": config.num_stages, "num_warps": config.num_warps}


@pytest.mark.parametrize("kernel", [bsr_t_matmul, bsr_matmul], ids=lambda k: k.__name__)
@pytest.mark.parametrize("block", [(16, 64), (64, 16), (4, 16), (32, 8)])
def test_non_square_blocks_lower_for_cuda(kernel, block):
    params = _launch_params(kernel, block, jnp.bfloat16, 40)
    assert params["num_warps"] == tile_config_for(block, jnp.bfloat16).num_warps


def test_float16_full_precision_and_overridden_config_lower_for_cuda():
    config = TileConfig(bn=32, num_warps=2, num_stages=4)
    params = _launch_params(bsr_t_matmul, (16, 16), jnp.float16, 100, config=config)
    assert params == {"grid_x": NUM_BLOCKS, "grid_y": 4, "num_stages": 4, "num_warps": 2}
    _launch_params(bsr_t_matmul, (32, 32), jnp.float32, 64, precision=lax.Precision.HIGHEST)


def test_cpu_lowering_has_no_triton_call():
    args = (jnp.zeros((1, 16, 16)), jnp.zeros((1,), jnp.int32), jnp.array([0, 1], jnp.int32), jnp.zeros((16, 16)))
    text = jax.jit(bsr_t_matmul).trace(*args).lower(lowering_platforms=("cpu",)).as_text()
    assert TRITON_CALL not in text and "while" in text  # the interpreter's grid loop


def _dot_precisions(jaxpr) -> list:
    """The precision of every dot_general in ``jaxpr`` and the jaxprs nested in it (kernel bodies)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _dot_precisions(sub)
    return found


@pytest.mark.parametrize("kernel", [bsr_t_matmul, bsr_matmul], ids=lambda k: k.__name__)
def test_float32_blocks_multiply_at_full_precision_by_default(kernel):
    """Triton lowers a DEFAULT-precision float32 dot to TF32 (10-bit mantissas), which the float32
    tolerances of these tests would not meet on a GPU; the kernels ask for HIGHEST (IEEE) instead."""
    args = (jnp.zeros((1, 16, 16)), jnp.zeros((1,), jnp.int32), jnp.array([0, 1], jnp.int32), jnp.zeros((16, 16)))
    precisions = _dot_precisions(jax.make_jaxpr(kernel)(*args).jaxpr)
    assert precisions and all(p == (lax.Precision.HIGHEST, lax.Precision.HIGHEST) for p in precisions), precisions
    tf32 = _dot_precisions(jax.make_jaxpr(functools.partial(kernel, precision=lax.Precision.DEFAULT))(*args).jaxpr)
    assert tf32 and all(p != (lax.Precision.HIGHEST, lax.Precision.HIGHEST) for p in tf32), tf32
