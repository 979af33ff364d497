"""Flax linen layers: ``Dense`` on ``bsr_linear``; ``Affine`` and ``LayerScale`` on ``bsr_scale_shift``."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from jax import lax

from bsr_jax.core import layer_choice
from bsr_jax.ops.elementwise import bsr_scale_shift
from bsr_jax.storage.format import BlockSpec, Criterion, Rounding, Selection, StorageDtype
from bsr_jax.storage.pruning import PRUNING_OPTIONS, Pruning, as_pruning
from bsr_jax.ops.linear import bsr_linear


def _option():
    # Keyword-only, so positional arguments keep nn.Dense's / ResMLP's meaning (LayerScale(0.1) is
    # the initial scale, never a sparsity).
    return dataclasses.field(default=None, kw_only=True)


class PrunedModule(nn.Module):
    """The pruning options every bsr_jax layer takes: ``pruning=bsr_jax.Pruning(...)``, or its
    fields as shorthand keywords (``sparsity=0.7, block=16``). Nothing set means dense. Inside
    ``bsr_jax.compress_model`` (or ``bsr_jax.use_rules``), a rule matching the layer's path
    decides instead."""

    pruning: Pruning | None = _option()
    sparsity: float | None = _option()
    block: BlockSpec | None = _option()
    criterion: Criterion | None = _option()
    selection: Selection | None = _option()
    storage_dtype: StorageDtype | None = _option()
    stochastic: bool | None = _option()
    rounding: Rounding | None = _option()

    def resolved_pruning(self, sparsity: float | None = None) -> Pruning:
        """The layer's ``Pruning``: a matching rule's, else its own; ``sparsity`` overrides the level."""
        ruled = layer_choice.lookup(self)
        if ruled is not layer_choice.NO_MATCH:
            pruning = ruled or Pruning(0.0)
        else:
            # backend is Dense's own attribute (passed to bsr_linear), not a shorthand.
            options = {name: getattr(self, name) for name in PRUNING_OPTIONS if name != "backend"}
            if self.pruning is None and options["sparsity"] is None:
                options["sparsity"] = 0.0
            pruning = as_pruning(self.pruning, options)
        return pruning if sparsity is None else dataclasses.replace(pruning, sparsity=sparsity)

    def compress_with(self, x: jax.Array, sparsity: float | None) -> tuple[Pruning, jax.Array | None]:
        """The resolved ``Pruning`` for input ``x`` (recorded for ``bsr_jax.pruning_plan``) and its key."""
        pruning = self.resolved_pruning(sparsity)
        layer_choice.record(layer_choice.module_path(self), pruning, x)
        return pruning, self.pruning_key(pruning)

    def pruning_key(self, pruning: Pruning) -> jax.Array | None:
        # Drawn only where it exists: a forward-only apply (evaluation) needs no "pruning" stream, and
        # differentiating a stochastic layer without one raises (see Pruning.compress).
        return self.make_rng("pruning") if pruning.needs_key and self.has_rng("pruning") else None


class Dense(PrunedModule):
    """Drop-in for ``flax.linen.Dense`` whose weight gradient keeps only the largest input blocks.

    Same attributes (``features``, ``use_bias``, ``dtype``, ``param_dtype``, ``precision``,
    ``kernel_init``, ``bias_init``) and parameters (``kernel (K, features)``, ``bias (features,)``)
    as ``nn.Dense``, so checkpoints load both ways. ``nn.Dense``'s ``dot_general`` hooks are not
    supported. The forward output is bit-identical to ``nn.Dense`` at every sparsity; the input and
    bias gradients are exact; the kernel gradient is approximate for ``sparsity > 0`` (see
    ``bsr_linear``). Pruning options: see ``PrunedModule``; stochastic options draw keys from the
    ``"pruning"`` rng stream: ``apply(..., rngs={"pruning": key})`` when differentiating.

    Attributes:
      backend: dW backend, see ``bsr_linear``.
    """

    features: int
    use_bias: bool = True
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32
    precision: lax.PrecisionLike = None
    kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
    bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()
    backend: str | None = None

    @nn.compact
    def __call__(self, inputs: jax.Array, sparsity: float | None = None) -> jax.Array:
        """Applies the layer to ``inputs (..., K)``.

        ``sparsity`` overrides the level for this call (e.g. from a schedule). It must be a Python
        float: each distinct value is a new static shape and compiles a new program, so schedules
        should use a few discrete levels.
        """
        if not jnp.issubdtype(jnp.result_type(inputs), jnp.floating):
            raise ValueError(f"inputs must have a floating dtype, got {jnp.result_type(inputs)}")
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        pruning, key = self.compress_with(inputs, sparsity)
        return bsr_linear(inputs, kernel, bias, pruning=pruning, key=key, backend=self.backend, precision=self.precision)


class _ScaleShift(PrunedModule):
    dtype: jnp.dtype | None = dataclasses.field(default=None, kw_only=True)
    param_dtype: jnp.dtype = dataclasses.field(default=jnp.float32, kw_only=True)

    def _apply(self, x, scale, shift, sparsity):
        x, scale, shift = promote_dtype(x, scale, shift, dtype=self.dtype)
        pruning, key = self.compress_with(x, sparsity)
        return bsr_scale_shift(x, scale, shift, pruning=pruning, key=key)


class Affine(_ScaleShift):
    """ResMLP's ``alpha * x + beta`` over the last axis; params ``alpha (K,)`` (ones), ``beta (K,)`` (zeros).

    With pruning the alpha gradient sees only the largest blocks of x; everything else is exact.
    Pruning options as in ``Dense``; ``sparsity`` may be overridden per call.
    """

    @nn.compact
    def __call__(self, x: jax.Array, sparsity: float | None = None) -> jax.Array:
        alpha = self.param("alpha", nn.initializers.ones_init(), (x.shape[-1],), self.param_dtype)
        beta = self.param("beta", nn.initializers.zeros_init(), (x.shape[-1],), self.param_dtype)
        return self._apply(x, alpha, beta, sparsity)


class LayerScale(_ScaleShift):
    """Per-channel ``x * scale`` of a residual branch; param ``scale (K,)`` initialised to ``init_value``
    (the first positional argument, as in ResMLP code: ``LayerScale(0.1)``). Pruning options as in
    ``Dense`` (keyword-only)."""

    init_value: float = 0.1

    @nn.compact
    def __call__(self, x: jax.Array, sparsity: float | None = None) -> jax.Array:
        scale = self.param("scale", nn.initializers.constant(self.init_value), (x.shape[-1],), self.param_dtype)
        return self._apply(x, scale, None, sparsity)
