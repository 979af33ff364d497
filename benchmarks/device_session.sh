#!/usr/bin/env bash
# What a session lent a GPU runs first, in one call (docs/RESULTS.md 13, 13.1 and 13.2 say what came back
# before): the fused kernels alone (benchmarks/kernels/fused_gpu.py, their tilings, timed in bursts of calls, at most
# 200 s), then whole steps (benchmarks/memory/device_check.py, about 60 s a row): what 13.2 left open, the LM's lean
# attention with and without compressed layers (compress_model's lean alone, XLA's int4 token rows with lean, the
# attention's output projection left exact) and ViT-B/16's token rows. Writes under $OUT (the device tool's folder),
# else ./device_out.
#   bash benchmarks/device_session.sh [SECONDS_FOR_THE_STEPS [SECONDS_FOR_THE_KERNELS]]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-device_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
# int4's CPU branch is traced when lowering for the GPU too: the CPU kernel must be importable.
python3 setup.py build_ext --inplace >"$out/build.log" 2>&1 || echo "CPU kernel build failed: see build.log"
timeout "${2:-200}" python3 -m benchmarks.kernels.fused_gpu --json "$out/fused_gpu.json" 2>&1 | tee "$out/fused_gpu.log"
timeout "${1:-360}" python3 -m benchmarks.memory.device_check --no-deviceless-options --reps 10 --json "$out/device_check.json" \
  --rows "lm-12x768::plan:12xkeep, rest keep" "lm-12x768::lean" "lm-12x768::int4-row" "lm-12x768::int4-outdense" \
  "vit-b16::plan:12xkeep, rest keep" "vit-b16::int4-row-nolean" 2>&1 | tee "$out/device_check.log"
