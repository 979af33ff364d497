"""Sharded jit on 4 host devices: per-device memory of dense vs block-pruned grad steps, and gathers.

    python -m benchmarks.memory.sharding [MLP] [ResMLP-S12] [ResNet-18]   # sets --xla_force_host_platform_device_count=4 itself

Models: the issue's 2-layer MLP of ``bsr_jax.Dense`` (x (256, 64, 256)); ResMLP-S12 at CIFAR
shapes, batch 128, linear, Affine and LayerScale inputs pruned (dense baseline: ``nn.Dense`` with
the output sharding Explicit axes need, ``explicit_dot_general``); ResNet-18 at CIFAR shapes,
batch 128, ``compress_model`` with every convolution pruned (as ``train.cifar --model resnet18``).
Meshes: data parallel with Explicit and Auto axes; (data 2, model 2) with Explicit and Auto axes
(Auto: traced under ``batch_axes("data")`` and ``jax.set_mesh``), where the MLP's kernels are
split along their outputs and ResMLP's fc1/fc2 as Megatron splits them (ResNet: data parallel
only). Sparsity 0.7, block 16. The loss gradient step is traced and compiled, never run. Columns:
per-device residual bytes (the arrays the backward pass keeps, each once, as shard shapes;
Explicit axes only, where the types carry the shard shapes), per-device compiled temp memory, and
the number of all-gathers in the compiled HLO. Writes benchmarks/results/sharding.json.

Writes the tables of docs/sharding.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import bsr_jax  # noqa: E402
from train import models  # noqa: E402
from train.resnet import ResNet18, compression_rules  # noqa: E402

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


def explicit_dot_general(x, w, dims, precision=None, preferred_element_type=None):
    """``lax.dot_general`` naming its output sharding where Explicit axes demand it: x and w both
    split along the contracted axis (Megatron's row-parallel fc2) give partial sums, placed like
    x's other axes (all-reduced). What a user of plain ``nn.Dense`` must write; the pruned op does
    it itself (``bsr_jax.core.sharding``)."""
    (x_axes, w_axes), _ = dims
    x_spec, w_spec = (tuple(jax.typeof(a).sharding.spec) + (None,) * a.ndim for a in (x, w))
    out_sharding = None
    if any(x_spec[i] is not None and x_spec[i] == w_spec[j] for i, j in zip(x_axes, w_axes)):
        kept = [x_spec[i] for i in range(x.ndim) if i not in x_axes] + [w_spec[j] for j in range(w.ndim) if j not in w_axes]
        out_sharding = NamedSharding(jax.typeof(x).sharding.mesh, P(*kept))
    return jax.lax.dot_general(x, w, dims, precision=precision, preferred_element_type=preferred_element_type, out_sharding=out_sharding)


def resmlp_s12(sparsity: float):
    # The dense baseline is plain nn.Dense (the same parameters), with the output sharding named
    # where Explicit axes need it; the pruned model is bsr_jax.Dense.
    dense = models.dense_def(sparsity=sparsity, block=BLOCK) if sparsity else functools.partial(nn.Dense, dot_general=explicit_dot_general)
    affine, layerscale = models.scale_shift_defs(sparsity=sparsity, block=BLOCK)
    # CIFAR's 32x32x3 images in 4x4 patches, given pre-cut as 8x8 "images" of 48 channels with
    # patch_size 1: the same shapes for every layer (64 tokens of 48 -> 384), and no reshape that
    # splits a sharded axis (train/models.py's patch cut fails under Explicit axes).
    model = models.ResMLP(10, **models.PRESETS["s12"], patch_size=1, dense=dense, affine=affine, layerscale=layerscale)
    return model, (128, 8, 8, 48)


def kernel_spec(path, leaf, plan: str | None) -> P:
    """Where a parameter lives on the "model" axis (tensor parallel); the rest replicated.

    ``"outputs"`` (the issue's MLP): every kernel and bias split along its output features.
    ``"megatron"`` (ResMLP): Megatron's MLP split, fc1 along its outputs (kernel and bias) and fc2
    along its inputs, so only the hidden activation is split; the rest replicated. ``None``: all
    replicated (data parallel)."""
    name = jax.tree_util.keystr(path)
    if plan == "outputs" and name.endswith(("['kernel']", "['bias']")) and leaf.shape[-1] % 2 == 0:
        return P(*(None,) * (leaf.ndim - 1), "model")
    if plan == "megatron" and "['fc1']" in name:
        return P(*(None,) * (leaf.ndim - 1), "model")
    if plan == "megatron" and name.endswith("['fc2']['kernel']"):
        return P("model", None)
    return P()


def shard_bytes(leaf) -> int:
    sharding = jax.typeof(leaf).sharding
    shape = sharding.shard_shape(leaf.shape) if not sharding.mesh.empty else leaf.shape
    return math.prod(shape) * jnp.dtype(leaf.dtype).itemsize


@contextlib.contextmanager
def auto_2d(mesh):
    with bsr_jax.core.sharding.batch_axes("data"), jax.set_mesh(mesh):
        yield


def resnet18(sparsity: float):
    # As `train.cifar --model resnet18 --sparsity 0.7` builds it: compress_model of the plain model
    # (every conv compressed, classifier dense, lean BatchNorm/ReLU); the plain model at 0.
    model = ResNet18(num_classes=10, stem="cifar")
    if sparsity:
        model = bsr_jax.compress_model(model, compression_rules(bsr_jax.Pruning(sparsity, block=BLOCK)))
    return model, (128, 32, 32, 3)


def measure(build, sparsity: float, mesh, plan: str | None, declare: bool) -> dict:
    model, x_shape = build(sparsity)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((2, *x_shape[1:]))))
    variables = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, kernel_spec(path, a, plan))), variables
    )
    params, state = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    x = jax.ShapeDtypeStruct(x_shape, jnp.float32, sharding=NamedSharding(mesh, P("data")))

    def loss(params, state, x):
        # BatchNorm's statistics (ResNet) are updated in training mode, as the train step does.
        out = model.apply({"params": params, **state}, x, mutable=list(state)) if state else model.apply({"params": params}, x)
        return jnp.mean((out[0] if state else out) ** 2)

    # Several Auto axes: declare the batch's and set the mesh (bsr_jax.core.sharding, docs/sharding.md).
    context = auto_2d(mesh) if declare else contextlib.nullcontext()
    with context:
        residual = None
        if mesh.axis_types[0] == AxisType.Explicit:
            found = {}

            def keep(p, state, x):
                _, vjp_fn = jax.vjp(lambda p, x: loss(p, state, x), p, x)
                skip = {id(leaf) for leaf in jax.tree.leaves((p, state, x))}
                found.update({id(leaf): shard_bytes(leaf) for leaf in jax.tree.leaves(vjp_fn) if id(leaf) not in skip and hasattr(leaf, "shape")})

            jax.jit(keep).trace(params, state, x)
            residual = sum(found.values())
        compiled = jax.jit(jax.grad(loss)).lower(params, state, x).compile()
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
    # model: (builder, its tensor-parallel plan on the "model" axis, meshes)
    models = {
        "MLP": (mlp, "outputs", list(meshes)),
        "ResMLP-S12": (resmlp_s12, "megatron", list(meshes)),
        "ResNet-18": (resnet18, None, ["data 4, Explicit", "data 4, Auto"]),
    }
    chosen = sys.argv[1:] or list(models)
    unknown = sorted(set(chosen) - set(models))
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {list(models)}")
    rows = []
    print(f"{'model':<11} {'mesh':<27} {'resid dense':>11} {'resid 0.7':>9} {'ratio':>5} {'temp dense':>10} {'temp 0.7':>8} {'ratio':>5} {'gathers d/s':>11}")
    for model_name in chosen:
        build, model_plan, mesh_names = models[model_name]
        for mesh_name in mesh_names:
            mesh, model_axis, declare = meshes[mesh_name]
            plan = model_plan if model_axis else None
            dense = measure(build, 0.0, mesh, plan, declare)
            sparse = measure(build, SPARSITY, mesh, plan, declare)
            rows.append(dict(model=model_name, mesh=mesh_name, dense=dense, sparse=sparse))
            print(f"{model_name:<11} {mesh_name:<27} {row_text(dense, sparse)}", flush=True)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(dict(sparsity=SPARSITY, block=BLOCK, devices=len(devices), jax=jax.__version__, rows=rows), f, indent=1)
    print(f"wrote {RESULTS}")


def row_text(dense: dict, sparse: dict) -> str:
    mib = lambda m, key: "-" if m[key] is None else f"{m[key]:.1f}"
    ratio = lambda key: "-" if dense[key] is None else f"{sparse[key] / dense[key]:.2f}"
    gathers = f"{dense['all_gathers']}/{sparse['all_gathers']}"
    return (f"{mib(dense, 'residual_mib'):>11} {mib(sparse, 'residual_mib'):>9} {ratio('residual_mib'):>5} "
            f"{mib(dense, 'temp_mib'):>10} {mib(sparse, 'temp_mib'):>8} {ratio('temp_mib'):>5} {gathers:>11}")  # fmt: skip


if __name__ == "__main__":
    main()
