"""Gradient-step time of ResMLP settings against dense on CIFAR shapes, alternating in one process.

Each setting is ``train.cifar``'s own model for those flags (``train.loop.create_model``): the
recommended all-int4 setting (``--sparsity 0 --storage-dtype int4 --prune-scale-shift``) and the
paper's top-k (``--sparsity 0.7 --block 16``) beside dense. What is timed is the jitted
``jax.value_and_grad`` of ``train.loop.loss_function`` at batch 128, 32 px (forward, backward,
compression; no optimizer update, no data loading). The settings are timed in turn, each timed call
after an untimed warm one, ``--reps`` rounds; the ratio is the median of the per-round ratios to
dense (``benchmarks.run_info.alternating_time_ratios``), so a slow spell of the shared machine hits
all alike.

``--pieces`` also times, per layer shape of the model, one int4 compression alone
(``Pruning.compress``) against that layer's dense forward matmul: where the extra time goes.

``--isas`` runs everything once per CPU kernel path, forced through ``$BSR_JAX_CPU_ISA`` (both
kernels: dW and the int4 compression); dense never calls them.

    python -m benchmarks.step_time --presets tiny s12 --reps 11
    python -m benchmarks.step_time --presets tiny --isas avx2 avx512
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp

import cpu_kernels
from bsr_jax import Pruning
from train import loop
from train.config import CIFAR_DEFAULTS, parse

if __package__:
    from benchmarks.run_info import alternating_time_ratios, footer, run_metadata, write_json
else:  # run as a script
    from run_info import alternating_time_ratios, footer, run_metadata, write_json

# label -> train.cifar flags
SETTINGS = {
    "dense": ["--sparsity", "0"],
    "int4 s0 (recommended)": ["--sparsity", "0", "--storage-dtype", "int4", "--prune-scale-shift"],
    "top-k s0.7/16": ["--sparsity", "0.7", "--block", "16"],
}
BASELINE = "dense"


def grad_step(flags: list[str], preset: str, batch_size: int):
    """The jitted ``value_and_grad`` of the training loss for these flags, and its arguments."""
    config = parse("train.cifar", "", CIFAR_DEFAULTS, ("cifar10",), [*flags, "--model", preset, "--batch-size", str(batch_size)])[0]
    model = loop.create_model(config, 10)
    shape = (batch_size, config.image_size, config.image_size, 3)
    images = jax.random.normal(jax.random.key(1), shape)
    params = model.init(jax.random.key(0), images)["params"]
    batch = {"image": images, "label": jnp.arange(batch_size) % 10}
    step = jax.jit(jax.value_and_grad(loop.loss_function(model, 10, config.label_smoothing), has_aux=True))
    return lambda: step(params, batch)


def piece_steps(preset_dim: int, batch_size: int, tokens: int = 64) -> dict[str, object]:
    """One int4 compression (block 16) of each distinct ResMLP activation shape, and the dense
    forward matmul of the layer reading it: fc1's input ``(B*T, D)``, fc2's ``(B*T, 4D)``, token
    mixing's ``(B*D, T)``."""
    pruning = Pruning(0.0, block=16, storage_dtype="int4")
    steps = {}
    for name, (m, k, n) in {
        "fc1": (batch_size * tokens, preset_dim, 4 * preset_dim),
        "fc2": (batch_size * tokens, 4 * preset_dim, preset_dim),
        "token": (batch_size * preset_dim, tokens, tokens),
    }.items():
        x = jax.random.normal(jax.random.key(2), (m, k))
        w = jax.random.normal(jax.random.key(3), (k, n))
        compress, matmul = jax.jit(pruning.compress), jax.jit(jnp.matmul)
        steps[f"{name} x@w ({m}x{k}x{n})"] = lambda matmul=matmul, x=x, w=w: matmul(x, w)
        steps[f"{name} int4 compress"] = lambda compress=compress, x=x: compress(x)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "s12"], help="train.models presets (default: tiny s12)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--reps", type=int, default=11, help="alternating rounds per preset (default: %(default)s)")
    parser.add_argument("--isas", nargs="+", choices=cpu_kernels.ISAS,
                        help="CPU kernel paths to run, each forced in turn (default: the one picked for this CPU)")
    parser.add_argument("--pieces", action="store_true", help="also time one int4 compression per layer shape vs its matmul")
    parser.add_argument("--json", default="benchmarks/results/step_time.json")
    args = parser.parse_args()
    meta = run_metadata()
    rows = []
    print("| kernel path | preset | setting | ms per value_and_grad | vs dense (median of rounds) |\n|---|---|---|---|---|")
    for isa in args.isas or [None]:
        if isa:
            os.environ[cpu_kernels.ISA_ENV] = cpu_kernels.resolve_isa(isa)
            jax.clear_caches()  # programs traced under the previous path must not be reused
        path = cpu_kernels.resolve_isa()
        for preset in args.presets:
            labels = dict.fromkeys([BASELINE, *args.settings])
            steps = {label: grad_step(SETTINGS[label], preset, args.batch_size) for label in labels}
            for label, result in alternating_time_ratios(steps, args.reps, BASELINE).items():
                rows.append(dict(path=path, preset=preset, setting=label, flags=SETTINGS[label], ms=result["seconds"] * 1e3,
                                 ratio=result["ratio"]))  # fmt: skip
                print(f"| {path} | {preset} | {label} | {rows[-1]['ms']:.1f} | **{result['ratio']:.2f}** |", flush=True)
    if args.isas:
        meta["cpu_kernel_isa"] += f" by default; forced per row: {' '.join(args.isas)}"
    pieces = []
    if args.pieces:
        from train.models import PRESETS

        print("\n| preset | piece | ms |\n|---|---|---|")
        for preset in args.presets:
            steps = piece_steps(PRESETS[preset]["dim"], args.batch_size)
            first = next(iter(steps))
            for label, result in alternating_time_ratios(steps, args.reps, first).items():
                pieces.append(dict(preset=preset, piece=label, ms=result["seconds"] * 1e3))
                print(f"| {preset} | {label} | {pieces[-1]['ms']:.2f} |", flush=True)
    print(f"\n{footer(meta)}")
    write_json(args.json, meta, dict(rows=rows, pieces=pieces, batch_size=args.batch_size, reps=args.reps))


if __name__ == "__main__":
    main()
