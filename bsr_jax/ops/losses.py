"""An exact head + softmax cross-entropy that never holds the ``(tokens, vocabulary)`` logits.

In a language model's training step the largest arrays at the peak are usually the head's f32
logits and their gradient, ``B x T x V`` each (GPT-2 small at B=8, T=1024: two of 1570 MiB), and
``nn.remat`` does not touch them. ``chunked_softmax_cross_entropy(h, w, labels, chunk=...)``
computes ``softmax_cross_entropy(h @ w, labels)`` ``chunk`` tokens at a time, as Liger Kernel's
fused linear cross-entropy and Apple's Cut Cross-Entropy do in PyTorch:

* forward: per chunk, the logits ``(chunk, V)`` in f32, their logsumexp and the label's logit;
  only the per-token logsumexp (``(N,)`` f32) is kept for the backward pass;
* backward (a ``jax.custom_vjp``): per chunk, the logits again, ``softmax - onehot`` scaled by the
  incoming cotangent, then ``dh = dlogits @ w.T`` and ``dw += h.T @ dlogits`` (accumulated in f32).

At most one chunk's logits exist at a time, so the extra memory is ``chunk x V`` f32 (plus ``w``'s
f32 gradient accumulator) instead of ``2 x N x V``; the price is one more ``h @ w`` in the backward
pass. Where the caller knows the losses are only summed with one weight (``summed=True``: a
``.mean()``; ``bsr_jax.chunked_head_loss`` reads it from the traced loss function), the forward
computes the gradient as it goes, as Liger Kernel does, and the backward only scales it: no second
product (the 12 x 768 LM's dense step with the chunked loss: 60.09 -> 59.13 ms on H100, modelled;
the plain loss's 59.28), at ``dh``'s and ``dw``'s bytes kept from the forward on. Loss and
gradients are the plain form's up to f32 rounding (the products accumulate in f32).
``logits_dtype`` rounds each logit to the head's output dtype first (a bf16 ``nn.Dense`` returns
bf16 logits): the chunked loss then reads the values the plain loss reads.

Inside a ``jax.checkpoint`` (``nn.remat``) the forward's logsumexp is kept (named ``LEAN_NAME``,
which ``bsr_jax.rewrite.lean_graph``'s policy keeps), not the chunks' logits; a policy that keeps every
product (``dots_saveable``) keeps them all, as it asks.

``bsr_jax.ops.head_loss`` recognises a head projection followed by optax's softmax cross-entropy in a
model or a loss function as written, and computes the pair with this function.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from bsr_jax.core import sharding
from bsr_jax.core.names import LEAN_NAME


def _logits(h: jax.Array, w: jax.Array, b: jax.Array | None, logits_dtype: jnp.dtype) -> jax.Array:
    """``h (C, D) @ w (D, V) + b (V,)`` as a Dense with ``dtype=h.dtype`` computes it: the product
    in h's dtype accumulated in f32 and rounded to ``logits_dtype``, plus the bias in that dtype;
    returned in f32."""
    logits = jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32).astype(logits_dtype)
    return (logits if b is None else logits + b.astype(logits_dtype)).astype(jnp.float32)


def _chunk_losses(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token ``(loss, logsumexp)`` of one chunk's f32 logits, f32 ``(C,)`` each; negative labels give loss 0."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[:, None], axis=-1)[:, 0]
    return jnp.where(labels >= 0, lse - picked, 0.0), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked_losses(h: jax.Array, w: jax.Array, b: jax.Array | None, labels: jax.Array, logits_dtype: jnp.dtype) -> jax.Array:
    """``h (n, C, D)``, ``w (D, V)``, ``b (V,)`` or None, ``labels (n, C)`` int32 -> losses f32 ``(n, C)``."""
    return _fwd(h, w, b, labels, logits_dtype)[0]


def _fwd(h, w, b, labels, logits_dtype):
    def body(_, chunk):
        h_c, labels_c = chunk
        return None, _chunk_losses(_logits(h_c, w, b, logits_dtype), labels_c)

    _, (losses, lse) = jax.lax.scan(body, None, (h, labels))
    # Named as a small value worth keeping: inside a jax.checkpoint with bsr_jax.rewrite.lean_graph's policy
    # (compress_model's), which keeps products, the lse is kept, not every chunk's logits to
    # recompute it from.
    lse = checkpoint_name(lse, LEAN_NAME)
    return losses, (h, w, b, labels, lse)


def _chunk_gradient(logits, lse, h_c, w, labels_c, scale):
    """One chunk's ``dh (C, D)`` in h's dtype and ``dw (D, V)``, ``db (V,)`` f32 from its f32 logits,
    each token's ``softmax - onehot`` scaled by ``scale (C,)`` (0 where the label is negative)."""
    probs = jnp.exp(logits - lse[:, None])
    onehot = jnp.arange(w.shape[1])[None, :] == labels_c[:, None]
    dlogits = (probs - onehot) * jnp.where(labels_c >= 0, scale, 0.0)[:, None]  # f32 (C, V)
    dlogits = dlogits.astype(h_c.dtype)  # what autodiff of a Dense in h's dtype would carry
    dh = jnp.dot(dlogits, w.astype(h_c.dtype).T, preferred_element_type=jnp.float32).astype(h_c.dtype)
    return dh, jnp.dot(h_c.T, dlogits, preferred_element_type=jnp.float32), dlogits.astype(jnp.float32).sum(0)


def _accumulate(h, w, b, labels, per_chunk, *others):
    """``scan`` over the chunks of ``h``, ``labels`` and ``others``: ``per_chunk(h_c, labels_c, *others_c)
    -> (outputs, dh_c, dw_c, db_c)``; returns (stacked outputs, stacked dh, dw f32, db f32 or None)."""
    def body(sums, chunk):
        dw, db = sums
        out, dh, dw_c, db_c = per_chunk(*chunk)
        return (dw + dw_c, None if b is None else db + db_c), (out, dh)

    # Inside shard_map the accumulators must vary over the manual axes their updates vary over.
    varying = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in (h, w, labels, *others)))
    zeros = [None if a is None else sharding.vary_over(jnp.zeros(a.shape, jnp.float32), varying) for a in (w, b)]
    (dw, db), (out, dh) = jax.lax.scan(body, tuple(zeros), (h, labels, *others))
    return out, dh, dw, db


def _bwd(logits_dtype, residuals, g):
    h, w, b, labels, lse = residuals
    per_chunk = lambda h_c, labels_c, lse_c, g_c: (None, *_chunk_gradient(_logits(h_c, w, b, logits_dtype), lse_c, h_c, w, labels_c, g_c))  # noqa: E731
    _, dh, dw, db = _accumulate(h, w, b, labels, per_chunk, lse, g)
    return dh, dw.astype(w.dtype), None if b is None else db.astype(b.dtype), None


_chunked_losses.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _summed_losses(h: jax.Array, w: jax.Array, b: jax.Array | None, labels: jax.Array, logits_dtype: jnp.dtype) -> jax.Array:
    """``_chunked_losses`` with the gradient computed in the forward, each token's at weight 1: its
    backward scales ``dh`` per token (exact for any cotangent) and ``dw``, ``db`` by one cotangent,
    right only where every token's is the same (a sum or mean of the losses)."""
    return _summed_fwd(h, w, b, labels, logits_dtype)[0]


def _summed_fwd(h, w, b, labels, logits_dtype):
    def per_chunk(h_c, labels_c):
        logits = _logits(h_c, w, b, logits_dtype)
        losses, lse = _chunk_losses(logits, labels_c)
        return (losses, *_chunk_gradient(logits, lse, h_c, w, labels_c, jnp.ones_like(lse)))

    losses, dh, dw, db = _accumulate(h, w, b, labels, per_chunk)
    # w and b (parameters, live anyway) only for the dtypes the gradients come back in.
    return losses, (dh, dw, db, w, b)


def _summed_bwd(logits_dtype, residuals, g):
    dh, dw, db, w, b = residuals
    # Every token's is the same, but for tokens whose loss the caller replaced (optax's out-of-range
    # labels read NaN; their dlogits are 0 here): the cotangent of largest magnitude.
    flat = g.reshape(-1)
    scale = flat[jnp.argmax(jnp.abs(flat))]
    dh = (dh.astype(jnp.float32) * g[..., None]).astype(dh.dtype)
    return dh, (dw * scale).astype(w.dtype), None if db is None else (db * scale).astype(b.dtype), None


_summed_losses.defvjp(_summed_fwd, _summed_bwd)


def chunked_softmax_cross_entropy(h: jax.Array, w: jax.Array, labels: jax.Array, *, chunk: int = 1024,
                                  logits_dtype: jax.typing.DTypeLike = jnp.float32, bias: jax.Array | None = None,
                                  summed: bool = False) -> jax.Array:  # fmt: skip
    """Per-token ``softmax_cross_entropy(h @ w + bias, labels)`` without the ``(..., V)`` logits array.

    Args:
      h: features ``(..., D)``, any float dtype (e.g. a model's bf16 final-norm output); the
        product runs in h's dtype with f32 accumulation, as ``nn.Dense(dtype=h.dtype)`` computes.
      w: the head's weight ``(D, V)`` (e.g. f32 parameters; its gradient comes back in w's dtype,
        accumulated over chunks in f32). For a head tied to an embedding ``E (V, D)`` pass ``E.T``.
      labels: int ``(...)``, in ``[0, V)``; negative labels are ignored (loss 0, no gradient).
      chunk: tokens per chunk (the last is padded): the largest transient array is ``chunk x V`` f32.
      logits_dtype: a float dtype the logits are rounded to before the softmax (in f32): the head's
        output dtype, e.g. ``jnp.bfloat16`` for a bf16 ``nn.Dense``, whose plain loss reads bf16
        logits. The default (f32) rounds nothing.
      bias: the head's bias ``(V,)`` or None; added in ``logits_dtype`` after the product's
        rounding, as ``nn.Dense`` adds it; its gradient (summed over chunks in f32) comes back in
        its dtype.
      summed: the caller's promise that the losses are only summed, each token with the same weight
        (``.sum()``, ``.mean()``, then any scalar math): the gradient is then computed in the
        forward, chunk by chunk, and the backward only scales it (no second head product: Liger
        Kernel's form); with any other use of the losses (a mask, per-token weights) ``w``'s and
        ``bias``'s gradients are wrong. ``bsr_jax.chunked_head_loss`` sets it where the traced
        loss function shows it; the default recomputes the logits in the backward, exact for any use.

    Returns:
      f32 ``(...)``: each token's ``logsumexp(logits) - logits[label]`` (0 where the label is
      negative). Differentiable in ``h``, ``w`` and ``bias``.
    """
    if h.ndim < 1 or h.shape[:-1] != labels.shape:
        raise ValueError(f"h must be (..., D) with labels (...): got h {h.shape}, labels {labels.shape}")
    if w.ndim != 2 or w.shape[0] != h.shape[-1]:
        raise ValueError(f"w must be (D, V) with D = h.shape[-1] = {h.shape[-1]}, got {w.shape}")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels must be integers, got {labels.dtype}")
    if bias is not None and bias.shape != (w.shape[1],):
        raise ValueError(f"bias must be (V,) with V = w.shape[1] = {w.shape[1]}, got {bias.shape}")
    if not jnp.issubdtype(logits_dtype, jnp.floating):
        raise ValueError(f"logits_dtype must be a float dtype (e.g. jnp.bfloat16, jnp.float32), got {logits_dtype!r}")
    features = h.reshape(-1, h.shape[-1])
    flat = labels.reshape(-1).astype(jnp.int32)
    count = flat.shape[0]
    chunk = max(1, min(chunk, count))
    pad = -count % chunk
    if pad:  # padding tokens carry label -1: no loss, no gradient
        features = jnp.pad(features, ((0, pad), (0, 0)))
        flat = jnp.pad(flat, (0, pad), constant_values=-1)
    losses = (_summed_losses if summed else _chunked_losses)(features.reshape(-1, chunk, h.shape[-1]), w, bias, flat.reshape(-1, chunk),
                                                             jnp.dtype(logits_dtype))  # fmt: skip
    return losses.reshape(-1)[:count].reshape(labels.shape)

