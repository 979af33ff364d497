"""Convolutions whose weight gradient sees a compressed input: ``compressed_conv`` and ``Conv``.

The forward pass is the exact ``lax.conv_general_dilated`` call ``flax.linen.Conv`` makes
(channels-last input ``(N, *spatial, C)``, kernel ``(*window, C / groups, features)``), so outputs
are bit-identical to it. For the backward pass the op keeps only ``compression.compress(x)`` and
the kernel, not ``x``:

* dx is exact: the transposed convolution of dy, which needs the kernel only;
* db is exact (the bias is added outside the op);
* dW is the exact weight gradient of the same convolution evaluated at a reconstruction of x:
  the nearest-neighbour upsampling of the window means (``bsr_jax.Pooling``), or x with its pruned
  ``(rows, channels)`` blocks zeroed (``bsr_jax.Pruning``, x flattened to ``(N * prod(spatial), C)``
  as ``bsr_jax.Dense`` flattens its input). See docs/conv.md for the estimator and its bias.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.linear import canonicalize_padding
from jax import lax

from bsr_jax.storage import barriers
from bsr_jax.core import layer_choice
from bsr_jax.core import sharding
from bsr_jax.storage.format import BlockSparse
from bsr_jax.storage.pruning import Pruning
from bsr_jax.storage.pooling import PooledMap, Pooling
from bsr_jax.storage.compression import Compression
LAX_PADDINGS = ("SAME", "SAME_LOWER", "VALID")


@dataclasses.dataclass(frozen=True)
class _ConvConfig:
    """Static arguments of one convolution; ``padding`` a lax string or ``((lo, hi), ...)``."""

    compression: Compression
    input_shape: tuple[int, ...]
    strides: tuple[int, ...]
    padding: str | tuple[tuple[int, int], ...]
    lhs_dilation: tuple[int, ...]
    rhs_dilation: tuple[int, ...]
    feature_group_count: int
    precision: lax.PrecisionLike


def channels_last_dimension_numbers(ndim: int) -> lax.ConvDimensionNumbers:
    # Channels-last input and output, (*window, in, out) kernel: flax.linen.Conv's layout.
    lhs = (0, ndim - 1, *range(1, ndim - 1))
    rhs = (ndim - 1, ndim - 2, *range(ndim - 2))
    return lax.ConvDimensionNumbers(lhs, rhs, lhs)


def _conv(x: jax.Array, w: jax.Array, config: _ConvConfig) -> jax.Array:
    return lax.conv_general_dilated(
        x,
        w,
        config.strides,
        config.padding,
        lhs_dilation=config.lhs_dilation,
        rhs_dilation=config.rhs_dilation,
        dimension_numbers=channels_last_dimension_numbers(x.ndim),
        feature_group_count=config.feature_group_count,
        precision=config.precision,
    )


def reconstructed_input(kept: PooledMap | BlockSparse, input_shape: tuple[int, ...]) -> jax.Array:
    """The ``input_shape`` array dW is evaluated at: upsampled window means or the masked x."""
    if isinstance(kept, PooledMap):
        return kept.upsampled()
    return kept.to_dense().reshape(input_shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _compressed_conv(x: jax.Array, w: jax.Array, key: jax.Array | None, config: _ConvConfig) -> jax.Array:
    return _conv(x, w, config)


def _compressed_conv_fwd(x, w, key, config):
    # The dense x is deliberately not a residual: only its compressed form (and w, for dx) is.
    y, kept = barriers.materialize(_conv(x, w, config), config.compression.compress(x, key))
    return y, (kept, w)


def _compressed_conv_bwd(config, residuals, dy):
    kept, w = residuals
    kept, dy = barriers.when_needed(kept, dy)
    x_hat = reconstructed_input(kept, config.input_shape)
    # The convolution is bilinear: its VJP at (x_hat, w) gives the exact dx (the transpose in x
    # reads only w and dy) and dW at x_hat. Differentiating at x_hat, which is computed from x,
    # also gives the cotangents x's and w's types under shard_map (varying manual axes).
    _, vjp = jax.vjp(lambda a, b: _conv(a, b, config), x_hat, w)
    dx, dw = vjp(dy)
    return dx, dw, None


_compressed_conv.defvjp(_compressed_conv_fwd, _compressed_conv_bwd)


def _spatial_tuple(name: str, value: int | Sequence[int] | None, rank: int) -> tuple[int, ...]:
    value = 1 if value is None else value
    values = (value,) * rank if isinstance(value, int) else tuple(value)
    if len(values) != rank or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise ValueError(f"{name} must be a positive int or {rank} positive ints, got {value!r}")
    return values


def _lax_padding(padding, rank: int) -> str | tuple[tuple[int, int], ...]:
    padding = canonicalize_padding(padding, rank)
    if isinstance(padding, str):
        if padding not in LAX_PADDINGS:
            raise ValueError(
                f"padding must be one of {LAX_PADDINGS}, an int or {rank} (low, high) pairs, got {padding!r} "
                "(bsr_jax.Conv also takes 'CIRCULAR', 'REFLECT' and 'CAUSAL')"
            )
        return padding
    return tuple((int(lo), int(hi)) for lo, hi in padding)


def compressed_conv(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    compression: Compression | None,
    strides: int | Sequence[int] = 1,
    padding: str | int | Sequence[int | tuple[int, int]] = "SAME",
    lhs_dilation: int | Sequence[int] | None = None,
    rhs_dilation: int | Sequence[int] | None = None,
    feature_group_count: int = 1,
    precision: lax.PrecisionLike = None,
    key: jax.Array | None = None,
) -> jax.Array:
    """A convolution with an exact forward pass and dx, and dW from a compressed input.

    Args:
      x: ``(N, *spatial, C)`` floating input (channels last, at least one spatial dim).
      w: ``(*window, C / feature_group_count, features)`` kernel of x's dtype.
      b: optional ``(features,)`` bias, added after the convolution.
      compression: ``bsr_jax.Pooling`` or ``bsr_jax.Pruning``; ``None``, or one that would not save
        memory for this x (``compression.saves_memory(x)``), runs the plain convolution.
      strides, lhs_dilation, rhs_dilation: an int or one int per spatial dim (None means 1).
      padding: ``"SAME"``, ``"SAME_LOWER"``, ``"VALID"``, an int, or per spatial dim an int or a
        ``(low, high)`` pair (flax's ``canonicalize_padding``).
      feature_group_count: groups of input channels, as in ``lax.conv_general_dilated``.
      precision: passed to the convolution (forward, dx and dW).
      key: PRNG key, needed only by a ``Pruning`` whose ``needs_key`` is set, when differentiated.

    Returns:
      ``(N, *out_spatial, features)``, equal to ``lax.conv_general_dilated`` with flax's dimension
      numbers (plus b). Gradients: dx and db exact; dW is the exact weight gradient at
      ``reconstructed_input`` of the compressed x (approximate, see docs/conv.md).
    """
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(jnp.result_type(a), jnp.floating):
            raise ValueError(f"{name} must have a floating dtype, got {jnp.result_type(a)}")
    rank = jnp.ndim(x) - 2
    if rank < 1 or jnp.ndim(w) != rank + 2:
        raise ValueError(
            f"expected x (N, *spatial, C) and w (*window, C / groups, features), got x {jnp.shape(x)} and w {jnp.shape(w)}"
        )
    if jnp.result_type(x) != jnp.result_type(w):
        raise ValueError(f"x and w must share a dtype, got {jnp.result_type(x)} and {jnp.result_type(w)}")
    if compression is not None and not isinstance(compression, (Pooling, Pruning)):
        raise ValueError(f"compression must be None, a bsr_jax.Pooling or a bsr_jax.Pruning, got {compression!r}")
    if key is not None and (compression is None or not compression.needs_key):
        raise ValueError("key is only used by a Pruning with stochastic sampling or rounding")
    config = _ConvConfig(
        compression=compression,
        input_shape=tuple(jnp.shape(x)),
        strides=_spatial_tuple("strides", strides, rank),
        padding=_lax_padding(padding, rank),
        lhs_dilation=_spatial_tuple("lhs_dilation", lhs_dilation, rank),
        rhs_dilation=_spatial_tuple("rhs_dilation", rhs_dilation, rank),
        feature_group_count=feature_group_count,
        precision=precision,
    )
    if compression is None or not compression.saves_memory(x):
        y = _conv(x, w, config)
    else:

        def local(x, params, key, _):
            # Runs on each device's batch shard under a mesh (bsr_jax.core.sharding): compression and
            # the reconstruction for dW see the local shape.
            local_config = dataclasses.replace(config, input_shape=tuple(x.shape))
            return _compressed_conv(x, params[0], key, local_config)

        spatial = tuple(f"s{i}" for i in range(rank))
        window = tuple(f"k{i}" for i in range(rank))
        # Windows and channels need the whole map: only the batch (and, without feature groups,
        # the kernel's output features) may be split.
        whole = frozenset({*spatial, *window, "c"} | ({"f"} if feature_group_count > 1 else set()))
        y = sharding.map_row_shards(
            local, x, [w], x_labels=("n", *spatial, "c"), param_labels=[(*window, "c", "f")],
            out_labels=("n", *spatial, "f"), key=key, whole=whole,
        )  # fmt: skip
    if b is not None:
        y += jnp.reshape(b, (1,) * (y.ndim - 1) + (-1,))
    return y


class Conv(nn.Conv):
    """Drop-in for ``flax.linen.Conv`` whose weight gradient sees a compressed input.

    Every ``nn.Conv`` attribute keeps its meaning (features, kernel_size, strides, padding incl.
    ``'CIRCULAR'``/``'REFLECT'``/``'CAUSAL'`` and explicit pairs, input/kernel dilation,
    feature_group_count, use_bias, mask, dtype, param_dtype, precision, initialisers,
    promote_dtype) and the parameters are the same (``kernel (*kernel_size, C / groups,
    features)``, ``bias (features,)``), so checkpoints move both ways. The forward output is
    bit-identical to ``nn.Conv``; dx and db are exact; dW is approximate (``compressed_conv``).
    ``nn.Conv``'s deprecated ``conv_general_dilated``/``conv_general_dilated_cls`` hooks would
    replace the convolution being compressed, so setting them raises.

    Attributes:
      compression: ``bsr_jax.Pooling(factor, storage_dtype)``, ``bsr_jax.Pruning(...)`` or ``None``
        (exactly ``nn.Conv``). A stochastic ``Pruning`` draws keys from the ``"pruning"`` rng
        stream: ``apply(..., rngs={"pruning": key})`` when differentiating. Inside
        ``bsr_jax.compress_model`` (or ``bsr_jax.use_rules``) a rule matching the layer's path
        decides instead (``None``: dense).
    """

    compression: Compression | None = None

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Convolves ``inputs (*batch, *spatial, C)``; batch dims are flattened as ``nn.Conv`` does."""
        if self.conv_general_dilated is not None or self.conv_general_dilated_cls is not None:
            raise ValueError("bsr_jax.Conv does not take conv_general_dilated / conv_general_dilated_cls")
        kernel_size = (self.kernel_size,) if isinstance(self.kernel_size, int) else tuple(self.kernel_size)
        rank = len(kernel_size)
        batch_dims = inputs.ndim - (rank + 1)
        if batch_dims != 1:
            batch_shape = inputs.shape[:batch_dims]
            inputs = jnp.reshape(inputs, (-1, *inputs.shape[batch_dims:]))
        kernel_dilation = _spatial_tuple("kernel_dilation", self.kernel_dilation, rank)
        inputs, padding = _pad_like_flax(inputs, canonicalize_padding(self.padding, rank), kernel_size, kernel_dilation)

        in_features = jnp.shape(inputs)[-1]
        if in_features % self.feature_group_count:
            raise ValueError(f"input features {in_features} must divide into feature_group_count={self.feature_group_count}")
        kernel_shape = (*kernel_size, in_features // self.feature_group_count, self.features)
        if self.mask is not None and self.mask.shape != kernel_shape:
            raise ValueError(f"mask must have the kernel's shape {kernel_shape}, got {self.mask.shape}")
        kernel = self.param("kernel", self.kernel_init, kernel_shape, self.param_dtype)
        if self.mask is not None:
            kernel *= self.mask
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)

        ruled = layer_choice.lookup(self)
        compression = self.compression if ruled is layer_choice.NO_MATCH else ruled
        if compression is not None:
            layer_choice.record(layer_choice.module_path(self), compression, inputs)
        needs_key = compression is not None and compression.needs_key
        y = compressed_conv(
            inputs,
            kernel,
            bias,
            compression=compression,
            strides=self.strides,
            padding=padding,
            lhs_dilation=self.input_dilation,
            rhs_dilation=kernel_dilation,
            feature_group_count=self.feature_group_count,
            precision=self.precision,
            key=self.make_rng("pruning") if needs_key and self.has_rng("pruning") else None,
        )
        if batch_dims != 1:
            y = jnp.reshape(y, (*batch_shape, *y.shape[1:]))
        return y


def _pad_like_flax(inputs, padding, kernel_size, kernel_dilation):
    """Apply flax's explicit padding modes to the input (outside the op, so the compressed
    residual is of the padded input); lax modes and pairs pass through unchanged."""
    if padding in ("CIRCULAR", "REFLECT"):
        dilated = [(k - 1) * d + 1 for k, d in zip(kernel_size, kernel_dilation)]
        pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in dilated] + [(0, 0)]
        return jnp.pad(inputs, pads, mode={"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding]), "VALID"
    if padding == "CAUSAL":
        if len(kernel_size) != 1:
            raise ValueError("padding='CAUSAL' is only defined for 1-D convolutions")
        return jnp.pad(inputs, [(0, 0), (kernel_dilation[0] * (kernel_size[0] - 1), 0), (0, 0)]), "VALID"
    return inputs, padding
