"""Where compressed residuals live in the compiled program: two ``lax.optimization_barrier`` ties.

XLA schedules by dataflow alone. Left to it, an accelerator compiler (XLA:GPU and XLA:TPU,
measured in docs/memory.md) undoes the compression:

* it fuses a residual's compression into its backward consumer and keeps the full-precision input
  alive instead, or merges the compressions of every layer into one horizontal fusion that can only
  run after the last layer's forward, so every layer's input stays alive to the end of the forward
  pass (the ResMLP-S12 top-k step needed 1.03x dense's peak on H100);
* it hoists the backward's decompression (dequantize, densify) into the forward pass, where the
  full-size copies of every layer are live together.

``materialize`` makes the layer's output depend on its compressed residual, so the compressed
arrays exist before anything downstream runs and the input can die; ``when_needed`` makes the
residual's use wait for the cotangent of that layer, so decompression runs next to its consumer.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from bsr_jax.core import platforms
from bsr_jax.core.names import RESIDUAL_NAME

T = TypeVar("T")
U = TypeVar("U")


@jax.tree_util.register_pytree_node_class
class Stored:
    """A residual as the compiled program keeps it: arrays whose minor dimension is a multiple of
    128 as they are, the others flattened to one dimension.

    XLA:TPU tiles an array's two minor dimensions to (8, 128): kept blocks ``(n, 16, 16)`` would
    take 8x their bytes, a 1-D array takes its own. Lane-dense arrays (1 x 128 blocks' codes) keep
    their shape: flattening them is a relayout pass over them each way (ResMLP-S12's int8 step
    on TPU v5p: 28.3 ms flattened, 22.2 ms as they are; docs/RESULTS.md 14.2). On GPU and CPU
    the reshape is free."""

    def __init__(self, flat: tuple[jax.Array, ...], layout: tuple[Any, tuple[tuple[int, ...], ...]]):
        self.flat, self.layout = flat, layout

    @classmethod
    def of(cls, residual: Any) -> Stored:
        leaves, treedef = jax.tree.flatten(residual)
        kept = tuple(a if a.ndim and a.shape[-1] % platforms.TPU_LANES == 0 else a.reshape(-1) for a in leaves)
        return cls(kept, (treedef, tuple(a.shape for a in leaves)))

    def restore(self) -> Any:
        treedef, shapes = self.layout
        return jax.tree.unflatten(treedef, [a.reshape(shape) for a, shape in zip(self.flat, shapes)])

    def tree_flatten(self):
        return self.flat, self.layout

    @classmethod
    def tree_unflatten(cls, layout, flat):
        return cls(tuple(flat), layout)


def materialize(y: T, residual: U) -> tuple[T, Stored]:
    """``y`` and ``residual`` as a ``Stored``, computed before any use of ``y``; ``when_needed``
    gives the residual back.

    The residual's arrays are named ``RESIDUAL_NAME`` again on this side of the barrier, so a
    ``jax.checkpoint`` policy saving that name keeps them as they are (recomputing the barrier
    would keep ``y``'s producer as well)."""
    y, stored = lax.optimization_barrier((y, Stored.of(residual)))
    return y, named(stored)


def named(residual: T) -> T:
    """``residual`` with its arrays named ``RESIDUAL_NAME``: what ``bsr_jax.remat_policy`` keeps."""
    return jax.tree.map(lambda a: checkpoint_name(a, RESIDUAL_NAME), residual)


def when_needed(residual: T | Stored, dy: U) -> tuple[T, U]:
    """``(residual, dy)`` unchanged (a ``Stored`` one restored), the residual read no earlier than
    ``dy`` exists. Use the returned ``dy``: XLA drops a barrier's operands whose results nobody
    reads."""
    residual, dy = lax.optimization_barrier((residual, dy))
    return (residual.restore() if isinstance(residual, Stored) else residual), dy


def together(dx: T, dw: U) -> tuple[T, U]:
    """``(dx, dw)`` unchanged, both computed before either is used."""
    return lax.optimization_barrier((dx, dw))
