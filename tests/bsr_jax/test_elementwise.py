"""bsr_scale_shift and the Affine / LayerScale layers against the float64 reference and plain autodiff."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from numerics import assert_close_scaled, bf16_exact_normal

from bsr_jax import Affine, LayerScale, bsr_scale_shift, residual_bytes

SPARSITY = 0.6
# (shape of x, dtype, pruning keywords besides sparsity). Storage and stochastic cases get inputs
# with full float32 mantissas (see tests/reference.py on int8 half-way points).
CASES = {
    "l2-global-16": ((4, 16, 48), jnp.float32, dict(block=16)),
    "l1-column-8x4-padded-bf16": ((3, 13, 37), jnp.bfloat16, dict(block=(8, 4), criterion="l1", selection="column")),
    "l2-column-tiny-2x3": ((13, 11), jnp.float32, dict(block=(2, 3), selection="column")),
    "int8-storage": ((40, 48), jnp.float32, dict(block=8, storage_dtype="int8")),
    "fp8-storage-column": ((40, 48), jnp.float32, dict(block=(8, 16), selection="column", storage_dtype="float8_e4m3fn")),
    "stochastic-l1-bfloat16-storage": ((40, 48), jnp.float32, dict(block=8, criterion="l1", stochastic=True, storage_dtype="bfloat16")),
    "stochastic-column-int8": ((40, 48), jnp.float32, dict(block=(4, 8), selection="column", stochastic=True, storage_dtype="int8")),
}


def _inputs(shape, dtype, heavy_tailed_block=None, seed=0):
    """x, scale, shift, dy; with ``heavy_tailed_block``, x has full float32 mantissas and one
    log-normal scale per block (magnitudes e^+-3 apart), so priority sampling keeps blocks above its
    threshold (rescale 1) as well as below it."""
    kx, ks, kb, kdy, kbs = jax.random.split(jax.random.key(seed), 5)
    x = bf16_exact_normal(kx, shape)
    if heavy_tailed_block is not None:
        (bm, bk), m, k = heavy_tailed_block, int(np.prod(shape[:-1])), shape[-1]
        scales = jnp.exp(1.5 * jax.random.normal(kbs, (-(-m // bm), -(-k // bk))))
        x = jax.random.normal(kx, shape) * jnp.repeat(jnp.repeat(scales, bm, 0), bk, 1)[:m, :k].reshape(shape)
    scale, shift = bf16_exact_normal(ks, shape[-1:]), bf16_exact_normal(kb, shape[-1:])
    return tuple(a.astype(dtype) for a in (x, scale, shift, bf16_exact_normal(kdy, shape)))


def _kept(x, options, key, dtype):
    x2 = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    options = {k: v for k, v in options.items() if k != "stochastic"}
    sampling = None if key is None else reference.op_sampling_key(key)
    return reference.kept_input(x2, SPARSITY, key=sampling, dtype=dtype, **options)


@pytest.mark.parametrize("case", CASES)
def test_scale_shift_grads_match_independent_reference(case):
    shape, dtype, options = CASES[case]
    block = options["block"] if isinstance(options["block"], tuple) else (options["block"],) * 2
    full_mantissas = "storage_dtype" in options or "stochastic" in options
    x, scale, shift, dy = _inputs(shape, dtype, heavy_tailed_block=block if full_mantissas else None)
    key = jax.random.key(5) if options.get("stochastic") else None
    op = lambda x, s, b: bsr_scale_shift(x, s, b, sparsity=SPARSITY, key=key, **options)
    y, grads = jax.jit(lambda x, s, b, dy: (lambda y, vjp: (y, vjp(dy)))(*jax.vjp(op, x, s, b)))(x, scale, shift, dy)
    # The forward rule under differentiation; jitted on both sides, since XLA may fuse x * s + b.
    chex.assert_trees_all_equal(y, jax.jit(lambda x, s, b: x * s + b)(x, scale, shift))
    assert all(g.dtype == dtype for g in grads)
    expected = reference.scale_shift_grads(scale, dy, _kept(x, options, key, dtype))
    assert_close_scaled(grads, tuple(jnp.asarray(e, jnp.float32) for e in expected), dtype)


def test_forward_bitwise_and_sparsity_zero_exact():
    x = jax.random.normal(jax.random.key(1), (8, 32))
    s, b = jnp.linspace(0.5, 2, 32), jnp.linspace(-1, 1, 32)
    chex.assert_trees_all_equal(bsr_scale_shift(x, s, b, sparsity=0.8, block=8), x * s + b)
    loss = lambda y: jnp.sum(jnp.sin(y) * jnp.linspace(-1.0, 1.0, 32))
    dense = jax.grad(lambda s: loss(x * s + b))(s)
    chex.assert_trees_all_equal(jax.grad(lambda s: loss(bsr_scale_shift(x, s, b, sparsity=0.0)))(s), dense)


def test_residual_is_blocks_not_dense_input():
    x = jnp.ones((64, 64, 32))
    s = jnp.ones((32,))
    res = residual_bytes(lambda s, x: jnp.sum(bsr_scale_shift(x, s, sparsity=0.75, block=16)), s, x)
    assert res.inputs == 0
    assert res.activations == 128 * (16 * 16 * 4 + 2) + 3 * 4  # 128 of 512 blocks, int16 rows, col_ptr


def _random_params(params, seed):
    """Every parameter replaced by random values, so a layer ignoring one (or swapping them) shows."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [bf16_exact_normal(k, p.shape) for k, p in zip(keys, leaves)])


@pytest.mark.parametrize("sparsity", [0.0, 0.6])
def test_affine_and_layerscale_match_plain_autodiff_with_random_params(sparsity):
    """Forward, dx and the shift gradient exactly those of alpha * x + beta / scale * x; the scale
    gradient exact at sparsity 0 and the reference's masked one at 0.6."""
    x = bf16_exact_normal(jax.random.key(2), (2, 8, 16))
    dy = bf16_exact_normal(jax.random.key(3), (2, 8, 16))
    for layer, plain in [
        (Affine(sparsity=sparsity, block=4), lambda p, x: p["alpha"] * x + p["beta"]),
        (LayerScale(init_value=0.1, sparsity=sparsity, block=4), lambda p, x: p["scale"] * x),
    ]:
        params = _random_params(layer.init(jax.random.key(0), x), seed=4)
        # Each forward and its vjp in one jitted program, as training runs them (one compile each).
        under_vjp = lambda f: jax.jit(lambda p, x: (lambda y, vjp: (y, vjp(dy)))(*jax.vjp(f, p, x)))(params, x)  # noqa: E731
        (y, (dparams, dx)), (y_plain, (dparams_plain, dx_plain)) = under_vjp(layer.apply), under_vjp(lambda p, x: plain(p["params"], x))
        chex.assert_trees_all_equal(y, y_plain)
        chex.assert_trees_all_close(dx, dx_plain, atol=1e-6, rtol=1e-6)
        name = "alpha" if isinstance(layer, Affine) else "scale"
        kept = reference.kept_input(np.asarray(x, np.float64).reshape(-1, 16), sparsity, 4) if sparsity else np.asarray(x, np.float64).reshape(-1, 16)
        expected = {**jax.tree.map(np.asarray, dparams_plain["params"]), name: (kept * np.asarray(dy, np.float64).reshape(-1, 16)).sum(0)}
        chex.assert_trees_all_close(dparams["params"], expected, atol=1e-5, rtol=1e-5)


def test_affine_int8_storage_and_stochastic_match_reference():
    """The layer passes storage_dtype and stochastic on, sampling with its "pruning" stream's key."""
    x = jax.random.normal(jax.random.key(6), (64, 32)) * jnp.linspace(0.2, 3.0, 32)
    dy = bf16_exact_normal(jax.random.key(7), (64, 32))
    affine = Affine(sparsity=0.5, block=8, storage_dtype="int8", stochastic=True)
    params = _random_params(affine.init(jax.random.key(0), x), seed=8)
    rngs = {"pruning": jax.random.key(1)}
    layer_key = affine.bind(params, rngs=rngs).make_rng("pruning")  # the key the layer's first draw gets
    dparams = jax.jit(lambda p: jax.vjp(lambda p: affine.apply(p, x, rngs=rngs), p)[1](dy)[0])(params)["params"]
    kept = reference.kept_input(np.asarray(x), 0.5, 8, storage_dtype="int8", key=reference.op_sampling_key(layer_key))
    _, dalpha, dbeta = reference.scale_shift_grads(params["params"]["alpha"], dy, kept)
    assert_close_scaled((dparams["alpha"], dparams["beta"]), (jnp.asarray(dalpha, jnp.float32), jnp.asarray(dbeta, jnp.float32)), jnp.float32)


def test_bad_arguments():
    with pytest.raises(ValueError, match="sparsity"):
        bsr_scale_shift(jnp.ones((4, 8)), jnp.ones(8), sparsity=1.0)
    with pytest.raises(ValueError, match="scale must be"):
        bsr_scale_shift(jnp.ones((4, 8)), jnp.ones(7), sparsity=0.5)
    with pytest.raises(ValueError, match="x must have a floating dtype"):
        bsr_scale_shift(jnp.ones((4, 8), jnp.int32), jnp.ones(8, jnp.int32), sparsity=0.5)
    with pytest.raises(ValueError, match="key is only used with stochastic=True"):
        bsr_scale_shift(jnp.ones((4, 8)), jnp.ones(8), sparsity=0.5, key=jax.random.key(0))
    with pytest.raises(ValueError, match="block"):
        Affine(sparsity=0.5, block=0).init(jax.random.key(0), jnp.ones((4, 8)))
