import chex
import jax
import jax.numpy as jnp
import pytest
from numerics import assert_close_scaled, bf16_exact_normal

from bsr_jax import Affine, LayerScale, bsr_scale_shift, from_dense, residual_bytes


def _loss(y):
    return jnp.sum(jnp.sin(y.astype(jnp.float32)) * jnp.linspace(-1.0, 1.0, y.shape[-1]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("selection", ["global", "column"])
@pytest.mark.parametrize("shape,block", [((4, 16, 48), 16), ((3, 13, 37), (8, 4))])
def test_scale_shift_grads(dtype, selection, shape, block):
    kx, ks, kb = jax.random.split(jax.random.key(0), 3)
    x = bf16_exact_normal(kx, shape, dtype)
    scale, shift = bf16_exact_normal(ks, shape[-1:], dtype), bf16_exact_normal(kb, shape[-1:], dtype)
    prune = dict(sparsity=0.6, block=block, selection=selection)
    f = lambda x, s, b: _loss(bsr_scale_shift(x, s, b, **prune))
    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, scale, shift)
    assert all(g.dtype == dtype for g in grads)
    x32, s32, b32 = (a.astype(jnp.float32) for a in (x, scale, shift))
    dy = jax.grad(_loss)(x32 * s32 + b32)
    kept = from_dense(x32.reshape(-1, shape[-1]), **prune).to_dense()
    expected = (dy * s32, (kept * dy.reshape(kept.shape)).sum(0), dy.reshape(-1, shape[-1]).sum(0))
    assert_close_scaled(grads, expected, dtype)


def test_forward_bitwise_and_sparsity_zero_exact():
    x = jax.random.normal(jax.random.key(1), (8, 32))
    s, b = jnp.linspace(0.5, 2, 32), jnp.linspace(-1, 1, 32)
    chex.assert_trees_all_equal(bsr_scale_shift(x, s, b, sparsity=0.8, block=8), x * s + b)
    dense = jax.grad(lambda s: _loss(x * s + b))(s)
    chex.assert_trees_all_equal(jax.grad(lambda s: _loss(bsr_scale_shift(x, s, b, sparsity=0.0)))(s), dense)


def test_residual_is_blocks_not_dense_input():
    x = jnp.ones((64, 64, 32))
    s = jnp.ones((32,))
    res = residual_bytes(lambda s, x: jnp.sum(bsr_scale_shift(x, s, sparsity=0.75, block=16)), s, x)
    assert res.inputs == 0
    assert res.activations == 128 * (16 * 16 * 4 + 2) + 3 * 4  # 128 of 512 blocks, int16 rows, col_ptr


@pytest.mark.parametrize("sparsity", [0.0, 0.5])
def test_affine_and_layerscale_params_match_plain_modules(sparsity):
    x = jax.random.normal(jax.random.key(2), (2, 8, 16))
    affine = Affine(sparsity=sparsity, block=4)
    params = affine.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, params) == {"params": {"alpha": (16,), "beta": (16,)}}
    chex.assert_trees_all_equal(params["params"]["alpha"], jnp.ones(16))
    chex.assert_trees_all_equal(affine.apply(params, x), x)
    ls = LayerScale(init_value=0.1, sparsity=sparsity, block=4)
    ls_params = ls.init(jax.random.key(0), x)
    chex.assert_trees_all_equal(ls_params["params"]["scale"], jnp.full(16, 0.1))
    chex.assert_trees_all_close(ls.apply(ls_params, x), 0.1 * x)


def test_bad_arguments():
    with pytest.raises(ValueError, match="sparsity"):
        bsr_scale_shift(jnp.ones((4, 8)), jnp.ones(8), sparsity=1.0)
    with pytest.raises(ValueError, match="scale must be"):
        bsr_scale_shift(jnp.ones((4, 8)), jnp.ones(7), sparsity=0.5)
    with pytest.raises(ValueError, match="x must have a floating dtype"):
        bsr_scale_shift(jnp.ones((4, 8), jnp.int32), jnp.ones(8, jnp.int32), sparsity=0.5)
    with pytest.raises(ValueError, match="block"):
        Affine(sparsity=0.5, block=0).init(jax.random.key(0), jnp.ones((4, 8)))
