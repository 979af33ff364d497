"""Where compression's TPU v5p time goes: ResMLP-S12's full adamw step (CIFAR, B=128) with every dW
residual in 1 x 128 blocks, compiled deviceless for TPU v5p, with and without the library's
``lax.optimization_barrier`` ties (``bsr_jax.storage.barriers``), XLA:TPU's modelled time and the
compiled peak beside dense's.

Without the barriers XLA is free to keep the full-precision input instead of the stored one, so
the peak shows whether compression survives; the time shows what the ties cost.

    python -m benchmarks.memory.tpu_barriers dense int8 int8-nobarrier bfloat16 bfloat16-nobarrier

Writes nothing: prints one line a variant (~80 s each on 2 cores). Read in docs/RESULTS.md section 14.2.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import bsr_jax  # noqa: E402
from bsr_jax import Pruning  # noqa: E402
from bsr_jax.storage import barriers  # noqa: E402
from benchmarks.memory import kernel_account  # noqa: E402
from benchmarks.memory.compiled_memory import step_args  # noqa: E402

STORAGES = ("dense", "bfloat16", "int8", "int4")
VARIANTS = STORAGES + tuple(f"{s}-nobarrier" for s in STORAGES[1:])


def measure(variant: str) -> str:
    storage, _, untied = variant.partition("-")
    saved = barriers.materialize, barriers.when_needed, barriers.together
    if untied:  # the ties made identities for this compile
        barriers.materialize, barriers.when_needed, barriers.together = (lambda y, r: (y, r),) * 3
    try:
        pruning = None if storage == "dense" else Pruning(0.0, block=(1, 128), storage_dtype=storage)
        step, args = step_args(kernel_account.s12(pruning), (128, 32, 32, 3), 10)
        r = bsr_jax.compiled_memory(step, *args, target="tpu-v5p", donate_argnums=(0, 1))
    finally:
        barriers.materialize, barriers.when_needed, barriers.together = saved
    return f"{variant}: peak {r.peak / 2**20:.0f} MiB, XLA:TPU {r.optimal_seconds * 1e3:.2f} ms, roofline {r.roofline_seconds * 1e3:.2f} ms"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="+", choices=VARIANTS)
    for variant in parser.parse_args(argv).variants:
        print(measure(variant), flush=True)


if __name__ == "__main__":
    main()
