"""Activation memory of a training step: dense vs block-sparse residuals, per model and config.

For each model and each (mode, sparsity, block, storage), traces the loss's VJP (nothing runs).
Mode ``linear`` prunes linear-layer inputs only (the paper); ``all`` also prunes the inputs of the
Affine and LayerScale layers, every residual that only feeds a parameter gradient (ResMLP only).
Reported:

* act MiB: bytes the backward pass keeps that are not parameters (``residual_bytes``
  activations + inputs), and its ratio to dense;
* linear-input MiB: the part of it that stores linear-layer inputs. In the dense model this is the
  sum of the inputs of every ``bsr_jax.Dense`` call (recorded with a Flax interceptor); the forward
  pass is identical at every sparsity, so the sparse model's figure is the dense one plus the
  change in act MiB;
* program peak MiB: ``program_order_peak`` of the grad step (live bytes in program order,
  arguments included): what a memory-aware scheduler would need;
* compiled temp MiB: XLA's ``memory_analysis()`` of the jitted grad step on this backend (a
  secondary figure on CPU: see docs/memory.md).

The ``remat`` row wraps every block in ``jax.checkpoint`` (dense layers): the usual alternative.
The ``policy`` rows (mode ``policy``) combine both: linear inputs pruned, every block under
``jax.checkpoint(policy=bsr_jax.remat_policy())``, which keeps the block-sparse residuals and
matmul outputs and recomputes the elementwise ops.

    python -m benchmarks.memory.residuals                     # all models, full grid, table + JSON
    python -m benchmarks.memory.residuals --models mlp --compile none

Writes docs/RESULTS.md section 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

import bsr_jax
from bsr_jax.measure.memory import MIB

from benchmarks.run_info import run_metadata, write_json


class MLPBlock(nn.Module):
    """Pre-residual MLP block: x + fc2(gelu(fc1(x))), GELU checkpointed so it keeps only its input."""

    dense: Callable[..., nn.Module]
    hidden: int

    @nn.compact
    def __call__(self, x):
        h = jax.checkpoint(nn.gelu)(self.dense(self.hidden)(x))
        return x + self.dense(x.shape[-1])(h)


class DenseStack(nn.Module):
    dense: Callable[..., nn.Module]
    depth: int
    hidden: int
    remat: bool = False
    remat_policy: Callable[..., bool] | None = None

    @nn.compact
    def __call__(self, x):  # no Affine/LayerScale: modes "linear" and "all" coincide
        block = nn.remat(MLPBlock, policy=self.remat_policy) if self.remat else MLPBlock
        for _ in range(self.depth):
            x = block(self.dense, self.hidden)(x)
        return x


@dataclasses.dataclass(frozen=True)
class ModelCase:
    name: str
    build: Callable[..., nn.Module]  # (dense, scale_shift, remat, remat_policy) -> module
    input_shape: tuple[int, ...]


def _resmlp_case(name: str, preset: str, image_size: int, patch: int, batch: int) -> ModelCase:
    from train import models  # benchmarks may use the training suite; bsr_jax itself does not

    def build(dense, scale_shift, remat, remat_policy):
        affine, layerscale = scale_shift
        return models.ResMLP(
            num_classes=1000,
            patch_size=patch,
            dense=dense,
            affine=affine,
            layerscale=layerscale,
            remat=remat,
            remat_policy=remat_policy,
            **models.PRESETS[preset],
        )

    return ModelCase(name, build, (batch, image_size, image_size, 3))


def model_cases(names: list[str]) -> list[ModelCase]:
    cases = {
        "mlp": lambda: ModelCase(
            "mlp-d384x12 (B=128, T=64)",
            lambda dense, scale_shift, remat, remat_policy: DenseStack(dense, 12, 1536, remat, remat_policy),
            (128, 64, 384),
        ),
        "s12-cifar": lambda: _resmlp_case("resmlp-s12 cifar (32px/4, B=128)", "s12", 32, 4, 128),
        "s12-imagenet": lambda: _resmlp_case("resmlp-s12 imagenet (224px/16, B=64)", "s12", 224, 16, 64),
        "s12-imagenet-b128": lambda: _resmlp_case("resmlp-s12 imagenet (224px/16, B=128)", "s12", 224, 16, 128),
    }
    return [cases[n]() for n in names]


def linear_input_bytes(module: nn.Module, params, x) -> int:
    """Sum of the input bytes of every bsr_jax.Dense call in one forward pass (shapes only)."""
    total = 0

    def record(next_fun, args, kwargs, context):
        nonlocal total
        if isinstance(context.module, bsr_jax.Dense) and context.method_name == "__call__":
            total += args[0].size * args[0].dtype.itemsize
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(module.apply, params, x)
    return total


@dataclasses.dataclass(frozen=True)
class Config:
    mode: str = "dense"  # "dense", "remat", "linear", "all" or "policy"
    sparsity: float = 0.0
    block: int = 16
    storage: str | None = None

    @property
    def label(self) -> str:
        if self.mode in ("dense", "remat"):
            return self.mode
        return f"{self.mode} s{self.sparsity} b{self.block}" + (f" {self.storage}" if self.storage else "")


def should_compile(config: Config, which: str) -> bool:
    headline = config.mode in ("dense", "remat") or (config.sparsity, config.block, config.storage) == (0.7, 16, None)
    return which == "all" or (which == "headline" and headline)


def measure(case: ModelCase, config: Config, compile_step: bool, selection: str) -> dict:
    options = dict(sparsity=config.sparsity, block=config.block, selection=selection, storage_dtype=config.storage)
    dense = functools.partial(bsr_jax.Dense, **options)
    prune_scales = config.mode == "all"
    scale_shift = (
        functools.partial(bsr_jax.Affine, **(options if prune_scales else {})),
        functools.partial(bsr_jax.LayerScale, **(options if prune_scales else {})),
    )
    policy = bsr_jax.remat_policy() if config.mode == "policy" else None
    module = case.build(dense, scale_shift, config.mode in ("remat", "policy"), policy)
    x = jax.ShapeDtypeStruct(case.input_shape, jnp.float32)
    params = jax.eval_shape(module.init, jax.random.key(0), x)
    loss = lambda p, x: jnp.mean(module.apply(p, x).astype(jnp.float32) ** 2)
    res = bsr_jax.residual_bytes(loss, params, x)
    row = dict(
        model=case.name,
        config=config.label,
        **dataclasses.asdict(config),
        selection=selection,
        act_mib=(res.activations + res.inputs) / MIB,
        param_residual_mib=res.params / MIB,
        program_peak_mib=bsr_jax.program_order_peak(jax.grad(loss), params, x) / MIB,
    )
    if compile_step:
        row["compiled_temp_mib"] = bsr_jax.compiled_memory(jax.grad(loss), params, x).temp / MIB
    if config.mode == "dense":
        row["linear_input_mib"] = linear_input_bytes(module, params, x) / MIB
    return row


def configs_for(args) -> list[Config]:
    configs = [Config("remat")]
    for mode in args.modes:
        configs += [Config(mode, s, b) for s in args.sparsities for b in args.blocks]
        configs += [Config(mode, 0.7, 16, storage) for storage in args.storage]
    configs += [Config("policy", s, 16) for s in args.policy_sparsities]
    return configs


def run(args) -> list[dict]:
    rows = []
    for case in model_cases(args.models):
        base = measure(case, Config(), should_compile(Config(), args.compile), args.selection)
        case_rows = [base]
        print(f"# {case.name}: dense measured", file=sys.stderr, flush=True)
        for config in configs_for(args):
            row = measure(case, config, should_compile(config, args.compile), args.selection)
            if config.mode == "linear" and config.storage is None:
                row["linear_input_mib"] = base["linear_input_mib"] + row["act_mib"] - base["act_mib"]
                row["linear_input_reduction"] = 1 - row["linear_input_mib"] / base["linear_input_mib"]
            row["act_ratio"] = row["act_mib"] / base["act_mib"]
            case_rows.append(row)
            print(f"# {case.name}: {row['config']} measured", file=sys.stderr, flush=True)
        base["act_ratio"] = 1.0
        rows += case_rows
    return rows


def print_table(rows: list[dict]) -> None:
    cols = [
        ("model", "{}"),
        ("config", "{}"),
        ("act_mib", "{:.1f}"),
        ("act_ratio", "{:.3f}"),
        ("linear_input_mib", "{:.1f}"),
        ("linear_input_reduction", "{:.1%}"),
        ("program_peak_mib", "{:.1f}"),
        ("compiled_temp_mib", "{:.1f}"),
    ]
    cells = [[c for c, _ in cols]] + [[fmt.format(r[c]) if c in r else "-" for c, fmt in cols] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cols))]
    for i, line in enumerate(cells):
        print("| " + " | ".join(v.ljust(w) for v, w in zip(line, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    models = ["mlp", "s12-cifar", "s12-imagenet", "s12-imagenet-b128"]
    parser.add_argument("--models", nargs="+", default=models, choices=models, help="models to measure (default: all)")
    parser.add_argument("--sparsities", nargs="+", type=float, default=[0.3, 0.5, 0.7, 0.9],
                        help="default: 0.3 0.5 0.7 0.9")
    parser.add_argument("--blocks", nargs="+", type=int, default=[4, 16, 64], help="square block sizes (default: 4 16 64)")
    parser.add_argument("--modes", nargs="+", default=["linear", "all"], choices=["linear", "all"],
                        help="prune linear inputs only (paper) and/or every parameter-gradient residual (default: both)")
    parser.add_argument("--storage", nargs="*", default=["bfloat16", "int8", "float8_e4m3fn"],
                        help="extra rows at sparsity 0.7 block 16 with kept blocks stored in these dtypes "
                             "(default: bfloat16 int8 float8_e4m3fn)")
    parser.add_argument("--policy-sparsities", nargs="*", type=float, default=[0.7],
                        help="policy rows (block 16): linear pruning plus remat_policy per block (default: 0.7)")
    parser.add_argument("--selection", default="global", choices=["global", "column"], help="default: global")
    parser.add_argument("--compile", default="headline", choices=["all", "headline", "none"],
                        help="which rows compile their grad step for the compiled temp MiB column: all, none, or "
                             "dense, remat and sparsity 0.7 block 16 (default: %(default)s)")
    parser.add_argument("--out", default="benchmarks/results/memory.json", help="JSON output path (default: %(default)s)")
    args = parser.parse_args()
    meta = run_metadata()
    rows = run(args)
    print_table(rows)
    write_json(args.out, meta, dict(rows=rows))


if __name__ == "__main__":
    main()
