"""The fused kernels alone on a GPU: ``matmul_quantizing`` against XLA's ``x @ w`` and
``quantized_t_matmul`` (unsplit, split, and with wider tiles: ``DW_VARIANTS``; for float32 layers also with dy in
bfloat16, the fused backend's int4 products) against XLA's ``x.T @ dy``, at the layer
shapes of the models in docs/RESULTS.md 13.1, beside what the roofline models for each.

Each variant is jitted, warmed up and timed ``--reps`` times (each waited for), alternating with
its XLA baseline so that a slow spell hits both; the median is reported, and the kernel's share of
the matrix units' peak it implies (``pallas_kernels.KERNEL_EFFICIENCY`` is fitted to whole steps;
this measures it per kernel and shape). Off a GPU the kernels run in the Pallas interpreter: use
``--shapes tiny`` there to check the script, not to time.

    python -m benchmarks.kernels.fused_gpu --json fused_gpu.json        # on a GPU
    python -m benchmarks.kernels.fused_gpu --shapes tiny --reps 1       # anywhere

Writes docs/RESULTS.md section 13.1's per-kernel rows, once run on a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp

from bsr_jax.measure import roofline
from bsr_jax.measure.hardware import H100
from pallas_kernels import quantized_matmul as qm

# (name, tokens M, K, N, dtype): the dense layers of the 12 x 768 LM (bf16), ViT-B/16 and ResMLP-S12 (f32).
SHAPES = {
    "models": [
        ("lm attention", 16384, 768, 768, jnp.bfloat16), ("lm fc1", 16384, 768, 3072, jnp.bfloat16),
        ("lm fc2", 16384, 3072, 768, jnp.bfloat16), ("vit attention", 12608, 768, 768, jnp.float32),
        ("vit fc1", 12608, 768, 3072, jnp.float32), ("s12 fc1", 8192, 384, 1536, jnp.float32),
        ("s12 fc2", 8192, 1536, 384, jnp.float32),
    ],
    "tiny": [("tiny", 256, 128, 64, jnp.float32)],
}  # fmt: skip


# dW's (splits, columns, num_warps): as before the split; the default; wider tiles (each tile of codes
# dequantized for more products) with the warps their accumulators need.
DW_VARIANTS = ((1, None, 4), (None, None, 4), (None, 256, 8), (None, 128, 8))


def _seconds(compiled, args):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - t0


def rows(shapes, storage, reps):
    for name, m, k, n, dtype in shapes:
        keys = jax.random.split(jax.random.key(0), 3)
        x, w = jax.random.normal(keys[0], (m, k), dtype), jax.random.normal(keys[1], (k, n), dtype) * 0.05
        dy = jax.random.normal(keys[2], (m, n), dtype)
        forward = jax.jit(functools.partial(qm.matmul_quantizing, storage=storage))
        _, codes, scales = forward(x, w)
        dense_dw = jax.jit(lambda x, dy: jnp.matmul(x.T, dy, preferred_element_type=jnp.float32))
        variants = [("forward", forward, (x, w), jax.jit(jnp.matmul), (x, w))]
        for splits, columns, warps in DW_VARIANTS:
            kernel = functools.partial(qm.quantized_t_matmul, splits=splits, columns=columns, num_warps=warps)
            label = f"dW splits={splits or 'auto'}" + (f" columns={columns} warps={warps}" if columns else "")
            variants.append((label, jax.jit(kernel), (codes, scales, dy), dense_dw, (x, dy)))
        if dtype == jnp.float32:  # what the fused backend runs for float32 int4 layers (fused.DW_PRODUCTS)
            variants.append(("dW bf16 products", jax.jit(qm.quantized_t_matmul), (codes, scales, dy.astype(jnp.bfloat16)), dense_dw, (x, dy)))
        for kind, fn, args, baseline, base_args in variants:
            # Compiled once: timed, and its program read by the roofline.
            ours_compiled, theirs_compiled = fn.lower(*args).compile(), baseline.lower(*base_args).compile()
            jax.block_until_ready((ours_compiled(*args), theirs_compiled(*base_args)))  # warm-up
            ours, theirs = [], []
            for _ in range(reps):  # alternating, one timing of each per round
                ours.append(_seconds(ours_compiled, args))
                theirs.append(_seconds(theirs_compiled, base_args))
            flops = 2 * m * k * n
            seconds = statistics.median(ours)
            yield dict(layer=name, m=m, k=k, n=n, dtype=jnp.dtype(dtype).name, storage=storage, kernel=kind,
                       us=seconds * 1e6, xla_us=statistics.median(theirs) * 1e6, ratio=seconds / statistics.median(theirs),
                       modelled_us=roofline.roofline(ours_compiled.as_text(), "h100").seconds * 1e6, tflops=flops / seconds / 1e12,
                       share_of_peak=flops / seconds / H100.matmul_flops["bf16" if dtype == jnp.bfloat16 else "f32"])  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="models")
    parser.add_argument("--storage", choices=sorted(qm.LIMITS), default="int4")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default="fused_gpu.json")
    args = parser.parse_args(argv)
    found = []
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| layer (M x K x N, dtype) | kernel | us | XLA's us | ratio | modelled us | TFLOP/s | share of the H100's peak |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows(SHAPES[args.shapes], args.storage, args.reps):
        found.append(row)
        print(f"| {row['layer']} ({row['m']} x {row['k']} x {row['n']}, {row['dtype']}) | {row['kernel']} | {row['us']:.1f} | "
              f"{row['xla_us']:.1f} | {row['ratio']:.2f} | {row['modelled_us']:.1f} | {row['tflops']:.0f} | {row['share_of_peak']:.2f} |", flush=True)  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
