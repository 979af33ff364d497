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

from typing import TypeVar

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from bsr_jax.format import RESIDUAL_NAME

T = TypeVar("T")
U = TypeVar("U")


def materialize(y: T, residual: U) -> tuple[T, U]:
    """``(y, residual)`` unchanged, with ``residual`` computed before any use of ``y``.

    The residual's arrays are named ``RESIDUAL_NAME`` again on this side of the barrier, so a
    ``jax.checkpoint`` policy saving that name keeps them as they are (recomputing the barrier
    would keep ``y``'s producer as well)."""
    y, residual = lax.optimization_barrier((y, residual))
    return y, named(residual)


def named(residual: T) -> T:
    """``residual`` with its arrays named ``RESIDUAL_NAME``: what ``bsr_jax.remat_policy`` keeps."""
    return jax.tree.map(lambda a: checkpoint_name(a, RESIDUAL_NAME), residual)


def when_needed(residual: T, dy: U) -> tuple[T, U]:
    """``(residual, dy)`` unchanged, the residual read no earlier than ``dy`` exists. Use the
    returned ``dy``: XLA drops a barrier's operands whose results nobody reads."""
    return lax.optimization_barrier((residual, dy))
