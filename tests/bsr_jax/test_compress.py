"""compress_model and rules on models written the way their authors write them
(tests/third_party_models.py), against plain autodiff of the unmodified model and a float64
numpy reference of the masked weight gradient (tests/reference.py)."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
import third_party_models as tpm
from flax import nnx

import bsr_jax
from bsr_jax import Pruning, Rule, compress_model
from train.resnet import ResNet18

PRUNE = [Rule("*", Pruning(0.7, block=16))]
MODELS = {
    "mixer": (tpm.mixer, tpm.images, lambda c, out: tpm.classifier_loss(out, tpm.labels(c))),
    "vit": (tpm.vit, tpm.images, lambda c, out: tpm.classifier_loss(out, tpm.labels(c))),
    "lm": (tpm.lm, tpm.tokens, lambda c, out: tpm.lm_loss(out, tpm.tokens(c))),
}


def _activation_bytes(model, params, x, loss):
    r = bsr_jax.residual_bytes(lambda p, x: loss(model.apply(p, x)), params, x)
    return r.activations + r.inputs  # parameters are counted apart, so they cancel


def _tiny(name):
    """(model, input, loss(out), params) of a TINY third-party stand-in; params jittered."""
    make, inputs, loss = MODELS[name]
    model, x = make(tpm.TINY), inputs(tpm.TINY)
    return model, x, lambda out: loss(tpm.TINY, out), tpm.jitter(jax.jit(model.init)(jax.random.key(0), x))


# 11-16 s a model: -m slow. By default GPT-2's form (test_custom_layers: every projection routed,
# forward bitwise, only kernel gradients approximate) and test_lean's ViT (forward bits, exact
# gradients of the lean neighbours) hold the claim.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixer", "vit", "lm"])
def test_forward_bitwise_parameters_unchanged_and_only_kernel_grads_approximate(name):
    model, x, loss, params = _tiny(name)
    compressed = compress_model(model, PRUNE)
    chex.assert_trees_all_equal_structs(compressed.init(jax.random.key(0), x), params)
    chex.assert_trees_all_equal(jax.jit(compressed.apply)(params, x), jax.jit(model.apply)(params, x))
    argnums = (0, 1) if jnp.issubdtype(x.dtype, jnp.floating) else 0
    grad = lambda m: jax.jit(jax.grad(lambda p, x: loss(m.apply(p, x)), argnums))(params, x)
    got, want = grad(compressed), grad(model)
    flat_got, flat_want = jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)
    differing = 0
    for (path, g), w in zip(flat_got, flat_want):
        if "kernel" in jax.tree_util.keystr(path):
            differing += not np.allclose(g, w, rtol=1e-4, atol=1e-6)
        else:  # biases, norms, embeddings, inputs: everything upstream of dx, all exact
            chex.assert_trees_all_close(g, w, rtol=2e-5, atol=2e-6)
    assert differing > 0  # the pruned kernels' gradients do change


# Mixer (7 s) repeats ViT's and the LM's case: -m slow.
@pytest.mark.parametrize("name", [pytest.param("mixer", marks=pytest.mark.slow), "vit", "lm"])
def test_sparsity_zero_rules_give_dense_gradients(name):
    model, x, loss, params = _tiny(name)
    compressed = compress_model(model, [Rule("*", Pruning(0.0))])
    grad = lambda m: jax.jit(jax.grad(lambda p: loss(m.apply(p, x))))(params)
    chex.assert_trees_all_close(grad(compressed), grad(model), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name,limit,int8_limit", [("mixer", 0.30, 0.25), ("vit", 0.40, 0.30), ("lm", 0.50, 0.30)])
def test_residual_bytes_of_the_issue_configuration(name, limit, int8_limit):
    """Issue 13's configuration (4 layers, width 128, batch 8), traced only."""
    make, inputs, loss = MODELS[name]
    c = tpm.ISSUE
    model, x = make(c), inputs(c)
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    lossc = lambda out: loss(c, out)
    dense = _activation_bytes(model, params, x, lossc)
    assert _activation_bytes(compress_model(model, PRUNE), params, x, lossc) <= limit * dense
    int8 = [Rule("*", Pruning(0.7, block=16, storage_dtype="int8"))]
    assert _activation_bytes(compress_model(model, int8), params, x, lossc) <= int8_limit * dense
    # Without lean neighbours the linear inputs alone are a small part of what is kept.
    assert _activation_bytes(compress_model(model, PRUNE, lean=False), params, x, lossc) > 0.8 * dense


def test_nnx_model():
    c = tpm.ISSUE
    model, x = tpm.nnx_mlp(c), tpm.features(c)
    graph, state = nnx.split(model)

    def activation_bytes(m):
        g, st = nnx.split(m)
        r = bsr_jax.residual_bytes(lambda st, x: jnp.sum(nnx.merge(g, st)(x) ** 2), st, x)
        return r.activations + r.inputs

    # Jitted, as the linen cases are: one compile each rather than op-by-op dispatch.
    forward, grad = nnx.jit(lambda m: m(x)), nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))
    dense_bytes, y = activation_bytes(model), forward(model)
    dense_grads = grad(model)
    compressed = compress_model(model, PRUNE)
    chex.assert_trees_all_equal(forward(compressed), y)
    assert activation_bytes(compressed) <= 0.60 * dense_bytes
    chex.assert_trees_all_equal_structs(nnx.split(compressed)[1], state)
    grads = grad(compressed)
    chex.assert_trees_all_close(grads["norm"], dense_grads["norm"], rtol=1e-4, atol=1e-5)
    assert not np.allclose(grads["fc1"]["kernel"][...], dense_grads["fc1"]["kernel"][...], rtol=1e-4)


@pytest.mark.slow  # 14 s; compress_model on NNX holds by default in test_nnx_model and test_table's NNX table
def test_nnx_model_is_changed_in_place_and_a_linen_model_is_not():
    # What the README says: the NNX model passed compresses from then on; a linen one is copied.
    c = tpm.ISSUE
    model, x = tpm.nnx_mlp(c), tpm.features(c)
    loss = lambda m: jnp.sum(m(x) ** 2)  # noqa: E731
    dense_fc1 = nnx.grad(loss)(model)["fc1"]["kernel"][...]
    assert compress_model(model, PRUNE) is model
    assert not np.allclose(nnx.grad(loss)(model)["fc1"]["kernel"][...], dense_fc1, rtol=1e-4)

    linen, xs = _Named(), jnp.ones((8, 16, 32))
    params = linen.init(jax.random.key(0), xs)
    before = bsr_jax.residual_bytes(lambda p: jnp.sum(linen.apply(p, xs) ** 2), params).activations
    compressed = compress_model(linen, PRUNE)
    assert compressed is not linen and type(linen) is _Named
    assert bsr_jax.residual_bytes(lambda p: jnp.sum(linen.apply(p, xs) ** 2), params).activations == before
    assert bsr_jax.residual_bytes(lambda p: jnp.sum(compressed.apply(p, xs) ** 2), params).activations < before


class _ThreeHeads(nn.Module):
    """q, k and v read one array, as attention projections do."""

    @nn.compact
    def __call__(self, x):
        return sum(nn.Dense(32, name=n)(x) for n in ("query", "key", "value"))


class _OneHead(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(32, name="query")(x)


def test_layers_reading_one_array_keep_one_residual():
    x = jax.random.normal(jax.random.key(0), (4, 64, 32))
    three, one = compress_model(_ThreeHeads(), PRUNE, lean=False), compress_model(_OneHead(), PRUNE, lean=False)
    loss = lambda y: jnp.sum(y)  # keeps nothing of its own
    p3, p1 = three.init(jax.random.key(1), x), one.init(jax.random.key(1), x)
    assert _activation_bytes(three, p3, x, loss) == _activation_bytes(one, p1, x, loss) < x.nbytes / 2
    dense = jax.grad(lambda p: loss(_ThreeHeads().apply(p, x)))(p3)
    got = jax.grad(lambda p: loss(three.apply(p, x)))(p3)
    kept = reference.kept_input(np.asarray(x, np.float64).reshape(-1, 32), 0.7, 16)
    for name in ("query", "key", "value"):  # dy is all ones: dW = kept.T @ ones
        want = kept.T @ np.ones((kept.shape[0], 32))
        chex.assert_trees_all_close(got["params"][name]["kernel"], want.astype(np.float32), rtol=1e-5, atol=1e-4)
        chex.assert_trees_all_close(got["params"][name]["bias"], dense["params"][name]["bias"])


@pytest.mark.parametrize("features,axis", [((4, 8), -1), (6, (-2, -1)), ((2, 3), (-2, -1))])
def test_dense_general_shapes_against_masked_reference(features, axis):
    x = jax.random.normal(jax.random.key(2), (3, 10, 4, 8))
    layer = nn.DenseGeneral(features, axis=axis)
    params = tpm.jitter(layer.init(jax.random.key(3), x))
    compressed = compress_model(layer, [Rule("*", Pruning(0.5, block=8))], lean=False)
    chex.assert_trees_all_equal(jax.jit(compressed.apply)(params, x), jax.jit(layer.apply)(params, x))
    c = jax.random.normal(jax.random.key(4), layer.apply(params, x).shape)
    loss = lambda m, p, x: jnp.vdot(m.apply(p, x), c)
    (dp, dx), (dp_dense, dx_dense) = (jax.jit(jax.grad(lambda p, x: loss(m, p, x), (0, 1)))(params, x) for m in (compressed, layer))
    chex.assert_trees_all_close(dx, dx_dense, rtol=1e-5, atol=1e-5)
    contracted = 1 if axis == -1 else 2
    k = int(np.prod(x.shape[x.ndim - contracted :]))
    kept = reference.kept_input(np.asarray(x, np.float64).reshape(-1, k), 0.5, 8)
    want = (kept.T @ np.asarray(c, np.float64).reshape(kept.shape[0], -1)).reshape(dp["params"]["kernel"].shape)
    chex.assert_trees_all_close(dp["params"]["kernel"], want.astype(np.float32), rtol=1e-4, atol=1e-4)


class _Named(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = bsr_jax.Dense(64, sparsity=0.5, block=8, name="own")(x)  # a non-zero default of its own
        x = nn.Dense(64, name="fc1")(x)
        x = nn.Dense(64, name="fc2")(x)
        return nn.Dense(10, name="head")(x)


def test_rules_first_match_none_and_defaults():
    x = jnp.ones((8, 16, 32))
    model = _Named()
    params = model.init(jax.random.key(0), x)
    rules = [Rule("head", None), Rule("fc2", Pruning(0.9, block=8)), Rule("fc*", Pruning(0.25, block=8))]
    compressed = compress_model(model, rules, lean=False)
    plan = {layer.path: layer.compression.sparsity for layer in bsr_jax.pruning_plan(compressed.apply, params, x)}
    assert plan == {"own": 0.5, "fc1": 0.25, "fc2": 0.9}  # head dense; own keeps its default
    with pytest.raises(ValueError, match=r"\['blocks/\*'\] matched no layer"):
        compress_model(model, [Rule("blocks/*", Pruning(0.5))]).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="bsr_jax.Rule"):
        compress_model(model, [("fc1", 0.5)])
    with pytest.raises(TypeError, match="rules must be a bsr_jax.Rule or a list of them"):
        compress_model(model, Pruning(0.5))
    with pytest.raises(ValueError, match="compression must be"):
        Rule("fc1", 0.5)


@pytest.mark.parametrize("model", [_Named(), nnx.Linear(4, 4, rngs=nnx.Rngs(0))], ids=["linen", "nnx"])
def test_no_rules_is_an_error_naming_the_argument(model):
    # An empty list would leave every layer dense without a word.
    for empty in ([], ()):
        with pytest.raises(ValueError, match=r"^rules is empty: compress_model needs at least one bsr_jax.Rule"):
            compress_model(model, empty)


def test_unsupported_products_stay_dense_and_exact():
    x = jax.random.normal(jax.random.key(0), (4, 6, 8))
    layer = nn.DenseGeneral(5, batch_dims=(0,), axis=-1)
    params = layer.init(jax.random.key(1), x)
    compressed = compress_model(layer, [Rule("*", Pruning(0.7, block=2))], lean=False)
    grad = lambda m: jax.grad(lambda p: jnp.sum(jnp.sin(m.apply(p, x))))(params)
    with pytest.warns(UserWarning, match="the root module stays dense: the module has its own dot_general or batch dims"):
        compressed_grad = grad(compressed)
    chex.assert_trees_all_equal(compressed_grad, grad(layer))


# ---- convolutions: nn.Conv and subclasses routed to the compressed conv ----


class _WeightStandardisedConv(nn.Conv):
    """A conv overriding ``param`` (as big_transfer's StdConv does): routing must use its kernel."""

    def param(self, name, *args, **kwargs):
        p = super().param(name, *args, **kwargs)
        if name == "kernel":
            mean, var = jnp.mean(p, axis=(0, 1, 2)), jnp.var(p, axis=(0, 1, 2))
            p = (p - mean) / jnp.sqrt(var + 1e-5)
        return p


def _upsampled_pool2(x):
    """Nearest-neighbour upsampling of the 2 x 2 window means (even sides), by nn.avg_pool."""
    means = nn.avg_pool(x, (2, 2), strides=(2, 2))
    return jnp.repeat(jnp.repeat(means, 2, axis=1), 2, axis=2)


CONV_CASES = [  # (conv class, strides, padding, kernel size, compression)
    (nn.Conv, 1, "SAME", 3, bsr_jax.Pooling(2)),
    (nn.Conv, 2, "VALID", 1, bsr_jax.Pooling(2)),
    (_WeightStandardisedConv, 2, ((1, 0), (2, 1)), 3, bsr_jax.Pooling(2)),
    (_WeightStandardisedConv, 1, "SAME", 3, Pruning(0.5, block=8)),
]


@pytest.mark.parametrize("conv_cls,strides,padding,kernel,compression", CONV_CASES)
def test_convs_forward_bitwise_dx_exact_dw_at_the_compressed_input(conv_cls, strides, padding, kernel, compression):
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 16))
    layer = conv_cls(8, (kernel, kernel), strides=strides, padding=padding)
    params = tpm.jitter(layer.init(jax.random.key(1), x))
    compressed = compress_model(layer, [Rule("*", compression)], lean=False)
    chex.assert_trees_all_equal_structs(compressed.init(jax.random.key(1), x), params)
    y = jax.jit(layer.apply)(params, x)
    chex.assert_trees_all_equal(jax.jit(compressed.apply)(params, x), y)
    c = jax.random.normal(jax.random.key(2), y.shape)
    loss = lambda m, p, x: jnp.vdot(m.apply(p, x), c)  # linear: dy = c wherever the conv is evaluated
    dp, dx = jax.jit(jax.grad(lambda p, x: loss(compressed, p, x), (0, 1)))(params, x)
    dp_dense, dx_dense = jax.jit(jax.grad(lambda p, x: loss(layer, p, x), (0, 1)))(params, x)
    chex.assert_trees_all_close(dx, dx_dense, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(dp["params"]["bias"], dp_dense["params"]["bias"], rtol=1e-6, atol=1e-6)
    if isinstance(compression, bsr_jax.Pooling):
        x_hat = _upsampled_pool2(x)
    else:
        x_hat = reference.kept_input(np.asarray(x, np.float64).reshape(-1, 16), 0.5, 8).reshape(x.shape)
    # The exact gradient of the unmodified layer (standardisation included) at the compressed input.
    want = jax.jit(jax.grad(lambda p: loss(layer, p, jnp.asarray(x_hat, jnp.float32))))(params)
    chex.assert_trees_all_close(dp["params"]["kernel"], want["params"]["kernel"], rtol=1e-5, atol=1e-4)
    assert not np.allclose(dp["params"]["kernel"], dp_dense["params"]["kernel"], rtol=1e-3)


def _resnet18():
    """flax examples' ResNet-18 shape (train/resnet.py with plain nn.Conv, nn.BatchNorm and
    ``act=nn.relu`` held as a module attribute), small: 8 filters, 16 px, batch 4."""
    model = ResNet18(num_classes=10, stem="cifar", num_filters=8)
    x = jax.random.normal(jax.random.key(0), (4, 16, 16, 3))
    return model, x, model.init(jax.random.key(1), x)


def _train_loss(model, variables):
    """Loss of a training step: BatchNorm on batch statistics, updating them."""

    def loss(params, x):
        y, _ = model.apply({"params": params, "batch_stats": variables["batch_stats"]}, x, mutable=["batch_stats"])
        return jnp.sum(jnp.sin(y))

    return loss


@pytest.mark.slow  # 13 s; pooled convs' dW and bytes hold by default in test_conv, ResNet training in test_resnet
def test_resnet18_pool2_keeps_at_most_060_of_dense_with_exact_input_gradient():
    model, x, variables = _resnet18()
    with pytest.warns(UserWarning, match="Dense_0 stays dense: .*Pooling compresses convolution inputs only"):
        compressed = compress_model(model, [Rule("*", bsr_jax.Pooling(2))])
        activations = lambda m: _activation_bytes_of(_train_loss(m, variables), variables["params"], x)
        ratio = activations(compressed) / activations(model)
        dense_dx = jax.jit(jax.grad(_train_loss(model, variables), 1))(variables["params"], x)
        dx = jax.jit(jax.grad(_train_loss(compressed, variables), 1))(variables["params"], x)
        forward = lambda m: jax.jit(lambda v, x: m.apply(v, x, mutable=["batch_stats"]))(variables, x)  # noqa: E731
        compressed_forward = forward(compressed)
    assert ratio <= 0.60, ratio
    chex.assert_trees_all_close(dx, dense_dx, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal(compressed_forward, forward(model))
    # Without lean neighbours the conv inputs alone are a small part of what is kept.
    every_conv = [Rule("Dense_0", None), Rule("*", bsr_jax.Pooling(2))]
    assert activations(compress_model(model, every_conv, lean=False)) > 0.75 * activations(model)


def _activation_bytes_of(loss, params, x):
    r = bsr_jax.residual_bytes(loss, params, x)
    return r.activations + r.inputs


class _BsrConvModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = bsr_jax.Conv(8, (3, 3), compression=bsr_jax.Pooling(4), name="own")(x)
        x = nn.Conv(8, (3, 3), name="plain")(x)
        return nn.Conv(8, (1, 1), name="last")(x)


def test_pruning_plan_lists_convs_and_bsr_jax_conv_follows_rules():
    x = jnp.ones((2, 8, 8, 4))
    model = _BsrConvModel()
    params = model.init(jax.random.key(0), x)
    plan = lambda rules: {layer.path: layer.compression for layer in bsr_jax.pruning_plan(compress_model(model, rules).apply, params, x)}
    assert plan([Rule("plain", bsr_jax.Pooling(2))]) == {"own": bsr_jax.Pooling(4), "plain": bsr_jax.Pooling(2)}
    bsr = Pruning(0.5, block=8)
    assert plan([Rule("own", None), Rule("*", bsr)]) == {"plain": bsr, "last": bsr}
    assert plan([Rule("*", bsr_jax.Pooling(2))]) == dict.fromkeys(("own", "plain", "last"), bsr_jax.Pooling(2))
    with pytest.raises(ValueError, match="compression must be a bsr_jax.Pruning, a bsr_jax.Pooling or None"):
        Rule("*", 2)


def test_unsupported_convs_stay_dense_exact_and_are_reported():
    x = jax.random.normal(jax.random.key(0), (2, 6, 6, 4))
    for layer, message in [
        (nn.Conv(4, (3, 3), conv_general_dilated=jax.lax.conv_general_dilated), "its own conv_general_dilated"),
        (nn.ConvTranspose(4, (3, 3)), "ConvTranspose is not routed"),
        (nn.ConvLocal(4, (3, 3)), "ConvLocal is not routed"),
    ]:
        params = layer.init(jax.random.key(1), x)
        compressed = compress_model(layer, [Rule("*", Pruning(0.7, block=2))], lean=False)
        grad = lambda m: jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(m.apply(p, x)))))(params)
        with pytest.warns(UserWarning, match=message):
            got = grad(compressed)
        chex.assert_trees_all_equal(got, grad(layer))


def test_einsum_is_reported_and_stays_dense():
    x = jax.random.normal(jax.random.key(0), (4, 6, 8))
    layer = nn.Einsum((8, 5), "btd,df->btf")
    params = layer.init(jax.random.key(1), x)
    compressed = compress_model(layer, [Rule("*", Pruning(0.7, block=2))], lean=False)
    with pytest.warns(UserWarning, match="Einsum is not routed"):
        got = jax.grad(lambda p: jnp.sum(jnp.sin(compressed.apply(p, x))))(params)
    chex.assert_trees_all_equal(got, jax.grad(lambda p: jnp.sum(jnp.sin(layer.apply(p, x))))(params))


# ---- NNX convolutions ----

NNX_CONV_CASES = [  # (strides, padding, kernel size, compression): stride 1 and 2, SAME/VALID/explicit, kernel 1 and 3
    (1, "SAME", 3, bsr_jax.Pooling(2)),
    (2, "VALID", 1, bsr_jax.Pooling(2)),
    (2, ((1, 0), (2, 1)), 3, bsr_jax.Pooling(2)),
    (1, "SAME", 3, Pruning(0.5, block=8)),
    (2, "VALID", 1, Pruning(0.5, block=8)),
]


def _nnx_grads(model, x, c):
    """(y, d kernel, d bias, dx) of ``vdot(model(x), c)``: linear, so dy = c wherever the conv runs."""
    graph, state = nnx.split(model)
    loss = lambda state, x: jnp.vdot(nnx.merge(graph, state)(x), c)
    d_state, dx = jax.jit(jax.grad(loss, (0, 1)))(state, x)
    return nnx.merge(graph, state)(x), d_state["kernel"][...], d_state["bias"][...], dx


@pytest.mark.parametrize("strides,padding,kernel,compression", NNX_CONV_CASES)
def test_nnx_conv_forward_bitwise_dx_exact_dw_at_the_compressed_input(strides, padding, kernel, compression):
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 16))
    layer = nnx.Conv(16, 8, (kernel, kernel), strides=strides, padding=padding, rngs=nnx.Rngs(1))
    layer.bias[...] = tpm.jitter(layer.bias[...])
    params = nnx.state(layer, nnx.Param)
    compressed = compress_model(nnx.clone(layer), [Rule("*", compression)], lean=False)
    chex.assert_trees_all_equal(nnx.state(compressed, nnx.Param), params)
    c = jax.random.normal(jax.random.key(2), layer(x).shape)
    y, dw, db, dx = _nnx_grads(compressed, x, c)
    y_dense, dw_dense, db_dense, dx_dense = _nnx_grads(layer, x, c)
    chex.assert_trees_all_equal(y, y_dense)
    chex.assert_trees_all_close(dx, dx_dense, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(db, db_dense, rtol=1e-6, atol=1e-6)
    if isinstance(compression, bsr_jax.Pooling):
        x_hat = _upsampled_pool2(x)
    else:
        x_hat = reference.kept_input(np.asarray(x, np.float64).reshape(-1, 16), 0.5, 8).reshape(x.shape)
    # The exact gradient of the unmodified layer at the compressed input.
    want = _nnx_grads(layer, jnp.asarray(x_hat, jnp.float32), c)[1]
    chex.assert_trees_all_close(dw, want, rtol=1e-5, atol=1e-4)
    assert not np.allclose(dw, dw_dense, rtol=1e-3)


class _NnxConvNet(nnx.Module):
    """conv -> BatchNorm (training mode) -> relu -> conv -> linear head, as an NNX user writes it."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(3, 16, (3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.conv2 = nnx.Conv(16, 16, (3, 3), strides=2, rngs=rngs)
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        x = self.conv2(nnx.relu(self.norm(self.conv1(x))))
        return self.head(x.mean(axis=(1, 2)))


def test_nnx_conv_net_pooled_with_lean_neighbours():
    x = jax.random.normal(jax.random.key(0), (4, 16, 16, 3))
    model = _NnxConvNet(nnx.Rngs(0))
    compressed = compress_model(nnx.clone(model), [Rule("head", None), Rule("*", bsr_jax.Pooling(2))])

    def loss_of(m):
        graph, state = nnx.split(m)  # BatchNorm's statistics update stays inside the traced call
        return lambda state, x: jnp.sum(nnx.merge(graph, state)(x) ** 2), state

    def activation_bytes(m):
        loss, state = loss_of(m)
        r = bsr_jax.residual_bytes(loss, state, x)
        return r.activations + r.inputs

    # Pooled conv inputs (1/4), BatchNorm keeping its input only, ReLU a 1-bit mask.
    assert activation_bytes(compressed) <= 0.45 * activation_bytes(model)
    # Differentiated in the state too: NNX BatchNorm in training mode, lean or not, raises flax's
    # TraceContextError under a jax.grad in x alone (its statistics update from an inner trace level).
    value_and_dx = lambda m: jax.jit(jax.value_and_grad(loss_of(m)[0], argnums=(0, 1)))(loss_of(m)[1], x)
    (value, (_, dx)), (dense_value, (_, dense_dx)) = value_and_dx(compressed), value_and_dx(model)
    chex.assert_trees_all_equal(value, dense_value)
    chex.assert_trees_all_close(dx, dense_dx, rtol=1e-5, atol=1e-6)


def test_nnx_layers_left_dense_are_reported():
    x = jax.random.normal(jax.random.key(0), (2, 6, 6, 4))
    rngs = nnx.Rngs(0)
    for layer, compression, message in [
        (nnx.Conv(4, 4, (3, 3), conv_general_dilated=lambda *a, **k: jax.lax.conv_general_dilated(*a, **k), rngs=rngs),
         Pruning(0.7, block=2), "its own conv_general_dilated"),
        (nnx.ConvTranspose(4, 4, (3, 3), rngs=rngs), Pruning(0.7, block=2), "ConvTranspose is not routed"),
        (nnx.Linear(4, 4, rngs=rngs), bsr_jax.Pooling(2), "Pooling compresses convolution inputs only"),
    ]:  # fmt: skip
        want = jax.grad(lambda x: jnp.sum(jnp.sin(layer(x))))(x)
        with pytest.warns(UserWarning, match=message):
            compressed = compress_model(nnx.clone(layer), [Rule("*", compression)], lean=False)
        chex.assert_trees_all_equal(jax.grad(lambda x: jnp.sum(jnp.sin(compressed(x))))(x), want)
    with pytest.raises(ValueError, match=r"\['conv9'\] matched no nnx.Linear / nnx.LinearGeneral / nnx.Conv"):
        compress_model(_NnxConvNet(rngs), [Rule("conv9", bsr_jax.Pooling(2))])
