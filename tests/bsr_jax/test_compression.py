"""Low-precision kept blocks and stochastic (unbiased) block sampling."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bsr_jax
from bsr_jax.storage.format import from_dense, quantize_blocks


def _x(shape=(64, 48), seed=0):
    return jax.random.normal(jax.random.key(seed), shape) * jnp.linspace(0.1, 3.0, shape[1])


@pytest.mark.parametrize(
    "storage,value_bytes,relative_error",
    [("bfloat16", 2, 2**-8), ("int8", 1, 1 / 254), ("float8_e4m3fn", 1, 2**-4)],
)
def test_quantized_storage_round_trip(storage, value_bytes, relative_error):
    x = _x()
    full = from_dense(x, 0.5, 8)
    low = from_dense(x, 0.5, 8, storage_dtype=storage)
    assert low.values.dtype == jnp.dtype(storage)
    scale_bytes = 0 if storage == "bfloat16" else 4 * low.capacity
    assert low.nbytes == full.nbytes - full.values.nbytes + full.values.size * value_bytes + scale_bytes
    assert low.to_dense().dtype == x.dtype
    chex.assert_trees_all_equal((low.block_rows, low.col_ptr), (full.block_rows, full.col_ptr))
    # Per-block bound: relative to each value for float formats, to the block max for int8.
    amax = jnp.max(jnp.abs(full.values), axis=(1, 2))[:, None, None]
    bound = amax * relative_error if storage == "int8" else jnp.abs(full.values) * relative_error + amax * 2**-15
    assert jnp.all(jnp.abs(low.dequantized().values - full.values) <= bound * 1.001)


def test_quantize_zero_and_nan_blocks():
    values = jnp.stack([jnp.zeros((4, 4)), jnp.full((4, 4), jnp.nan), jnp.eye(4)])
    for storage in ("int8", "float8_e4m3fn"):
        q, scales = quantize_blocks(values, storage)
        deq = q.astype(jnp.float32) * scales[:, None, None]
        chex.assert_trees_all_equal(deq[0], jnp.zeros((4, 4)))
        assert jnp.all(jnp.isnan(deq[1]))
        chex.assert_trees_all_close(deq[2], jnp.eye(4))


def test_bad_storage_dtype():
    with pytest.raises(ValueError, match="storage_dtype"):
        from_dense(jnp.ones((8, 8)), 0.5, 4, storage_dtype="int2")
    with pytest.raises(ValueError, match="storage_dtype"):
        bsr_jax.bsr_linear(jnp.ones((8, 8)), jnp.ones((8, 2)), sparsity=0.5, storage_dtype="float16")


def _heavy_tailed_blocks(shape, block, seed):
    """Normal entries times a log-normal scale per block (e^+-3 apart), so priority sampling keeps
    many blocks above its threshold (rescale 1) and many below it (rescale max(w, tau) / w > 1)."""
    kx, ks = jax.random.split(jax.random.key(seed))
    scales = jnp.exp(1.5 * jax.random.normal(ks, (shape[0] // block, shape[1] // block)))
    return jax.random.normal(kx, shape) * jnp.kron(scales, jnp.ones((block, block)))


@pytest.mark.parametrize("selection", ["global", "column"])
def test_stochastic_selection_is_unbiased_within_five_standard_errors(selection):
    """Each block's factor in to_dense() (0 if dropped, its rescale if kept) has mean 1 within 5
    measured standard errors. A third of the kept blocks lie above the threshold, where the right
    rescale is 1 and the classic slip tau / w shrinks them (tens of standard errors away)."""
    x, block, draws = _heavy_tailed_blocks((32, 64), 8, seed=1), 8, 2000

    def factors(key):
        kept = from_dense(x, 0.5, block, selection=selection, key=key).to_dense().reshape(4, 8, 8, 8)
        x4 = x.reshape(4, 8, 8, 8)
        return jnp.sum(kept * x4, (1, 3)) / jnp.sum(x4 * x4, (1, 3))  # (Mb, Kb)

    f = np.asarray(jax.jit(jax.vmap(factors))(jax.random.split(jax.random.key(2), draws)), np.float64)
    kept = f > 0
    assert np.all(kept.sum((1, 2)) == 16)  # static capacity: 16 of 32 blocks in every draw
    above_threshold = np.abs(f - 1) < 1e-6  # kept with rescale 1: w >= tau
    assert above_threshold.sum() >= kept.sum() / 3
    mean, stderr = f.mean(0), f.std(0, ddof=1) / np.sqrt(draws)
    # Blocks kept in every draw at rescale 1 have no variance: their mean must be 1 to rounding.
    assert np.all(np.abs(mean - 1) <= 5 * stderr + 1e-5), np.max(np.abs(mean - 1) / (stderr + 1e-12))
    deterministic = from_dense(x, 0.5, block, selection=selection).to_dense()
    assert float(jnp.linalg.norm(deterministic - x) / jnp.linalg.norm(x)) > 0.01  # top-k is biased


def test_stochastic_with_all_blocks_kept_is_exact():
    x = _x((16, 16))
    chex.assert_trees_all_close(from_dense(x, 0.0, 8, key=jax.random.key(0)).to_dense(), x)


def test_stochastic_dw_is_unbiased_through_bsr_linear():
    """The mean dW over keys is the dense dW within 5 measured standard errors, element by element."""
    x, w = _heavy_tailed_blocks((64, 32), 8, seed=3), jax.random.normal(jax.random.key(4), (32, 16))
    loss = lambda w, key: jnp.sum(jnp.sin(bsr_jax.bsr_linear(x, w, sparsity=0.7, block=8, stochastic=True, key=key)))
    draws = 2000
    grads = np.asarray(jax.jit(jax.vmap(jax.grad(loss), (None, 0)))(w, jax.random.split(jax.random.key(5), draws)), np.float64)
    dense = np.asarray(jax.grad(lambda w: jnp.sum(jnp.sin(x @ w)))(w), np.float64)
    stderr = grads.std(0, ddof=1) / np.sqrt(draws)
    assert np.all(np.abs(grads.mean(0) - dense) <= 5 * stderr + 1e-5 * np.abs(dense).max())
    assert np.linalg.norm(grads[0] - dense) / np.linalg.norm(dense) > 0.1


def test_int8_storage_dw_error_is_small_vs_f32_blocks():
    x, w = _x((128, 64), seed=6), jax.random.normal(jax.random.key(7), (64, 32))
    grad = lambda storage: jax.grad(
        lambda w: jnp.sum(jnp.sin(bsr_jax.bsr_linear(x, w, sparsity=0.5, block=16, storage_dtype=storage)))
    )(w)
    full, int8 = grad(None), grad("int8")
    err = float(jnp.linalg.norm(int8 - full) / jnp.linalg.norm(full))
    assert 0 < err < 0.01


def test_dense_stochastic_uses_the_pruning_rng_stream():
    x = _x((64, 32))
    layer = bsr_jax.Dense(8, sparsity=0.75, block=8, stochastic=True)
    params = layer.init(jax.random.key(0), x)  # sparsity only matters for gradients: init needs no key
    keyed = jax.jit(jax.grad(lambda p, key: jnp.sum(layer.apply(p, x, rngs={"pruning": key}) ** 2)))  # one compile
    grad = lambda seed: keyed(params, jax.random.key(seed))
    chex.assert_trees_all_equal(grad(1), grad(1))
    assert not jnp.allclose(grad(1)["params"]["kernel"], grad(2)["params"]["kernel"])
    chex.assert_trees_all_equal(layer.apply(params, x), x @ params["params"]["kernel"])  # forward needs no key
    with pytest.raises(ValueError, match="needs a PRNG key when differentiated"):
        jax.grad(lambda p: jnp.sum(layer.apply(p, x)))(params)
    with pytest.raises(ValueError, match="key is only used with stochastic=True"):
        bsr_jax.bsr_linear(x, params["params"]["kernel"], sparsity=0.5, key=jax.random.key(0))
