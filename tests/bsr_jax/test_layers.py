import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference

import bsr_jax


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("sparsity", [0.0, 0.7])
def test_dense_matches_flax_params_and_forward(use_bias, sparsity):
    x = jax.random.normal(jax.random.key(0), (2, 24, 40))
    ours = bsr_jax.Dense(32, use_bias=use_bias, sparsity=sparsity, block=8)
    theirs = nn.Dense(32, use_bias=use_bias)
    params = ours.init(jax.random.key(1), x)
    flax_params = theirs.init(jax.random.key(1), x)
    chex.assert_trees_all_equal(params, flax_params)  # same names, shapes, dtypes and initial values
    chex.assert_trees_all_equal(ours.apply(flax_params, x), theirs.apply(params, x))


def test_dense_dtype_and_param_dtype():
    x = jnp.ones((4, 16), jnp.float32)
    layer = bsr_jax.Dense(8, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, sparsity=0.5, block=4)
    params = layer.init(jax.random.key(0), x)
    assert params["params"]["kernel"].dtype == jnp.bfloat16
    y, grads = jax.value_and_grad(lambda p: layer.apply(p, x).astype(jnp.float32).sum())(params)
    assert grads["params"]["kernel"].dtype == jnp.bfloat16
    mixed = bsr_jax.Dense(8, dtype=jnp.bfloat16, sparsity=0.5, block=4)
    out = mixed.apply(mixed.init(jax.random.key(0), x), x)
    assert out.dtype == jnp.bfloat16


def test_call_time_sparsity_overrides_attribute():
    x = jax.random.normal(jax.random.key(0), (64, 32))
    layer = bsr_jax.Dense(16, sparsity=0.0, block=8)
    params = layer.init(jax.random.key(1), x)
    grad = lambda s: jax.grad(lambda p: jnp.sum(layer.apply(p, x, sparsity=s) ** 2))(params)
    dense, sparse = grad(None), grad(0.75)
    dy = 2 * np.asarray(layer.apply(params, x), np.float64)
    expected = reference.kept_input(np.asarray(x), 0.75, 8).T @ dy
    chex.assert_trees_all_close(sparse["params"]["kernel"], jnp.asarray(expected, jnp.float32), atol=1e-4, rtol=1e-5)
    assert not jnp.allclose(dense["params"]["kernel"], sparse["params"]["kernel"])
    with pytest.raises(ValueError, match="sparsity"):
        layer.apply(params, x, sparsity=1.0)


def test_integer_inputs_rejected():
    with pytest.raises(ValueError, match="inputs must have a floating dtype"):
        bsr_jax.Dense(4).init(jax.random.key(0), jnp.ones((2, 3), jnp.int32))
