"""The suite runs on the CPU. JAX_PLATFORMS=cpu also lets jax's CUDA plugin (the ``aot`` extra)
register without a GPU, which deviceless H100 compiles need (bsr_jax.compiled)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
