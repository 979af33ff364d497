"""ResNet v1.5 presets: exact parameter counts, output shapes, one training step with compression."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import bsr_jax
from tests import host_devices
from train.resnet import PRESETS, BottleneckResNetBlock, ResNet, ResNet18, ResNetBlock, conv_def


def expected_counts(preset: str, stem: str, classes: int, width: int = 64, channels: int = 3) -> tuple[int, int]:
    """(params, batch_stats) of a ResNet v1.5 from its definition: bias-free convs, BatchNorm with
    scale and bias (params) and mean and variance (batch_stats), a dense classifier."""
    conv = lambda k, cin, cout: k * k * cin * cout
    bottleneck = PRESETS[preset]["block_cls"] is BottleneckResNetBlock
    convs, norm_channels = conv(7 if stem == "imagenet" else 3, channels, width), width
    cin = width
    for i, size in enumerate(PRESETS[preset]["stage_sizes"]):
        f = width * 2**i
        cout = 4 * f if bottleneck else f
        for j in range(size):
            if bottleneck:
                convs += conv(1, cin, f) + conv(3, f, f) + conv(1, f, cout)
                norm_channels += f + f + cout
            else:
                convs += conv(3, cin, f) + conv(3, f, f)
                norm_channels += 2 * f
            if cin != cout or (i > 0 and j == 0):  # projection shortcut where the shape changes
                convs += conv(1, cin, cout)
                norm_channels += cout
            cin = cout
    return convs + 2 * norm_channels + cin * classes + classes, 2 * norm_channels


def count(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def test_formula_matches_published_counts():
    # torchvision's resnet18 / resnet50 and the usual CIFAR ResNet-18 (3x3 stem, 10 classes).
    assert expected_counts("resnet18", "imagenet", 1000)[0] == 11_689_512
    assert expected_counts("resnet50", "imagenet", 1000)[0] == 25_557_032
    assert expected_counts("resnet18", "cifar", 10)[0] == 11_173_962


@pytest.mark.parametrize(
    "preset,stem,image,classes",
    [("resnet18", "imagenet", 224, 1000), ("resnet50", "imagenet", 224, 1000), ("resnet18", "cifar", 32, 10), ("resnet50", "cifar", 32, 100)],
)
def test_shapes_and_param_counts(preset, stem, image, classes):
    model = ResNet(num_classes=classes, stem=stem, **PRESETS[preset])
    images = jax.ShapeDtypeStruct((2, image, image, 3), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), images)
    logits = jax.eval_shape(lambda v, x: model.apply(v, x, train=False), variables, images)
    assert logits.shape == (2, classes) and logits.dtype == jnp.float32
    params, stats = expected_counts(preset, stem, classes)
    assert count(variables["params"]) == params
    assert count(variables["batch_stats"]) == stats


def test_unknown_stem_raises():
    with pytest.raises(ValueError, match="stem must be one of"):
        ResNet18(num_classes=10, stem="tiny").init(jax.random.key(0), jnp.ones((1, 8, 8, 3)))


def _tiny(compression):
    # Two stages, so a strided block with a projection shortcut is included; ResNet-18's blocks.
    return ResNet(stage_sizes=(1, 1), block_cls=ResNetBlock, num_classes=10, num_filters=4, stem="cifar", conv=conv_def(compression))


def _loss(model, params, batch_stats, images, labels):
    logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, images, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), updates["batch_stats"]


def test_one_training_step_with_pooled_convs():
    images = jax.random.normal(jax.random.key(0), (4, 16, 16, 3))
    labels = jnp.arange(4) % 10
    dense, pooled = _tiny(None), _tiny(bsr_jax.Pooling(factor=2))
    variables = jax.jit(dense.init)(jax.random.key(1), images)
    chex.assert_trees_all_equal_shapes(variables, jax.eval_shape(pooled.init, jax.random.key(1), images))
    optimizer = optax.sgd(0.1)

    @jax.jit
    def step(params, batch_stats, images):
        grad = lambda m: jax.grad(_loss, argnums=(1, 3), has_aux=True)(m, params, batch_stats, images, labels)
        (g_dense, dx_dense), stats_dense = grad(dense)
        (g, dx), stats = grad(pooled)
        updates, _ = optimizer.update(g, optimizer.init(params))
        new_params = optax.apply_updates(params, updates)
        losses = _loss(pooled, params, batch_stats, images, labels)[0], _loss(pooled, new_params, stats, images, labels)[0]
        return g, g_dense, dx, dx_dense, stats, stats_dense, losses

    g, g_dense, dx, dx_dense, stats, stats_dense, (before, after) = step(variables["params"], variables["batch_stats"], images)
    chex.assert_trees_all_equal(stats, stats_dense)  # the forward pass is dense in both
    chex.assert_trees_all_close(dx, dx_dense, atol=1e-6, rtol=1e-5)  # every input gradient is exact
    # Only weight gradients differ. At initialisation every block's last BatchNorm scale is zero,
    # so the blocks' convs get no gradient yet and the stem conv shows the difference.
    stem = lambda g: g["conv_init"]["kernel"]
    assert not np.allclose(stem(g), stem(g_dense), atol=1e-4)
    assert jnp.isfinite(after) and after < before


def test_pooled_convs_keep_fewer_residual_bytes():
    images = jax.ShapeDtypeStruct((8, 16, 16, 3), jnp.float32)
    variables = jax.eval_shape(_tiny(None).init, jax.random.key(1), images)
    labels = jnp.zeros(8, jnp.int32)

    def activations(compression):
        loss = lambda p, stats, x: _loss(_tiny(compression), p, stats, x, labels)[0]
        return bsr_jax.residual_bytes(loss, variables["params"], variables["batch_stats"], images).activations

    # Conv inputs are a minority of what BatchNorm and ReLU keep, so the saving is partial (docs/conv.md).
    assert activations(bsr_jax.Pooling(factor=2)) < 0.9 * activations(None)


def _plan(model, images):
    """{compression: number of layers} that ``model``'s forward pass compresses (traced)."""
    from train.models import predict

    variables = jax.eval_shape(model.init, jax.random.key(0), images)
    plan = bsr_jax.pruning_plan(lambda v, x: predict(model, v, x), variables, images)
    return {c: sum(layer.compression == c for layer in plan) for c in {layer.compression for layer in plan}}


def test_create_model_from_flags():
    from train.config import TrainConfig
    from train.models import create_model

    small = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
    model = lambda **flags: create_model(TrainConfig(model="resnet18", dim=8, **flags), 10)
    # ResNet-18: the stem, 2 convs in each of 8 blocks, 3 projection shortcuts; the classifier stays dense.
    assert model().stem == "cifar" and _plan(model(), small) == {}
    assert _plan(model(compression="pool4", storage_dtype="int8"), small) == {bsr_jax.Pooling(4, "int8"): 20}
    pruning = bsr_jax.Pruning(0.7, block=8, criterion="l1")
    large = model(sparsity=0.7, block=8, criterion="l1", image_size=224)
    assert large.stem == "imagenet" and _plan(large, jax.ShapeDtypeStruct((2, 224, 224, 3), jnp.float32)) == {pruning: 20}
    assert create_model(TrainConfig(model="resnet50", dim=16), 10).num_filters == 16


def test_created_resnet_keeps_the_lean_figure():
    """``--compression pool2`` trains the plain ResNet through ``compress_model``: BatchNorm keeps
    its input and ReLU a 1-bit mask, so the step keeps about a third of the dense residual bytes
    (0.32 in docs/RESULTS.md section 8) where pooled convolutions alone keep 0.84. (That the
    routed ResNet-18's forward and dx are the dense model's: tests/bsr_jax/test_compress.py.)"""
    from train.config import TrainConfig
    from train.loop import loss_function
    from train.models import create_model

    config = TrainConfig(model="resnet18", dim=8, compression="pool2")
    pooled, dense = create_model(config, 10), create_model(dataclasses.replace(config, compression=None), 10)
    images = jax.ShapeDtypeStruct((8, 16, 16, 3), jnp.float32)
    variables = jax.eval_shape(dense.init, jax.random.key(1), images)
    assert jax.eval_shape(pooled.init, jax.random.key(1), images) == variables
    labels = jnp.arange(8) % 10

    def kept(model):
        loss_fn = loss_function(model, 10, 0.1)
        loss = lambda p, x, stats: loss_fn(p, {"image": x, "label": labels}, None, stats)[0]
        counted = bsr_jax.residual_bytes(loss, variables["params"], images, variables["batch_stats"])
        return counted.activations + counted.inputs

    assert kept(pooled) <= 0.40 * kept(dense)


DATA_PARALLEL_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from train import loop, sharding
from train.config import TrainConfig
import bsr_jax
from train.resnet import ResNet, ResNetBlock, compression_rules
config = TrainConfig(model="resnet18", compression="pool2", dim=4, batch_size=4)
# One block instead of ResNet-18's eight, built as create_model builds a compressed ResNet: the
# averaging is the loop's, not the depth's, and one block compiles in a third of the time.
plain = ResNet(stage_sizes=(1,), block_cls=ResNetBlock, num_classes=10, num_filters=4, stem="cifar")
model = bsr_jax.compress_model(plain, compression_rules(bsr_jax.Pooling(2)))
schedule = loop.learning_rate_schedule(config, 10)
tx = loop.create_optimizer(config, schedule)
batch = {"image": jax.random.normal(jax.random.key(0), (4, 16, 16, 3)), "label": jnp.arange(4)}
means = []
for n in (1, 2):
    mesh = sharding.make_mesh(jax.devices()[:n])
    state = loop.create_state(model, tx, (4, 16, 16, 3), 0, mesh)
    step = loop.make_train_step(loop.loss_function(model, 10, 0.0), tx, schedule, mesh)
    new, metrics = step(state, jax.device_put(batch, sharding.batch_sharding(mesh)))
    assert np.isfinite(metrics["loss"])
    means.append(np.asarray(new["batch_stats"]["bn_init"]["mean"]))
# The stem's running mean is linear in the batch: the pmean of the two shards' updates equals the
# whole batch's, so batch_stats are averaged over devices, not taken from one.
np.testing.assert_allclose(means[1], means[0], rtol=1e-5, atol=1e-7)
print("ok")
"""


def test_data_parallel_train_step_averages_batch_stats_over_devices():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": host_devices.xla_flags(2)}
    done = subprocess.run([sys.executable, "-c", DATA_PARALLEL_SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
