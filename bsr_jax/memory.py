"""Memory accounting: what a loss keeps for its backward pass, and what a compiled step needs.

``residual_bytes`` is the product's primary figure. It traces ``jax.vjp`` of the function under
``jax.eval_shape`` (nothing runs, no memory is allocated) and sizes the arrays the VJP closure
holds, i.e. what stays alive between the forward and the backward pass. Each array is counted
once, however many times the closure refers to it, and is classified as

* ``params``: an array passed in as the first argument (parameters kept for dx, e.g. kernels);
* ``inputs``: an array passed in as another argument (e.g. the image batch);
* ``activations``: anything computed: the figure block-sparse residuals shrink.

``compiled_memory`` reads XLA's ``memory_analysis()`` of a jitted function. It depends on the
backend's scheduler: on CPU it need not follow residual savings (see docs/memory.md), so treat it as
a secondary, explained figure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Residual:
    """One array kept for the backward pass."""

    shape: tuple[int, ...]
    dtype: str
    kind: str  # "params", "inputs" or "activations"

    @property
    def nbytes(self) -> int:
        return int(jax.numpy.dtype(self.dtype).itemsize * _size(self.shape))


def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclasses.dataclass(frozen=True)
class ResidualBytes:
    """Bytes a function's VJP keeps, split by origin; ``residuals`` lists every array."""

    params: int
    inputs: int
    activations: int
    residuals: tuple[Residual, ...]

    @property
    def total(self) -> int:
        return self.params + self.inputs + self.activations

    def mib(self) -> dict[str, float]:
        return {k: getattr(self, k) / MIB for k in ("params", "inputs", "activations", "total")}


def residual_bytes(fn: Callable[..., Any], params: Any, *args: Any) -> ResidualBytes:
    """Residuals of ``jax.vjp(fn, params, *args)`` without running anything.

    Args:
      fn: the loss (or any function) of ``params`` and further arguments.
      params: a pytree of arrays (or ``jax.ShapeDtypeStruct``), classified as ``params``.
      *args: further pytrees (e.g. a batch); arrays of them kept as residuals count as ``inputs``.
    """
    found: list[Residual] = []

    def traced(params, *args):
        _, vjp_fn = jax.vjp(fn, params, *args)
        kinds = {id(leaf): "params" for leaf in jax.tree.leaves(params)}
        kinds.update({id(leaf): "inputs" for leaf in jax.tree.leaves(args)})
        seen: set[int] = set()
        for leaf in jax.tree.leaves(vjp_fn):
            if id(leaf) in seen or not hasattr(leaf, "shape"):
                continue
            seen.add(id(leaf))
            found.append(Residual(tuple(leaf.shape), str(leaf.dtype), kinds.get(id(leaf), "activations")))
        return None

    jax.eval_shape(traced, params, *args)
    totals = {k: sum(r.nbytes for r in found if r.kind == k) for k in ("params", "inputs", "activations")}
    return ResidualBytes(**totals, residuals=tuple(found))


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's ``memory_analysis()`` of a compiled function, in bytes."""

    temp: int
    arguments: int
    outputs: int
    aliased: int

    @property
    def peak(self) -> int:
        """Upper bound of live bytes: temporaries plus arguments plus outputs not aliased."""
        return self.temp + self.arguments + self.outputs - self.aliased


def compiled_memory(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CompiledMemory:
    """Compile ``fn`` (jitted here if it is not already) for ``args`` and read its memory analysis.

    ``args`` may be arrays or ``jax.ShapeDtypeStruct``. Nothing is executed.
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    stats = jitted.lower(*args, **kwargs).compile().memory_analysis()
    if stats is None:
        raise RuntimeError(f"the {jax.default_backend()} backend reports no memory analysis")
    return CompiledMemory(
        temp=int(stats.temp_size_in_bytes),
        arguments=int(stats.argument_size_in_bytes),
        outputs=int(stats.output_size_in_bytes),
        aliased=int(stats.alias_size_in_bytes),
    )
