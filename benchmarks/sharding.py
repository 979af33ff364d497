"""Sharded jit on 4 host devices: per-device memory of dense vs block-pruned grad steps, and gathers.

    python -m benchmarks.sharding [MLP] [ResMLP-S12]   # sets --xla_force_host_platform_device_count=4 itself

For each model (the issue's 2-layer MLP of ``bsr_jax.Dense``, x (256, 64, 256); ResMLP-S12 at
CIFAR shapes, batch 128) and mesh (data parallel with Explicit and Auto axes; a (data 2, model 2)
mesh with kernels split over "model" and Explicit axes), the loss gradient step is traced and
compiled, never run. Columns: per-device residual bytes (the arrays the backward pass keeps, each
once, as shard shapes; Explicit axes only, where the types carry the shard shapes), per-device
compiled temp memory, and the number of all-gathers in the compiled HLO. Writes
benchmarks/results/sharding.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import bsr_jax  # noqa: E402
from train import models  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "sharding.json")
SPARSITY, BLOCK = 0.7, 16


class MLP(nn.Module):
    """The issue's 2-layer MLP: Dense(1024), GELU, Dense(256). (With ``jax.checkpoint(nn.gelu)``
    the dense step's temp drops 64 -> 48 MiB on one device at the per-device batch, the pruned one
    stays at 68: XLA:CPU's schedule, not the sharding; see docs/sharding.md.)"""

    sparsity: float

    @nn.compact
    def __call__(self, x):
        x = bsr_jax.Dense(1024, sparsity=self.sparsity, block=BLOCK)(x)
        return bsr_jax.Dense(256, sparsity=self.sparsity, block=BLOCK)(nn.gelu(x))


def mlp(sparsity: float):
    return MLP(sparsity), (256, 64, 256)


def resmlp_s12(sparsity: float):
    dense = models.dense_def(sparsity=sparsity, block=BLOCK)
    affine, layerscale = models.scale_shift_defs(sparsity=sparsity, block=BLOCK)
    # CIFAR's 32x32x3 images in 4x4 patches, given pre-cut as 8x8 "images" of 48 channels with
    # patch_size 1: the same shapes for every layer (64 tokens of 48 -> 384), and no reshape that
    # splits a sharded axis (train/models.py's patch cut fails under Explicit axes).
    model = models.ResMLP(10, **models.PRESETS["s12"], patch_size=1, dense=dense, affine=affine, layerscale=layerscale)
    return model, (128, 8, 8, 48)


def kernel_spec(path, leaf, model_axis: bool) -> P:
    """Kernels and biases split along their output features over "model" (tensor parallel), the
    rest replicated."""
    name = jax.tree_util.keystr(path)
    if model_axis and name.endswith(("['kernel']", "['bias']")) and leaf.shape[-1] % 2 == 0:
        return P(*(None,) * (leaf.ndim - 1), "model")
    return P()


def shard_bytes(leaf) -> int:
    sharding = jax.typeof(leaf).sharding
    shape = sharding.shard_shape(leaf.shape) if not sharding.mesh.empty else leaf.shape
    return math.prod(shape) * jnp.dtype(leaf.dtype).itemsize


def measure(build, sparsity: float, mesh, model_axis: bool, declare: bool) -> dict:
    model, x_shape = build(sparsity)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((2, *x_shape[1:]))))
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, kernel_spec(path, a, model_axis))), params
    )
    x = jax.ShapeDtypeStruct(x_shape, jnp.float32, sharding=NamedSharding(mesh, P("data")))
    loss = lambda p, x: jnp.mean(model.apply(p, x) ** 2)
    context = bsr_jax.sharding.batch_axes("data") if declare else contextlib.nullcontext()
    with context:
        residual = None
        if mesh.axis_types[0] == AxisType.Explicit:
            found = {}

            def keep(p, x):
                _, vjp_fn = jax.vjp(loss, p, x)
                skip = {id(leaf) for leaf in jax.tree.leaves((p, x))}
                found.update({id(leaf): shard_bytes(leaf) for leaf in jax.tree.leaves(vjp_fn) if id(leaf) not in skip and hasattr(leaf, "shape")})

            jax.jit(keep).trace(params, x)
            residual = sum(found.values())
        compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
    hlo = compiled.as_text()
    return dict(residual_mib=None if residual is None else residual / 2**20,
                temp_mib=compiled.memory_analysis().temp_size_in_bytes / 2**20,
                all_gathers=hlo.count("all-gather-start") + hlo.count(" all-gather("))  # fmt: skip


def main() -> None:
    devices = jax.devices()
    assert len(devices) == 4, f"expected 4 host devices, got {len(devices)}"
    meshes = {
        "data 4, Explicit": (jax.make_mesh((4,), ("data",)), False, False),
        "data 4, Auto": (jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,)), False, False),
        "data 2 x model 2, Explicit": (jax.make_mesh((2, 2), ("data", "model")), True, False),
        "data 2 x model 2, Auto": (jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2), True, True),
    }
    rows = []
    header = f"{'model':<11} {'mesh':<27} {'resid dense':>11} {'resid 0.7':>9} {'ratio':>5} {'temp dense':>10} {'temp 0.7':>8} {'ratio':>5} {'gathers d/s':>11}"
    print(header)
    chosen = set(sys.argv[1:]) or {"MLP", "ResMLP-S12"}
    for model_name, build in (("MLP", mlp), ("ResMLP-S12", resmlp_s12)):
        if model_name not in chosen:
            continue
        for mesh_name, (mesh, model_axis, declare) in meshes.items():
            if model_axis and model_name == "ResMLP-S12":
                continue  # splitting every ResMLP kernel over "model" breaks the dense model's own dots
            dense = measure(build, 0.0, mesh, model_axis, declare)
            sparse = measure(build, SPARSITY, mesh, model_axis, declare)
            row = dict(model=model_name, mesh=mesh_name, dense=dense, sparse=sparse)
            rows.append(row)
            res = lambda m: "-" if m["residual_mib"] is None else f"{m['residual_mib']:.1f}"
            res_ratio = "-" if dense["residual_mib"] is None else f"{sparse['residual_mib'] / dense['residual_mib']:.2f}"
            print(
                f"{model_name:<11} {mesh_name:<27} {res(dense):>11} {res(sparse):>9} {res_ratio:>5} {dense['temp_mib']:>10.1f} "
                f"{sparse['temp_mib']:>8.1f} {sparse['temp_mib'] / dense['temp_mib']:>5.2f} {dense['all_gathers']:>5}/{sparse['all_gathers']:<5}",
                flush=True,
            )
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(dict(sparsity=SPARSITY, block=BLOCK, devices=len(devices), jax=jax.__version__, rows=rows), f, indent=1)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
