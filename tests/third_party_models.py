"""Small stand-ins for models users bring, written the way their authors write them.

Our own equivalents (not copies) of google-research/vision_transformer's MLP-Mixer and ViT
(``MlpBlock``, ``MixerBlock``, ``Encoder1DBlock``), flax ``examples/lm1b``'s decoder-only
TransformerLM (``EncoderDecoder1DBlock``, ReLU MLP, causal + padding mask) and a LayerNorm + two
Linear NNX model. They use plain ``nn.Dense``/``nn.DenseGeneral`` (inside
``nn.MultiHeadDotProductAttention``)/``nn.LayerNorm``/``nn.gelu``/``nn.relu`` and know nothing of
bsr_jax: ``compress_model`` and the lean neighbours must handle them unmodified. GPT-2 and Llama
are written as transformers' Flax models are: custom projection modules and bare products on
parameters, activations from an ``ACT2FN`` dict, heads tied through nested applies, hand-written
RMSNorm, SwiGLU and einsum attention with rotary embeddings. ``HFResNetForImageClassification`` is a
bottleneck ResNet written as transformers' Flax ResNet is: each conv layer a module of convolution,
``nn.BatchNorm`` submodule and activation from ``ACT2FN``; the projection shortcut a module of
convolution and BatchNorm; the shortcut added, and ReLU applied, in the parent block.

``ISSUE`` is issue 13's configuration (4 layers, width 128, MLP 512, batch 8); ``TINY`` is small
enough for unit tests. Images are 32x32x3 with 4x4 patches (64 tokens); the LM reads 64 tokens of a
512-word vocabulary (the lm1b example's 30k vocabulary would make the logits dominate).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int
    width: int
    mlp: int
    heads: int
    batch: int
    image: int = 32
    patch: int = 4
    classes: int = 10
    vocab: int = 512
    length: int = 64


ISSUE = Config(layers=4, width=128, mlp=512, heads=4, batch=8)
TINY = Config(layers=2, width=32, mlp=64, heads=2, batch=2, image=16, length=16, vocab=64)


# ---- MLP-Mixer (vision_transformer models_mixer.py style) ----


class MlpBlock(nn.Module):
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(self.mlp_dim)(x)
        y = nn.gelu(y)
        return nn.Dense(x.shape[-1])(y)


class MixerBlock(nn.Module):
    tokens_mlp_dim: int
    channels_mlp_dim: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        y = jnp.swapaxes(y, 1, 2)
        y = MlpBlock(self.tokens_mlp_dim, name="token_mixing")(y)
        y = jnp.swapaxes(y, 1, 2)
        x = x + y
        y = nn.LayerNorm()(x)
        return x + MlpBlock(self.channels_mlp_dim, name="channel_mixing")(y)


class MlpMixer(nn.Module):
    patch: int
    num_classes: int
    num_blocks: int
    hidden_dim: int
    tokens_mlp_dim: int
    channels_mlp_dim: int

    @nn.compact
    def __call__(self, inputs, *, train: bool = False):
        del train
        x = nn.Conv(self.hidden_dim, (self.patch, self.patch), strides=(self.patch, self.patch), name="stem")(inputs)
        n, h, w, c = x.shape
        x = x.reshape(n, h * w, c)
        for _ in range(self.num_blocks):
            x = MixerBlock(self.tokens_mlp_dim, self.channels_mlp_dim)(x)
        x = nn.LayerNorm(name="pre_head_layer_norm")(x)
        x = jnp.mean(x, axis=1)
        return nn.Dense(self.num_classes, kernel_init=nn.initializers.zeros, name="head")(x)


# ---- ViT (vision_transformer models_vit.py style) ----


class AddPositionEmbs(nn.Module):
    @nn.compact
    def __call__(self, inputs):
        shape = (1, inputs.shape[1], inputs.shape[2])
        pe = self.param("pos_embedding", nn.initializers.normal(stddev=0.02), shape)
        return inputs + pe


class ViTMlpBlock(nn.Module):
    mlp_dim: int
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, inputs, *, deterministic):
        x = nn.Dense(self.mlp_dim, kernel_init=nn.initializers.xavier_uniform(), bias_init=nn.initializers.normal(stddev=1e-6))(inputs)
        x = nn.gelu(x)
        x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)
        x = nn.Dense(inputs.shape[-1], kernel_init=nn.initializers.xavier_uniform(), bias_init=nn.initializers.normal(stddev=1e-6))(x)
        return nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)


class Encoder1DBlock(nn.Module):
    mlp_dim: int
    num_heads: int
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, inputs, *, deterministic):
        x = nn.LayerNorm()(inputs)
        x = nn.MultiHeadDotProductAttention(
            kernel_init=nn.initializers.xavier_uniform(),
            broadcast_dropout=False,
            deterministic=deterministic,
            dropout_rate=self.attention_dropout_rate,
            num_heads=self.num_heads,
        )(x, x)
        x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic)
        x = x + inputs
        y = nn.LayerNorm()(x)
        y = ViTMlpBlock(self.mlp_dim, self.dropout_rate)(y, deterministic=deterministic)
        return x + y


class VisionTransformer(nn.Module):
    patch: int
    num_classes: int
    num_layers: int
    hidden_size: int
    mlp_dim: int
    num_heads: int
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, inputs, *, train: bool = False):
        x = nn.Conv(self.hidden_size, (self.patch, self.patch), strides=(self.patch, self.patch), name="embedding")(inputs)
        n, h, w, c = x.shape
        x = x.reshape(n, h * w, c)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
        x = jnp.concatenate([jnp.tile(cls, [n, 1, 1]), x], axis=1)
        x = AddPositionEmbs(name="posembed_input")(x)
        x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=not train)
        for i in range(self.num_layers):
            x = Encoder1DBlock(self.mlp_dim, self.num_heads, self.dropout_rate, self.attention_dropout_rate, name=f"encoderblock_{i}")(
                x, deterministic=not train
            )
        x = nn.LayerNorm(name="encoder_norm")(x)
        return nn.Dense(self.num_classes, kernel_init=nn.initializers.zeros, name="head")(x[:, 0])


# ---- lm1b TransformerLM (flax examples/lm1b models.py style, decoder only) ----


def shift_right(x):
    return jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]


class LmMlpBlock(nn.Module):
    mlp_dim: int
    dropout_rate: float
    deterministic: bool
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, inputs):
        init = dict(kernel_init=nn.initializers.xavier_uniform(), bias_init=nn.initializers.normal(stddev=1e-6), dtype=self.dtype)
        x = nn.Dense(self.mlp_dim, **init)(inputs)
        x = nn.relu(x)
        x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=self.deterministic)
        x = nn.Dense(inputs.shape[-1], **init)(x)
        return nn.Dropout(rate=self.dropout_rate)(x, deterministic=self.deterministic)


class EncoderDecoder1DBlock(nn.Module):
    mlp_dim: int
    num_heads: int
    dropout_rate: float
    deterministic: bool
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, inputs, decoder_mask=None):
        x = nn.LayerNorm(dtype=self.dtype)(inputs)
        x = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            dtype=self.dtype,
            kernel_init=nn.initializers.xavier_uniform(),
            bias_init=nn.initializers.normal(stddev=1e-6),
            use_bias=False,
            broadcast_dropout=False,
            dropout_rate=self.dropout_rate,
            deterministic=self.deterministic,
        )(x, mask=decoder_mask)
        x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=self.deterministic)
        x = x + inputs
        z = nn.LayerNorm(dtype=self.dtype)(x)
        z = LmMlpBlock(self.mlp_dim, self.dropout_rate, self.deterministic, self.dtype)(z)
        return x + z


class TransformerLM(nn.Module):
    vocab_size: int
    emb_dim: int
    num_layers: int
    mlp_dim: int
    num_heads: int
    max_len: int
    dropout_rate: float = 0.1
    deterministic: bool = True
    dtype: Any = jnp.float32  # computation dtype (lm1b trains in bfloat16); params stay float32

    @nn.compact
    def __call__(self, inputs):
        decoder_mask = nn.combine_masks(nn.make_attention_mask(inputs > 0, inputs > 0), nn.make_causal_mask(inputs))
        embed = nn.Embed(self.vocab_size, self.emb_dim, embedding_init=nn.initializers.normal(stddev=1.0), name="embed")
        y = embed(shift_right(inputs).astype("int32"))
        pos = self.param("pos_embedding", nn.initializers.normal(stddev=0.02), (1, self.max_len, self.emb_dim))
        y = y + pos[:, : y.shape[1]]
        y = nn.Dropout(rate=self.dropout_rate)(y, deterministic=self.deterministic)
        y = y.astype(self.dtype)
        for lyr in range(self.num_layers):
            block = EncoderDecoder1DBlock(self.mlp_dim, self.num_heads, self.dropout_rate, self.deterministic, self.dtype, name=f"encoderdecoderblock_{lyr}")
            y = block(y, decoder_mask)
        y = nn.LayerNorm(dtype=self.dtype, name="encoderdecoder_norm")(y)
        return nn.Dense(self.vocab_size, kernel_init=nn.initializers.xavier_uniform(), dtype=self.dtype, name="logitdense")(y)


# ---- NNX: LayerNorm + two Linear ----


class NnxMlp(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(din, rngs=rngs)
        self.fc1 = nnx.Linear(din, dhidden, rngs=rngs)
        self.fc2 = nnx.Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.fc2(nnx.gelu(self.fc1(self.norm(x))))


# ---- a ResNet as transformers writes it in Flax ----
# BatchNorm is each layer's own submodule and the block's parent adds the shortcut and applies the
# activation, so BatchNorm outputs cross module boundaries (bsr_jax issue 31: lean neighbours kept
# both BatchNorm outputs and the ReLU output at each residual add). ``deterministic=False`` trains
# (batch statistics, ``mutable=["batch_stats"]``), as the library's ``train=True`` does.


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    embedding_size: int = 64
    hidden_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
    depths: tuple[int, ...] = (3, 4, 6, 3)
    num_labels: int = 1000
    hidden_act: str = "relu"


class Identity(nn.Module):
    @nn.compact
    def __call__(self, x, **kwargs):
        return x


class HFResNetConvLayer(nn.Module):
    out_channels: int
    kernel_size: int = 3
    stride: int = 1
    activation: str | None = "relu"

    def setup(self):
        k = self.kernel_size
        self.convolution = nn.Conv(self.out_channels, (k, k), strides=self.stride, padding=k // 2, use_bias=False)
        self.normalization = nn.BatchNorm(momentum=0.9, epsilon=1e-5)
        self.activation_func = ACT2FN[self.activation] if self.activation is not None else Identity()

    def __call__(self, x, deterministic: bool = True):
        h = self.normalization(self.convolution(x), use_running_average=deterministic)
        return self.activation_func(h)


class HFResNetShortCut(nn.Module):
    out_channels: int
    stride: int = 2

    def setup(self):
        self.convolution = nn.Conv(self.out_channels, (1, 1), strides=self.stride, use_bias=False)
        self.normalization = nn.BatchNorm(momentum=0.9, epsilon=1e-5)

    def __call__(self, x, deterministic: bool = True):
        return self.normalization(self.convolution(x), use_running_average=deterministic)


class HFResNetBottleNeckLayerCollection(nn.Module):
    out_channels: int
    stride: int = 1
    reduction: int = 4

    def setup(self):
        reduced = self.out_channels // self.reduction
        self.layer = [
            HFResNetConvLayer(reduced, kernel_size=1, name="0"),
            HFResNetConvLayer(reduced, stride=self.stride, name="1"),
            HFResNetConvLayer(self.out_channels, kernel_size=1, activation=None, name="2"),
        ]

    def __call__(self, h, deterministic: bool = True):
        for layer in self.layer:
            h = layer(h, deterministic=deterministic)
        return h


class HFResNetBottleNeckLayer(nn.Module):
    in_channels: int
    out_channels: int
    stride: int = 1
    activation: str = "relu"

    def setup(self):
        projected = self.in_channels != self.out_channels or self.stride != 1
        self.shortcut = HFResNetShortCut(self.out_channels, stride=self.stride) if projected else None
        self.layer = HFResNetBottleNeckLayerCollection(self.out_channels, stride=self.stride)
        self.activation_func = ACT2FN[self.activation]

    def __call__(self, h, deterministic: bool = True):
        residual = h if self.shortcut is None else self.shortcut(h, deterministic=deterministic)
        h = self.layer(h, deterministic)
        h += residual
        return self.activation_func(h)


class HFResNetStage(nn.Module):
    config: ResNetConfig
    in_channels: int
    out_channels: int
    stride: int = 2
    depth: int = 2

    def setup(self):
        act = self.config.hidden_act
        first = HFResNetBottleNeckLayer(self.in_channels, self.out_channels, stride=self.stride, activation=act, name="0")
        rest = [HFResNetBottleNeckLayer(self.out_channels, self.out_channels, activation=act, name=str(i + 1)) for i in range(self.depth - 1)]
        self.layers = [first, *rest]

    def __call__(self, h, deterministic: bool = True):
        for layer in self.layers:
            h = layer(h, deterministic=deterministic)
        return h


class HFResNetModule(nn.Module):
    config: ResNetConfig

    def setup(self):
        c = self.config
        self.embedder = HFResNetConvLayer(c.embedding_size, kernel_size=7, stride=2, activation=c.hidden_act)
        ins = (c.embedding_size, *c.hidden_sizes[:-1])
        self.stages = [HFResNetStage(c, i, o, stride=1 if k == 0 else 2, depth=d, name=str(k))
                       for k, (i, o, d) in enumerate(zip(ins, c.hidden_sizes, c.depths))]  # fmt: skip

    def __call__(self, pixel_values, deterministic: bool = True):
        h = self.embedder(pixel_values, deterministic=deterministic)
        h = nn.max_pool(h, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        for stage in self.stages:
            h = stage(h, deterministic=deterministic)
        return nn.avg_pool(h, h.shape[1:3], strides=h.shape[1:3])  # (B, 1, 1, C)


class HFResNetForImageClassification(nn.Module):
    """Images ``(B, H, W, 3)`` (channels last, as the library's module receives them) -> logits."""

    config: ResNetConfig

    def setup(self):
        self.resnet = HFResNetModule(self.config)
        self.classifier = nn.Dense(self.config.num_labels)

    def __call__(self, pixel_values, deterministic: bool = True):
        return self.classifier(self.resnet(pixel_values, deterministic)[:, 0, 0, :])


# ---- factories at a config, with inputs and losses ----


def mixer(c: Config = ISSUE) -> MlpMixer:
    return MlpMixer(c.patch, c.classes, c.layers, c.width, tokens_mlp_dim=c.width // 2, channels_mlp_dim=c.mlp)


def vit(c: Config = ISSUE, dropout_rate: float = 0.0) -> VisionTransformer:
    return VisionTransformer(c.patch, c.classes, c.layers, c.width, c.mlp, c.heads, dropout_rate, dropout_rate)


def lm(c: Config = ISSUE, dropout_rate: float = 0.0, dtype=jnp.float32) -> TransformerLM:
    return TransformerLM(c.vocab, c.width, c.layers, c.mlp, c.heads, c.length, dropout_rate, dropout_rate == 0.0, dtype)


def nnx_mlp(c: Config = ISSUE, seed: int = 0) -> NnxMlp:
    return NnxMlp(c.width, c.mlp, c.classes, rngs=nnx.Rngs(seed))


def images(c: Config = ISSUE, seed: int = 0) -> jax.Array:
    """(batch, image, image, 3) float32 normal."""
    return jax.random.normal(jax.random.key(seed), (c.batch, c.image, c.image, 3), jnp.float32)


def labels(c: Config = ISSUE, seed: int = 1) -> jax.Array:
    """(batch,) int32 class ids."""
    return jax.random.randint(jax.random.key(seed), (c.batch,), 0, c.classes)


def tokens(c: Config = ISSUE, seed: int = 0) -> jax.Array:
    """(batch, length) int32 in [1, vocab) with the last quarter zero-padded (exercises the mask)."""
    t = jax.random.randint(jax.random.key(seed), (c.batch, c.length), 1, c.vocab)
    return t.at[:, 3 * c.length // 4 :].set(0)


def features(c: Config = ISSUE, seed: int = 0) -> jax.Array:
    """(batch, 16, width) float32 normal: the NNX model's input."""
    return jax.random.normal(jax.random.key(seed), (c.batch, 16, c.width), jnp.float32)


def classifier_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross entropy; logits (..., classes), labels (...) int."""
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def lm_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Next-token cross entropy over non-padding positions (the model shifts its input right)."""
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    weights = (tokens > 0).astype(logp.dtype)
    return jnp.sum(nll * weights) / jnp.sum(weights)


@functools.partial(jax.jit, static_argnames=("seed", "scale"))
def jitter(params, seed: int = 0, scale: float = 0.05):
    """``params`` plus small normal noise on every leaf: the published inits zero the heads (and
    set LayerNorm scales to one), which would make most gradients zero or symmetric in tests.
    Jitted: one compile instead of one per leaf shape (XLA:CPU compiles each eager op)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [p + scale * jax.random.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, noisy)


# ---- GPT-2 and Llama as a widely used model library writes them in Flax ----
# Projections are the library's own modules or bare products on ``self.param``s (not nn.Dense),
# activations come from a dict of functions bound at import, the LM heads are tied through a nested
# ``apply`` / ``Embed.attend``, and Llama's norm, gated MLP and attention are written by hand.


def quick_gelu(x):
    return x * jax.nn.sigmoid(1.702 * x)


ACT2FN = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "quick_gelu": quick_gelu,
}


class FlaxConv1D(nn.Module):
    """GPT-2's projection: kernel stored (out, in), applied with ``lax.dot_general`` on its transpose."""

    features: int

    @nn.compact
    def __call__(self, inputs):
        kernel = self.param("kernel", nn.initializers.normal(stddev=0.02), (self.features, inputs.shape[-1]))
        kernel = jnp.asarray(kernel.transpose(), inputs.dtype)
        y = jax.lax.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())))
        return y + jnp.asarray(self.param("bias", nn.initializers.zeros, (self.features,)), inputs.dtype)


class GPT2Attention(nn.Module):
    width: int
    heads: int

    def setup(self):
        self.c_attn = FlaxConv1D(3 * self.width)
        self.c_proj = FlaxConv1D(self.width)

    def __call__(self, h):
        b, t, e = h.shape
        q, k, v = jnp.split(self.c_attn(h), 3, axis=2)
        q, k, v = (a.reshape(b, t, self.heads, e // self.heads) for a in (q, k, v))
        mask = nn.make_causal_mask(jnp.ones((b, t), "bool"), dtype="bool")
        bias = jax.lax.select(mask, jnp.zeros(mask.shape, h.dtype), jnp.full(mask.shape, -1e4, h.dtype))
        weights = nn.dot_product_attention_weights(q, k, bias=bias)
        out = jnp.einsum("...hqk,...khd->...qhd", weights, v)
        return self.c_proj(out.reshape(b, t, e))


class GPT2MLP(nn.Module):
    hidden: int
    width: int
    activation: str = "gelu_new"

    def setup(self):
        self.c_fc = FlaxConv1D(self.hidden)
        self.c_proj = FlaxConv1D(self.width)
        self.act = ACT2FN[self.activation]

    def __call__(self, h):
        return self.c_proj(self.act(self.c_fc(h)))


class GPT2Block(nn.Module):
    width: int
    hidden: int
    heads: int

    def setup(self):
        self.ln_1 = nn.LayerNorm(epsilon=1e-5)
        self.attn = GPT2Attention(self.width, self.heads)
        self.ln_2 = nn.LayerNorm(epsilon=1e-5)
        self.mlp = GPT2MLP(self.hidden, self.width)

    def __call__(self, h):
        h = h + self.attn(self.ln_1(h))
        return h + self.mlp(self.ln_2(h))


class GPT2Module(nn.Module):
    vocab: int
    width: int
    hidden: int
    heads: int
    layers: int
    length: int

    def setup(self):
        self.wte = nn.Embed(self.vocab, self.width, embedding_init=nn.initializers.normal(stddev=0.02))
        self.wpe = nn.Embed(self.length, self.width, embedding_init=nn.initializers.normal(stddev=0.02))
        self.h = [GPT2Block(self.width, self.hidden, self.heads, name=str(i)) for i in range(self.layers)]
        self.ln_f = nn.LayerNorm(epsilon=1e-5)

    def __call__(self, tokens):
        h = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1])[None])
        for block in self.h:
            h = block(h)
        return self.ln_f(h)


class GPT2LMHead(nn.Module):
    """Tied head: the word embedding, transposed, applied through the head's own nested ``apply``."""

    vocab: int
    width: int
    hidden: int
    heads: int
    layers: int
    length: int

    def setup(self):
        self.transformer = GPT2Module(self.vocab, self.width, self.hidden, self.heads, self.layers, self.length)
        self.lm_head = nn.Dense(self.vocab, use_bias=False)

    def __call__(self, tokens):
        h = self.transformer(tokens)
        shared_kernel = self.transformer.variables["params"]["wte"]["embedding"].T
        return self.lm_head.apply({"params": {"kernel": shared_kernel}}, h)


class LlamaRMSNorm(nn.Module):
    eps: float = 1e-6

    @nn.compact
    def __call__(self, h):
        weight = self.param("weight", nn.initializers.ones, (h.shape[-1],))
        variance = jnp.mean(jnp.asarray(h, jnp.float32) ** 2, axis=-1, keepdims=True)
        return weight * (h * jax.lax.rsqrt(variance + self.eps)).astype(h.dtype)


def rotate_half(x):
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-second, first], axis=-1)


def rotary(length: int, depth: int):
    """(length, 1, depth) cos and sin tables, as numpy constants (computed once, at trace time)."""
    inv = 1.0 / (10000 ** (np.arange(0, depth, 2) / depth))
    angles = np.concatenate([np.outer(np.arange(length), inv)] * 2, axis=-1)[:, None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class LlamaAttention(nn.Module):
    """q/k/v/o as einsums on the module's own kernels; scores, softmax and mixing as einsums."""

    width: int
    heads: int

    @nn.compact
    def __call__(self, h):
        b, t, _ = h.shape
        d = self.width // self.heads
        init = nn.initializers.normal(stddev=0.02)
        wq, wk, wv = (self.param(n, init, (self.width, self.heads, d)) for n in ("q_proj", "k_proj", "v_proj"))
        wo = self.param("o_proj", init, (self.heads, d, self.width))
        q, k, v = (jnp.einsum("btd,dhk->bthk", h, w) for w in (wq, wk, wv))
        cos, sin = rotary(t, d)
        q, k = (a * cos + rotate_half(a) * sin for a in (q, k))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d).astype(np.float32)
        scores = jnp.where(np.tril(np.ones((t, t), bool)), scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return jnp.einsum("bthk,hkd->btd", out, wo)


class LlamaMLP(nn.Module):
    """SwiGLU with ``x @ w`` products and the activation from ACT2FN."""

    width: int
    hidden: int
    activation: str = "silu"

    @nn.compact
    def __call__(self, h):
        init = nn.initializers.normal(stddev=0.02)
        gate = self.param("gate_proj", init, (self.width, self.hidden))
        up = self.param("up_proj", init, (self.width, self.hidden))
        down = self.param("down_proj", init, (self.hidden, self.width))
        return (ACT2FN[self.activation](h @ gate) * (h @ up)) @ down


class LlamaBlock(nn.Module):
    width: int
    hidden: int
    heads: int

    @nn.compact
    def __call__(self, h):
        h = h + LlamaAttention(self.width, self.heads, name="self_attn")(LlamaRMSNorm(name="input_layernorm")(h))
        return h + LlamaMLP(self.width, self.hidden, name="mlp")(LlamaRMSNorm(name="post_attention_layernorm")(h))


class LlamaForCausalLM(nn.Module):
    """Tied head through ``Embed.attend``."""

    vocab: int
    width: int
    hidden: int
    heads: int
    layers: int

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.width, embedding_init=nn.initializers.normal(stddev=0.02), name="embed_tokens")
        h = embed(tokens)
        for i in range(self.layers):
            h = LlamaBlock(self.width, self.hidden, self.heads, name=f"layers_{i}")(h)
        return embed.attend(LlamaRMSNorm(name="norm")(h))


def gpt2(c: Config = ISSUE) -> GPT2LMHead:
    return GPT2LMHead(c.vocab, c.width, c.mlp, c.heads, c.layers, c.length)


def llama(c: Config = ISSUE) -> LlamaForCausalLM:
    return LlamaForCausalLM(c.vocab, c.width, c.mlp, c.heads, c.layers)


def hf_resnet(c: ResNetConfig = ResNetConfig()) -> HFResNetForImageClassification:
    """transformers' ResNet-50 at the default config; smaller ones for tests."""
    return HFResNetForImageClassification(c)
