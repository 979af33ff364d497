"""Block-sparse ``x.T @ dy`` on the CPU: a C++ kernel called from jitted code as an XLA FFI custom call.

XLA:CPU can only express "multiply the kept blocks" by gathering one ``(bm, N)`` slab of ``dy`` per
kept block into a new array, and that copy costs as much as the dense matmul it saves (see
docs/kernels.md). ``bsr_t_matmul.cc`` reads ``dy`` in place: tiles of the result's columns are
shared between XLA's intra-op threads, kept blocks are visited in block-row order so each slab of
``dy`` is loaded once per tile, and a grid of accumulators sized to the vector registers stays in
registers per block (``tile_kernel.h``). Kept blocks stored as bf16, int8 or packed int4 (with
per-block scales) are decoded inside the kernel, a block at a time.

``quantize_blocks`` (``quantize_blocks.cc``) is the other direction, for storage with every block
kept: x's blocks quantized to int8 or packed int4 with per-block scales in one pass over x, where
XLA:CPU fuses x's producer into a reduction and a packing loop and recomputes it in each.

The library is built by ``pip install`` (``setup.py``, a C++17 compiler and jaxlib's FFI headers)
without ``-march``: the AVX-512, AVX2 and portable paths are compiled side by side and each call
picks one (``resolve_isa``: ``BSR_JAX_CPU_ISA`` if set, else the widest this CPU supports). Like the
Pallas kernels it takes plain arrays; its reference is ``pallas_kernels.bsr_t_matmul_reference``
of the dequantized blocks.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os

import jax
import jax.numpy as jnp

TARGET = "bsr_jax_cpu_bsr_t_matmul"
QUANTIZE_TARGET = "bsr_jax_cpu_quantize_blocks"
ISA_ENV = "BSR_JAX_CPU_ISA"
ISAS = ("portable", "avx2", "avx512")  # the kernel's `isa` attribute is the index


@functools.cache
def _library() -> ctypes.CDLL:
    spec = importlib.util.find_spec("cpu_kernels._bsr_t_matmul")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "cpu_kernels: the compiled kernel is missing; build it with `pip install -e .` from the "
            "repository (needs a C++17 compiler), or pick backend='xla'"
        )
    library = ctypes.cdll.LoadLibrary(spec.origin)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.BsrTMatmul), platform="cpu")
    jax.ffi.register_ffi_target(QUANTIZE_TARGET, jax.ffi.pycapsule(library.QuantizeBlocks), platform="cpu")
    return library


@functools.cache
def supported_isas() -> tuple[str, ...]:
    """The kernel paths this CPU (and OS) can run, narrowest first; ``"portable"`` always."""
    mask = _library().BsrJaxCpuIsaMask()
    return tuple(name for i, name in enumerate(ISAS) if mask & (1 << i))


def resolve_isa(isa: str | None = None) -> str:
    """The path a call runs: ``isa`` if given, else ``$BSR_JAX_CPU_ISA`` if set, else the widest
    supported. A forced path the CPU lacks is an error (it would die on an illegal instruction)."""
    source = "isa"
    if isa is None and os.environ.get(ISA_ENV):
        isa, source = os.environ[ISA_ENV], ISA_ENV
    if isa is None:
        return supported_isas()[-1]
    if isa not in ISAS:
        raise ValueError(f"{source} must be one of {ISAS}, got {isa!r}")
    if isa not in supported_isas():
        raise ValueError(f"{source}={isa!r}: this CPU supports only {supported_isas()}")
    return isa


def kernel_by_default() -> bool:
    """Whether the ``cpu`` backend should call the kernel rather than the ``xla`` backend's path:
    when the CPU has a vector path (AVX2 or AVX-512: 0.2-0.4x of dense at sparsity 0.7, block 16,
    where the xla path takes 0.9-1.4x), or ``$BSR_JAX_CPU_ISA`` forces one. The portable path,
    forced on an AVX-512 CPU, took 2.3-4x of dense with every block kept (0.7-0.9x at sparsity
    0.7); it has not been timed on a CPU limited to it, so the xla path runs there."""
    return bool(os.environ.get(ISA_ENV)) or supported_isas()[-1] != "portable"


def bsr_t_matmul(
    values: jax.Array,
    row_ids: jax.Array,
    col_ptr: jax.Array,
    dy: jax.Array,
    *,
    scales: jax.Array | None = None,
    block: tuple[int, int] | None = None,
    isa: str | None = None,
) -> jax.Array:
    """``x.T @ dy`` where ``x`` is given by its kept blocks, grouped by block-column (CPU only).

    Args:
      values: the kept blocks of ``x (Mb * bm, Kb * bk)``: ``(cap, bm, bk)`` float32 or bfloat16
        (read as stored; other float dtypes are converted to float32 first, at the cost of one
        copy), ``(cap, bm, bk)`` int8 with ``scales``, or int4 packed two per byte as
        ``(cap, ceil(bm * bk / 2))`` uint8 (low nibble first, ``bsr_jax.storage.quantize``) with ``scales``
        and ``block``.
      row_ids: ``(cap,)`` integer block-row of each block, in ``[0, Mb)``; an id outside that range
        fails the call with an error naming the slot.
      col_ptr: ``(Kb + 1,)`` integer, non-decreasing from 0; block-column ``j`` owns slots
        ``col_ptr[j]:col_ptr[j + 1]`` and slots from ``col_ptr[-1]`` on are unused (the layout of
        ``pallas_kernels.layout``).
      dy: ``(Mb * bm, N)`` float operand (the caller pads M to whole blocks).
      scales: ``(cap,)`` float32 per-block scales of int8 / int4 values: block ``b`` is
        ``values[b] * scales[b]``.
      block: ``(bm, bk)``, needed only for packed int4 values.
      isa: kernel path, one of ``ISAS`` (default ``resolve_isa()``).

    Returns:
      ``(Kb * bk, N)`` float32. Each element is a float32 sum over the kept blocks in block-row
      order, so it matches a dense float32 matmul of the densified (dequantized) ``x`` to rounding.
    """
    packed = values.dtype == jnp.uint8
    quantized = packed or values.dtype == jnp.int8
    if packed:
        if values.ndim != 2 or block is None or values.shape[1] != -(-block[0] * block[1] // 2):
            raise ValueError(
                f"packed int4 values must be (cap, ceil(bm * bk / 2)) with block=(bm, bk); got values "
                f"{values.shape} and block {block}"
            )
        bm, bk = block
    elif values.ndim == 3:
        bm, bk = values.shape[1:]
    else:
        raise ValueError(f"values must be (cap, bm, bk) (or packed int4 with block=), got shape {values.shape}")
    if dy.ndim != 2 or row_ids.shape != values.shape[:1] or col_ptr.ndim != 1:
        raise ValueError(
            "want values (cap, bm, bk), row_ids (cap,), col_ptr (Kb + 1,) and dy (Mb * bm, N); got "
            f"values {values.shape}, row_ids {row_ids.shape}, col_ptr {col_ptr.shape}, dy {dy.shape}"
        )
    if quantized != (scales is not None) or (scales is not None and scales.shape != values.shape[:1]):
        raise ValueError(
            f"scales must be (cap,) for int8 / packed int4 values and None otherwise; got values {values.dtype} "
            f"and scales {None if scales is None else scales.shape}"
        )
    if dy.shape[0] % bm:
        raise ValueError(f"dy must have a whole number of {bm}-row blocks, got {dy.shape[0]} rows")
    isa = resolve_isa(isa)
    if not quantized and values.dtype not in (jnp.float32, jnp.bfloat16):
        values = values.astype(jnp.float32)
    scales = jnp.zeros((0,), jnp.float32) if scales is None else scales.astype(jnp.float32)
    operands = _varying_alike(values, scales, row_ids.astype(jnp.int32), col_ptr.astype(jnp.int32), dy.astype(jnp.float32))
    shape = ((col_ptr.shape[0] - 1) * bk, dy.shape[1])
    dy_type = jax.typeof(operands[-1])
    # Inside shard_map the result varies like dy and lives on its manual mesh: derive it from dy's type.
    out = dy_type.update(shape=shape) if dy_type.manual_axis_type.varying else jax.ShapeDtypeStruct(shape, jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    return call(*operands, bm=int(bm), bk=int(bk), isa=ISAS.index(isa))


def _varying_alike(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Inside ``jax.shard_map`` an FFI call needs every operand to vary over the same mesh axes (and
    its result declared so); ``pcast`` the operands that vary over fewer up to the union."""
    varying = [jax.typeof(a).manual_axis_type.varying for a in arrays]
    axes = frozenset().union(*varying)
    return tuple(
        jax.lax.pcast(a, tuple(sorted(axes - v)), to="varying") if axes - v else a for a, v in zip(arrays, varying)
    )


# Bits of the stored integers, by storage dtype (bsr_jax.storage.quantize's names).
QUANTIZE_BITS = {"int8": 8, "int4": 4}


def quantize_blocks(
    x: jax.Array, block: tuple[int, int], storage_dtype: str, *, isa: str | None = None
) -> tuple[jax.Array, jax.Array]:
    """Every ``(bm, bk)`` block of ``x (M, K)`` (float32 or bfloat16; zero-padded to whole blocks)
    rounded to nearest, as ``bsr_jax.storage.quantize.quantize_blocks`` stores it, in block-column-major
    order (block ``(i, j)`` at ``j * Mb + i``, the layout of ``bsr_jax.from_dense`` at sparsity 0).

    Returns ``(stored, scales)``: ``(Mb * Kb, bm, bk)`` int8 or ``(Mb * Kb, ceil(bm * bk / 2))``
    uint8 packed int4, and ``(Mb * Kb,)`` float32. Bitwise equal to the jitted reference
    (``quantize_blocks.cc`` states the rule, NaN/inf blocks and underflowing scales included).
    """
    if storage_dtype not in QUANTIZE_BITS:
        raise ValueError(f"storage_dtype must be one of {tuple(QUANTIZE_BITS)}, got {storage_dtype!r}")
    if x.ndim != 2 or x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"x must be (M, K) float32 or bfloat16, got {x.shape} {x.dtype}")
    (m, k), (bm, bk) = x.shape, block
    if not (1 <= bm <= m and 1 <= bk <= k):
        raise ValueError(f"block {block} must be within x's shape {x.shape}")
    blocks = -(-m // bm) * -(-k // bk)
    bits = QUANTIZE_BITS[storage_dtype]
    stored = (blocks, bm, bk) if bits == 8 else (blocks, -(-bm * bk // 2))
    x_type = jax.typeof(x)
    # Inside shard_map the results vary like x and live on its manual mesh.
    like_x = (lambda shape, dtype: x_type.update(shape=shape, dtype=dtype)) if x_type.manual_axis_type.varying else jax.ShapeDtypeStruct
    call = jax.ffi.ffi_call(
        QUANTIZE_TARGET, (like_x(stored, jnp.int8 if bits == 8 else jnp.uint8), like_x((blocks,), jnp.float32)),
        vmap_method="sequential",
    )
    return call(x, bm=int(bm), bk=int(bk), bits=bits, isa=ISAS.index(resolve_isa(isa)))
