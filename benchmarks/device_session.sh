#!/usr/bin/env bash
# What a session lent a GPU runs first, in one call (docs/RESULTS.md 13 and 13.1 say what came back
# before): the fused kernels alone (benchmarks/kernels/fused_gpu.py, their tilings, at most 200 s), then whole steps
# (benchmarks/memory/device_check.py, about 50 s a row): the split dW kernels' steps (S12's with float32
# int4's bf16 dW products, RESULTS 14.8) and XLA's row formats, which no GPU has run. Writes under $OUT (the device tool's folder), else ./device_out.
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
  --rows "lm-12x768::plan:12xkeep, rest keep" "lm-12x768::int4-fused-nolean" "lm-12x768::int8-row" \
  "lm-12x768::int4-row-nolean" "resmlp-s12::plan:12xkeep, rest keep" "resmlp-s12::plan:12xint4-fused, rest keep" \
  "vit-b16::plan:12xkeep, rest keep" "vit-b16::int4-fused-nolean" 2>&1 | tee "$out/device_check.log"
