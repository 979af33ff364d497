import jax
import jax.numpy as jnp

import bsr_jax


def test_residual_bytes_classifies_params_inputs_activations():
    w = jnp.ones((16, 32))
    x = jnp.ones((8, 16))
    # jax.vjp of sin(x @ w) keeps w (for dx), x (for dw) and cos(x @ w) (for sin's derivative).
    res = bsr_jax.residual_bytes(lambda w, x: jnp.sum(jnp.sin(x @ w)), w, x)
    assert (res.params, res.inputs, res.activations) == (16 * 32 * 4, 8 * 16 * 4, 8 * 32 * 4)
    assert res.total == sum(r.nbytes for r in res.residuals)


def test_residual_bytes_counts_a_reused_array_once():
    w = jnp.ones((16, 16))
    x = jnp.ones((4, 16))
    res = bsr_jax.residual_bytes(lambda w, x: jnp.sum((x @ w) @ w), w, x)
    assert res.params == w.nbytes


def test_residual_bytes_runs_nothing_on_shape_structs():
    big = jax.ShapeDtypeStruct((1 << 16, 1 << 14), jnp.float32)  # 4 GiB: would not fit if allocated
    w = jax.ShapeDtypeStruct((1 << 14, 8), jnp.float32)
    res = bsr_jax.residual_bytes(lambda w, x: jnp.sum(jnp.tanh(x @ w)), w, big)
    assert res.inputs == 4 * 2**30


def test_dense_layer_sparse_residual_is_smaller_by_the_kept_fraction():
    x = jnp.ones((1024, 256))
    for sparsity, kept_blocks in [(0.5, 512), (0.75, 256)]:
        layer = bsr_jax.Dense(64, sparsity=sparsity, block=16)
        params = layer.init(jax.random.key(0), x)
        res = bsr_jax.residual_bytes(lambda p, x: jnp.sum(layer.apply(p, x)), params, x)
        assert res.inputs == 0
        assert res.activations == kept_blocks * (16 * 16 * 4 + 2) + (16 + 1) * 4  # int16 block rows


def test_compiled_memory_of_a_grad_step_grows_with_batch():
    grad = jax.grad(lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w)))
    w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    small, large = (bsr_jax.compiled_memory(grad, w, jax.ShapeDtypeStruct((n, 128), jnp.float32)) for n in (256, 1024))
    assert small.arguments == (128 + 256) * 128 * 4 and small.outputs == 128 * 128 * 4
    assert small.temp >= 256 * 128 * 4  # at least the hidden activation kept for the backward pass
    assert large.temp > small.temp
    assert large.peak == large.temp + large.arguments + large.outputs - large.aliased
