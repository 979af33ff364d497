"""The data-parallel step across processes; run by test_multiprocess.py as 2 processes x 2 devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/train/multiprocess_check.py \
        --coordinator localhost:PORT --num-processes 2 --process-id I   # I = 0 and 1, side by side

Each process joins with ``train.sharding.join_processes``, feeds its rows of one global batch
(``local_rows``, placed by ``train.data.prefetch``) to the 4-device mesh, and checks against
single-device computations of its own (on its first device):
1. sparsity 0.7: the loss and grads equal the mean over the 4 shards of single-device ones (each
   device prunes its own shard, whichever process it belongs to);
2. a stop signal received by one process only stops both (``StopRequest.agreed``);
3. the library's own path, ``bsr_linear`` under a plain ``jax.jit`` on an Explicit mesh spanning
   both processes (``bsr_jax.core.sharding``, no train/ code): y and dx exact, dW the sum over the 4 row
   shards of single-device ones.
The whole CLI run (data, optimizer steps, evaluation, checkpoints) against 1 process x 4 devices
is test_multiprocess.py's slow test and benchmarks/speed/multiprocess.py.
"""

import sys

import chex
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import bsr_jax

from train import data, loop, sharding, stopping
from train.config import TrainConfig, parse_processes

TOL = dict(atol=1e-6, rtol=1e-5)  # float32 reassociation of the cross-process all-reduce


def placed(batch, mesh):
    """``batch`` (the same global numpy batch on every process) as a global array over ``mesh``,
    built from this process's rows only, as the train loop builds it."""
    return next(data.prefetch(iter([sharding.local_rows(batch)]), sharding=sharding.batch_sharding(mesh)))


def main(argv) -> int:
    sharding.join_processes(parse_processes("multiprocess_check", argv))
    assert jax.process_count() == 2 and len(jax.devices()) == 4, jax.devices()
    mesh = sharding.make_mesh()
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(16, 8, 8, 3)).astype(np.float32), "label": (np.arange(16) % 4).astype(np.int32)}

    # 1. per-shard pruning across processes.
    model = loop.create_model(TrainConfig(dim=16, depth=1, image_size=8, patch_size=4, sparsity=0.7, block=4), num_classes=4)
    loss_fn = loop.loss_function(model, num_classes=4, label_smoothing=0.1)
    params = jax.device_get(jax.jit(model.init)(jax.random.key(0), batch["image"])["params"])
    grad_fn = jax.jit(sharding.data_parallel_grad(loss_fn, mesh))
    (loss4, _), grads4 = jax.device_get(grad_fn(jax.device_put(params, sharding.replicated(mesh)), placed(batch, mesh)))
    single = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))  # on this process's first device
    per_shard = [jax.device_get(single(params, {k: v[i * 4 : (i + 1) * 4] for k, v in batch.items()})) for i in range(4)]
    mean = lambda *xs: sum(xs) / len(xs)
    chex.assert_trees_all_close(grads4, jax.tree.map(mean, *[g for _, g in per_shard]), **TOL)
    chex.assert_trees_all_close(loss4, mean(*[l for (l, _), _ in per_shard]), **TOL)

    # 2. a signal on process 1 alone stops both.
    request = stopping.StopRequest()
    assert request.agreed() is None
    if jax.process_index() == 1:
        request.signal = 15
    assert request.agreed() == 15, request.agreed()

    # 3. bsr_linear on a mesh spanning both processes, sharded by jit alone.
    explicit = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))
    x = rng.normal(size=(32, 16)).astype(np.float32)
    w, dy = rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(32, 8)).astype(np.float32)
    pruning = bsr_jax.Pruning(0.5, block=4)

    def vjp(x, w, dy):
        y, pullback = jax.vjp(lambda x, w: bsr_jax.bsr_linear(x, w, pruning=pruning), x, w)
        return y, *pullback(dy)

    rows = NamedSharding(explicit, PartitionSpec("data"))
    global_rows = lambda a: jax.make_array_from_process_local_data(rows, sharding.local_rows(a), a.shape)
    with jax.set_mesh(explicit):
        y, dx, dw = jax.jit(vjp)(global_rows(x), jax.device_put(w, NamedSharding(explicit, PartitionSpec())), global_rows(dy))
    gather = lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True))
    shards = [jax.device_get(jax.jit(vjp)(x[i * 8 : (i + 1) * 8], w, dy[i * 8 : (i + 1) * 8])) for i in range(4)]
    chex.assert_trees_all_close(gather(y), x @ w, **TOL)
    chex.assert_trees_all_close(gather(dx), dy @ w.T, **TOL)
    chex.assert_trees_all_close(gather(dw), sum(s[2] for s in shards), **TOL)

    print(f"process {jax.process_index()}: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
