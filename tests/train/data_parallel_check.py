"""Data-parallel checks on 4 forced host devices; run by test_loop.py in a fresh interpreter.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/train/data_parallel_check.py

1. sparsity 0: the 4-device loss and grads equal the single-device full-batch ones (float
   reassociation only), and so do the params after two optimizer steps;
2. sparsity 0.7: the grads equal the mean over shards of single-device grads on each shard (each
   device prunes its own shard) and differ from pruning the whole batch at once;
3. the compiled step never gathers the batch (no all-gather in its HLO);
4. train_and_evaluate runs on the 4-device mesh (per-device batch 4) and its sharded, padded
   evaluation reports the test loss and accuracy of its saved params;
5. the same ResMLP loss under a plain ``jax.jit`` on an Explicit mesh (``jax.make_mesh``'s
   default; the library's own per-shard ops, no train/ shard_map, incl. the patch reshape) gives
   the grads of 2.
"""

import sys
import tempfile

import chex
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from checkpoint_scores import checkpoint_scores

from train import data, loop, sharding
from train.config import TrainConfig

TOL = dict(atol=1e-6, rtol=1e-5)


def setup(sparsity: float):
    cfg = TrainConfig(dim=16, depth=1, image_size=8, patch_size=4, batch_size=16, sparsity=sparsity, block=4, lr=1e-2, warmup_epochs=0)
    model = loop.create_model(cfg, num_classes=4)
    loss_fn = loop.loss_function(model, num_classes=4, label_smoothing=0.1)
    schedule = loop.learning_rate_schedule(cfg, steps_per_epoch=10)
    tx = loop.create_optimizer(cfg, schedule)
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(16, 8, 8, 3)).astype(np.float32), "label": (np.arange(16) % 4).astype(np.int32)}
    return loss_fn, schedule, tx, model, batch


def grads_on(mesh, loss_fn, params, batch):
    fn = jax.jit(sharding.data_parallel_grad(loss_fn, mesh))
    out = fn(jax.device_put(params, sharding.replicated(mesh)), jax.device_put(batch, sharding.batch_sharding(mesh)))
    return jax.device_get(out)


def main() -> int:
    devices = jax.devices()
    assert len(devices) == 4, f"expected 4 forced host devices, got {devices}"
    multi, single = sharding.make_mesh(), sharding.make_mesh(devices[:1])

    # 1. sparsity 0: same as one device on the whole batch.
    loss_fn, schedule, tx, model, batch = setup(0.0)
    state = jax.device_get(loop.create_state(model, tx, (16, 8, 8, 3), 0, single))
    (loss4, aux4), grads4 = grads_on(multi, loss_fn, state["params"], batch)
    (loss1, aux1), grads1 = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(state["params"], batch)
    chex.assert_trees_all_close((loss4, aux4, grads4), (loss1, aux1, grads1), **TOL)
    finals = []
    for mesh in (multi, single):
        step = loop.make_train_step(loss_fn, tx, schedule, mesh)
        s = jax.device_put(state, sharding.replicated(mesh))
        for _ in range(2):
            s, _ = step(s, jax.device_put(batch, sharding.batch_sharding(mesh)))
        finals.append(jax.device_get(s["params"]))
    chex.assert_trees_all_close(finals[0], finals[1], **TOL)

    # 2. sparsity 0.7: each device prunes its own shard.
    loss_fn, schedule, tx, model, batch = setup(0.7)
    (loss4, _), grads4 = grads_on(multi, loss_fn, state["params"], batch)
    local = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    shards = [{k: v[i * 4 : (i + 1) * 4] for k, v in batch.items()} for i in range(4)]
    per_shard = [local(state["params"], shard) for shard in shards]
    mean = lambda *xs: sum(xs) / len(xs)
    chex.assert_trees_all_close(grads4, jax.tree.map(mean, *[g for _, g in per_shard]), **TOL)
    chex.assert_trees_all_close(loss4, mean(*[l for (l, _), _ in per_shard]), **TOL)
    (_, _), global_grads = local(state["params"], batch)
    kernel = lambda g: g["block0"]["fc2"]["kernel"]
    assert not np.allclose(kernel(grads4), kernel(global_grads), atol=1e-6), "per-shard pruning equals global pruning"

    # 5. plain jit on Explicit axes: the library's ops prune per shard the same way.
    explicit = jax.make_mesh((4,), ("data",))
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    with jax.set_mesh(explicit):
        rows = jax.device_put(batch, NamedSharding(explicit, PartitionSpec("data")))
        (loss_jit, _), grads_jit = jax.device_get(grad_fn(jax.device_put(state["params"], NamedSharding(explicit, PartitionSpec())), rows))
    chex.assert_trees_all_close((loss_jit, grads_jit), (loss4, grads4), **TOL)

    # 3. no all-gather: the batch stays on its device.
    step = loop.make_train_step(loss_fn, tx, schedule, multi)
    s = jax.device_put(state, sharding.replicated(multi))
    hlo = step.lower(s, jax.device_put(batch, sharding.batch_sharding(multi))).compile().as_text()
    assert "all-gather" not in hlo and "all-reduce" in hlo

    # 4. the whole loop, data sharded by prefetch.
    rng = np.random.default_rng(1)
    splits = {
        name: data.ArrayDataset(rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8), (np.arange(n) % 4).astype(np.int32), 4)
        for name, n in (("train", 32), ("test", 29))  # 29 = 3 * 8 + 5: the last eval batch is padded
    }
    data.load_split = lambda dataset, name, **kw: splits[name]
    cfg = TrainConfig(dim=16, depth=1, image_size=8, patch_size=4, batch_size=16, eval_batch_size=8, epochs=1, sparsity=0.5, block=4)
    with tempfile.TemporaryDirectory() as workdir:
        result = loop.train_and_evaluate(cfg, workdir)
        recomputed = checkpoint_scores(workdir, 2)
    assert result["step"] == 2 and result["memory"]["per_device_batch"] == 4, result
    # The sharded, padded evaluation scores the saved params over exactly the 29 test images.
    assert recomputed["test_examples"] == 29
    chex.assert_trees_all_close(
        (result["eval"]["test_accuracy"], result["eval"]["test_loss"]),
        (recomputed["test_accuracy"], recomputed["test_loss"]),
        atol=1e-7,
        rtol=1e-5,
    )
    print("4 devices: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
