"""The train loop's ``shard_map`` against a plain ``jax.jit`` over batch-sharded arrays, on 4 host devices.

    python -m benchmarks.speed.loop_vs_jit        # sets --xla_force_host_platform_device_count=4 itself

One loss gradient of ``train.loop``'s loss on a batch of 16 random 8x8 images, computed twice on
``train.sharding``'s 1-D Auto mesh: by ``data_parallel_grad`` (the loop's ``shard_map``; per-device
pruning and BatchNorm statistics) and by ``jax.jit`` of the plain loss with the batch sharded (the
library's per-op ``map_row_shards`` prunes per row shard; XLA partitions the rest). Prints the
losses, the largest gradient difference and the all-gathers in the ``jit`` step's HLO, for a tiny
ResMLP at sparsity 0.7 and a width-8 ResNet-18 (BatchNorm) at sparsity 0: the evidence for
``train/sharding.py``'s paragraph on why the loop keeps its ``shard_map``.

Writes the measurement in ``train/sharding.py``'s docstring.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from train import loop, sharding  # noqa: E402
from train.config import TrainConfig  # noqa: E402

MODELS = {
    "ResMLP tiny (width 16, 1 block), sparsity 0.7": TrainConfig(dim=16, depth=1, image_size=8, patch_size=4, sparsity=0.7, block=4),
    "ResNet-18 (width 8, BatchNorm), sparsity 0": TrainConfig(model="resnet18", dim=8, image_size=8),
}


def main() -> None:
    mesh = sharding.make_mesh()
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(16, 8, 8, 3)).astype(np.float32), "label": (np.arange(16) % 4).astype(np.int32)}
    for name, config in MODELS.items():
        model = loop.create_model(config, num_classes=4)
        loss_fn = loop.loss_function(model, num_classes=4, label_smoothing=0.1)
        variables = jax.device_put(jax.jit(model.init)(jax.random.key(0), batch["image"]), sharding.replicated(mesh))
        stats = () if "batch_stats" not in variables else (variables["batch_stats"],)
        sharded = jax.device_put(batch, sharding.batch_sharding(mesh))
        (loop_loss, _), loop_grads = jax.jit(sharding.data_parallel_grad(loss_fn, mesh))(variables["params"], sharded, None, *stats)
        plain = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
        (jit_loss, _), jit_grads = plain(variables["params"], sharded, None, *stats)
        hlo = plain.lower(variables["params"], sharded, None, *stats).compile().as_text()
        diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(loop_grads), jax.tree.leaves(jit_grads)))
        largest = max(float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(loop_grads))
        print(f"{name}: loss shard_map {float(loop_loss):.4f}, jit {float(jit_loss):.4f}; "
              f"max |grad difference| {diff:.3g} (largest |grad| {largest:.3g}); all-gathers in the jit HLO: {hlo.count('all-gather')}")  # fmt: skip


if __name__ == "__main__":
    main()
