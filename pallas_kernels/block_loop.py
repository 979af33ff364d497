"""The one Pallas kernel behind ``bsr_matmul`` and ``bsr_t_matmul``.

Both multiply kept ``(bm, bk)`` blocks of ``x``, grouped along one block axis, with a dense
operand, one program per output tile ``(rows, bn)``: program ``(i, n)`` loops over the slots
``ptr[i]:ptr[i + 1]`` of its group, loads the slab of the dense operand each block meets (rows
``ids[p] * slab`` onwards, columns of tile ``n``) and accumulates in f32. ``x.T @ dy`` contracts
the blocks' row axis (groups are block-columns, slabs ``bm`` rows of dy); ``x @ w`` contracts their
column axis (groups are block-rows, slabs ``bk`` rows of w). One writer per tile: no atomics.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tiling import (
    TileConfig,
    block_product,
    check_index,
    check_values,
    column_tile,
    pad_columns,
    result_like,
    run_by_lowering_platform,
    tile_config_for,
)


def _kernel(ptr_ref, ids_ref, values_ref, dense_ref, out_ref, *, contract, precision):
    slab = values_ref.shape[1 + contract]  # dense rows each block meets
    group = pl.program_id(0)

    def accumulate(p, acc):
        first_row = pl.multiple_of(ids_ref[p] * slab, slab)
        rows = dense_ref[pl.ds(first_row, slab), :]  # (slab, bn) of this program's column tile
        return acc + block_product(values_ref[p], rows, contract, precision)

    acc = jnp.zeros(out_ref.shape, jnp.float32)
    acc = lax.fori_loop(ptr_ref[group], ptr_ref[group + 1], accumulate, acc)
    out_ref[...] = acc.astype(out_ref.dtype)


def _cost(values, dense, out, bn, contract) -> pl.CostEstimate:
    """What the kernel does, so cost models do not take it for free: every kept block meets every
    column of the dense operand (``2 * bm * bk * N`` FLOPs each); each program re-reads its
    group's blocks and, per block, a ``(slab, bn)`` tile of the dense operand (no reuse across
    programs assumed)."""
    capacity, cols, slab = values.shape[0], dense.shape[1], values.shape[1 + contract]
    column_tiles = cols // bn
    nbytes = (values.size * values.dtype.itemsize * column_tiles
              + capacity * slab * cols * dense.dtype.itemsize
              + math.prod(out.shape) * jnp.dtype(out.dtype).itemsize)  # fmt: skip
    return pl.CostEstimate(flops=flops(values.shape, dense.shape), transcendentals=0, bytes_accessed=int(nbytes))


def flops(values_shape: tuple[int, ...], dense_shape: tuple[int, ...]) -> int:
    """FLOPs of either kernel: each ``(bm, bk)`` kept block multiplies every column of the dense
    operand. XLA:GPU's Triton custom call carries no cost estimate, so ``bsr_jax.measure.roofline`` counts
    the kernel's FLOPs from its operand shapes with this."""
    return 2 * math.prod(values_shape) * dense_shape[1]


def operand_flops(operands: list[tuple[int, ...]], result: tuple[int, ...]) -> int:
    """``flops`` from the compiled call's operands ``(ptr, ids, values, dense)``."""
    return flops(operands[2], operands[3])


def _launch(ptr, ids, values, dense, *, contract, bn, config, precision, out_dtype, interpret, name):
    out_rows = values.shape[2 - contract]  # bk for x.T @ dy, bm for x @ w
    groups, (rows, cols) = ptr.shape[0] - 1, dense.shape
    whole = pl.no_block_spec  # index arrays and blocks are read at data-dependent slots
    out_shape = result_like(dense, (groups * out_rows, cols), out_dtype)
    return pl.pallas_call(
        functools.partial(_kernel, contract=contract, precision=precision),
        out_shape=out_shape,
        grid=(groups, cols // bn),
        in_specs=[whole, whole, whole, pl.BlockSpec((rows, bn), lambda i, n: (0, n))],
        out_specs=pl.BlockSpec((out_rows, bn), lambda i, n: (i, n)),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        cost_estimate=_cost(values, dense, out_shape, bn, contract),
        interpret=interpret,
        name=name,
    )(ptr, ids, values, dense)


def grouped_block_matmul(
    values: jax.Array,
    ids: jax.Array,
    ptr: jax.Array,
    dense: jax.Array,
    *,
    contract: int,
    names: tuple[str, str, str],
    config: TileConfig | None,
    precision: lax.PrecisionLike,
    out_dtype,
    interpret: bool,
    kernel_name: str,
) -> jax.Array:
    """Validate, then run the kernel. ``contract`` is the block axis summed over (0: ``x.T @ dy``,
    1: ``x @ w``); ``names`` are the caller's names of ``ids``, ``ptr`` and ``dense`` for errors."""
    ids_name, ptr_name, dense_name = names
    block = check_values(values, dense, dense_name)
    slab, out_rows = block[contract], block[1 - contract]
    slab_name, padded_dim, groups_name = ("bm", "M", "Kb") if contract == 0 else ("bk", "K", "Mb")
    if ptr.ndim != 1 or ptr.shape[0] < 1:
        raise ValueError(f"{ptr_name} must be 1-D of length {groups_name} + 1 >= 1, got shape {ptr.shape}")
    capacity, groups, (rows, cols) = values.shape[0], ptr.shape[0] - 1, dense.shape
    ids = check_index(ids_name, ids, capacity)
    ptr = check_index(ptr_name, ptr, groups + 1)
    if rows % slab:
        raise ValueError(
            f"{dense_name} must have a multiple of {slab_name}={slab} rows (pad {padded_dim} to whole blocks), got {rows}"
        )
    if capacity == 0 or groups == 0 or cols == 0 or rows == 0:
        return jnp.zeros((groups * out_rows, cols), out_dtype)
    config = config or tile_config_for(block, values.dtype)
    bn = column_tile(cols, config)
    call = functools.partial(
        _launch, contract=contract, bn=bn, config=config, precision=precision,
        out_dtype=jnp.dtype(out_dtype), name=kernel_name,
    )  # fmt: skip
    out = run_by_lowering_platform(call, ptr, ids, values, pad_columns(dense, bn), interpret=interpret)
    return out[:, :cols]
