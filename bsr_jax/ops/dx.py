"""Approximate input gradients, opt-in: what the backward of a nonlinearity needs, stored compressed.

Compressing a linear layer's input only changes its weight gradient; the arrays that bound memory
once that is done are the ones exact dx needs through nonlinearities: GELU/SiLU inputs, norm
inputs, attention's q, k, v (docs/memory.md). ``stored_compressed(fn, dx)`` runs ``fn`` exactly in
the forward pass but keeps, for its backward pass, only its floating-point inputs stored in
``dx``'s format; the backward pass decompresses them and differentiates ``fn`` again at the
decompressed inputs (recomputing what ``fn`` computes from them, as ``jax.checkpoint`` would).

So the forward values are bit-identical, and every gradient that flows through ``fn``, to its
inputs and to parameters it reads, is plain autodiff's at inputs within the format's rounding
of the true ones: approximate, with the error measured per layer kind in docs/RESULTS.md.

Formats (``DX_FORMATS``), each with one float32 scale per 128 consecutive values of a row (the
last axis; the layout of ``bsr_jax.storage.quantize``, 1 x 128 blocks, which XLA:TPU stores lane-dense):

* ``"int8"``: values in [-127, 127], rounded to nearest; 0.26 of an f32 input's bytes;
* ``"int4"``: values in [-7, 7]; 0.14 of the bytes.

Inputs that are not floating point (keys, masks, integer ids) and inputs smaller than
``MIN_COMPRESSED`` values are kept as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

from bsr_jax.storage import barriers
from bsr_jax.storage.format import BlockSparse, from_dense

DxFormat = Literal["int8", "int4"]
DX_FORMATS = ("int8", "int4")
# Scales per 128 values of a row: lane-dense on TPU, one row of a block on GPU.
BLOCK = (1, 128)
# Below this many values an input costs less than its scales and code paths are worth.
MIN_COMPRESSED = 4096


def check_dx(dx: str | None) -> None:
    if dx is not None and dx not in DX_FORMATS:
        raise ValueError(f"dx must be None (exact) or one of {DX_FORMATS}, got {dx!r}")


def _floating(a: Any) -> bool:
    return isinstance(a, jax.Array | jax.core.Tracer) and jnp.issubdtype(a.dtype, jnp.floating)


def _compressible(a: Any) -> bool:
    return _floating(a) and a.ndim >= 1 and a.size >= MIN_COMPRESSED


def compress(a: jax.Array, dx: DxFormat) -> BlockSparse:
    """``a`` (any shape, last axis the row) stored in ``dx``: every value kept, 1 x 128 scales."""
    return from_dense(a.reshape(-1, a.shape[-1]), sparsity=0.0, block=BLOCK, storage_dtype=dx)


def decompress(stored: BlockSparse, shape: tuple[int, ...]) -> jax.Array:
    return stored.to_dense().reshape(shape)


def stored_compressed(
    fn: Callable[..., Any], dx: DxFormat | None, only: Sequence[bool] | None = None, unread: Sequence[bool] | None = None
) -> Callable[..., Any]:
    """``fn`` whose backward pass keeps its floating-point inputs in ``dx`` (module docstring);
    ``dx=None`` returns ``fn`` itself (exact). ``fn`` takes and returns arrays (pytrees of them).
    ``only``, one bool per leaf of the arguments, limits the compression to the leaves marked True
    (the others are kept as they are); ``unread`` marks leaves ``fn``'s backward does not read
    (it is linear in them): those are not kept at all, zeros stand in for them."""
    check_dx(dx)
    if dx is None:
        return fn

    @functools.wraps(fn)
    def wrapped(*args):
        leaves, treedef = jax.tree.flatten(args)
        marked = [True] * len(leaves) if only is None else list(only)
        dropped = [False] * len(leaves) if unread is None else list(unread)
        how = tuple(_DROP if d and _floating(a) else _SHRINK if m and _compressible(a) else _KEEP for a, m, d in zip(leaves, marked, dropped))
        if _SHRINK not in how:
            return jax.checkpoint(fn)(*args)
        return _call(fn, treedef, how, dx, tuple((a.shape, a.dtype) for a in leaves), *leaves)

    return wrapped


_KEEP, _SHRINK, _DROP = "keep", "shrink", "drop"  # what the backward pass keeps of each input


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _call(fn, treedef, how, dx, avals, *leaves):
    return fn(*jax.tree.unflatten(treedef, leaves))


def _fwd(fn, treedef, how, dx, avals, *leaves):
    out = fn(*jax.tree.unflatten(treedef, leaves))
    kept = tuple(compress(a, dx) if h == _SHRINK else a for a, h in zip(leaves, how) if h != _DROP)
    # Without the ties XLA fuses compress -> decompress into the backward and keeps the input.
    return barriers.materialize(out, kept)


def _bwd(fn, treedef, how, dx, avals, stored, g):
    kept, g = barriers.when_needed(stored, g)
    kept = iter(kept)
    leaves = [jnp.zeros(shape, dtype) if h == _DROP else decompress(next(kept), shape) if h == _SHRINK else next(kept)
              for h, (shape, dtype) in zip(how, avals)]  # fmt: skip
    _, vjp = jax.vjp(lambda *ls: fn(*jax.tree.unflatten(treedef, ls)), *leaves)
    return tuple(vjp(g))


_call.defvjp(_fwd, _bwd)
