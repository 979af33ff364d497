"""Lean neighbours: same forward bits, the gradients of plain autodiff, fewer residual bytes."""

import dataclasses
import functools
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
import third_party_models as tpm
from flax import nnx

import bsr_jax
from bsr_jax.rewrite import lean as lean_lib
from bsr_jax.rewrite import lean_policy
from bsr_jax.rewrite.lean import lean_neighbours
from bsr_jax.rewrite.lean_graph import Treatment, lean_call

TOL = dict(atol=1e-6, rtol=1e-5)  # float reassociation only (recomputed stats, f32)
# Attention's key bias has a zero gradient in exact arithmetic (softmax ignores a shift per query
# row): plain autodiff and flash attention's derivative leave different rounding noise there (~5e-6).
ATTENTION_TOL = dict(atol=2e-5, rtol=1e-5)


def normal(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def probe(y, weights):
    """A linear read-out of ``y`` that keeps only ``weights`` (as one computed array), not ``y``."""
    return jnp.sum(y * jax.lax.stop_gradient(weights))


def compare(fn, params, *args, jit=False, tol=TOL):
    """fn(params, *args, lean) -> scalar: checks the value's bits and the gradients (params and float
    args), returns the residuals of plain and lean. ``jit``: compiled, as training runs (faster than
    op-by-op for whole models)."""
    floating = [i for i, a in enumerate(args, 1) if all(jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in jax.tree.leaves(a))]
    transform = functools.partial(jax.jit, static_argnums=len(args) + 1) if jit else (lambda f: f)
    forward = transform(fn)
    assert forward(params, *args, False) == forward(params, *args, True)
    # Within one fwd+bwd program XLA may fuse the (recomputed) forward differently, so the value
    # there is only close; the bits are checked on the forward program above.
    step = transform(jax.value_and_grad(fn, argnums=(0, *floating)))
    plain_value, plain_grads = step(params, *args, False)
    lean_value, lean_grads = step(params, *args, True)
    chex.assert_trees_all_close(lean_value, plain_value, **tol)
    chex.assert_trees_all_close(lean_grads, plain_grads, **tol)
    return tuple(bsr_jax.residual_bytes(lambda p, *a: fn(p, *a, lean), params, *args) for lean in (False, True))


def test_linen_norms_keep_only_their_input():
    x = normal((4, 6, 32))
    cotangent = normal((4, 6, 32), seed=1)
    for norm in (nn.LayerNorm(), nn.RMSNorm(), nn.GroupNorm(num_groups=4)):
        variables = tpm.jitter(norm.init(jax.random.key(0), x))

        def loss(variables, inputs, lean):
            x, cotangent = inputs
            with lean_neighbours(lean):
                y = norm.apply(variables, x)
            return probe(y, cotangent)

        plain_y = norm.apply(variables, x)
        with lean_neighbours():
            assert jnp.array_equal(norm.apply(variables, x), plain_y)
        plain, lean = compare(loss, variables, (x, cotangent))
        assert (lean.inputs, lean.activations) == (x.nbytes, cotangent.nbytes), type(norm).__name__
        assert plain.total > lean.total


def test_batch_norm_training_updates_statistics_and_keeps_only_its_input():
    x = normal((16, 32)) * 3 + 1
    cotangent = normal((16, 32), seed=1)
    norm = nn.BatchNorm(use_running_average=False, momentum=0.9)
    variables = tpm.jitter(norm.init(jax.random.key(0), x))

    def apply(params, x, lean):
        with lean_neighbours(lean):
            return norm.apply({"params": params, "batch_stats": variables["batch_stats"]}, x, mutable=["batch_stats"])

    (y_plain, stats_plain), (y_lean, stats_lean) = apply(variables["params"], x, False), apply(variables["params"], x, True)
    assert jnp.array_equal(y_plain, y_lean)
    chex.assert_trees_all_equal(stats_lean, stats_plain)
    assert not jnp.allclose(stats_lean["batch_stats"]["mean"], variables["batch_stats"]["mean"])
    plain, lean = compare(lambda p, xc, lean: probe(apply(p, xc[0], lean)[0], xc[1]), variables["params"], (x, cotangent))
    assert (lean.inputs, lean.activations) == (x.nbytes, cotangent.nbytes)
    assert plain.total > lean.total


def test_batch_norm_statistics_update_under_jit_value_and_grad():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(nn.relu(nn.BatchNorm(use_running_average=False)(nn.Dense(16)(x))))

    x = normal((8, 4))
    variables = Net().init(jax.random.key(0), x)

    @jax.jit
    def step(params, x):
        def loss(params):
            with lean_neighbours():
                y, updates = Net().apply({"params": params, "batch_stats": variables["batch_stats"]}, x, mutable=["batch_stats"])
            return jnp.sum(y**2), updates

        return jax.value_and_grad(loss, has_aux=True)(params)

    def plain_loss(params):
        y, updates = Net().apply({"params": params, "batch_stats": variables["batch_stats"]}, x, mutable=["batch_stats"])
        return jnp.sum(y**2), updates

    (value, updates), grads = step(variables["params"], x)
    (plain_value, plain_updates), plain_grads = jax.value_and_grad(plain_loss, has_aux=True)(variables["params"])
    chex.assert_trees_all_close((value, updates, grads), (plain_value, plain_updates, plain_grads), **TOL)


# Looked up at call time, as model code does (``nn.gelu(x)``): that is what the context replaces.
SMOOTH = {
    "nn.gelu": lambda x: nn.gelu(x),
    "jax.nn.gelu": lambda x: jax.nn.gelu(x),
    "nn.gelu exact": lambda x: nn.gelu(x, approximate=False),
    "nn.silu": lambda x: nn.silu(x),
    "nn.swish": lambda x: nn.swish(x),
    "nnx.silu": lambda x: nnx.silu(x),
}
RELU = {"nn.relu": lambda x: nn.relu(x), "jax.nn.relu": lambda x: jax.nn.relu(x), "nnx.relu": lambda x: nnx.relu(x)}


@pytest.mark.parametrize("name", SMOOTH)
def test_smooth_activations_keep_only_their_input(name):
    activation = SMOOTH[name]
    x, cotangent = normal((8, 64)), normal((8, 64), seed=1)

    def loss(_, inputs, lean):
        x, cotangent = inputs
        with lean_neighbours(lean):
            return probe(activation(x), cotangent)

    plain, lean = compare(loss, {}, (x, cotangent))
    assert (lean.inputs, lean.activations) == (x.nbytes, cotangent.nbytes)
    assert plain.total > lean.total


@pytest.mark.parametrize("name", RELU)
def test_relu_keeps_a_one_bit_mask(name):
    relu = RELU[name]
    x = normal((3, 5, 61)).at[0, 0, :4].set(0.0)  # 15 rows pad the last byte; zeros take derivative 0
    cotangent = normal((3, 5, 61), seed=1)

    def loss(_, inputs, lean):
        x, cotangent = inputs
        with lean_neighbours(lean):
            return probe(relu(x), cotangent)

    plain, lean = compare(loss, {}, (x, cotangent))
    kept = sorted((r.shape, r.dtype) for r in lean.residuals)
    # (ceil(rows / 8), columns) on every platform: the last axis stays the minor one (TPU's 128 lanes).
    assert kept == sorted([((math.ceil(15 / 8), 61), "uint8"), (cotangent.shape, "float32")])
    assert plain.total > lean.total


def test_relu_forward_mode_matches():
    x, t = normal((5, 7)), normal((5, 7), seed=1)
    plain = jax.jvp(lambda x: jax.nn.relu(x), (x,), (t,))
    with lean_neighbours():
        lean = jax.jvp(lambda x: jax.nn.relu(x), (x,), (t,))
    chex.assert_trees_all_equal(lean, plain)


def test_dot_product_attention_recomputes_probabilities_with_the_same_dropout():
    batch, length, heads, depth = 2, 12, 3, 8
    q, k, v = (normal((batch, length, heads, depth), seed=s) for s in range(3))
    bias = normal((1, heads, length, length), seed=3)  # broadcast: (B, H, T, T) is the probabilities' shape
    mask = nn.make_causal_mask(jnp.ones((batch, length)))
    rng = jax.random.key(7)

    def loss(_, qkv, lean):
        with lean_neighbours(lean):
            out = nn.dot_product_attention(*qkv, bias=bias, mask=mask, dropout_rng=rng, dropout_rate=0.3, deterministic=False)
        return jnp.sum(jnp.sin(out))

    plain, lean = compare(loss, {}, (q, k, v), jit=True)
    square = (batch, heads, length, length)
    assert [r.shape for r in lean.residuals].count(square) == 0  # no probabilities or dropout masks
    assert [r.shape for r in plain.residuals].count(square) >= 3


def test_multi_head_attention_default_attention_fn_is_lean_with_dropout():
    x = normal((2, 10, 16))
    attention = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.5, deterministic=False)
    params = attention.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)

    def loss(params, x, lean):
        with lean_neighbours(lean):
            return jnp.sum(attention.apply(params, x, rngs={"dropout": jax.random.key(2)}) ** 2)

    plain, lean = compare(loss, params, x, tol=ATTENTION_TOL)
    assert not [r for r in lean.residuals if r.shape == (2, 2, 10, 10)]
    assert plain.activations > lean.activations
    assert attention.attention_fn is nn.dot_product_attention  # restored on exit


@pytest.mark.parametrize("name", ["vit", "lm", pytest.param("mixer", marks=pytest.mark.slow)])  # vit covers mixer's parts
def test_third_party_models_forward_bits_gradients_and_bytes(name):
    c = dataclasses.replace(tpm.TINY, layers=1)
    model, x, target, task_loss = {
        "mixer": (tpm.mixer(c), tpm.images(c), tpm.labels(c), tpm.classifier_loss),
        "vit": (tpm.vit(c, dropout_rate=0.1), tpm.images(c), tpm.labels(c), tpm.classifier_loss),
        "lm": (tpm.lm(c, dropout_rate=0.1), tpm.tokens(c), tpm.tokens(c), tpm.lm_loss),
    }[name]
    params = tpm.jitter(jax.jit(model.init)(jax.random.key(0), x))
    with lean_neighbours():
        assert jax.tree.structure(jax.eval_shape(model.init, jax.random.key(0), x)) == jax.tree.structure(params)
    kwargs = {"train": True} if name == "vit" else {}
    rngs = {"dropout": jax.random.key(3)}

    def loss(params, x, lean):
        with lean_neighbours(lean):
            return task_loss(model.apply(params, x, rngs=rngs, **kwargs), target)

    plain, lean = compare(loss, params, x, jit=True)
    assert lean.activations < 0.7 * plain.activations
    length = x.shape[1] if name == "lm" else (c.image // c.patch) ** 2 + 1
    probabilities = (c.batch, c.heads, length, length)
    assert (probabilities in [r.shape for r in plain.residuals]) == (name != "mixer")
    assert probabilities not in [r.shape for r in lean.residuals]


def test_nnx_norms_and_model():
    x = normal((4, 16))
    for norm in (nnx.LayerNorm(16, rngs=nnx.Rngs(0)), nnx.RMSNorm(16, rngs=nnx.Rngs(0)), nnx.GroupNorm(16, num_groups=4, rngs=nnx.Rngs(0))):
        graphdef, state = nnx.split(norm)
        state = tpm.jitter(state)

        def loss(state, x, lean):
            with lean_neighbours(lean):
                return jnp.sum(jnp.sin(nnx.merge(graphdef, state)(x)))

        plain, lean = compare(loss, state, x, jit=True)
        assert plain.total > lean.total, type(norm).__name__
    model = tpm.nnx_mlp(tpm.TINY)
    graphdef, state = nnx.split(model)

    def model_loss(state, x, lean):
        with lean_neighbours(lean):
            return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)

    plain, lean = compare(model_loss, state, tpm.features(tpm.TINY), jit=True)
    assert lean.activations < 0.5 * plain.activations


def test_nnx_batch_norm_training_updates_statistics():
    x = normal((16, 8)) * 2 + 1
    plain_norm, lean_norm = (nnx.BatchNorm(8, use_running_average=False, rngs=nnx.Rngs(0)) for _ in range(2))
    y_plain = plain_norm(x)
    with lean_neighbours():
        y_lean = lean_norm(x)
    assert jnp.array_equal(y_lean, y_plain)
    chex.assert_trees_all_equal(nnx.state(lean_norm), nnx.state(plain_norm))
    assert not jnp.allclose(lean_norm.mean[...], 0.0)


def test_everything_restored_on_exit_and_on_error_and_off_switch():
    originals = (jax.nn.gelu, nn.gelu, nn.relu, nnx.silu, nn.dot_product_attention, nnx.LayerNorm.__call__)
    with pytest.raises(RuntimeError, match="boom"):
        with lean_neighbours():
            assert jax.nn.gelu is not originals[0]
            with lean_neighbours():  # nested: a no-op
                pass
            assert nn.relu is not originals[2]
            raise RuntimeError("boom")
    assert (jax.nn.gelu, nn.gelu, nn.relu, nnx.silu, nn.dot_product_attention, nnx.LayerNorm.__call__) == originals
    x = normal((4, 32))
    layer = nn.LayerNorm()
    variables = layer.init(jax.random.key(0), x)

    def loss(variables, x, lean):
        with lean_neighbours(enabled=False):
            return jnp.sum(nn.gelu(layer.apply(variables, x)))

    plain = bsr_jax.residual_bytes(lambda v, x: loss(v, x, True), variables, x)
    with lean_neighbours(enabled=False):
        assert nn.gelu is originals[1]
    assert plain.activations > x.nbytes


def test_attention_that_sows_its_weights_runs_unchanged():
    x = normal((2, 6, 8))
    attention = nn.MultiHeadDotProductAttention(num_heads=2)
    params = attention.init(jax.random.key(0), x)
    plain, plain_state = attention.apply(params, x, sow_weights=True, mutable=["intermediates"])
    with lean_neighbours():
        lean, lean_state = attention.apply(params, x, sow_weights=True, mutable=["intermediates"])
    assert jnp.array_equal(lean, plain)
    chex.assert_trees_all_equal(lean_state, plain_state)


def test_lean_call_evaluates_a_scans_body_segment_by_segment():
    """bsr_jax.rewrite.lean_graph binds a ``scan`` again with each of its body's segments under a
    checkpoint (layers stacked with nn.scan keep what a loop of layers keeps): loop invariants
    closed over, an integer carry beside a float one, ``reverse``; the value's bits and the
    gradients of plain autodiff."""
    w, xs, c = normal((8, 8)), normal((5, 4, 8), seed=1), jnp.float32(0.3)

    def fn(w, xs, c):
        def body(carry, x):
            h, n = carry
            h = jnp.tanh(h @ w + x) * jnp.exp(-c)
            return (h, n + 1), jax.nn.softmax(h)

        (h, n), ys = jax.lax.scan(body, (jnp.zeros((4, 8)), jnp.int32(0)), xs, reverse=True)
        return jnp.sum(h) + jnp.sum(ys * jnp.arange(5.0)[:, None, None]) + n

    lean = lambda *a: lean_call(fn, *a)
    assert jax.jit(lean)(w, xs, c) == jax.jit(fn)(w, xs, c)
    chex.assert_trees_all_close(jax.grad(lean, (0, 1, 2))(w, xs, c), jax.grad(fn, (0, 1, 2))(w, xs, c), **TOL)
    scans = [e for e in jax.make_jaxpr(lean)(w, xs, c).eqns[0].params["jaxpr"].eqns if e.primitive.name == "scan"]
    assert scans and all(e.primitive.name in ("remat2", "checkpoint") for e in scans[0].params["jaxpr"].eqns)  # the name by JAX version


class _MlpBlock(nn.Module):
    """vision_transformer's MlpBlock: the GELU in the block's own code, between its two Dense."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(nn.gelu(nn.Dense(512)(x)))  # 8 x 512: dx stores it (bsr_jax.ops.dx)


class _Stream(nn.Module):
    @nn.compact
    def __call__(self, x):
        s = nn.Dense(512)(x) + nn.Dense(512)(x)
        return nn.Dense(512)(s) + s


def test_a_dense_reading_its_parents_activation_recomputes_it_rather_than_keeping_it():
    """The second Dense's checkpoint recomputes the GELU from the first Dense's output, which the
    GELU's backward keeps anyway (XLA's choice in a dense step, TPU v5p), rather than keeping the
    GELU's output beside it; not where a dx format stores the GELU's inputs."""
    model, x = _MlpBlock(), normal((8, 16))
    params = model.init(jax.random.key(1), x)
    plain = lambda p, x: jnp.sum(model.apply(p, x) ** 2)
    lean = lambda p, x: jnp.sum(lean_call(model.apply, p, x) ** 2)
    assert jax.jit(lean)(params, x) == jax.jit(plain)(params, x)
    chex.assert_trees_all_close(jax.grad(lean, (0, 1))(params, x), jax.grad(plain, (0, 1))(params, x), **TOL)
    hidden = [str(r.dtype) for r in bsr_jax.residual_bytes(lean, params, x).residuals if r.shape == (8, 512)]
    assert hidden == ["float32"]  # the first Dense's output only
    stored = lambda p, x: jnp.sum(lean_call(model.apply, p, x, treatment=Treatment(dx="int8")) ** 2)
    kept = bsr_jax.residual_bytes(stored, params, x).residuals
    assert [str(r.dtype) for r in kept if r.shape == (8, 512)] == ["float32"]  # the second Dense's input
    assert "int8" in [str(r.dtype) for r in kept]  # the GELU's input, not pulled into the Dense
    # A sum that the block's own code reads again (a residual stream): kept, not recomputed from the
    # two arrays it sums (which nothing else keeps).
    stream = _Stream()
    stream_params = stream.init(jax.random.key(2), x)
    kept = bsr_jax.residual_bytes(lambda p, x: jnp.sum(lean_call(stream.apply, p, x) ** 2), stream_params, x).residuals
    assert [r.shape for r in kept].count((8, 512)) == 2  # the sum, and the output the squared loss reads (3 if pulled)


class _DenseConvDense(nn.Module):
    transpose: bool = False
    over_two_axes: bool = False

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(3)(x)  # reads the model's input only: keeps its checkpoint
        y = jnp.swapaxes(y, 1, 2) if self.transpose else y  # pulled into the conv's run: the conv reads its output
        y = nn.Conv(8, (3, 3), use_bias=False)(y)
        return nn.DenseGeneral(4, axis=(-2, -1))(y) if self.over_two_axes else nn.Dense(4)(y)


def _top_level(model, params, x) -> list[str]:
    """The primitives ``lean_call`` binds outside any checkpoint (``remat2``: one checkpoint)."""
    return [e.primitive.name for e in jax.make_jaxpr(lambda p, x: lean_call(model.apply, p, x))(params, x).jaxpr.eqns]


def test_a_linear_layer_alone_runs_without_a_checkpoint():
    """A convolution (no bias) and a Dense with its bias, reading what the step computed, recompute
    nothing their backward reads: no checkpoint, so no optimization barrier in front of their
    backward. With one, XLA kept each convolution's kernel live in its own layout beside the
    transposed copy it made for the forward until that layer's backward (transformers' ResNet-50,
    B 16, 128 px, H100: lean at 1.07x of dense's peak, now 1.01; test_compiled's slow test). Not where a
    product reads the model's input only (XLA then kept a layout copy of ViT-B/16's images), nor
    one over several axes (its out projection's input twice), nor an equation's output pulled into
    its run (a transpose: plain autodiff would keep that output, the checkpoint keeps its input)."""
    model, x = _DenseConvDense(), normal((2, 6, 6, 3))
    params = model.init(jax.random.key(1), x)
    plain = lambda p, x: jnp.sum(model.apply(p, x) ** 2)
    lean = lambda p, x: jnp.sum(lean_call(model.apply, p, x) ** 2)
    chex.assert_trees_all_close(jax.grad(lean, (0, 1))(params, x), jax.grad(plain, (0, 1))(params, x), **TOL)
    top = _top_level(model, params, x)
    assert top.count("remat2") == 1 and "conv_general_dilated" in top and top.count("dot_general") == 1
    transposed = _DenseConvDense(transpose=True)
    top = _top_level(transposed, transposed.init(jax.random.key(1), x), x)
    assert top.count("remat2") == 2 and "conv_general_dilated" not in top
    two_axes = _DenseConvDense(over_two_axes=True)  # as attention's out projection over the heads
    top = _top_level(two_axes, two_axes.init(jax.random.key(1), x), x)
    assert top.count("remat2") == 2 and "conv_general_dilated" in top and "dot_general" not in top


@pytest.mark.parametrize("pack, unpack", [(lean_lib._pack_by_rows, lean_lib._unpack_by_rows),
                                          (lean_lib._pack_along_rows, lean_lib._unpack_along_rows)])  # fmt: skip
def test_both_mask_packings_give_the_mask_back(pack, unpack):
    """TPU's (8 rows of a column a byte) and the other platforms' (8 neighbours a byte) packing."""
    mask = jax.random.bernoulli(jax.random.key(0), 0.5, (5, 3, 61))
    rows = lean_lib._as_rows(mask).astype(jnp.uint8)
    packed = pack(rows)
    assert (packed.shape, packed.dtype) == ((2, 61), jnp.uint8)
    chex.assert_trees_all_equal(unpack(packed)[:15].reshape(mask.shape).astype(bool), mask)


@pytest.mark.parametrize("platform, grouped", [("tpu", "2x8x61xui8"), ("cuda", "122x8xui8")])
def test_the_mask_is_packed_by_rows_on_tpu_and_along_them_elsewhere(platform, grouped):
    """Lowered for TPU, bytes gather 8 rows of a column; for a GPU, 8 neighbours of a row."""
    mask = jnp.zeros((5, 3, 61), bool)
    text = jax.jit(lean_lib._pack_mask).trace(mask).lower(lowering_platforms=(platform,)).as_text()
    assert f"tensor<{grouped}>" in text, text


class _NormsBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(nn.Dense(64)(x))
        y = nn.BatchNorm(use_running_average=False)(nn.Dense(32)(y))
        return nn.Dense(8)(jax.nn.gelu(y))


def test_a_norms_statistics_are_kept_not_recomputed():
    """A lean norm keeps its statistics (a reduction of 16 or more inputs per output: a LayerNorm's
    per row, a BatchNorm's per feature), so its backward recomputes only elementwise math; a
    reduction of fewer inputs, and one judged without its operand's shape, is recomputed (ResNet-50,
    H100: BatchNorm's statistics took 1.07 of 16 lean blocks' 2.48 ms; docs/RESULTS.md 12.13)."""
    aval = jax.core.ShapedArray((8, 64), jnp.float32)
    assert lean_policy.policy(jax.lax.reduce_sum_p, aval, axes=(1,))
    assert not lean_policy.policy(jax.lax.reduce_sum_p, jax.core.ShapedArray((8, 4), jnp.float32), axes=(1,))
    assert not lean_policy.policy(jax.lax.reduce_sum_p, axes=(1,))  # ``recomputed``: by the primitive
    model, x = _NormsBlock(), normal((128, 16))
    variables = model.init(jax.random.key(1), x)
    params, stats = variables["params"], {"batch_stats": variables["batch_stats"]}
    plain = lambda p, x: jnp.sum(model.apply({"params": p, **stats}, x, mutable=["batch_stats"])[0] ** 2)
    lean = lambda p, x: jnp.sum(lean_call(lambda v, x: model.apply(v, x, mutable=["batch_stats"])[0], {"params": p, **stats}, x) ** 2)
    chex.assert_trees_all_close(jax.grad(lean, (0, 1))(params, x), jax.grad(plain, (0, 1))(params, x), **TOL)
    shapes = [r.shape for r in bsr_jax.residual_bytes(lean, params, x).residuals]
    # The LayerNorm's two per-row statistics; the BatchNorm's two per-feature ones beside its scale.
    assert shapes.count((128,)) == 2 and shapes.count((32,)) == 3, shapes
