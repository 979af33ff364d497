"""Memory accounting: what a loss keeps for its backward pass, and what a compiled step needs.

``residual_bytes`` is the product's primary figure. It traces ``jax.vjp`` of the function under
``jax.eval_shape`` (nothing runs, no memory is allocated) and sizes the arrays the VJP closure
holds, i.e. what stays alive between the forward and the backward pass. Each array is counted
once, however many times the closure refers to it, and is classified as

* ``params``: an array passed in as the first argument (parameters kept for dx, e.g. kernels);
* ``inputs``: an array passed in as another argument (e.g. the image batch);
* ``activations``: anything computed: the figure block-sparse residuals shrink.

``compiled_memory`` (``bsr_jax.measure.compiled``) compiles a step for a GPU or TPU target without the
device and reads XLA's memory plan: the figure an accelerator must hold. On the host's CPU backend
it need not follow residual savings (see docs/memory.md).

``program_order_peak`` walks the function's jaxpr in program order and sums the bytes of live
values, each freed after its last use: a backend-independent peak estimate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.extend as jex

from bsr_jax.measure.compiled import CompiledMemory, compiled_memory  # noqa: F401  (bsr_jax.measure.memory.*)
from bsr_jax.core.names import RESIDUAL_NAME

MIB = 2**20


def remat_policy():
    """A ``jax.checkpoint`` policy: keep block-sparse residuals and matmul outputs, recompute
    every elementwise op in the backward pass.

    ``jax.checkpoint(block, policy=bsr_jax.remat_policy())`` (or ``nn.remat(Block, policy=...)``)
    stores, per block, the kept blocks of each pruned layer and the outputs of unbatched dots (e.g.
    a GELU's input), and recomputes the cheap elementwise ops (activations, norms, scales and their
    internal temporaries); no matmul is recomputed.
    """
    policies = jax.checkpoint_policies
    return policies.save_from_both_policies(
        policies.dots_with_no_batch_dims_saveable, policies.save_only_these_names(RESIDUAL_NAME)
    )


@dataclasses.dataclass(frozen=True)
class Residual:
    """One array kept for the backward pass."""

    shape: tuple[int, ...]
    dtype: str
    kind: str  # "params", "inputs" or "activations"
    itemsize: int  # from the array's dtype itself: typed PRNG keys (key<fry>) have no numpy dtype

    @property
    def nbytes(self) -> int:
        return int(self.itemsize * _size(self.shape))


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
            kind = kinds.get(id(leaf), "activations")
            found.append(Residual(tuple(leaf.shape), str(leaf.dtype), kind, leaf.dtype.itemsize))

    jax.eval_shape(traced, params, *args)
    totals = {k: sum(r.nbytes for r in found if r.kind == k) for k in ("params", "inputs", "activations")}
    return ResidualBytes(**totals, residuals=tuple(found))


def _aval_bytes(var) -> int:
    aval = var.aval
    if not hasattr(aval, "shape") or not hasattr(aval, "dtype"):
        return 0  # tokens and other abstract values hold no buffer
    return _size(aval.shape) * aval.dtype.itemsize


def _internal_peak(jaxpr) -> int:
    """Peak bytes of the values a jaxpr creates (its inputs belong to the caller)."""
    eqns = jaxpr.eqns
    end = len(eqns)
    last_use: dict = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if isinstance(v, jex.core.Var):
                last_use[v] = i
    for v in jaxpr.outvars:
        if isinstance(v, jex.core.Var):
            last_use[v] = end
    created: set = set()
    live = peak = 0
    for i, eqn in enumerate(eqns):
        produced = sum(_aval_bytes(v) for v in eqn.outvars)
        nested = max((_internal_peak(sub) for sub in jex.core.jaxprs_in_params(eqn.params)), default=0)
        # While an equation runs, its inputs, its outputs and its own temporaries are all live.
        peak = max(peak, live + max(produced, nested))
        live += produced
        for v in eqn.outvars:
            created.add(v)
            if last_use.get(v, i) <= i:  # never read again: dropped right away
                live -= _aval_bytes(v)
        for v in {v for v in eqn.invars if isinstance(v, jex.core.Var)}:
            if v in created and last_use[v] == i:
                live -= _aval_bytes(v)
    return peak


def program_order_peak(fn: Callable[..., Any], *args: Any) -> int:
    """Estimated peak bytes of ``fn(*args)`` when run in program order (traced only, nothing runs).

    Arguments stay live throughout (they belong to the caller); every value ``fn`` creates is
    allocated when its equation runs and freed after its last use; nested jaxprs (jit, remat,
    custom_vjp, scan bodies) add their own internal peak while their equation runs. It ignores
    fusion (which removes elementwise temporaries, so it tends to overestimate) and in-place reuse,
    and assumes a scheduler that keeps program order, as memory-aware GPU schedulers roughly do.
    For a grad step the forward/backward boundary, where every residual is live, usually sets it.
    """
    closed = jax.make_jaxpr(fn)(*args)
    arguments = sum(_aval_bytes(v) for v in closed.jaxpr.invars + closed.jaxpr.constvars)
    return arguments + _internal_peak(closed.jaxpr)
