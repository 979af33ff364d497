"""Flax linen layers: ``Dense`` on ``bsr_linear``; ``Affine`` and ``LayerScale`` on ``bsr_scale_shift``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from jax import lax

from bsr_jax.elementwise import bsr_scale_shift
from bsr_jax.format import BlockSpec, Criterion, Selection, StorageDtype
from bsr_jax.linear import bsr_linear


def _pruning_key(module: nn.Module, stochastic: bool, sparsity: float) -> jax.Array | None:
    # Drawn only where it exists: a forward-only apply (evaluation) needs no "pruning" stream, and
    # differentiating a stochastic layer without one raises (see Pruning.compress).
    use = stochastic and sparsity > 0 and module.has_rng("pruning")
    return module.make_rng("pruning") if use else None


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
      criterion, selection, storage_dtype, backend: see ``bsr_linear``.
      stochastic: sample blocks (unbiased dW) with keys from the ``"pruning"`` rng stream:
        ``apply(..., rngs={"pruning": key})`` when differentiating (evaluation needs none).
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
    storage_dtype: StorageDtype | None = None
    stochastic: bool = False
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
        sparsity = self.sparsity if sparsity is None else sparsity
        return bsr_linear(
            inputs,
            kernel,
            bias,
            sparsity=sparsity,
            block=self.block,
            criterion=self.criterion,
            selection=self.selection,
            storage_dtype=self.storage_dtype,
            stochastic=self.stochastic,
            key=_pruning_key(self, self.stochastic, sparsity),
            backend=self.backend,
            precision=self.precision,
        )


class _ScaleShift(nn.Module):
    """Options shared by Affine and LayerScale; see ``Dense`` for their meaning."""

    sparsity: float = 0.0
    block: BlockSpec = 16
    criterion: Criterion = "l2"
    selection: Selection = "global"
    storage_dtype: StorageDtype | None = None
    stochastic: bool = False
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32

    def _apply(self, x, scale, shift, sparsity):
        x, scale, shift = promote_dtype(x, scale, shift, dtype=self.dtype)
        sparsity = self.sparsity if sparsity is None else sparsity
        return bsr_scale_shift(
            x,
            scale,
            shift,
            sparsity=sparsity,
            block=self.block,
            criterion=self.criterion,
            selection=self.selection,
            storage_dtype=self.storage_dtype,
            stochastic=self.stochastic,
            key=_pruning_key(self, self.stochastic, sparsity),
        )


class Affine(_ScaleShift):
    """ResMLP's ``alpha * x + beta`` over the last axis; params ``alpha (K,)`` (ones), ``beta (K,)`` (zeros).

    With ``sparsity > 0`` the alpha gradient sees only the largest blocks of x; everything else is
    exact. ``sparsity`` may be overridden per call, as in ``Dense``.
    """

    @nn.compact
    def __call__(self, x: jax.Array, sparsity: float | None = None) -> jax.Array:
        alpha = self.param("alpha", nn.initializers.ones_init(), (x.shape[-1],), self.param_dtype)
        beta = self.param("beta", nn.initializers.zeros_init(), (x.shape[-1],), self.param_dtype)
        return self._apply(x, alpha, beta, sparsity)


class LayerScale(_ScaleShift):
    """Per-channel ``x * scale`` of a residual branch; param ``scale (K,)`` initialised to ``init_value``."""

    init_value: float = 0.1

    @nn.compact
    def __call__(self, x: jax.Array, sparsity: float | None = None) -> jax.Array:
        scale = self.param("scale", nn.initializers.constant(self.init_value), (x.shape[-1],), self.param_dtype)
        return self._apply(x, scale, None, sparsity)
