#!/usr/bin/env bash
# Re-runs every measurement behind docs/RESULTS.md, in order. Resumable: the CIFAR grid skips
# finished runs and resumes interrupted ones; the benchmarks are cheap to repeat.
#   bash benchmarks/reproduce.sh PATH_TO_CIFAR10 [EPOCHS]
# PATH_TO_CIFAR10: cifar-10-python.tar.gz, or an image-folder directory/tar (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:?usage: bash benchmarks/reproduce.sh PATH_TO_CIFAR10 [EPOCHS]}
epochs=${2:-3}
python benchmarks/memory.py --out benchmarks/results/memory.json
python benchmarks/memory.py --models s12-cifar --modes linear --storage --policy-sparsities --compile all \
  --out benchmarks/results/memory-s12-cifar-compiled.json
python benchmarks/kernels.py
python benchmarks/cifar_grid.py --data-dir "$data" --epochs "$epochs" --seeds 0 1 --out docs/results
python benchmarks/sensitivity.py --run runs/cifar_grid/dense-seed0 --data-dir "$data" --prune-scale-shift
