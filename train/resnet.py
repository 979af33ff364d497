"""ResNet v1.5 (He et al. 2016; stride on the 3x3 conv of the bottleneck) in Flax linen.

The shape of flax's ``examples/imagenet/models.py``: blocks take their convolution and norm as
``ModuleDef``s (``functools.partial``s). Two ways to compress every convolution's input for the
backward pass while the forward pass stays exactly that of ``nn.Conv``:

* ``bsr_jax.compress_model(ResNet18(...), compression_rules(bsr_jax.Pooling(2)))`` (what
  ``train.models.create_model`` builds): the plain model, routed, with lean neighbours (BatchNorm
  keeps its input, ReLU a 1-bit mask; exact), so a ResNet keeps about a third of its dense
  residual bytes instead of 0.84 (docs/RESULTS.md section 8);
* ``conv=conv_def(bsr_jax.Pooling(2))`` (or ``bsr_jax.Pruning``): the convolutions alone; BatchNorm
  and ReLU keep what plain autodiff keeps.

``stem="cifar"`` swaps the ImageNet stem (7x7 stride-2 conv and 3x3 stride-2 max-pool) for one 3x3
stride-1 conv, the usual variant for 32 px images.

BatchNorm runs on the ``batch_stats`` collection: ``apply(variables, x, train=True,
mutable=["batch_stats"])`` in training, ``train=False`` for evaluation (running averages).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

import bsr_jax

ModuleDef = Any
Stem = Literal["imagenet", "cifar"]
STEMS = ("imagenet", "cifar")


# Flax's automatic name of the classifier (ResNet's one ``dense`` call; nn.Dense -> "Dense_0").
CLASSIFIER_PATH = "Dense_0"


def compression_rules(compression: bsr_jax.Pooling | bsr_jax.Pruning) -> list[bsr_jax.Rule]:
    """``bsr_jax.compress_model`` rules for a ``ResNet``: every convolution keeps ``compression``
    of its input, the classifier stays dense (a ``Pooling`` rule would not apply to it anyway)."""
    return [bsr_jax.Rule(CLASSIFIER_PATH, None), bsr_jax.Rule("*", compression)]


def conv_def(compression: bsr_jax.Pooling | bsr_jax.Pruning | None = None) -> ModuleDef:
    """A ``bsr_jax.Conv`` constructor carrying ``compression``, for ``ResNet(conv=...)``;
    ``None`` is exactly ``nn.Conv``."""
    return functools.partial(bsr_jax.Conv, compression=compression)


class _ResidualBlock(nn.Module):
    """What both block kinds share: their attributes and ``act(shortcut(x) + y)``."""

    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable[[jax.Array], jax.Array]
    strides: tuple[int, int] = (1, 1)

    def add_shortcut(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """``act(x + y)``, x through a strided 1x1 projection and norm where the shape changes."""
        if x.shape != y.shape:
            x = self.norm(name="norm_proj")(self.conv(y.shape[-1], (1, 1), self.strides, name="conv_proj")(x))
        return self.act(x + y)


class ResNetBlock(_ResidualBlock):
    """Two 3x3 convs (ResNet-18/34); a 1x1 projection shortcut where the shape changes."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(x)))
        # Zero-initialised last scale: each block starts as the identity (Goyal et al. 2017).
        y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(self.filters, (3, 3))(y))
        return self.add_shortcut(x, y)


class BottleneckResNetBlock(_ResidualBlock):
    """1x1 reduce, 3x3 (strided: v1.5), 1x1 expand to ``4 * filters``; projection shortcut."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.act(self.norm()(self.conv(self.filters, (1, 1))(x)))
        y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
        y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(4 * self.filters, (1, 1))(y))
        return self.add_shortcut(x, y)


class ResNet(nn.Module):
    """ResNet classifier for images ``(B, H, W, C)`` -> logits ``(B, num_classes)`` float32.

    Attributes:
      stage_sizes: blocks per stage; stage ``i`` has ``num_filters * 2**i`` filters and its first
        block strides by 2 (except stage 0).
      block_cls: ``ResNetBlock`` or ``BottleneckResNetBlock``.
      num_classes: output classes.
      num_filters: filters of the stem and the first stage.
      stem: ``"imagenet"`` (7x7/2 conv, 3x3/2 max-pool) or ``"cifar"`` (3x3/1 conv, no pooling).
      conv: convolution constructor (``nn.Conv``, or ``conv_def(compression)``); called with
        ``use_bias=False`` and ``dtype``.
      norm: norm constructor (``nn.BatchNorm`` or a drop-in), called with ``use_running_average``,
        ``momentum=0.9``, ``epsilon=1e-5``, ``dtype`` and ``axis_name``.
      dense: classifier constructor (``nn.Dense``).
      axis_name: mapped axis BatchNorm averages its batch statistics over (data parallel), or None.
      act: activation.
      dtype: computation dtype (e.g. ``jnp.bfloat16``); params stay float32.
    """

    stage_sizes: Sequence[int]
    block_cls: ModuleDef
    num_classes: int
    num_filters: int = 64
    stem: Stem = "imagenet"
    conv: ModuleDef = nn.Conv
    norm: ModuleDef = nn.BatchNorm
    dense: ModuleDef = nn.Dense
    axis_name: str | None = None
    act: Callable[[jax.Array], jax.Array] = nn.relu
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        if self.stem not in STEMS:
            raise ValueError(f"stem must be one of {STEMS}, got {self.stem!r}")
        conv = functools.partial(self.conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            self.norm, use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=self.dtype, axis_name=self.axis_name
        )
        if self.stem == "imagenet":
            x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
            x = self.act(norm(name="bn_init")(x))
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        else:
            x = conv(self.num_filters, (3, 3), name="conv_init")(x)
            x = self.act(norm(name="bn_init")(x))
        for i, size in enumerate(self.stage_sizes):
            for j in range(size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = self.block_cls(self.num_filters * 2**i, conv=conv, norm=norm, act=self.act, strides=strides)(x)
        x = jnp.mean(x, axis=(1, 2))
        return self.dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


PRESETS: dict[str, dict[str, Any]] = {
    "resnet18": dict(stage_sizes=(2, 2, 2, 2), block_cls=ResNetBlock),
    "resnet50": dict(stage_sizes=(3, 4, 6, 3), block_cls=BottleneckResNetBlock),
}
ResNet18 = functools.partial(ResNet, **PRESETS["resnet18"])
ResNet50 = functools.partial(ResNet, **PRESETS["resnet50"])
