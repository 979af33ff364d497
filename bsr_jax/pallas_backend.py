"""The ``pallas`` dW backend: wires ``pallas_kernels`` into ``bsr_linear`` (GPU default)."""

from __future__ import annotations

import jax

from bsr_jax.format import BlockSparse


def pallas_dw(bsr: BlockSparse, dy: jax.Array) -> jax.Array:
    raise NotImplementedError(
        "backend='pallas' is not available yet (pallas_kernels issue); use backend='xla' or 'reference'"
    )
