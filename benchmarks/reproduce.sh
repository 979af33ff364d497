#!/usr/bin/env bash
# Re-runs every measurement behind docs/RESULTS.md, in order. Resumable: the CIFAR grid skips
# finished runs and resumes interrupted ones; the benchmarks are cheap to repeat.
#   bash benchmarks/reproduce.sh PATH_TO_CIFAR10 [EPOCHS]
# PATH_TO_CIFAR10: cifar-10-python.tar.gz, or an image-folder directory/tar (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:?usage: bash benchmarks/reproduce.sh PATH_TO_CIFAR10 [EPOCHS]}
epochs=${2:-3}
python -m benchmarks.memory.residuals --out benchmarks/results/memory.json
# The first compiled table in RESULTS 1.2 predates the cpu backend: it was compiled with the xla one.
BSR_JAX_BACKEND=xla python -m benchmarks.memory.residuals --models s12-cifar --modes linear --storage --policy-sparsities \
  --compile all --out benchmarks/results/memory-s12-cifar-compiled.json
python -m benchmarks.memory.residuals --models s12-cifar --modes linear --sparsities 0.3 0.7 0.9 --blocks 16 --compile all \
  --out benchmarks/results/memory-s12-cifar-compiled-cpu-backend.json
python -m benchmarks.kernels.dw_speed
python -m benchmarks.kernels.dw_speed --shapes cifar-fc1 cifar-fc2 --blocks 16 64 --sparsities 0.7 --reps 21 \
  --out benchmarks/results/kernels-cpu-targets.json
for run in "dense 0.0" "s0.7-b16 0.7"; do
  set -- $run
  rm -rf "runs/throughput/$1"  # step timings only: start fresh rather than resume
  python -m train.cifar --model tiny --data-dir "$data" --steps 120 --log-every 20 --sparsity "$2" --block 16 \
    --workdir "runs/throughput/$1"
done
python -m benchmarks.accuracy.cifar_grid --data-dir "$data" --epochs "$epochs" --seeds 0 1 --out docs/results
python -m benchmarks.accuracy.sensitivity --run runs/cifar_grid/dense-seed0 --data-dir "$data" --prune-scale-shift
python -m benchmarks.memory.models --reps 15
# Accuracy at memory (RESULTS "Accuracy at memory"): 10-epoch runs, then the Pareto front.
long() { python -m benchmarks.accuracy.cifar_grid --root runs/long --data-dir "$data" --epochs 10 --out runs/long/report "$@" \
  -- --checkpoint-every 390; }
long --seeds 0 --configs dense all-s0-b16-int8 all-s0-b16-int4 stoch-s0.7-b16 s0.7-b16 all-s0.5-b16-int8-stoch
long --seeds 1 --configs dense all-s0-b16-int4 all-s0-b16-int8
python -m benchmarks.accuracy.pareto runs/long docs/results --step-reps 10
# Convolutions (RESULTS section 8): memory table, then ResNet-18 accuracy at equal epochs.
python -m benchmarks.memory.conv_memory
python -m benchmarks.accuracy.resnet_study --data-dir "$data"
# Sharded jit on 4 host devices (docs/sharding.md), and 2 processes x 2 devices against 1 x 4.
python -m benchmarks.memory.sharding
python -m benchmarks.speed.multiprocess --data-dir "$data"
