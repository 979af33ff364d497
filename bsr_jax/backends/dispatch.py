"""Backends for the weight gradient ``dW = x.T @ dy`` from a ``BlockSparse`` x.

Every backend is a function ``(bsr, dy) -> dW`` where ``dy`` is ``(Mb * bm, N)`` (zero-padded to
whole block-rows) and ``dW`` is ``(Kb * bk, N)`` float32; the caller slices off padding and casts.

Names: ``"reference"`` (densify then one matmul; for tests), ``"xla"`` (pure jax.numpy; default on
TPU), ``"cpu"`` (the C++ kernel of ``cpu_kernels``; CPU only, the default there) and ``"pallas"``
(Pallas kernels; default on GPU), ``"fused"`` (opt in: int8 / int4 codes written by the forward
GEMM and read by the dW GEMM, ``bsr_jax.backends.fused``; the platform's default elsewhere). ``backend=None`` resolves to the environment variable
``BSR_JAX_BACKEND`` if set, else to ``"auto"``: the backend of the platform the function is lowered
for (``PLATFORM_DEFAULTS``; ``"xla"`` on TPU), not of the host, so compiling ahead of time for a
GPU or TPU from a CPU machine takes the accelerator's kernels. All agree to float32 rounding.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

import cpu_kernels
from bsr_jax.core import platforms
from bsr_jax.core import sharding
from bsr_jax.storage.format import BlockSparse
from bsr_jax.storage.quantize import whole_rows
from bsr_jax.backends.fused import fused_dw
from bsr_jax.backends.pallas import pallas_dw
from bsr_jax.backends.xla import xla_dw

DwBackend = Callable[[BlockSparse, jax.Array], jax.Array]
ENV_VAR = "BSR_JAX_BACKEND"
# backend=None: decided when lowering, per target platform, so one jitted function compiles for any
# target from any host (e.g. ahead of time for a TPU on a CPU machine). Platforms not named: "xla".
PLATFORM_DEFAULTS = {"cpu": "cpu", "cuda": "pallas", "rocm": "pallas"}
AUTO = "auto"
# Blocks with few rows give the kernel's register tile few multiply-adds per load and store of dW:
# at 4 rows it ran at 1.6-2.3x of dense where the xla backend's densify-and-matmul ran at 1.3-1.4x
# (benchmarks/kernels.py, docs/kernels.md).
CPU_KERNEL_MIN_ROWS = 8


def reference_dw(bsr: BlockSparse, dy: jax.Array) -> jax.Array:
    """Densify the kept blocks (zeros elsewhere) and run one f32-accumulating matmul."""
    dense = bsr.to_dense(padded=True)
    return jnp.matmul(dense.T, dy, preferred_element_type=jnp.float32)


def cpu_dw(bsr: BlockSparse, dy: jax.Array) -> jax.Array:
    """``cpu_kernels.bsr_t_matmul`` on the kept blocks as stored: f32 or bf16 values, or int8 / int4
    with their per-block scales, decoded inside the kernel (no f32 copy of x), every-block-kept
    ones included (their indices are synthesised). The xla backend's path runs instead where it is
    the faster one: blocks of fewer than ``CPU_KERNEL_MIN_ROWS`` rows, and CPUs whose widest kernel
    path is the portable one (unless ``$BSR_JAX_CPU_ISA`` forces a path)."""
    if bsr.block[0] < CPU_KERNEL_MIN_ROWS or not cpu_kernels.kernel_by_default():
        return BACKENDS["xla"](bsr, dy)
    if bsr.storage_dtype == "float8_e4m3fn":  # no float8 decoder in the kernel
        bsr = bsr.dequantized()
    (mb, kb), packed = bsr.grid, bsr.storage_dtype == "int4"
    col_ptr = jnp.arange(kb + 1, dtype=jnp.int32) * mb if bsr.is_full else bsr.col_ptr
    return cpu_kernels.bsr_t_matmul(
        bsr.values, bsr.row_ids, col_ptr, dy, scales=bsr.scales, block=bsr.block if packed else None
    )


def full_dw(bsr: BlockSparse, dy: jax.Array) -> jax.Array:
    """dW from every block, kept: densify and multiply once. x kept in token rows (one scale per
    row, ``block="row"``) and dy no wider than x: ``codes.T @ (scales * dy)``, the same sum with
    the scales on dy's rows, so the GEMM reads the stored codes (XLA:GPU fuses their conversion
    into it) and the one extra pass is over the narrower of x and dy."""
    if bsr.scales is None or not whole_rows(bsr.block, bsr.shape[1]) or dy.shape[1] > bsr.shape[1]:
        return reference_dw(bsr, dy)
    codes = bsr.values.reshape(bsr.padded_shape).astype(dy.dtype)
    scaled = (dy.astype(jnp.float32) * bsr.scales[:, None]).astype(dy.dtype)
    return jnp.matmul(codes.T, scaled, preferred_element_type=jnp.float32)


def _dense_when_full(sparse_dw: DwBackend) -> DwBackend:
    # Every block kept (sparsity 0 with a storage dtype): a sparse kernel has nothing to skip, and
    # no indices are stored.
    return lambda bsr, dy: full_dw(bsr, dy) if bsr.is_full else sparse_dw(bsr, dy)


BACKENDS: dict[str, DwBackend] = {
    "reference": reference_dw,
    "xla": _dense_when_full(xla_dw),
    "cpu": cpu_dw,
    "pallas": _dense_when_full(pallas_dw),
}


def platform_dw(bsr: BlockSparse, dy: jax.Array) -> jax.Array:
    """``PLATFORM_DEFAULTS``' backend of the platform being lowered for (``"xla"`` elsewhere), inside
    ``jax.shard_map`` too (``bsr_jax.core.platforms``)."""
    branches = {platform: BACKENDS[name] for platform, name in PLATFORM_DEFAULTS.items()}
    return platforms.by_lowering_platform(BACKENDS["xla"], branches, bsr, dy)


BACKENDS[AUTO] = platform_dw
# The weight-gradient half of the fused backend; its forward half is in bsr_jax.ops.linear.
BACKENDS["fused"] = lambda bsr, dy: fused_dw(bsr, dy, platform_dw)


def resolve_backend(name: str | None, layer: str | None = None) -> str:
    """The backend name to use: the argument, else the layer's (``Pruning.backend``), else
    ``$BSR_JAX_BACKEND``, else ``"auto"`` (by the platform lowered for). An argument and a layer's
    backend that disagree are an error."""
    if name is not None and layer is not None and name != layer:
        raise ValueError(f"backend={name!r} and the layer's Pruning(backend={layer!r}) disagree: give one of them")
    name = name if name is not None else layer
    if name is None:
        name = os.environ.get(ENV_VAR) or AUTO
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)} or None, got {name!r}")
    return name


def dw_from_blocks(bsr: BlockSparse, dy: jax.Array, backend: str) -> jax.Array:
    # Under a mesh, per shard of dy's columns where XLA partitions them (bsr_jax.core.sharding).
    return sharding.per_column_shard(BACKENDS[backend], bsr, dy)
