"""The LM's causal attention, by ``--attention``; both take grouped-query attention (``kv_heads``).

``"xla"``: ``causal_attention``, a hand-written softmax that holds the ``(B, H, T, T)`` scores and
probabilities in f32, the form ``bsr_jax.compress_model``'s lean pass recognises in users' models.
``"flash"``: ``flash_attention``, ``jax.nn.dot_product_attention(..., is_causal=True)`` with its
implementation chosen by the platform the step is lowered for (``bsr_jax.core.platforms``), so a
step compiled ahead of time for an H100 on a CPU host gets the GPU's: cuDNN's fused flash attention
on a GPU, which never holds the ``(T, T)`` scores; XLA's elsewhere, on CPU and, for now, on TPU
(Pallas splash attention for TPU is not wired yet), which computes what ``"xla"`` computes.

cuDNN's kernel takes bf16 or f16 (a float32 step runs XLA's on every platform) and a head dimension
that is a multiple of 8, at most 128 before Hopper and 256 from it (jax raises otherwise, naming it).
Tracing it needs cuDNN's library (``nvidia-cudnn-cu12``: jax's CUDA wheels bring it, the ``aot`` extra
does not): a host without it, such as a CPU host compiling for ``--target h100``, gets XLA's in the
GPU branch, with a warning. With it, the cuDNN kernel compiles deviceless for an H100 (jax 0.10.2,
cuDNN 9.28); XLA's cost model counts no FLOPs in it, ``bsr_jax.measure.roofline`` counts its products.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp

from bsr_jax.core.platforms import by_lowering_platform
from bsr_jax.measure import compiled

ATTENTIONS = ("xla", "flash")  # train.lm_config repeats them (a test keeps them equal)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Softmax attention of ``q, k, v (B, T, H, Dh)``, each position attending to itself and earlier
    ones; scores and softmax in f32, output ``(B, T, H, Dh)`` in q's dtype."""
    seq_len, head_dim = q.shape[1], q.shape[3]
    scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq_len, seq_len), jnp.bool_))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhts,bshd->bthd", probs, v)


def grouped_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``causal_attention`` of ``q (B, T, H, Dh)`` with ``k, v (B, T, KV, Dh)``, KV dividing H:
    query head ``h`` attends with key/value head ``h // (H / KV)``, as ``jax.nn.dot_product_attention``
    groups them. The key/value heads are repeated to H, which costs ``(B, T, H, Dh)`` beside the
    ``(B, H, T, T)`` scores; with KV = H nothing is repeated (multi-head attention, as before)."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    return causal_attention(q, k, v)


def _cudnn_on_host() -> bool:
    """Whether cuDNN's attention traces here: jax looks up the cuDNN library's version as it traces
    it (found once jax's CUDA plugin has started, for a GPU or a deviceless GPU target)."""
    bf16 = jax.ShapeDtypeStruct((1, 8, 1, 64), jnp.bfloat16)
    try:
        jax.eval_shape(functools.partial(jax.nn.dot_product_attention, implementation="cudnn"), bf16, bf16, bf16)
        return True
    except RuntimeError:  # "cuDNN not found." (the CUDA plugin without the library), "cuDNN is not detected."
        if compiled.plugin_installed("h100"):  # this host could compile for a GPU: say what that step would run
            warnings.warn("--attention flash: jax finds no cuDNN library here (pip install nvidia-cudnn-cu12), so a step "
                          "lowered here for a GPU runs XLA's attention, holding (B, heads, T, T) scores", stacklevel=3)  # fmt: skip
        return False


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal ``jax.nn.dot_product_attention`` of ``q (B, T, H, Dh)``, ``k, v (B, T, KV, Dh)`` (KV
    dividing H), output ``(B, T, H, Dh)`` in q's dtype: cuDNN's when lowered for a CUDA GPU (bf16/f16
    inputs, cuDNN on the host), XLA's otherwise."""
    xla = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")
    if q.dtype not in (jnp.bfloat16, jnp.float16) or not _cudnn_on_host():
        return xla(q, k, v)
    cudnn = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
    return by_lowering_platform(xla, {"cuda": cudnn}, q, k, v)


def attention_fn(name: str):
    """The ``(q, k, v) -> out`` function ``--attention name`` runs."""
    return {"xla": grouped_causal_attention, "flash": flash_attention}[name]
