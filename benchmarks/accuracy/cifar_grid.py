"""The paper's CIFAR-10 grid with the project's own CLI, resumable, then a report.

Runs ``python -m train.cifar`` once per (configuration, seed), one after the other, each in its
own workdir under ``--root``. A finished run (its last eval record at the final epoch) is skipped;
an interrupted one continues from its last checkpoint (``--resume``), so re-running this script
after a stop finishes the grid. Seeds run in the outer loop: if time runs out, every configuration
has the same number of seeds. Afterwards (or with ``--report-only``) it calls ``grid_report``.

    python -m benchmarks.accuracy.cifar_grid --data-dir ../shared/data/cifar10-jpg.tar.gz --epochs 4 --seeds 0 1

Writes docs/RESULTS.md sections 2, 9 and 9.1 (its report through ``grid_report``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.accuracy import grid_report

# name -> train.cifar flags. The paper's grid (dense; 0.5/16; 0.7 with blocks 4/16/64), 0.9/16, and
# this project's extensions: every parameter-gradient residual pruned, kept blocks in int8, and
# unbiased stochastic block sampling instead of top-k.
CONFIGS: dict[str, list[str]] = {
    "dense": ["--sparsity", "0"],
    "s0.5-b16": ["--sparsity", "0.5", "--block", "16"],
    "s0.7-b4": ["--sparsity", "0.7", "--block", "4"],
    "s0.7-b16": ["--sparsity", "0.7", "--block", "16"],
    "s0.7-b64": ["--sparsity", "0.7", "--block", "64"],
    "s0.9-b16": ["--sparsity", "0.9", "--block", "16"],
    "all-s0.7-b16": ["--sparsity", "0.7", "--block", "16", "--prune-scale-shift"],
    "all-s0.7-b16-int8": ["--sparsity", "0.7", "--block", "16", "--prune-scale-shift", "--storage-dtype", "int8"],
    "stoch-s0.7-b16": ["--sparsity", "0.7", "--block", "16", "--stochastic"],
    "all-s0.7-b16-int8-stoch": [
        "--sparsity", "0.7", "--block", "16", "--prune-scale-shift", "--storage-dtype", "int8", "--stochastic",
    ],
    # Quantize-only: every block of every parameter-gradient residual kept, in low precision.
    "all-s0-b16-int8": ["--sparsity", "0", "--block", "16", "--prune-scale-shift", "--storage-dtype", "int8"],
    "all-s0-b16-int4": ["--sparsity", "0", "--block", "16", "--prune-scale-shift", "--storage-dtype", "int4"],
    # The fused kernels' format (backend="fused", issue 40): one scale per token and 128 features (the
    # token-mixing layers' 64 tokens: one per row); on the CPU the unfused path stores the same codes.
    "all-s0-1x128-int4": ["--sparsity", "0", "--block", "1x128", "--prune-scale-shift", "--storage-dtype", "int4"],
    "all-s0-b16-int4-sr": [  # unbiased (stochastic) rounding of the int4 values
        "--sparsity", "0", "--block", "16", "--prune-scale-shift", "--storage-dtype", "int4", "--rounding", "stochastic",
    ],
    "all-s0.5-b16-int8-stoch": [
        "--sparsity", "0.5", "--block", "16", "--prune-scale-shift", "--storage-dtype", "int8", "--stochastic",
    ],
    # The recommended setting with approximate dx: the GELU input stored in int8 (bsr_jax.ops.dx).
    "all-s0-b16-int4-dx8": ["--sparsity", "0", "--block", "16", "--prune-scale-shift", "--storage-dtype", "int4", "--dx", "int8"],
    # Issue 14's accuracy study (benchmarks/accuracy/resnet_study.py runs it): ResNet-18 at a quarter of its
    # width (--dim 16: several epochs an hour on 2 cores, benchmarks/speed/resnet_step_time.py), dense, every
    # conv input pooled 2x2 (BatchNorm and ReLU lean), BSR 0.7/16 on every conv input.
    "resnet18-dense": ["--model", "resnet18", "--dim", "16", "--sparsity", "0"],
    "resnet18-pool2": ["--model", "resnet18", "--dim", "16", "--compression", "pool2"],
    "resnet18-bsr0.7-b16": ["--model", "resnet18", "--dim", "16", "--sparsity", "0.7", "--block", "16"],
}
# Run by benchmarks/accuracy/resnet_study.py; the default grid (ResMLP) leaves them out. The first is the dense reference.
RESNET_STUDY = ("resnet18-dense", "resnet18-pool2", "resnet18-bsr0.7-b16")


def finished(workdir: str, epochs: int) -> bool:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        evals = [r for r in map(json.loads, f) if r.get("kind") == "eval"]
    return bool(evals) and evals[-1]["epoch"] >= epochs - 1e-9


def run_grid(args) -> None:
    for seed in args.seeds:
        for name in args.configs:
            workdir = os.path.join(args.root, f"{name}-seed{seed}")
            if finished(workdir, args.epochs):
                print(f"[grid] {name} seed {seed}: done, skipped", flush=True)
                continue
            resume = os.path.isdir(os.path.join(workdir, "checkpoints"))
            command = [
                sys.executable, "-m", "train.cifar", "--model", args.model, "--epochs", str(args.epochs),
                "--seed", str(seed), "--workdir", workdir, *CONFIGS[name], *args.extra,
            ]
            if args.data_dir:
                command += ["--data-dir", args.data_dir]
            if resume:
                command.append("--resume")
            print(f"[grid] {name} seed {seed}: {'resuming' if resume else 'starting'}: {' '.join(command)}", flush=True)
            os.makedirs(workdir, exist_ok=True)
            with open(os.path.join(workdir, "log.txt"), "a") as log:
                status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
            if status != 0:
                sys.exit(f"[grid] {name} seed {seed} failed with exit code {status}; see {workdir}/log.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="runs/cifar_grid", help="one workdir per run below this (default: %(default)s)")
    parser.add_argument("--data-dir", help="passed to train.cifar --data-dir")
    parser.add_argument("--model", default="tiny", help="ResMLP preset (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per run, equal for all (default: %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="default: 0 1")
    resmlp = [name for name in CONFIGS if name not in RESNET_STUDY]
    parser.add_argument("--configs", nargs="+", default=resmlp, choices=list(CONFIGS), help="default: all but RESNET_STUDY")
    parser.add_argument("--report-only", action="store_true", help="only summarise the runs that exist")
    parser.add_argument("--out", default="docs/results", help="where the report's table, JSON and plots go")
    parser.add_argument("extra", nargs="*", help="further train.cifar flags, after --")
    args = parser.parse_args()
    if not args.report_only:
        run_grid(args)
    grid_report.report(args.root, args.out, list(CONFIGS))


if __name__ == "__main__":
    main()
