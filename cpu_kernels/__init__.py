"""Block-sparse ``x.T @ dy`` on the CPU: a C++ kernel called from jitted code as an XLA FFI custom call.

XLA:CPU can only express "multiply the kept blocks" by gathering one ``(bm, N)`` slab of ``dy`` per
kept block into a new array, and that copy costs as much as the dense matmul it saves (see
docs/kernels.md). ``bsr_t_matmul.cc`` reads ``dy`` in place: tiles of the result's columns are
shared between XLA's intra-op threads, kept blocks are visited in block-row order so each slab of
``dy`` is loaded once per tile, and a 4 x 64 accumulator stays in vector registers per block.

The library is built by ``pip install`` (``setup.py``, a C++17 compiler and jaxlib's FFI headers)
with one build per x86-64 level (AVX-512, AVX2, baseline) chosen when it loads. Like the Pallas
kernels it takes plain arrays; its reference is ``pallas_kernels.bsr_t_matmul_reference``.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util

import jax
import jax.numpy as jnp

TARGET = "bsr_jax_cpu_bsr_t_matmul_f32"


@functools.cache
def _register() -> None:
    spec = importlib.util.find_spec("cpu_kernels._bsr_t_matmul")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "cpu_kernels: the compiled kernel is missing; build it with `pip install -e .` from the "
            "repository (needs a C++17 compiler), or pick backend='xla'"
        )
    library = ctypes.cdll.LoadLibrary(spec.origin)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.BsrTMatmulF32), platform="cpu")


def bsr_t_matmul(values: jax.Array, row_ids: jax.Array, col_ptr: jax.Array, dy: jax.Array) -> jax.Array:
    """``x.T @ dy`` where ``x`` is given by its kept blocks, grouped by block-column (CPU only).

    Args:
      values: ``(cap, bm, bk)`` kept blocks of ``x (Mb * bm, Kb * bk)``, any float dtype (computed
        in float32: other dtypes are converted first, at the cost of one copy).
      row_ids: ``(cap,)`` integer block-row of each block, in ``[0, Mb)``; an id outside that range
        fails the call with an error naming the slot.
      col_ptr: ``(Kb + 1,)`` integer, non-decreasing from 0; block-column ``j`` owns slots
        ``col_ptr[j]:col_ptr[j + 1]`` and slots from ``col_ptr[-1]`` on are unused (the layout of
        ``pallas_kernels.layout``).
      dy: ``(Mb * bm, N)`` float operand (the caller pads M to whole blocks).

    Returns:
      ``(Kb * bk, N)`` float32. Each element is a float32 sum over the kept blocks in block-row
      order, so it matches a dense float32 matmul of the densified ``x`` to rounding.
    """
    if values.ndim != 3 or dy.ndim != 2 or row_ids.shape != values.shape[:1] or col_ptr.ndim != 1:
        raise ValueError(
            "want values (cap, bm, bk), row_ids (cap,), col_ptr (Kb + 1,) and dy (Mb * bm, N); got "
            f"values {values.shape}, row_ids {row_ids.shape}, col_ptr {col_ptr.shape}, dy {dy.shape}"
        )
    _, bm, bk = values.shape
    if dy.shape[0] % bm:
        raise ValueError(f"dy must have a whole number of {bm}-row blocks, got {dy.shape[0]} rows")
    _register()
    operands = _varying_alike(
        values.astype(jnp.float32), row_ids.astype(jnp.int32), col_ptr.astype(jnp.int32), dy.astype(jnp.float32)
    )
    shape = ((col_ptr.shape[0] - 1) * bk, dy.shape[1])
    dy_type = jax.typeof(operands[-1])
    # Inside shard_map the result varies like dy and lives on its manual mesh: derive it from dy's type.
    out = dy_type.update(shape=shape) if dy_type.manual_axis_type.varying else jax.ShapeDtypeStruct(shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(*operands)


def _varying_alike(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Inside ``jax.shard_map`` an FFI call needs every operand to vary over the same mesh axes (and
    its result declared so); ``pcast`` the operands that vary over fewer up to the union."""
    varying = [jax.typeof(a).manual_axis_type.varying for a in arrays]
    axes = frozenset().union(*varying)
    return tuple(
        jax.lax.pcast(a, tuple(sorted(axes - v)), to="varying") if axes - v else a for a, v in zip(arrays, varying)
    )
