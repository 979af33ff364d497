"""Where a compressed step's time goes: ResMLP-S12's full adamw step (CIFAR, B=128) compiled
deviceless for H100 (or TPU v5p, ``--target``), its modelled time summed per kind of kernel (each block's kernels added up over
the 12 blocks), one column per storage format of every dW residual, beside dense (``int8-fused`` / ``int4-fused``:
the 1 x 128 formats through ``backend="fused"``, whose GEMMs write and read the codes). ``--model vit-b16``
(or ``lm-12x768``) accounts for compiled_memory's step of that model instead, its settings named as there
(``dense int4-rows int8-fused int4-fused ...``: every linear input through ``compress_model``).

A kernel's kind is its module and op from XLA's metadata (``block*/fc1/reduce_max``), prefixed
``GEMM`` where it is a GEMM (a Triton or cuBLAS call, or over 0.1 GFLOP) and ``bwd`` where it runs
in the backward pass: so a format's extra passes (scales, quantize, dequantize) show as their own
rows. ``--triton-gemm off`` compiles cuBLAS GEMMs (the instrument of RESULTS 10-13). The kinds'
times are the roofline's (``bsr_jax.measure.roofline``); on TPU v5p the table adds XLA:TPU's own
modelled step beside its sum.

    python -m benchmarks.memory.kernel_account --formats dense int8 int8-rows int4 --triton-gemm auto off
    python -m benchmarks.memory.kernel_account --model vit-b16 --formats dense int4-rows int4-fused --triton-gemm off

Writes docs/RESULTS.md section 14 (JSON: benchmarks/results/kernel_account.json).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bsr_jax import Pruning  # noqa: E402
from bsr_jax.measure import compiled, roofline  # noqa: E402
from benchmarks.memory.compiled_memory import FUSED, MODELS, SETTINGS, TOKEN_ROWS, step_args  # noqa: E402
from benchmarks.run_info import footer, run_metadata  # noqa: E402
from train import models as train_models  # noqa: E402

MIB = 2**20
# Every dW residual's storage; "int8-rows": one scale per 128 values of a token row, the layout a
# GEMM could read with its scales (issue 40's option (a)).
FORMATS = {
    "dense": None,
    "int8": Pruning(0.0, block=16, storage_dtype="int8"),
    "int8-rows": Pruning(0.0, block=(1, 128), storage_dtype="int8"),
    "int4": Pruning(0.0, block=16, storage_dtype="int4"),
    "int4-rows": Pruning(0.0, block=(1, 128), storage_dtype="int4"),
    **TOKEN_ROWS,
}
# The 1 x 128 formats through the fused backend (compiled_memory's): codes written by the forward
# GEMM, read by dW's.
FORMATS |= FUSED
TRITON = {"auto": None, "on": True, "off": False}


def s12(pruning: Pruning | None):
    affine, layerscale = train_models.scale_shift_defs(pruning)
    return train_models.ResMLP(num_classes=10, patch_size=4, dense=train_models.dense_def(pruning), stem_dense=train_models.dense_def(),
                               head_dense=train_models.dense_def(), affine=affine, layerscale=layerscale, **train_models.PRESETS["s12"])  # fmt: skip


def kind(kernel: roofline.Kernel) -> str:
    # Blocks' indices (S12's block3, ViT's encoderblock_3, the LM's encoderdecoderblock_3) become *.
    op = re.sub(r"(?<=block)_?\d+", "*", kernel.op)
    where = "/".join(op.split("/")[-3:]) if op else kernel.name.split(".")[0]
    gemm = "gemm" in kernel.name or "cublas" in kernel.name or kernel.flops > 1e8
    return f"{'GEMM ' if gemm else ''}{'bwd' if 'transpose' in op else 'fwd'} {where}"


def account(fmt: str, triton_gemm: bool | None, target: str = "h100", model: str = "resmlp-s12") -> dict:
    if model == "resmlp-s12":
        step, args = step_args(s12(FORMATS[fmt]), (128, 32, 32, 3), 10)
        context = contextlib.nullcontext()
    else:
        built = MODELS[model](fmt)
        if built is None:
            raise SystemExit(f"--formats: {fmt} does not apply to {model} (compiled_memory measures no such step)")
        module, shape, classes, context = built
        with context:
            step, args = step_args(module, shape, classes)
    with context:
        program = compiled.compile_for(step, *args, target=target, donate_argnums=(0, 1), triton_gemm=triton_gemm)
    text = program.as_text()
    rl = roofline.roofline(text, target)
    cost = program.cost_analysis() or {}
    xla_seconds = (cost[0] if isinstance(cost, list) else cost).get("optimal_seconds")
    us, mib = collections.Counter(), collections.Counter()
    for kernel in rl.kernels:
        us[kind(kernel)] += kernel.seconds * 1e6
        mib[kind(kernel)] += kernel.bytes / MIB
    return dict(format=fmt, model=model, target=target, triton_gemm=compiled.uses_triton_gemm(text), peak_mib=program.memory_analysis().peak_memory_in_bytes / MIB,
                modelled_us=rl.seconds * 1e6, xla_us=xla_seconds * 1e6 if xla_seconds and xla_seconds > 0 else None,
                kernels=len(rl.kernels), us=dict(us), mib=dict(mib))  # fmt: skip


def table(rows: list[dict], top: int) -> str:
    cols = [f"{r['format']} {'TPU v5p' if r.get('target') == 'tpu-v5p' else 'Triton' if r['triton_gemm'] else 'cuBLAS'}" for r in rows]
    kinds = sorted({k for r in rows for k in r["us"]}, key=lambda k: -max(r["us"].get(k, 0) - rows[0]["us"].get(k, 0) for r in rows))
    lines = ["| kernel kind (summed over blocks), modelled us | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(rows)]
    lines += [f"| {k} | " + " | ".join(f"{r['us'].get(k, 0):.0f}" for r in rows) + " |" for k in kinds[:top]]
    lines.append("| everything else | " + " | ".join(f"{sum(v for k, v in r['us'].items() if k not in kinds[:top]):.0f}" for r in rows) + " |")
    lines.append("| **modelled step** | " + " | ".join(f"**{r['modelled_us']:.0f}**" for r in rows) + " |")
    if any(r.get("xla_us") for r in rows):
        lines.append("| XLA:TPU's modelled step | " + " | ".join(f"{r['xla_us']:.0f}" if r.get("xla_us") else "-" for r in rows) + " |")
    lines.append("| kernels | " + " | ".join(str(r["kernels"]) for r in rows) + " |")
    lines.append("| compiled peak MiB | " + " | ".join(f"{r['peak_mib']:.0f}" for r in rows) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["resmlp-s12", "vit-b16", "lm-12x768"], default="resmlp-s12")
    parser.add_argument("--formats", nargs="+", choices=sorted(set(FORMATS) | set(SETTINGS)), default=["dense", "int8", "int8-rows", "int4"],
                        help="ResMLP-S12: this module's formats; other models: compiled_memory's settings")
    parser.add_argument("--triton-gemm", nargs="+", choices=list(TRITON), default=["auto"])
    parser.add_argument("--target", choices=["h100", "tpu-v5p"], default="h100", help="tpu-v5p: --triton-gemm does not apply")
    parser.add_argument("--top", type=int, default=16, help="kinds shown: those whose time grows most over the first format's")
    parser.add_argument("--out", default="benchmarks/results/kernel_account.json")
    args = parser.parse_args(argv)
    meta, rows = run_metadata(), []
    for triton in args.triton_gemm if args.target == "h100" else ["auto"]:
        for fmt in args.formats:
            print(f"{args.model} {fmt} {args.target} triton_gemm={triton} ...", file=sys.stderr, flush=True)
            rows.append(account(fmt, TRITON[triton], args.target, args.model) | {"meta": {k: meta[k] for k in ("commit", "date", "machine", "cpu", "jax")}})
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    print(table(rows, args.top))
    print(footer(meta))


if __name__ == "__main__":
    main()
