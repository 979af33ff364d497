import itertools
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import bsr_jax
from bsr_jax.ops.conv import compressed_conv

# Odd spatial sizes, so pool-2 windows and 8-row blocks are partial at the far edge.
X_SHAPE = (2, 7, 7, 16)
FEATURES = 8
POOL2 = bsr_jax.Pooling(factor=2)
PRUNE = bsr_jax.Pruning(sparsity=0.7, block=8)
PADDINGS = ["SAME", "VALID", ((1, 2), (0, 1))]
GRID = list(itertools.product([1, 2], PADDINGS, [1, 3]))  # strides, padding, kernel size


def _x(shape=X_SHAPE):
    return jax.random.normal(jax.random.key(0), shape)


def _pooled_reference(x: np.ndarray, f: int) -> np.ndarray:
    """Nearest-neighbour upsampling of the f x f window means (valid elements only), by loops."""
    out = np.empty_like(x)
    for i in range(0, x.shape[1], f):
        for j in range(0, x.shape[2], f):
            out[:, i : i + f, j : j + f] = x[:, i : i + f, j : j + f].mean(axis=(1, 2), keepdims=True)
    return out


def _masked_reference(x: np.ndarray, sparsity: float, block: int) -> np.ndarray:
    """x flattened to (rows, channels) with all but the top ceil((1 - s) * blocks) L2 blocks zeroed."""
    m = x.reshape(-1, x.shape[-1])
    mb, kb = math.ceil(m.shape[0] / block), math.ceil(m.shape[1] / block)
    padded = np.zeros((mb * block, kb * block), m.dtype)
    padded[: m.shape[0], : m.shape[1]] = m
    norms = (padded.reshape(mb, block, kb, block) ** 2).sum(axis=(1, 3))
    keep = math.ceil((1 - sparsity) * mb * kb)
    mask = np.zeros(mb * kb, bool)
    mask[np.argsort(-norms.reshape(-1))[:keep]] = True
    dense_mask = np.repeat(np.repeat(mask.reshape(mb, kb), block, 0), block, 1)[: m.shape[0], : m.shape[1]]
    return (m * dense_mask).reshape(x.shape)


def _weight_grad_at(x_hat, w, dy, strides, padding):
    """dW of a plain NHWC/HWIO convolution at x_hat, spelt independently of bsr_jax.ops.conv."""
    conv = lambda w: lax.conv_general_dilated(x_hat, w, (strides, strides), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.grad(lambda w: jnp.sum(conv(w) * dy))(w)


@pytest.mark.parametrize("strides,padding,kernel", GRID)
def test_params_and_forward_equal_flax(strides, padding, kernel):
    # compression=None here; test_gradients checks the same for every compression.
    x = _x()
    ours = bsr_jax.Conv(FEATURES, (kernel, kernel), strides, padding=padding)
    theirs = nn.Conv(FEATURES, (kernel, kernel), strides, padding=padding)
    params, flax_params = ours.init(jax.random.key(1), x), theirs.init(jax.random.key(1), x)
    chex.assert_trees_all_equal(params, flax_params)  # names, shapes, dtypes and initial values
    chex.assert_trees_all_equal(ours.apply(params, x), theirs.apply(params, x))


@pytest.mark.parametrize("compression", [POOL2, PRUNE], ids=["pool2", "prune0.7"])
@pytest.mark.parametrize("strides,padding,kernel", GRID)
def test_gradients(compression, strides, padding, kernel):
    x = _x()
    ours = bsr_jax.Conv(FEATURES, (kernel, kernel), strides, padding=padding, compression=compression)
    theirs = nn.Conv(FEATURES, (kernel, kernel), strides, padding=padding)
    params = theirs.init(jax.random.key(1), x)
    chex.assert_trees_all_equal(ours.init(jax.random.key(1), x), params)
    dy = jax.random.normal(jax.random.key(2), theirs.apply(params, x).shape)

    @jax.jit
    def grads(params, x):
        per_model = lambda m: jax.vjp(lambda p, x: m.apply(p, x), params, x)
        (y, vjp), (y_dense, vjp_dense) = per_model(ours), per_model(theirs)
        return y, y_dense, vjp(dy), vjp_dense(dy)

    y, y_dense, (g, dx), (g_dense, dx_dense) = grads(params, x)
    chex.assert_trees_all_equal(y, y_dense)
    chex.assert_trees_all_equal(dx, dx_dense)
    chex.assert_trees_all_close(g["params"]["bias"], g_dense["params"]["bias"], atol=1e-5, rtol=1e-6)
    if isinstance(compression, bsr_jax.Pooling):
        x_hat = _pooled_reference(np.asarray(x), compression.factor)
    else:
        x_hat = _masked_reference(np.asarray(x), compression.sparsity, compression.block[0])
    expected = _weight_grad_at(jnp.asarray(x_hat), params["params"]["kernel"], dy, strides, padding)
    chex.assert_trees_all_close(g["params"]["kernel"], expected, atol=1e-4, rtol=1e-5)
    assert not np.allclose(g["params"]["kernel"], g_dense["params"]["kernel"], atol=1e-2)


def _kept_bytes(module, x):
    params = module.init(jax.random.key(1), x)
    counted = bsr_jax.residual_bytes(lambda p, x: jnp.sum(module.apply(p, x)), params, x)
    return counted.inputs + counted.activations  # the kernel (params) is kept by both


@pytest.mark.parametrize(
    "compression,bound",
    [
        (POOL2, 0.27),
        (bsr_jax.Pruning(sparsity=0.7, block=16), 0.33),
        (bsr_jax.Pooling(factor=4), 0.07),
        (bsr_jax.Pooling(factor=2, storage_dtype="bfloat16"), 0.135),
        (bsr_jax.Pooling(factor=2, storage_dtype="int8"), 0.07),
    ],
    ids=str,
)
def test_residual_bytes_ratio(compression, bound):
    x = _x((4, 16, 16, 32))
    dense = _kept_bytes(nn.Conv(FEATURES, (3, 3)), x)
    assert dense == x.size * 4
    assert _kept_bytes(bsr_jax.Conv(FEATURES, (3, 3), compression=compression), x) <= bound * dense


@pytest.mark.parametrize("storage_dtype", ["bfloat16", "float8_e4m3fn", "int8", "int4"])
def test_pooled_storage_dtype_dequantizes_to_window_means(storage_dtype):
    x = _x()
    kept = bsr_jax.Pooling(factor=2, storage_dtype=storage_dtype).compress(x)
    exact = _pooled_reference(np.asarray(x), 2)
    # Round to nearest: half a step of the format at the largest magnitude (one scale per block,
    # so the global maximum bounds every block's step); float8 e4m3 and bf16 keep 3 and 7 mantissa bits.
    amax = np.abs(exact).max()
    atol = {"bfloat16": amax * 2**-8, "float8_e4m3fn": amax * 2**-4, "int8": amax / 254, "int4": amax / 14}[storage_dtype]
    assert kept.means().dtype == x.dtype
    chex.assert_trees_all_close(kept.upsampled(), jnp.asarray(exact), atol=atol * 1.001, rtol=0)
    assert kept.nbytes < bsr_jax.Pooling(factor=2).compress(x).nbytes


def test_compression_that_saves_nothing_is_the_plain_conv():
    # factor 1 keeps x itself and sparsity 0 keeps every block: the op keeps x, not a copy.
    x = _x()
    w = jax.random.normal(jax.random.key(1), (3, 3, 16, FEATURES))
    grad = lambda c: jax.grad(lambda w: jnp.sum(compressed_conv(x, w, compression=c) ** 2))(w)
    for compression in (bsr_jax.Pooling(factor=1), bsr_jax.Pruning(sparsity=0.0, block=8)):
        assert not compression.saves_memory(x)
        chex.assert_trees_all_equal(grad(compression), grad(None))


def test_batch_dims_dtype_and_dilation_match_flax():
    x = jax.random.normal(jax.random.key(0), (2, 3, 6, 6, 8))
    options = dict(features=4, kernel_size=(3, 3), padding=1, kernel_dilation=2, input_dilation=(1, 2), dtype=jnp.bfloat16)
    ours, theirs = bsr_jax.Conv(**options, compression=POOL2), nn.Conv(**options)
    params = theirs.init(jax.random.key(1), x)
    chex.assert_trees_all_equal(ours.apply(params, x), theirs.apply(params, x))
    grads = jax.grad(lambda p: jnp.sum(ours.apply(p, x).astype(jnp.float32)))(params)
    assert grads["params"]["kernel"].dtype == jnp.float32


def test_circular_padding_and_groups_match_flax():
    x = _x()
    options = dict(features=FEATURES, kernel_size=(3, 3), padding="CIRCULAR", feature_group_count=2)
    ours, theirs = bsr_jax.Conv(**options, compression=PRUNE), nn.Conv(**options)
    params = theirs.init(jax.random.key(1), x)
    chex.assert_trees_all_equal(ours.init(jax.random.key(1), x), params)
    chex.assert_trees_all_equal(ours.apply(params, x), theirs.apply(params, x))
    dx = lambda m: jax.jit(jax.grad(lambda x: jnp.sum(m.apply(params, x) ** 2)))(x)
    chex.assert_trees_all_equal(dx(ours), dx(theirs))


def test_stochastic_pruning_draws_from_the_pruning_stream():
    x = _x()
    layer = bsr_jax.Conv(FEATURES, (3, 3), compression=bsr_jax.Pruning(sparsity=0.7, block=8, stochastic=True))
    params = layer.init(jax.random.key(1), x)
    loss = lambda p, rngs: jnp.sum(layer.apply(p, x, rngs=rngs) ** 2)
    with pytest.raises(ValueError, match="PRNG key"):
        jax.grad(loss)(params, None)
    keyed = jax.jit(jax.grad(loss))  # one compile for both keys
    g1, g2 = (keyed(params, {"pruning": jax.random.key(k)}) for k in (0, 1))
    assert not np.allclose(g1["params"]["kernel"], g2["params"]["kernel"])


@pytest.mark.parametrize("factor", [0, -2, 1.5, True, "2"])
def test_pooling_rejects_bad_factor(factor):
    with pytest.raises(ValueError, match="factor must be a positive int"):
        bsr_jax.Pooling(factor=factor)


def test_bad_arguments_raise():
    x, w = _x(), jnp.ones((3, 3, 16, FEATURES))
    with pytest.raises(ValueError, match="storage_dtype"):
        bsr_jax.Pooling(factor=2, storage_dtype="int3")
    with pytest.raises(ValueError, match="padding must be one of"):
        compressed_conv(x, w, compression=POOL2, padding="CIRCULAR")
    with pytest.raises(ValueError, match="x must have a floating dtype"):
        compressed_conv(x.astype(jnp.int32), w, compression=POOL2)
    with pytest.raises(ValueError, match="compression must be"):
        compressed_conv(x, w, compression=0.5)
    with pytest.raises(ValueError, match="strides"):
        compressed_conv(x, w, compression=POOL2, strides=(1, 0))
    with pytest.raises(ValueError, match="key is only used"):
        compressed_conv(x, w, compression=POOL2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="conv_general_dilated"):
        bsr_jax.Conv(FEATURES, (3, 3), conv_general_dilated=lax.conv_general_dilated).init(jax.random.key(0), x)
