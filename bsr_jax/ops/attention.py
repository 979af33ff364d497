"""Dot-product attention whose backward takes flash attention's softmax derivative.

``dot_product_attention`` computes exactly what ``flax.linen.dot_product_attention`` computes
(the same operations in the same order: bit-identical outputs) and keeps for the backward pass
only q, k, v, the bias and mask, the dropout key and its output. The backward recomputes the
scores (one GEMM) and the probabilities (the forward's softmax, so its bits), and takes the
softmax's derivative as flash attention does (Dao et al., arXiv 2205.14135):
``ds = p * (dp - D)`` with ``D = rowsum(do * o)`` over the head dimension, where plain autodiff
reduces ``dp * p`` over the ``(..., heads, q, k)`` probabilities. Gradients equal plain autodiff's
up to float rounding (``ds`` is formed in f32; tests/bsr_jax/test_attention.py bounds the
difference). ``keep_output=False`` keeps no output: its backward is autodiff's of the recomputed
forward (what ``jax.checkpoint`` of Flax's function gives).

Why (docs/RESULTS.md 14.4, the 12 x 768 LM, T 2048, H100): recomputing under ``jax.checkpoint``
(what ``bsr_jax.rewrite.lean`` did before) ran autodiff's row sums over every (B, heads, T, T)
probability again, 3.0 of the step's 70.5 ms. Kept row statistics (max and sum, to recompute the
probabilities without the softmax's reductions) were measured and not kept: as outputs of the
forward they stop XLA fusing its softmax into one kernel, costing the forward what they save the
backward.

Arrays: query (..., q_length, heads, head_dim), key and value (..., kv_length, heads, head_dim),
bias and mask broadcastable to (..., heads, q_length, kv_length); as Flax's. Not covered (the
caller runs Flax's own function): ``module`` (sown weights), custom einsums or ``dot_general``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from jax.ad_checkpoint import checkpoint_name

from bsr_jax.core.names import LEAN_NAME


@dataclasses.dataclass(frozen=True)
class _Config:
    """The static arguments of one call (hashable: ``custom_vjp``'s non-differentiable argument)."""

    dropout_rate: float
    broadcast_dropout: bool
    deterministic: bool
    precision: Any
    force_fp32_for_softmax: bool
    keep_output: bool
    key_impl: Any  # the dropout key's PRNG implementation where it was a typed key, else None

    @property
    def dropout(self) -> bool:
        return not self.deterministic and self.dropout_rate > 0.0

    def softmax_in_f32(self, dtype) -> bool:
        """Flax's rule: the softmax in f32 (and its result left in f32) for a lower ``dtype``."""
        return self.force_fp32_for_softmax and dtype != jnp.float32


def _einsum(config: _Config):
    return functools.partial(jnp.einsum, precision=config.precision, _dot_general=jax.lax.dot_general)


def _scores(config: _Config, query, key, bias, mask):
    """Flax's ``dot_product_attention_weights`` up to its softmax: (scaled query, softmax input)."""
    dtype = query.dtype
    query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
    scores = _einsum(config)("...qhd,...khd->...hqk", query, key)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(dtype).min)
    if config.softmax_in_f32(dtype):
        scores = scores.astype(jnp.float32)
    return query, scores


def _multiplier(config: _Config, rng, shape, dtype):
    """Flax's dropout multiplier (``keep / keep_prob``), from the same key."""
    if config.key_impl is not None:
        rng = jax.random.wrap_key_data(rng, impl=config.key_impl)
    keep_prob = 1.0 - config.dropout_rate
    keep = jax.random.bernoulli(rng, keep_prob, shape)
    return keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype)


def _weights(config: _Config, query, key, bias, mask, rng):
    """Flax's ``dot_product_attention_weights``, its parts apart: (scaled query, probabilities, the
    dropout multiplier or None, weights = probabilities x multiplier). The softmax is fused by XLA
    into one kernel where it can."""
    dtype = query.dtype
    scaled_query, scores = _scores(config, query, key, bias, mask)
    probabilities = jax.nn.softmax(scores)
    probabilities = probabilities if config.softmax_in_f32(dtype) else probabilities.astype(dtype)
    if not config.dropout:
        return scaled_query, probabilities, None, probabilities
    shape = (1,) * (key.ndim - 2) + probabilities.shape[-2:] if config.broadcast_dropout else probabilities.shape
    multiplier = _multiplier(config, rng, shape, dtype)
    return scaled_query, probabilities, multiplier, probabilities * multiplier


def _forward(config: _Config, query, key, value, bias, mask, rng):
    weights = _weights(config, query, key, bias, mask, rng)[-1]
    return _einsum(config)("...hqk,...khd->...qhd", weights, value)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(config, query, key, value, bias, mask, rng):
    return _forward(config, query, key, value, bias, mask, rng)


def _attention_fwd(config, query, key, value, bias, mask, rng):
    out = _forward(config, query, key, value, bias, mask, rng)
    # Named so that a lean segment's policy (bsr_jax.rewrite.lean_policy) keeps it, not the scores.
    return out, (query, key, value, bias, mask, rng, checkpoint_name(out, LEAN_NAME) if config.keep_output else None)


def _sum_to(x, shape):
    """``x`` summed over the axes it was broadcast along from ``shape``."""
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(i + lead for i, n in enumerate(shape) if n == 1 and x.shape[i + lead] != 1)
    return jnp.sum(x, axes, keepdims=True).reshape(shape)


def _attention_bwd(config, residuals, d_out):
    query, key, value, bias, mask, rng, out = residuals
    if not config.keep_output:  # autodiff's derivative of the recomputed forward
        _, vjp = jax.vjp(lambda *arrays: _forward(config, *arrays, mask, rng), query, key, value, bias)
        return (*vjp(d_out), None, None)
    dtype, einsum = query.dtype, _einsum(config)
    scaled_query, probabilities, multiplier, weights = _weights(config, query, key, bias, mask, rng)
    d_value = einsum("...hqk,...qhd->...khd", weights, d_out.astype(jnp.result_type(weights, value)))
    d_weights = einsum("...qhd,...khd->...hqk", d_out, value)
    d_probabilities = d_weights * multiplier if multiplier is not None else d_weights
    # softmax's derivative: p * (dp - sum_k dp * p), where sum_k dp * p = sum_d do * o (flash attention's D).
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1)  # (..., q, heads)
    delta = jnp.moveaxis(delta, -1, -2)[..., None]  # (..., heads, q, 1)
    d_scores = probabilities.astype(jnp.float32) * (d_probabilities.astype(jnp.float32) - delta)
    if mask is not None:
        d_scores = jnp.where(mask, d_scores, 0.0)
    d_scores = d_scores.astype(dtype)
    d_query = einsum("...hqk,...khd->...qhd", d_scores, key) / jnp.sqrt(query.shape[-1]).astype(dtype)
    d_key = einsum("...hqk,...qhd->...khd", d_scores, scaled_query)
    d_bias = None if bias is None else _sum_to(d_scores, bias.shape).astype(bias.dtype)
    return d_query.astype(query.dtype), d_key.astype(key.dtype), d_value.astype(value.dtype), d_bias, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True, dropout_rng=None,
                          dropout_rate: float = 0.0, deterministic: bool = False, dtype=None, precision=None,
                          force_fp32_for_softmax: bool = False, keep_output: bool = True) -> jax.Array:  # fmt: skip
    """``flax.linen.dot_product_attention`` (same arguments but ``module`` and custom einsums; same
    output, bit for bit) whose backward keeps q, k, v, bias, mask, key and output, recomputes the
    probabilities and takes flash attention's softmax derivative (the module docstring). Gradients
    equal autodiff's of Flax's function up to float rounding; none for ``mask`` and ``dropout_rng``.

    ``keep_output=False`` keeps no output and differentiates the recomputed forward by autodiff (one
    more pass over the probabilities in the backward): for an output that the next layer does not
    keep as it is (its compressed input), where keeping it would add its bytes to the peak."""
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate!r}")
    query, key, value = promote_dtype(query, key, value, dtype=dtype)
    key_impl = None
    if dropout_rng is not None and jnp.issubdtype(dropout_rng.dtype, jax.dtypes.prng_key):
        key_impl = jax.random.key_impl(dropout_rng)
        dropout_rng = jax.random.key_data(dropout_rng)  # residuals stay plain arrays
    config = _Config(float(dropout_rate), bool(broadcast_dropout), bool(deterministic), precision, bool(force_fp32_for_softmax), bool(keep_output), key_impl)
    if config.dropout and dropout_rng is None:
        raise ValueError("dropout_rng is required where dropout_rate > 0 and deterministic is False")
    return _attention(config, query, key, value, bias, mask, dropout_rng)
