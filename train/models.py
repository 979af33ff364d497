"""ResMLP (Touvron et al. 2021, "ResMLP: Feedforward networks for image classification") in Flax linen.

Every linear layer is a ``dense`` module passed in by the caller, normally a ``functools.partial``
of ``bsr_jax.Dense`` that carries the sparsity, block, criterion, selection and backend (see
``dense_def``). At sparsity 0 it is exactly the plain model. Only the weight gradients of the
sparse layers are approximate; the forward pass and every input gradient are exact.

Layout of one block, for tokens ``x (B, T, D)``::

    x = x + LayerScale(TokenMixing(Affine(x)^T)^T)     # linear over the token axis (T -> T)
    x = x + LayerScale(fc2(GELU(fc1(Affine(x)))))      # D -> 4D -> D

Affine (``alpha * x + beta``) and LayerScale are ``bsr_jax.Affine`` / ``bsr_jax.LayerScale``, which
can prune the residual of their scale gradient the same way (off by default).

GELU runs under ``jax.checkpoint`` so its backward keeps only its input, not the internal
temporaries of erf; the dense and sparse models share this, so their memory differs only in the
linear layers' residuals.

``create_model(config, num_classes)`` builds the model a ``TrainConfig`` names: this ResMLP, or
``train.resnet.ResNet`` with every convolution compressed as ``conv_compression`` says (through
``bsr_jax.compress_model``, so BatchNorm and ReLU keep less too).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import bsr_jax
from bsr_jax.rewrite.schedules import prunable_layer_paths
from train.config import POOLING_FACTORS, TrainConfig, UsageError
from train.resnet import PRESETS as RESNET_PRESETS
from train.resnet import ResNet, compression_rules

ModuleDef = Any

# Exact (erf) GELU as in ResMLP; recomputed in the backward pass from its input alone (stored in
# the block's ``dx`` format when it has one: bsr_jax.ops.dx).
_gelu = functools.partial(nn.gelu, approximate=False)


def dense_def(pruning: bsr_jax.Pruning | None = None, *, backend: str | None = None, **shorthand: Any) -> ModuleDef:
    """A ``bsr_jax.Dense`` constructor carrying the pruning (a ``bsr_jax.Pruning``, or its fields
    as keywords; nothing: dense), for ``ResMLP(dense=...)``."""
    return functools.partial(bsr_jax.Dense, pruning=pruning, backend=backend, **shorthand)


def scale_shift_defs(pruning: bsr_jax.Pruning | None = None, **shorthand: Any) -> tuple[ModuleDef, ModuleDef]:
    """``(affine, layerscale)`` constructors whose scale gradients see only the largest input blocks.

    Their input and shift gradients stay exact (see ``bsr_jax.bsr_scale_shift``); no pruning is
    the plain ``alpha * x + beta`` and ``scale * x``.
    """
    return (
        functools.partial(bsr_jax.Affine, pruning=pruning, **shorthand),
        functools.partial(bsr_jax.LayerScale, pruning=pruning, **shorthand),
    )


def layerscale_init_for(depth: int) -> float:
    """ResMLP's LayerScale initial value: 0.1 up to 18 blocks, 1e-5 for deeper models."""
    return 0.1 if depth <= 18 else 1e-5


class ResMLPBlock(nn.Module):
    """One ResMLP block on tokens ``(B, T, D)``; returns the same shape and dtype."""

    dense: ModuleDef
    affine: ModuleDef
    layerscale: ModuleDef
    layerscale_init: float
    mlp_ratio: int = 4
    dtype: Any = None
    dx: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        tokens, dim = x.shape[-2], x.shape[-1]
        scale = functools.partial(self.layerscale, init_value=self.layerscale_init, dtype=self.dtype)
        y = self.affine(dtype=self.dtype, name="affine1")(x)
        y = self.dense(features=tokens, dtype=self.dtype, name="token_mixing")(jnp.swapaxes(y, -1, -2))
        x = x + scale(name="layerscale1")(jnp.swapaxes(y, -1, -2))
        y = self.affine(dtype=self.dtype, name="affine2")(x)
        y = self.dense(features=self.mlp_ratio * dim, dtype=self.dtype, name="fc1")(y)
        gelu = bsr_jax.ops.dx.stored_compressed(_gelu, self.dx) if self.dx else jax.checkpoint(_gelu)
        y = self.dense(features=dim, dtype=self.dtype, name="fc2")(gelu(y))
        return x + scale(name="layerscale2")(y)


def _batch_reshape(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``x.reshape(shape)`` of the axes after the leading (batch) one. On Explicit mesh axes jax
    wants the result's placement named: the batch axis keeps x's, the rest is whole."""
    placed = jax.typeof(x).sharding
    if placed.mesh.empty or AxisType.Explicit not in placed.mesh.axis_types:
        return x.reshape(shape)
    return jnp.reshape(x, shape, out_sharding=NamedSharding(placed.mesh, PartitionSpec(placed.spec[0] if placed.spec else None)))


class ResMLP(nn.Module):
    """ResMLP classifier for images ``(B, H, W, C)`` -> logits ``(B, num_classes)`` float32.

    Attributes:
      num_classes: output classes.
      dim: channels per token ``D``.
      depth: number of blocks.
      patch_size: side of the non-overlapping square patches; H and W must be multiples of it.
      dense: constructor of the blocks' linear layers (``dense_def(...)``, or ``nn.Dense``).
      stem_dense, head_dense: constructors of the patch embedding and classifier; dense by default,
        pass ``dense`` to prune their inputs as well.
      affine, layerscale: constructors of the Affine and LayerScale layers (``bsr_jax.Affine`` and
        ``bsr_jax.LayerScale``, unpruned by default; see ``scale_shift_defs``). Params: ``alpha``,
        ``beta`` and ``scale``, each ``(D,)``.
      remat: recompute each block in the backward pass (``nn.remat``), keeping only block inputs:
        the classic memory baseline to compare block-sparse residuals against.
      remat_policy: with ``remat``, the ``jax.checkpoint`` policy deciding what a block saves, e.g.
        ``bsr_jax.remat_policy()`` (keep block-sparse residuals and matmul outputs, recompute the
        elementwise ops); ``None`` saves nothing but the block input.
      layerscale_init: LayerScale initial value; ``None`` uses ``layerscale_init_for(depth)``.
      dtype: computation dtype (e.g. ``jnp.bfloat16``); params stay ``float32``.
      dx: ``None`` (exact input gradients) or a ``bsr_jax.ops.dx`` format (``"int8"``, ``"int4"``):
        the GELU input, which GELU's backward needs, is stored in it (approximate dx).
    """

    num_classes: int
    dim: int
    depth: int
    patch_size: int
    dense: ModuleDef = bsr_jax.Dense
    stem_dense: ModuleDef = bsr_jax.Dense
    head_dense: ModuleDef = bsr_jax.Dense
    affine: ModuleDef = bsr_jax.Affine
    layerscale: ModuleDef = bsr_jax.LayerScale
    remat: bool = False
    remat_policy: Callable[..., bool] | None = None
    mlp_ratio: int = 4
    layerscale_init: float | None = None
    dtype: Any = None
    dx: str | None = None

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        batch, height, width, channels = images.shape
        p = self.patch_size
        if height % p or width % p:
            raise ValueError(f"image size {height}x{width} must be a multiple of patch_size={p}")
        # Non-overlapping patches flattened in (row, col, channel) order: a stride-p conv as a linear.
        patches = _batch_reshape(images, (batch, height // p, p, width // p, p, channels)).transpose(0, 1, 3, 2, 4, 5)
        x = self.stem_dense(features=self.dim, dtype=self.dtype, name="stem")(
            _batch_reshape(patches, (batch, (height // p) * (width // p), p * p * channels))
        )
        init = layerscale_init_for(self.depth) if self.layerscale_init is None else self.layerscale_init
        block = nn.remat(ResMLPBlock, policy=self.remat_policy) if self.remat else ResMLPBlock
        for i in range(self.depth):
            x = block(self.dense, self.affine, self.layerscale, init, self.mlp_ratio, dtype=self.dtype, dx=self.dx, name=f"block{i}")(x)
        x = self.affine(dtype=self.dtype, name="final_affine")(x)
        logits = self.head_dense(features=self.num_classes, dtype=self.dtype, name="head")(x.mean(axis=1))
        return logits.astype(jnp.float32)


def predict(model: nn.Module, variables: dict[str, Any], images: jax.Array) -> jax.Array:
    """Evaluation-mode logits: a model with BatchNorm (``"batch_stats"`` in ``variables``, e.g.
    ``train.resnet.ResNet``) runs with ``train=False``, on its running averages."""
    if "batch_stats" in variables:
        return model.apply(variables, images, train=False)
    return model.apply(variables, images)


# Presets (ResMLP paper, Table 1). The patch size depends on the image size, so callers pass it:
# 16 for 224px ImageNet, 4 for 32px CIFAR.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(dim=128, depth=4),
    "s12": dict(dim=384, depth=12),
    "s24": dict(dim=384, depth=24),
    "b24": dict(dim=768, depth=24),
}


# ----------------------------------------------------------------------------- from a TrainConfig


def conv_compression(config: TrainConfig, level: float = 1.0) -> bsr_jax.Pooling | bsr_jax.Pruning | None:
    """What every ResNet convolution keeps of its input: window means (``--compression``), blocks
    at ``level * config.sparsity``, or (``None``) the input itself."""
    if config.compression is not None:
        return bsr_jax.Pooling(POOLING_FACTORS[config.compression], storage_dtype=config.storage_dtype)
    if config.sparsity == 0 and config.storage_dtype is None:
        return None
    return config_pruning(config, level)


def config_pruning(config: TrainConfig, level: float = 1.0) -> bsr_jax.Pruning:
    """The one place the run's flags become the library's options: ``Pruning`` at ``level`` times
    the configured sparsity (``level`` follows the sparsity warmup)."""
    return bsr_jax.Pruning(
        round(config.sparsity * level, 6),
        block=config.block,
        criterion=config.criterion,
        selection=config.selection,
        storage_dtype=config.storage_dtype,
        stochastic=config.stochastic,
        rounding=config.rounding,
    )


def create_model(config: TrainConfig, num_classes: int, level: float = 1.0) -> ResMLP | ResNet:
    """The model of ``config``. ResMLP: blocks' linears pruned at ``level * config.sparsity``
    (``level`` follows the sparsity warmup), stem/head and Affine/LayerScale optionally. ResNet:
    the 3x3 stem for images up to 64 px, the ImageNet stem above; with a ``conv_compression``,
    ``bsr_jax.compress_model`` of it: every convolution compressed, the classifier dense, and lean
    neighbours (BatchNorm keeps its input, ReLU a 1-bit mask: forward and dx stay exact). Without
    one, the plain model: the baseline residual memory is compared to."""
    dtype = jnp.bfloat16 if config.dtype == "bfloat16" else None
    if config.model in RESNET_PRESETS:
        stem = "cifar" if config.image_size <= 64 else "imagenet"
        filters = {} if config.dim is None else {"num_filters": config.dim}
        model = ResNet(num_classes=num_classes, stem=stem, dtype=dtype, **filters, **RESNET_PRESETS[config.model])
        compression = conv_compression(config, level)
        return model if compression is None else bsr_jax.compress_model(model, compression_rules(compression))
    preset = dict(PRESETS[config.model])
    preset.update({k: v for k, v in (("dim", config.dim), ("depth", config.depth)) if v is not None})
    pruning = config_pruning(config, level)
    dense, plain = dense_def(pruning, backend=config.backend), dense_def(backend=config.backend)
    affine, layerscale = scale_shift_defs(pruning) if config.prune_scale_shift else scale_shift_defs()
    # Plain remat keeps a block's input alone: compressed residuals would be recomputed, never kept,
    # so a compressing run keeps them (and the matmul outputs) through bsr_jax's policy.
    compressing = dense_counterpart(config) != dataclasses.replace(config, remat=False)
    return ResMLP(
        num_classes=num_classes,
        patch_size=config.patch_size,
        dense=dense,
        stem_dense=dense if config.sparse_stem else plain,
        head_dense=dense if config.sparse_head else plain,
        affine=affine,
        layerscale=layerscale,
        dtype=dtype,
        dx=config.dx,
        remat=config.remat,
        remat_policy=bsr_jax.remat_policy() if config.remat and compressing else None,
        **preset,
    )


def check_layer_rules(config: TrainConfig) -> None:
    """Refuse a ``--layer-sparsity`` pattern that matches no layer of the model (as
    ``bsr_jax.compress_model`` refuses an unmatched rule): a typo would otherwise train silently at
    the global sparsity. Traces the model's init once (nothing runs)."""
    if not config.layer_sparsity:
        return
    images = jax.ShapeDtypeStruct((1, config.image_size, config.image_size, 3), jnp.float32)
    paths = prunable_layer_paths(create_model(config, num_classes=1).init, jax.random.key(0), images)
    for pattern, sparsity in config.layer_sparsity:
        if not any(fnmatch.fnmatchcase(path, pattern) for path in paths):
            raise UsageError(f"--layer-sparsity {pattern}={sparsity}: {pattern!r} matches no layer of the {config.model} model, "
                             f"whose layer paths are {_folded(paths)}")  # fmt: skip


def _folded(paths: list[str]) -> str:
    """``block0/fc1, block1/fc1`` as ``block{0..1}/fc1``: a deep model's paths stay one short line."""
    groups: dict[str, list[int]] = {}
    for path in paths:
        first = re.search(r"\d+", path)
        groups.setdefault(re.sub(r"\d+", "#", path, count=1), []).append(int(first.group()) if first else 0)
    return ", ".join(shape.replace("#", f"{{{min(ns)}..{max(ns)}}}" if len(ns) > 1 else str(ns[0]), 1) for shape, ns in groups.items())


def dense_counterpart(config: TrainConfig) -> TrainConfig:
    """``config`` with nothing pruned, compressed or recomputed: the baseline its residual memory is compared to."""
    return dataclasses.replace(config, sparsity=0.0, layer_sparsity=(), storage_dtype=None, rounding="nearest", stochastic=False,
                               compression=None, dx=None, remat=False, backend=None)  # fmt: skip
