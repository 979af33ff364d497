"""Gradient-step time of compressed settings against dense, alternating in one process.

``--models resmlp`` (the default): ResMLP on CIFAR shapes, each setting ``train.cifar``'s own model
for those flags (``train.loop.create_model``): the recommended all-int4 setting (``--sparsity 0
--storage-dtype int4 --prune-scale-shift``) and the paper's top-k (``--sparsity 0.7 --block 16``)
beside dense; timed: the jitted ``jax.value_and_grad`` of ``train.loop.loss_function`` at batch
``--batch-size`` (128), 32 px, for each of ``--presets``.

``--models vit-b16``: ViT-B/16 (``tests.third_party_models.vit``, vision_transformer's model; 12
layers, width 768, MLP 3072, 12 heads, 224 px, 1000 classes) at batch 8, as written (dense) and
through ``compress_model`` with ``Rule("*", Pruning(0.7, block=16))`` (top-k) or ``Rule("*",
Pruning(0.0, block=16, storage_dtype="int4"))`` (every residual int4), lean neighbours on; timed:
the jitted ``jax.value_and_grad`` of its softmax cross-entropy (parameters jittered off the
published init, which zeroes the head).

Either way: forward, backward, compression; no optimizer update, no data loading. The settings are
timed in turn, each timed call after an untimed warm one, ``--reps`` rounds; the ratio is the
median of the per-round ratios to dense (``benchmarks.run_info.alternating_time_ratios``), so a
slow spell of the shared machine hits all alike.

``--pieces`` also times, per distinct layer input shape of each model, one compression alone
(``Pruning.compress``: int4, and top-k for ViT) against that layer's dense forward matmul: where
the extra time goes.

``--isas`` runs everything once per CPU kernel path, forced through ``$BSR_JAX_CPU_ISA`` (both
kernels: dW and the int4 compression); dense never calls them.

    python -m benchmarks.speed.step_time --presets tiny s12 --reps 11
    python -m benchmarks.speed.step_time --presets tiny --isas avx2 avx512
    python -m benchmarks.speed.step_time --models vit-b16 --reps 5 --pieces

Writes docs/RESULTS.md sections 4.1 and 4.2.
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp

import cpu_kernels
from bsr_jax import Pruning, Rule, compress_model
from tests import third_party_models as tpm
from train import loop
from train.config import CIFAR_DEFAULTS, parse
from train.models import PRESETS

from benchmarks.run_info import alternating_time_ratios, footer, run_metadata, write_json

# label -> train.cifar flags
SETTINGS = {
    "dense": ["--sparsity", "0"],
    "int4 s0 (recommended)": ["--sparsity", "0", "--storage-dtype", "int4", "--prune-scale-shift"],
    "top-k s0.7/16": ["--sparsity", "0.7", "--block", "16"],
}
BASELINE = "dense"
# the same settings for ViT: label -> compress_model rules (None: the model as written)
VIT_RULES = {
    "dense": None,
    "int4 s0 (recommended)": [Rule("*", Pruning(0.0, block=16, storage_dtype="int4"))],
    "top-k s0.7/16": [Rule("*", Pruning(0.7, block=16))],
}
VIT_B16 = tpm.Config(layers=12, width=768, mlp=3072, heads=12, batch=8, image=224, patch=16, classes=1000)
INT4, TOP_K = VIT_RULES["int4 s0 (recommended)"][0].compression, VIT_RULES["top-k s0.7/16"][0].compression


def resmlp_step(label: str, preset: str, batch_size: int):
    """The jitted ``value_and_grad`` of ``train.cifar``'s loss for ``SETTINGS[label]``."""
    flags = [*SETTINGS[label], "--model", preset, "--batch-size", str(batch_size)]
    config = parse("train.cifar", "", CIFAR_DEFAULTS, ("cifar10",), flags)[0]
    model = loop.create_model(config, 10)
    shape = (batch_size, config.image_size, config.image_size, 3)
    images = jax.random.normal(jax.random.key(1), shape)
    params = model.init(jax.random.key(0), images)["params"]
    batch = {"image": images, "label": jnp.arange(batch_size) % 10}
    step = jax.jit(jax.value_and_grad(loop.loss_function(model, 10, config.label_smoothing), has_aux=True))
    return lambda: step(params, batch)


def vit_step(label: str, c: tpm.Config = VIT_B16):
    """The jitted ``value_and_grad`` of ViT's classifier loss under ``VIT_RULES[label]``."""
    model = tpm.vit(c)
    images, labels = tpm.images(c), tpm.labels(c)
    params = tpm.jitter(model.init(jax.random.key(0), images))  # compress_model keeps the parameter tree
    if VIT_RULES[label]:
        model = compress_model(model, VIT_RULES[label])
    step = jax.jit(jax.value_and_grad(lambda p, x, y: tpm.classifier_loss(model.apply(p, x), y)))
    return lambda: step(params, images, labels)


def layer_shapes(name: str, batch_size: int) -> dict[str, tuple[int, int, int]]:
    """(m, k, n) of each distinct layer product, input ``(m, k)``, weight ``(k, n)``: a ResMLP
    preset's fc1, fc2 and token mixing; ViT's q/k/v (one input, three products: as one), fc1, fc2."""
    if name == "vit-b16":
        c = VIT_B16
        rows = c.batch * (1 + (c.image // c.patch) ** 2)  # 196 patches and the class token
        return {"qkv": (rows, c.width, 3 * c.width), "fc1": (rows, c.width, c.mlp), "fc2": (rows, c.mlp, c.width)}
    dim, rows = PRESETS[name]["dim"], batch_size * 64  # 64 patches
    return {"fc1": (rows, dim, 4 * dim), "fc2": (rows, 4 * dim, dim), "token": (batch_size * dim, 64, 64)}


def piece_steps(shapes: dict[str, tuple[int, int, int]], prunings: dict[str, Pruning]) -> dict[str, object]:
    """Per layer shape, the dense forward matmul and each compression of its input alone."""
    steps = {}
    for name, (m, k, n) in shapes.items():
        x = jax.random.normal(jax.random.key(2), (m, k))
        w = jax.random.normal(jax.random.key(3), (k, n))
        matmul = jax.jit(jnp.matmul)
        steps[f"{name} x@w ({m}x{k}x{n})"] = lambda matmul=matmul, x=x, w=w: matmul(x, w)
        for label, pruning in prunings.items():
            steps[f"{name} {label} compress"] = lambda compress=jax.jit(pruning.compress), x=x: compress(x)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resmlp"], choices=["resmlp", "vit-b16"])
    parser.add_argument("--presets", nargs="+", default=["tiny", "s12"], help="ResMLP: train.models presets (default: tiny s12)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--batch-size", type=int, default=128, help="ResMLP's (ViT-B/16's is 8)")
    parser.add_argument("--reps", type=int, default=11, help="alternating rounds per model (default: %(default)s)")
    parser.add_argument("--isas", nargs="+", choices=cpu_kernels.ISAS,
                        help="CPU kernel paths to run, each forced in turn (default: the one picked for this CPU)")
    parser.add_argument("--pieces", action="store_true", help="also time each compression per layer shape vs its matmul")
    parser.add_argument("--json", default="benchmarks/results/step_time.json")
    args = parser.parse_args()
    meta = run_metadata()
    todo = {}  # table name -> (setting label -> timed call)
    if "resmlp" in args.models:
        todo |= {preset: functools.partial(resmlp_step, preset=preset, batch_size=args.batch_size) for preset in args.presets}
    if "vit-b16" in args.models:
        todo["vit-b16"] = vit_step
    rows = []
    print("| kernel path | model | setting | ms per value_and_grad | vs dense (median of rounds) |\n|---|---|---|---|---|")
    for isa in args.isas or [None]:
        if isa:
            os.environ[cpu_kernels.ISA_ENV] = cpu_kernels.resolve_isa(isa)
            jax.clear_caches()  # programs traced under the previous path must not be reused
        path = cpu_kernels.resolve_isa()
        for name, step_of in todo.items():
            steps = {label: step_of(label) for label in dict.fromkeys([BASELINE, *args.settings])}
            for label, result in alternating_time_ratios(steps, args.reps, BASELINE).items():
                rows.append(dict(path=path, model=name, setting=label, ms=result["seconds"] * 1e3, ratio=result["ratio"]))
                print(f"| {path} | {name} | {label} | {rows[-1]['ms']:.1f} | **{result['ratio']:.2f}** |", flush=True)
    if args.isas:
        meta["cpu_kernel_isa"] += f" by default; forced per row: {' '.join(args.isas)}"
    pieces = []
    if args.pieces:
        print("\n| model | piece | ms |\n|---|---|---|")
        for name in todo:
            prunings = {"int4": INT4, "top-k": TOP_K} if name == "vit-b16" else {"int4": INT4}
            steps = piece_steps(layer_shapes(name, args.batch_size), prunings)
            first = next(iter(steps))
            for label, result in alternating_time_ratios(steps, args.reps, first).items():
                pieces.append(dict(model=name, piece=label, ms=result["seconds"] * 1e3))
                print(f"| {name} | {label} | {pieces[-1]['ms']:.2f} |", flush=True)
    print(f"\n{footer(meta)}")
    write_json(args.json, meta, dict(rows=rows, pieces=pieces, batch_size=args.batch_size, reps=args.reps, vit=vars(VIT_B16)))


if __name__ == "__main__":
    main()
