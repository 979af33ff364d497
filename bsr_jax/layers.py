"""Flax linen layers built on ``bsr_linear``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from jax import lax

from bsr_jax.format import BlockSpec, Criterion, Selection
from bsr_jax.linear import bsr_linear


class Dense(nn.Module):
    """Drop-in for ``flax.linen.Dense`` whose weight gradient keeps only the largest input blocks.

    Same attributes (``features``, ``use_bias``, ``dtype``, ``param_dtype``, ``precision``,
    ``kernel_init``, ``bias_init``) and parameters (``kernel (K, features)``, ``bias (features,)``)
    as ``nn.Dense``, so checkpoints load both ways. ``nn.Dense``'s ``dot_general`` hooks are not
    supported. The forward output is bit-identical to ``nn.Dense`` at every sparsity; the input and
    bias gradients are exact; the kernel gradient is approximate for ``sparsity > 0`` (see
    ``bsr_linear``).

    Attributes:
      sparsity: fraction of input blocks pruned from the backward residual, in ``[0, 1)``.
      block: block shape ``(rows, cols)`` over the flattened ``(M, K)`` input, or an int.
      criterion, selection, backend: see ``bsr_linear``.
    """

    features: int
    use_bias: bool = True
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32
    precision: lax.PrecisionLike = None
    kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
    bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()
    sparsity: float = 0.0
    block: BlockSpec = 16
    criterion: Criterion = "l2"
    selection: Selection = "global"
    backend: str | None = None

    @nn.compact
    def __call__(self, inputs: jax.Array, sparsity: float | None = None) -> jax.Array:
        """Applies the layer to ``inputs (..., K)``.

        ``sparsity`` overrides the attribute for this call (e.g. from a schedule). It must be a
        Python float: each distinct value is a new static shape and compiles a new program, so
        schedules should use a few discrete levels.
        """
        if not jnp.issubdtype(jnp.result_type(inputs), jnp.floating):
            raise ValueError(f"inputs must have a floating dtype, got {jnp.result_type(inputs)}")
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        return bsr_linear(
            inputs,
            kernel,
            bias,
            sparsity=self.sparsity if sparsity is None else sparsity,
            block=self.block,
            criterion=self.criterion,
            selection=self.selection,
            backend=self.backend,
            precision=self.precision,
        )
