"""Backends for the weight gradient ``dW = x.T @ dy`` from a ``BlockSparse`` x.

Every backend is a function ``(bsr, dy) -> dW`` where ``dy`` is ``(Mb * bm, N)`` (zero-padded to
whole block-rows) and ``dW`` is ``(Kb * bk, N)`` float32; the caller slices off padding and casts.

Names: ``"reference"`` (densify then one matmul; for tests), ``"xla"`` (pure jax.numpy; default
on CPU and TPU) and ``"pallas"`` (Pallas kernels; default on GPU). ``backend=None`` resolves to the
environment variable ``BSR_JAX_BACKEND`` if set, else by ``jax.default_backend()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

from bsr_jax.format import BlockSparse
from bsr_jax.pallas_backend import pallas_dw
from bsr_jax.xla_backend import xla_dw

DwBackend = Callable[[BlockSparse, jax.Array], jax.Array]
ENV_VAR = "BSR_JAX_BACKEND"


def reference_dw(bsr: BlockSparse, dy: jax.Array) -> jax.Array:
    """Densify the kept blocks (zeros elsewhere) and run one f32-accumulating matmul."""
    dense = bsr.to_dense(padded=True)
    return jnp.matmul(dense.T, dy, preferred_element_type=jnp.float32)


BACKENDS: dict[str, DwBackend] = {"reference": reference_dw, "xla": xla_dw, "pallas": pallas_dw}


def resolve_backend(name: str | None) -> str:
    """The backend name to use: the argument, else ``$BSR_JAX_BACKEND``, else by platform."""
    if name is None:
        name = os.environ.get(ENV_VAR) or ("pallas" if jax.default_backend() == "gpu" else "xla")
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)} or None, got {name!r}")
    return name


def dw_from_blocks(bsr: BlockSparse, dy: jax.Array, backend: str) -> jax.Array:
    return BACKENDS[backend](bsr, dy)
