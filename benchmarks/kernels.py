"""Speed of the weight-gradient backends against dense ``x.T @ dy``, measured in one run.

For each layer shape, block and sparsity: times dense ``x.T @ dy``, the ``xla`` backend (global
and column selection) and the platform's kernel backend: on a CPU ``cpu`` (the C++ kernel; blocks
it hands to ``xla`` are not timed twice), on a GPU ``pallas``; compression (block magnitudes, top-k,
gather: ``from_dense``) is timed against the layer's dense forward matmul ``x @ w``. Everything is
jitted and warmed up; each variant and its dense baseline are timed alternately ``--reps`` times
and the ratio reported is the median of the per-repetition ratios, so a slow spell of the shared
machine hits both alike. Sparse TFLOP/s counts
kept-block FLOPs only; GB/s counts the bytes each variant must read and write at least once.

    python benchmarks/kernels.py                     # CPU: xla and cpu (pallas needs a GPU)
    python benchmarks/kernels.py --shapes cifar-fc1 cifar-fc2 --blocks 16 64 --sparsities 0.7 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from bsr_jax import backends
from bsr_jax.format import from_dense

if __package__:  # python -m benchmarks.kernels
    from benchmarks.run_info import run_metadata, write_json
else:  # python benchmarks/kernels.py: this file's directory is sys.path[0]
    from run_info import run_metadata, write_json

# name -> (M, K, N): x (M, K), dy (M, N). ResMLP-S12, dim 384, MLP 1536.
SHAPES = {
    "cifar-fc1": (128 * 64, 384, 1536),  # 32px / patch 4 = 64 tokens, batch 128
    "cifar-fc2": (128 * 64, 1536, 384),
    "imagenet-fc1": (64 * 196, 384, 1536),  # 224px / patch 16 = 196 tokens, batch 64
    "imagenet-fc2": (64 * 196, 1536, 384),
    "square-4096": (8192, 4096, 4096),
}


def _seconds(fn, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def paired_times(fn_a, args_a, fn_b, args_b, reps: int) -> tuple[float, float, float]:
    """Median seconds of ``fn_a`` and ``fn_b`` and the median of their per-repetition ratio.

    The two are timed alternately, so a slow spell of the shared machine hits both alike.
    """
    jax.block_until_ready((fn_a(*args_a), fn_b(*args_b)))
    pairs = [(_seconds(fn_a, args_a), _seconds(fn_b, args_b)) for _ in range(reps)]
    return (statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs),
            statistics.median(a / b for a, b in pairs))  # fmt: skip


def measure_shape(name: str, args) -> list[dict]:
    m, k, n = SHAPES[name]
    kx, kd, kw = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32)
    dy = jax.random.normal(kd, (m, n), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32)
    dense_dw = jax.jit(lambda x, dy: jnp.matmul(x.T, dy))
    dense_fwd = jax.jit(lambda x, w: x @ w)
    flops = 2 * m * k * n
    dense_bytes = 4 * (m * k + m * n + k * n)
    kernel_backend = backends.PLATFORM_DEFAULTS.get(jax.default_backend())
    rows = []
    for block in args.blocks:
        for sparsity in args.sparsities:
            for selection in ("global", "column"):
                compress = jax.jit(lambda x: from_dense(x, sparsity, block, selection=selection))
                bsr = compress(x)
                dy_padded = jnp.pad(dy, ((0, bsr.padded_shape[0] - m), (0, 0)))
                t_compress, t_fwd, compress_ratio = paired_times(compress, (x,), dense_fwd, (x, w), args.reps)
                kept = bsr.capacity * bsr.block[0] * bsr.block[1] / (m * k)
                kernel_runs = kernel_backend and not (kernel_backend == "cpu" and block < backends.CPU_KERNEL_MIN_ROWS)
                for backend in ["xla"] + ([kernel_backend] if kernel_runs else []):
                    fn = jax.jit(backends.BACKENDS[backend])
                    t_sparse, t_dense, ratio = paired_times(fn, (bsr, dy_padded), dense_dw, (x, dy), args.reps)
                    gathered = bsr.capacity * bsr.block[0] * n  # dy rows read once per kept block
                    rows.append(
                        dict(
                            shape=name, m=m, k=k, n=n, block=block, sparsity=sparsity, selection=selection,
                            backend=backend, kept_fraction=kept,
                            dense_ms=t_dense * 1e3, sparse_ms=t_sparse * 1e3, ratio=ratio,
                            dense_tflops=flops / t_dense / 1e12, sparse_tflops=kept * flops / t_sparse / 1e12,
                            dense_gbs=dense_bytes / t_dense / 1e9,
                            sparse_gbs=4 * (bsr.capacity * block * block + gathered + k * n) / t_sparse / 1e9,
                            compress_ms=t_compress * 1e3, compress_over_forward=compress_ratio,
                        )
                    )  # fmt: skip
                    print(f"# {name} b{block} s{sparsity} {selection} {backend}: {rows[-1]['ratio']:.2f}x dense",
                          file=sys.stderr, flush=True)  # fmt: skip
    return rows


def print_table(rows: list[dict]) -> None:
    header = "| shape | block | sparsity | selection | backend | dense ms | sparse ms | ratio | sparse TFLOP/s | sparse GB/s | compress / fwd |"
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['block']} | {r['sparsity']} | {r['selection']} | {r['backend']} | {r['dense_ms']:.1f} | "
            f"{r['sparse_ms']:.1f} | {r['ratio']:.2f} | {r['sparse_tflops']:.3f} | {r['sparse_gbs']:.1f} | "
            f"{r['compress_over_forward']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["cifar-fc1", "cifar-fc2", "imagenet-fc1", "imagenet-fc2"],
                        choices=list(SHAPES), help="layer shapes (default: the ResMLP-S12 ones; add square-4096)")
    parser.add_argument("--blocks", nargs="+", type=int, default=[4, 16, 64], help="default: 4 16 64")
    parser.add_argument("--sparsities", nargs="+", type=float, default=[0.0, 0.3, 0.5, 0.7, 0.9],
                        help="default: 0 0.3 0.5 0.7 0.9")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement (default: %(default)s)")
    parser.add_argument("--out", help="JSON path (default: benchmarks/results/kernels-<device>.json)")
    args = parser.parse_args()
    meta = run_metadata()
    device = jax.devices()[0].device_kind
    if jax.default_backend() != "gpu":
        print(f"# {jax.default_backend()}: pallas backend skipped (compiled Pallas kernels need a GPU)", file=sys.stderr)
    rows = [row for shape in args.shapes for row in measure_shape(shape, args)]
    print_table(rows)
    out = args.out or f"benchmarks/results/kernels-{device.replace(' ', '_')}.json"
    write_json(out, meta, dict(rows=rows))


if __name__ == "__main__":
    main()
