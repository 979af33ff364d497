"""Activation memory of ResNet training steps with compressed convolution inputs (traced, nothing runs).

For ResNet-18 on CIFAR shapes (32 px, 10 classes, 3x3 stem) and ResNet-50 on ImageNet shapes
(224 px, 1000 classes), batch 64, BatchNorm in training mode, every convolution a ``bsr_jax.Conv``
with one compression: none (dense), int8 storage only, window means of 2x2 (pool2) or 4x4 (pool4)
windows (Barley & Fröning, arXiv 2409.11902), or block pruning at sparsity 0.7, block 16 (the BSR
method on ``(N*H*W, C)``), each also with int8 storage. Each configuration is traced twice: as is,
and inside ``bsr_jax.rewrite.lean.lean_neighbours()`` (BatchNorm keeps only its input and parameters,
ReLU a 1-bit mask). Reported per row:

* act MiB: what the backward pass keeps that is not a parameter (``residual_bytes`` activations +
  inputs, each array once), and its ratio to the dense model without lean neighbours;
* conv-input MiB: the part of it that stores convolution inputs: every ``nn.Conv`` call's input
  (recorded with a Flax interceptor), or what ``compression.compress`` keeps of it;
* program peak MiB: ``program_order_peak`` of the grad step (live bytes in program order,
  parameters and batch included), and its change against dense: the figure closest to the
  companion paper's measured peak (-29% on ResNet, GPU), which is printed beside it.

    python -m benchmarks.memory.conv_memory                      # both models, table + JSON
    python -m benchmarks.memory.conv_memory --models resnet18-cifar

Writes docs/RESULTS.md section 8.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import bsr_jax
from bsr_jax.rewrite.lean import lean_neighbours
from bsr_jax.measure.memory import MIB
from train.resnet import ResNet18, ResNet50, conv_def

from benchmarks.run_info import run_metadata, write_json

PAPER_PEAK_REDUCTION = 0.29  # Barley & Fröning 2024, abstract: ResNet peak memory, pooling


@dataclasses.dataclass(frozen=True)
class ModelCase:
    name: str
    build: Callable[..., nn.Module]  # (conv, act) -> module
    input_shape: tuple[int, ...]
    classes: int


MODELS = {
    "resnet18-cifar": ModelCase(
        "resnet18-cifar", lambda conv, act: ResNet18(num_classes=10, stem="cifar", conv=conv, act=act), (64, 32, 32, 3), 10
    ),
    "resnet50-imagenet": ModelCase(
        "resnet50-imagenet", lambda conv, act: ResNet50(num_classes=1000, conv=conv, act=act), (64, 224, 224, 3), 1000
    ),
}

CONFIGS: dict[str, bsr_jax.Pooling | bsr_jax.Pruning | None] = {
    "dense": None,
    "int8": bsr_jax.Pooling(factor=1, storage_dtype="int8"),
    "pool2": bsr_jax.Pooling(factor=2),
    "pool2+int8": bsr_jax.Pooling(factor=2, storage_dtype="int8"),
    "pool4": bsr_jax.Pooling(factor=4),
    "pool4+int8": bsr_jax.Pooling(factor=4, storage_dtype="int8"),
    "bsr0.7/16": bsr_jax.Pruning(sparsity=0.7, block=16),
    "bsr0.7/16+int8": bsr_jax.Pruning(sparsity=0.7, block=16, storage_dtype="int8"),
}


def _relu(x):
    # Looked up at call time, so lean_neighbours' 1-bit-mask relu replaces it when active (a
    # default ``act=nn.relu`` binds the original function when the class is defined).
    return nn.relu(x)


def _conv_inputs(model: nn.Module, variables, images) -> list[jax.ShapeDtypeStruct]:
    """Shapes of every convolution's input in one forward pass."""
    found: list[jax.ShapeDtypeStruct] = []

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, nn.Conv) and context.method_name == "__call__":
            found.append(jax.ShapeDtypeStruct(args[0].shape, args[0].dtype))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(lambda v, x: model.apply(v, x, mutable=["batch_stats"]), variables, images)
    return found


def _kept_conv_bytes(compression, inputs: list[jax.ShapeDtypeStruct]) -> int:
    dense = lambda x: math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
    if compression is None:
        return sum(dense(x) for x in inputs)
    return sum(jax.eval_shape(compression.compress, x).nbytes if compression.saves_memory(x) else dense(x) for x in inputs)


def measure(case: ModelCase, name: str, compression, lean: bool) -> dict:
    model = case.build(conv_def(compression), _relu)
    images = jax.ShapeDtypeStruct(case.input_shape, jnp.float32)
    labels = jax.ShapeDtypeStruct(case.input_shape[:1], jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), images)

    def loss(params, batch_stats, images, labels):
        logits, _ = model.apply({"params": params, "batch_stats": batch_stats}, images, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    args = (variables["params"], variables["batch_stats"], images, labels)
    with lean_neighbours(enabled=lean):
        kept = bsr_jax.residual_bytes(loss, *args)
        peak = bsr_jax.program_order_peak(jax.grad(loss), *args)
    return dict(
        model=case.name,
        config=name,
        lean=lean,
        act_mib=(kept.activations + kept.inputs) / MIB,
        conv_input_mib=_kept_conv_bytes(compression, _conv_inputs(model, variables, images)) / MIB,
        program_peak_mib=peak / MIB,
    )


def table(rows: list[dict]) -> str:
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        dense = next(r for r in rows if r["model"] == model and r["config"] == "dense" and not r["lean"])
        lines += [
            f"\n{model} (B={MODELS[model].input_shape[0]}): paper's peak change with pooling -{PAPER_PEAK_REDUCTION:.0%}",
            "| config | lean norms | act MiB | vs dense | conv-input MiB | program peak MiB | peak vs dense |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in rows if r["model"] == model):
            lines.append(
                f"| {r['config']} | {'yes' if r['lean'] else 'no'} | {r['act_mib']:.1f} | {r['act_mib'] / dense['act_mib']:.2f} | "
                f"{r['conv_input_mib']:.1f} | {r['program_peak_mib']:.1f} | {r['program_peak_mib'] / dense['program_peak_mib'] - 1:+.1%} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", default="benchmarks/results/conv_memory.json")
    args = parser.parse_args(argv)
    meta = run_metadata()
    rows = []
    for model in args.models:
        for lean in (False, True):
            for name in args.configs:
                rows.append(measure(MODELS[model], name, CONFIGS[name], lean))
                print(f"{model} {name} lean={lean}: {rows[-1]['act_mib']:.1f} MiB", file=sys.stderr)
    print(table(rows))
    write_json(args.out, meta, dict(paper_peak_reduction=PAPER_PEAK_REDUCTION, rows=rows))


if __name__ == "__main__":
    main()
