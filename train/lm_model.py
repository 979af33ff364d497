"""A decoder-only transformer LM written as current ones are (Llama-style), in Flax linen.

Layout, for tokens ``(B, T)`` int32 -> logits ``(B, T, V)`` float32::

    x = embed(tokens)                                       # (B, T, D), params f32, cast to dtype
    for each layer:                                         # Python loop or nn.scan
        x = x + o(attention(rope(q(n1(x))), rope(k(n1(x))), v(n1(x))))   # causal, H heads, KV key/value heads
        x = x + down(silu(gate(n2(x))) * up(n2(x)))          # SwiGLU MLP
    logits = head(norm(x))                                  # or embed.attend (tied)

Norms are a hand-written RMSNorm (statistics in f32), the MLP a hand-written ``silu(gate) * up``,
attention (``attention="xla"``) a hand-written causal softmax in f32: the forms
``bsr_jax.compress_model``'s lean pass has to recognise by what they compute
(``bsr_jax.rewrite.lean_graph``), as it will in users' models. ``attention="flash"`` runs
``jax.nn.dot_product_attention`` instead (cuDNN's flash attention on a GPU; ``train.lm_attention``).
With ``kv_heads`` below ``heads``, attention is grouped-query (Llama 3's): k and v have ``kv_heads``
heads, each serving ``heads / kv_heads`` query heads.
Every linear layer is an ``nn.Dense`` without bias; ``compress_model`` routes them by path
(``layer_3/attn/q``; under ``nn.scan`` one path for all layers, ``layers/attn/q``, its parameters
stacked on a leading axis). Computation runs in ``dtype`` (bf16 by default) with f32 parameters.

``scan=True`` stacks the layers with ``nn.scan`` (as MaxText and levanter do: one traced layer, so
compile time does not grow with depth); ``remat=True`` wraps each layer in ``nn.remat`` (inside
the scan when both are set), keeping only the layer input. Under ``train.sharding``'s FSDP layer by
layer, the scanned layer gathers its own parameters (``sharding.layer_gather``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from train import sharding
from train.lm_attention import attention_fn

_init = nn.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMShape:
    """A model's sizes: ``dim`` D, ``depth`` layers, ``heads`` H (head dim D / H), SwiGLU ``hidden``,
    ``vocab_size`` V (taken from the tokenizer when training; the preset's for compiled memory),
    ``seq_len`` T (the preset's default context), ``kv_heads`` KV key/value heads (dividing H;
    None: H, multi-head attention, which stays so when H is overridden)."""

    dim: int
    depth: int
    heads: int
    hidden: int
    vocab_size: int
    seq_len: int
    kv_heads: int | None = None

    @property
    def kv(self) -> int:
        """The number of key/value heads."""
        return self.kv_heads or self.heads


def swiglu_hidden(dim: int, multiple: int = 64) -> int:
    """Llama's SwiGLU width: 2/3 of 4 D (same parameters as a 4 D GELU MLP), rounded up to ``multiple``."""
    return multiple * math.ceil(8 * dim / 3 / multiple)


PRESETS: dict[str, LMShape] = {
    # A few million parameters: trains in minutes on 2 CPU cores.
    "cpu": LMShape(dim=256, depth=4, heads=4, hidden=swiglu_hidden(256), vocab_size=8192, seq_len=128),
    # GPT-2 small's shape (12 x 768, 12 heads) with Llama's blocks; vocabulary 32768.
    "gpt2-small": LMShape(dim=768, depth=12, heads=12, hidden=swiglu_hidden(768), vocab_size=32768, seq_len=1024),
    # ~1.1B parameters (Llama-style 16 x 2048 at vocabulary 32768): for compiled memory only.
    "1b": LMShape(dim=2048, depth=16, heads=16, hidden=swiglu_hidden(2048), vocab_size=32768, seq_len=2048),
    # Llama 3 8B's shape (~8.0B parameters: 32 x 4096, 8 key/value heads, SwiGLU 14336, vocabulary
    # 128256, T 8192): for compiled memory only (f32 parameters, AdamW moments and gradient: ~120 GiB).
    "8b": LMShape(dim=4096, depth=32, heads=32, kv_heads=8, hidden=14336, vocab_size=128256, seq_len=8192),
}


class RMSNorm(nn.Module):
    """``x / rms(x) * scale`` over the last axis, statistics in f32; output in ``dtype`` (or x's).
    Params: ``scale`` f32 (D,), initialised to ones."""

    eps: float = 1e-6
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(self.dtype or x.dtype)


def rope(x: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding of ``x (B, T, H, Dh)`` at positions 0..T-1 (pairs are the two
    halves of the head dimension, as in GPT-NeoX and Llama's Hugging Face port); computed in f32,
    returned in x's dtype."""
    seq_len, head_dim = x.shape[1], x.shape[3]
    inv_freq = 1.0 / base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # (T, Dh/2)
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nn.Module):
    heads: int
    depth: int  # of the whole model: the output projection's init is scaled by 1 / sqrt(2 depth)
    dtype: Any = None
    kv_heads: int | None = None  # None: heads
    attention: str = "xla"  # train.lm_attention.ATTENTIONS

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq_len, dim = x.shape
        head_dim, kv_heads = dim // self.heads, self.kv_heads or self.heads
        dense = lambda features, name, init=_init: nn.Dense(features, use_bias=False, dtype=self.dtype, kernel_init=init, name=name)
        split = lambda y: y.reshape(batch, seq_len, -1, head_dim)
        q = split(dense(dim, "q")(x))
        k, v = (split(dense(kv_heads * head_dim, name)(x)) for name in ("k", "v"))
        y = attention_fn(self.attention)(rope(q), rope(k), v).reshape(batch, seq_len, dim)
        return dense(dim, "o", nn.initializers.normal(0.02 / math.sqrt(2 * self.depth)))(y)


class SwiGLU(nn.Module):
    hidden: int
    depth: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = lambda features, name, init=_init: nn.Dense(features, use_bias=False, dtype=self.dtype, kernel_init=init, name=name)
        y = nn.silu(dense(self.hidden, "gate")(x)) * dense(self.hidden, "up")(x)
        return dense(x.shape[-1], "down", nn.initializers.normal(0.02 / math.sqrt(2 * self.depth)))(y)


class Layer(nn.Module):
    """One pre-norm block on ``(B, T, D)``; ``(x, None) -> (x, None)``, the carry form ``nn.scan`` takes."""

    heads: int
    hidden: int
    depth: int
    dtype: Any = None
    kv_heads: int | None = None
    attention: str = "xla"

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
        attn = Attention(self.heads, self.depth, self.dtype, self.kv_heads, self.attention, name="attn")
        x = x + attn(RMSNorm(dtype=self.dtype, name="norm1")(x))
        x = x + SwiGLU(self.hidden, self.depth, self.dtype, name="mlp")(RMSNorm(dtype=self.dtype, name="norm2")(x))
        return x, None


class LM(nn.Module):
    """Decoder-only LM: ``tokens (B, T)`` int -> logits ``(B, T, vocab_size)`` f32, or with
    ``features_only=True`` the final norm's output ``(B, T, D)`` in ``dtype`` (for a loss that
    applies the head itself, ``head_kernel``).

    Params: ``embed/embedding`` (V, D); ``layer_{i}/...`` (or ``layers/...`` stacked on a leading
    axis of size ``depth`` with ``scan``); ``norm/scale``; ``head/kernel`` (D, V) unless ``tie``.
    """

    shape: LMShape
    tie: bool = False
    scan: bool = False
    remat: bool = False
    remat_policy: Any = None  # with remat: a jax.checkpoint policy (None: keep nothing but the layer's input)
    dtype: Any = jnp.bfloat16
    attention: str = "xla"  # or "flash": train.lm_attention

    @nn.compact
    def __call__(self, tokens: jax.Array, features_only: bool = False) -> jax.Array:
        s = self.shape
        embed = nn.Embed(s.vocab_size, s.dim, embedding_init=_init, name="embed")
        x = embed(tokens).astype(self.dtype)
        layer = nn.remat(Layer, policy=self.remat_policy) if self.remat else Layer
        gather = sharding.layer_gather()
        if self.scan and gather is not None:  # FSDP layer by layer (train.sharding): gathered as each layer runs
            gathered = nn.map_variables(Layer, "params", trans_in_fn=lambda v: {**v, "params": gather(v["params"], self._dtypes(v["params"]))})
            # and gathered again for the backward, never kept, whatever else the layer keeps
            layer = nn.remat(gathered, policy=sharding.no_gathered_parameters if not self.remat else sharding.keeping_no_gathered(self.remat_policy))
        if self.scan:
            stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True, "pruning": True}, length=s.depth)
            x, _ = stack(s.heads, s.hidden, s.depth, self.dtype, s.kv_heads, self.attention, name="layers")(x, None)
        else:
            for i in range(s.depth):
                x, _ = layer(s.heads, s.hidden, s.depth, self.dtype, s.kv_heads, self.attention, name=f"layer_{i}")(x, None)
        x = RMSNorm(dtype=self.dtype, name="norm")(x)
        if features_only:
            return x
        if self.tie:
            return embed.attend(x.astype(jnp.float32))
        return nn.Dense(s.vocab_size, use_bias=False, dtype=self.dtype, kernel_init=_init, name="head")(x).astype(jnp.float32)

    def _dtypes(self, params: Any) -> Any:
        """The dtype a layer computes with each of its parameters: kernels in ``dtype`` (each
        ``nn.Dense`` casts its kernel), the rest (RMSNorm's scales) as they are."""
        return jax.tree_util.tree_map_with_path(lambda path, x: jnp.dtype(self.dtype if path[-1].key == "kernel" else x.dtype), params)


def head_kernel(params: dict[str, Any], tie: bool) -> jax.Array:
    """The head's ``(D, V)`` f32 weight in ``params``: the embedding transposed when tied."""
    return params["embed"]["embedding"].T if tie else params["head"]["kernel"]


def num_params(shape: LMShape, tie: bool = False) -> int:
    """Parameter count of ``LM(shape, tie)``, from the shapes (nothing runs)."""
    d, v = shape.dim, shape.vocab_size
    kv_dim = d // shape.heads * shape.kv
    layer = 2 * d * d + 2 * d * kv_dim + 3 * d * shape.hidden + 2 * d
    return v * d * (1 if tie else 2) + shape.depth * layer + d
