"""ResMLP: shapes, exact parameter counts, dense/sparse equivalence and residual memory per block."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bsr_jax
from train.models import (
    PRESETS,
    ResMLP,
    dense_def,
    layerscale_init_for,
    scale_shift_defs,
)


def expected_param_count(dim: int, depth: int, patch: int, image: int, classes: int, channels: int = 3) -> int:
    """ResMLP parameter count from its definition (Touvron et al. 2021)."""
    tokens = (image // patch) ** 2
    stem = patch * patch * channels * dim + dim
    block = (
        2 * dim  # affine1
        + tokens * tokens + tokens  # token mixing
        + dim  # layerscale1
        + 2 * dim  # affine2
        + dim * 4 * dim + 4 * dim  # fc1
        + 4 * dim * dim + dim  # fc2
        + dim  # layerscale2
    )
    return stem + depth * block + 2 * dim + dim * classes + classes


def count(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


@pytest.mark.parametrize(
    "preset, image, patch, classes",
    [("s12", 224, 16, 1000), ("s24", 224, 16, 1000), ("b24", 224, 16, 1000), ("s12", 32, 4, 100), ("tiny", 32, 4, 10)],
)
def test_shapes_and_param_counts(preset, image, patch, classes):
    model = ResMLP(num_classes=classes, patch_size=patch, **PRESETS[preset])
    images = jax.ShapeDtypeStruct((2, image, image, 3), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), images)
    logits = jax.eval_shape(model.apply, variables, images)
    assert logits.shape == (2, classes) and logits.dtype == jnp.float32
    assert count(variables) == expected_param_count(image=image, patch=patch, classes=classes, **PRESETS[preset])


@pytest.mark.parametrize("preset, published", [("s12", 15.4e6), ("s24", 30.0e6)])
def test_imagenet_presets_have_the_published_param_counts(preset, published):
    # Touvron et al. 2021 report, for 224px ImageNet with patch 16, 15.4M parameters for ResMLP-S12
    # and 30.0M for ResMLP-S24, rounded to 0.1M. Counting the model itself, this catches a layer the model lacks
    # or adds and, through expected_param_count, a formula that misreads the architecture.
    model = ResMLP(num_classes=1000, patch_size=16, **PRESETS[preset])
    variables = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32))
    assert count(variables) == expected_param_count(image=224, patch=16, classes=1000, **PRESETS[preset])
    assert abs(count(variables) - published) <= 0.05e6


def test_layerscale_init_follows_depth():
    assert layerscale_init_for(12) == 0.1 and layerscale_init_for(24) == 1e-5
    model = ResMLP(num_classes=10, patch_size=4, dim=16, depth=2)
    params = init(model, jnp.zeros((1, 8, 8, 3)))["params"]
    np.testing.assert_array_equal(params["block1"]["layerscale2"]["scale"], np.full((16,), 0.1, np.float32))


def test_rejects_image_not_multiple_of_patch():
    model = ResMLP(num_classes=10, patch_size=5, dim=16, depth=1)
    with pytest.raises(ValueError, match="patch_size=5"):
        model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))


def small_model(dense, **kw):
    return ResMLP(num_classes=10, patch_size=4, dim=32, depth=1, dense=dense, **kw)


def init(model, images):
    return jax.jit(model.init)(jax.random.key(0), images)


def grads(model, params, images, labels):
    return jax.jit(jax.grad(lambda p: loss_fn(model, p, images, labels)))(params)


def loss_fn(model, params, images, labels):
    logits = model.apply({"params": params}, images)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[:, None], -1)[:, 0])


@pytest.fixture(scope="module")
def batch():
    images = jax.random.normal(jax.random.key(1), (8, 16, 16, 3))
    return images, jnp.arange(8) % 10


def test_dense_and_sparse_share_parameter_trees(batch):
    images, _ = batch
    sparse = dense_def(sparsity=0.7, block=8)
    affine, layerscale = scale_shift_defs(sparsity=0.7, block=8)
    trees = [
        init(model, images)
        for model in (
            small_model(nn.Dense, stem_dense=nn.Dense, head_dense=nn.Dense),
            small_model(dense_def()),
            small_model(sparse, stem_dense=sparse, head_dense=sparse),
            small_model(sparse, affine=affine, layerscale=layerscale, remat=True),
        )
    ]
    for tree in trees[1:]:
        chex.assert_trees_all_equal_structs(tree, trees[0])
        chex.assert_trees_all_equal(tree, trees[0])  # same initialisers, same key


def test_sparsity_zero_is_the_plain_flax_model(batch):
    images, labels = batch
    plain = small_model(nn.Dense, stem_dense=nn.Dense, head_dense=nn.Dense)
    ours = small_model(dense_def(sparsity=0.0))
    params = init(plain, images)["params"]
    chex.assert_trees_all_close(
        grads(ours, params, images, labels),
        grads(plain, params, images, labels),
        atol=1e-6,
        rtol=1e-6,
    )


def test_sparse_model_changes_only_pruned_kernel_grads(batch):
    images, labels = batch
    dense, sparse = small_model(dense_def()), small_model(dense_def(sparsity=0.7, block=8))
    params = init(dense, images)["params"]
    chex.assert_trees_all_equal(*(jax.jit(m.apply)({"params": params}, images) for m in (dense, sparse)))
    g_dense = grads(dense, params, images, labels)
    g_sparse = grads(sparse, params, images, labels)
    # The head and the final Affine see exact upstream gradients and dense inputs.
    chex.assert_trees_all_close(g_sparse["head"], g_dense["head"], atol=1e-6, rtol=1e-6)
    chex.assert_trees_all_close(g_sparse["final_affine"], g_dense["final_affine"], atol=1e-6, rtol=1e-6)
    assert not np.allclose(g_sparse["block0"]["fc2"]["kernel"], g_dense["block0"]["fc2"]["kernel"], atol=1e-6)


@pytest.mark.parametrize("sparsity, policy, at_most", [(0.0, None, 0.5), (0.7, bsr_jax.remat_policy(), 1.0)])
def test_remat_gives_the_same_gradients_and_keeps_less(batch, sparsity, policy, at_most):
    images, labels = batch
    dense = dense_def(sparsity=sparsity, block=8)
    plain, remat = small_model(dense), small_model(dense, remat=True, remat_policy=policy)
    params = init(plain, images)["params"]
    chex.assert_trees_all_close(
        grads(remat, params, images, labels),
        grads(plain, params, images, labels),
        atol=1e-6,
        rtol=1e-6,
    )
    kept = [bsr_jax.residual_bytes(functools.partial(loss_fn, m, labels=labels), params, images).activations for m in (plain, remat)]
    assert kept[1] < at_most * kept[0]


def test_bf16_compute_keeps_f32_params_and_logits(batch):
    images, _ = batch
    model = small_model(dense_def(sparsity=0.5, block=8), dtype=jnp.bfloat16)
    variables = init(model, images)
    assert {x.dtype for x in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}
    assert jax.jit(model.apply)(variables, images).dtype == jnp.float32


def linear_residual_bytes(m: int, k: int, n: int, sparsity: float, block: int) -> int:
    """Activation bytes ``bsr_linear`` keeps for an f32 ``(m, k)`` input and a ``(k, n)`` kernel."""
    x, w = jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((k, n), jnp.float32)
    fn = lambda w, x: bsr_jax.bsr_linear(x, w, sparsity=sparsity, block=block).sum()
    kept = bsr_jax.residual_bytes(fn, w, x)
    return kept.activations + kept.inputs


def scale_shift_residual_bytes(m: int, k: int, sparsity: float, block: int) -> int:
    """Activation bytes ``bsr_scale_shift`` keeps for an f32 ``(m, k)`` input."""
    x, scale = jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((k,), jnp.float32)
    fn = lambda scale, x: bsr_jax.bsr_scale_shift(x, scale, sparsity=sparsity, block=block).sum()
    kept = bsr_jax.residual_bytes(fn, scale, x)
    return kept.activations + kept.inputs


@pytest.mark.parametrize("sparsity, prune_scale_shift", [(0.0, False), (0.7, False), (0.7, True)])
def test_residual_bytes_of_one_block(sparsity, prune_scale_shift):
    # One block of tokens (B, T, D) keeps GELU's 4D input only (4 units of B*T*D floats, thanks to
    # jax.checkpoint), the inputs of its 4 scale/shift layers (affine1, layerscale1, affine2,
    # layerscale2: 1 unit each when dense) and of its three linear layers (1 + 1 + 4 units when
    # dense), or their kept blocks when pruned. Differencing depth 2 and 1 isolates one block;
    # differencing batch 2B and B cancels the batch-independent broadcast copies of parameters.
    t, d, block = 16, 32, 8
    affine, layerscale = scale_shift_defs(sparsity=sparsity if prune_scale_shift else 0.0, block=block)

    def activations(depth, b):
        images = jax.ShapeDtypeStruct((b, 16, 16, 3), jnp.float32)
        model = ResMLP(
            num_classes=10,
            patch_size=4,
            dim=d,
            depth=depth,
            dense=dense_def(sparsity=sparsity, block=block),
            affine=affine,
            layerscale=layerscale,
        )
        params = jax.eval_shape(model.init, jax.random.key(0), images)["params"]
        labels = jnp.zeros((b,), jnp.int32)
        return bsr_jax.residual_bytes(lambda p, x: loss_fn(model, p, x, labels), params, images).activations

    def block_bytes(b):
        linear_inputs = (
            linear_residual_bytes(b * d, t, t, sparsity, block)
            + linear_residual_bytes(b * t, d, 4 * d, sparsity, block)
            + linear_residual_bytes(b * t, 4 * d, d, sparsity, block)
        )
        scale_inputs = 4 * scale_shift_residual_bytes(b * t, d, sparsity if prune_scale_shift else 0.0, block)
        if sparsity == 0.0:
            assert linear_inputs == 6 * b * t * d * 4
        return 4 * b * t * d * 4 + scale_inputs + linear_inputs

    measured = [activations(2, b) - activations(1, b) for b in (8, 16)]
    assert measured[1] - measured[0] == block_bytes(16) - block_bytes(8)


def test_rounding_flag_reaches_the_layers_and_draws_from_the_run_key(batch):
    """``--storage-dtype int4 --rounding stochastic``: the run's Pruning rounds stochastically, so
    the gradient depends on the pruning key (nearest rounding: it does not); without an int8/int4
    storage dtype the flag is refused naming it."""
    from train.config import TrainConfig, UsageError
    from train.loop import create_model, loss_function
    from train.models import config_pruning

    images, labels = batch
    with pytest.raises(UsageError, match="rounding must be .* needs --storage-dtype int8 or int4"):
        TrainConfig(rounding="stochastic")
    grads_by_key = {}
    for rounding in ("nearest", "stochastic"):
        config = TrainConfig(dim=16, depth=1, image_size=16, patch_size=4, storage_dtype="int4", rounding=rounding, prune_scale_shift=True)
        assert config_pruning(config).rounding == rounding
        model = create_model(config, 10)
        params = model.init(jax.random.key(0), images)["params"]
        loss = loss_function(model, 10, 0.0)
        grad = jax.jit(jax.grad(lambda p, k: loss(p, {"image": images, "label": labels}, k)[0]))
        grads_by_key[rounding] = [grad(params, jax.random.key(k)) for k in (1, 2)]
    chex.assert_trees_all_equal(*grads_by_key["nearest"])
    fc1 = [g["block0"]["fc1"]["kernel"] for g in grads_by_key["stochastic"]]
    assert not np.allclose(*fc1), "stochastic rounding ignored the key"
