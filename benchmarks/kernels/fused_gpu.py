"""The fused kernels alone on a GPU: ``matmul_quantizing`` against XLA's ``x @ w`` and
``quantized_t_matmul`` (unsplit, split, with taller and wider tiles: ``FORWARD_VARIANTS``, ``DW_VARIANTS``; for float32 layers also with dy in
bfloat16, the fused backend's int4 products) against XLA's ``x.T @ dy``, at the layer
shapes of the models in docs/RESULTS.md 13.1, beside what the roofline models for each.

Each variant is jitted, warmed up and timed ``--reps`` times (a burst of ``--burst`` calls each, waited for once), alternating with
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
        ("lm fc1", 16384, 768, 3072, jnp.bfloat16), ("lm attention", 16384, 768, 768, jnp.bfloat16),
        ("lm fc2", 16384, 3072, 768, jnp.bfloat16), ("vit fc1", 12608, 768, 3072, jnp.float32),
        ("s12 fc1", 8192, 384, 1536, jnp.float32), ("vit attention", 12608, 768, 768, jnp.float32),
        ("s12 fc2", 8192, 1536, 384, jnp.float32),
    ],
    "tiny": [("tiny", 256, 128, 64, jnp.float32)],
}  # fmt: skip


# The forward's (rows, columns, num_warps): the default; taller and wider tiles with the warps they need.
FORWARD_VARIANTS = ((None, None, 4), (128, None, 4), (128, None, 8), (None, 256, 8))
# dW's (splits, rows, columns, num_warps): as before the split; the default; a taller token step (more
# products per trip of the loop); wider tiles (each tile of codes dequantized for more products).
DW_VARIANTS = ((1, None, None, 4), (None, None, None, 4), (None, 128, None, 4), (None, 128, None, 8), (None, None, 256, 8), (None, 128, 256, 8))


# Calls dispatched back to back per timing, waited for once: a call alone timed the host's dispatch and wait
# too (150-250 us on the H200 of docs/RESULTS.md 13.2, as long as the kernels), a burst overlaps them.
BURST = 20


def _seconds(compiled, args, burst):
    t0 = time.perf_counter()
    for _ in range(burst):
        out = compiled(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / burst


def _label(kind, **tiling):
    chosen = [f"{name}={value}" for name, value in tiling.items() if value is not None]
    return kind + (" " + " ".join(chosen) if chosen else "")


def rows(shapes, storage, reps, burst=BURST):
    for name, m, k, n, dtype in shapes:
        keys = jax.random.split(jax.random.key(0), 3)
        x, w = jax.random.normal(keys[0], (m, k), dtype), jax.random.normal(keys[1], (k, n), dtype) * 0.05
        dy = jax.random.normal(keys[2], (m, n), dtype)
        _, codes, scales = jax.jit(functools.partial(qm.matmul_quantizing, storage=storage))(x, w)
        # XLA's GEMMs, compiled once per shape: every variant is timed against the same program.
        dense_fwd = jax.jit(jnp.matmul).lower(x, w).compile()
        dense_dw = jax.jit(lambda x, dy: jnp.matmul(x.T, dy, preferred_element_type=jnp.float32)).lower(x, dy).compile()
        variants = []
        for r, c, warps in FORWARD_VARIANTS:
            kernel = functools.partial(qm.matmul_quantizing, storage=storage, rows=r, columns=c, num_warps=warps)
            variants.append((_label("forward", rows=r, columns=c, warps=warps if r or c else None), kernel, (x, w), dense_fwd, (x, w)))
        for splits, r, c, warps in DW_VARIANTS:
            kernel = functools.partial(qm.quantized_t_matmul, splits=splits, rows=r, columns=c, num_warps=warps)
            label = _label("dW", splits=splits or "auto", rows=r, columns=c, warps=warps if r or c else None)
            variants.append((label, kernel, (codes, scales, dy), dense_dw, (x, dy)))
        if dtype == jnp.float32:  # what the fused backend runs for float32 int4 layers (fused.DW_PRODUCTS)
            variants.append(("dW bf16 products", qm.quantized_t_matmul, (codes, scales, dy.astype(jnp.bfloat16)), dense_dw, (x, dy)))
        for kind, fn, args, theirs_compiled, base_args in variants:
            try:  # compiled once: timed, and its program read by the roofline
                ours_compiled = jax.jit(fn).lower(*args).compile()
                jax.block_until_ready((ours_compiled(*args), theirs_compiled(*base_args)))  # warm-up
            except Exception as e:  # a tiling Triton cannot compile (shared memory, registers): say so, go on
                print(f"| {name} | {kind} | failed: {type(e).__name__}: {str(e).splitlines()[0][:200]} |", flush=True)
                continue
            ours, theirs = [], []
            for _ in range(reps):  # alternating, one timing of each per round
                ours.append(_seconds(ours_compiled, args, burst))
                theirs.append(_seconds(theirs_compiled, base_args, burst))
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
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--burst", type=int, default=BURST, help="calls per timing, waited for once (the median's unit is one call)")
    parser.add_argument("--json", default="fused_gpu.json")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.burst < 1:
        parser.error(f"--reps and --burst must be at least 1, got {args.reps} and {args.burst}")
    found = []
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| layer (M x K x N, dtype) | kernel | us | XLA's us | ratio | modelled us | TFLOP/s | share of the H100's peak |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows(SHAPES[args.shapes], args.storage, args.reps, args.burst):
        found.append(row)
        print(f"| {row['layer']} ({row['m']} x {row['k']} x {row['n']}, {row['dtype']}) | {row['kernel']} | {row['us']:.1f} | "
              f"{row['xla_us']:.1f} | {row['ratio']:.2f} | {row['modelled_us']:.1f} | {row['tflops']:.0f} | {row['share_of_peak']:.2f} |", flush=True)  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
