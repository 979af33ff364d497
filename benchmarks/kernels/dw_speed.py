"""Speed of the weight-gradient backends against dense ``x.T @ dy``, measured in one run.

For each layer shape, block and sparsity: times dense ``x.T @ dy``, the ``xla`` backend (global
and column selection) and the platform's kernel backend: on a CPU ``cpu`` (the C++ kernel; blocks
it hands to ``xla`` are not timed twice), on a GPU ``pallas``; compression (block magnitudes, top-k,
gather: ``from_dense``) is timed against the layer's dense forward matmul ``x @ w``. Everything is
jitted and warmed up; each variant and its dense baseline are timed alternately ``--reps`` times
and the ratio reported is the median of the per-repetition ratios, so a slow spell of the shared
machine hits both alike. Sparse TFLOP/s counts
kept-block FLOPs only; GB/s counts the bytes each variant must read and write at least once.

``--suite layer`` times issue 23's rows instead, per CPU kernel path (``--isas``, forced through
``$BSR_JAX_CPU_ISA``): one layer's whole backward (dx + dW: ``bsr_linear``'s vjp at sparsity 0.7,
block 16, after its forward) against dense ``x @ w``'s vjp, and dW alone against ``x.T @ dy``, on
the ResMLP-S12 fc1 and fc2 shapes; and dW from int8 / int4 blocks with every block kept (sparsity
0). Each row names the kernel path its compiled code calls (read from the lowered program).

    python -m benchmarks.kernels.dw_speed                     # CPU: xla and cpu (pallas needs a GPU)
    python -m benchmarks.kernels.dw_speed --shapes cifar-fc1 cifar-fc2 --blocks 16 64 --sparsities 0.7 --reps 5
    python -m benchmarks.kernels.dw_speed --suite layer --isas avx2 avx512 --reps 21

Writes docs/RESULTS.md sections 4 and 4.0.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import cpu_kernels
from bsr_jax import bsr_linear
from bsr_jax.backends import dispatch as backends
from bsr_jax.storage.format import from_dense

from benchmarks.run_info import footer, run_metadata, write_json

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


def kernel_path(fn, *args) -> str:
    """The CPU kernel path that ``jax.jit(fn)(*args)`` calls (``"-"`` if it calls none)."""
    found = set(re.findall(r"isa = (\d)", jax.jit(fn).lower(*args).as_text()))
    return ",".join(cpu_kernels.ISAS[int(i)] for i in sorted(found)) or "-"


LAYER_SHAPES = ("cifar-fc1", "cifar-fc2")
# (sparsity, storage dtype) of the dW-alone rows: the s0.7/16, and every block kept in int8 / int4.
LAYER_DW = ((0.7, None), (0.0, "int8"), (0.0, "int4"))


def measure_layer(name: str, reps: int) -> list[dict]:
    """Issue 23's rows for one shape on the current kernel path, for the cpu and xla backends."""
    m, k, n = SHAPES[name]
    kx, kd, kw = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32)
    dy = jax.random.normal(kd, (m, n), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32) / k**0.5
    # The backward alone: vjp functions made (forward and compression run) before timing starts.
    vjp_of = lambda layer: jax.jit(lambda x, w: jax.vjp(layer, x, w)[1])(x, w)  # noqa: E731
    apply_vjp = lambda vjp, dy: vjp(dy)  # noqa: E731
    dense_vjp = vjp_of(lambda x, w: x @ w)
    dense_dw = jax.jit(lambda x, dy: jnp.matmul(x.T, dy))
    rows = []

    def add(what, sparsity, storage, backend, path, times):
        t_sparse, t_dense, ratio = times
        rows.append(dict(shape=name, m=m, k=k, n=n, what=what, block=16, sparsity=sparsity, storage=storage or "float32",
                         backend=backend, path=path, dense_ms=t_dense * 1e3, sparse_ms=t_sparse * 1e3, ratio=ratio))  # fmt: skip
        print(f"# {name} {what} s{sparsity} {storage} {backend} [{path}]: {ratio:.2f}x dense", file=sys.stderr, flush=True)

    for backend in ("cpu", "xla"):
        layer = lambda x, w, backend=backend: bsr_linear(x, w, sparsity=0.7, block=16, backend=backend)  # noqa: E731
        sparse_vjp = vjp_of(layer)
        times = paired_times(jax.jit(apply_vjp), (sparse_vjp, dy), jax.jit(apply_vjp), (dense_vjp, dy), reps)
        add("backward dx+dW", 0.7, None, backend, kernel_path(apply_vjp, sparse_vjp, dy), times)
    for sparsity, storage in LAYER_DW:
        bsr = jax.jit(lambda x: from_dense(x, sparsity, 16, storage_dtype=storage))(x)
        for backend in ("cpu", "xla"):
            fn = lambda bsr, dy, backend=backend: backends.BACKENDS[backend](bsr, dy)  # noqa: E731
            times = paired_times(jax.jit(fn), (bsr, dy), dense_dw, (x, dy), reps)
            add("dW", sparsity, storage, backend, kernel_path(fn, bsr, dy), times)
    return rows


def print_layer_table(rows: list[dict]) -> None:
    print("| kernel path | shape (M, K, N) | what | sparsity | storage | backend | dense ms | sparse ms | sparse / dense |")
    print("|---" * 9 + "|")
    for r in rows:
        print(
            f"| {r['path']} | {r['shape']} ({r['m']}, {r['k']}, {r['n']}) | {r['what']} | {r['sparsity']} | {r['storage']} | "
            f"{r['backend']} | {r['dense_ms']:.1f} | {r['sparse_ms']:.1f} | **{r['ratio']:.2f}** |"
        )


def print_table(rows: list[dict]) -> None:
    header = "| kernel path | shape | block | sparsity | selection | backend | dense ms | sparse ms | ratio | sparse TFLOP/s | sparse GB/s | compress / fwd |"
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for r in rows:
        print(
            f"| {r['path'] if r['backend'] == 'cpu' else '-'} | {r['shape']} | {r['block']} | {r['sparsity']} | {r['selection']} | "
            f"{r['backend']} | {r['dense_ms']:.1f} | "
            f"{r['sparse_ms']:.1f} | {r['ratio']:.2f} | {r['sparse_tflops']:.3f} | {r['sparse_gbs']:.1f} | "
            f"{r['compress_over_forward']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=("sweep", "layer"), default="sweep",
                        help="sweep: every backend over --shapes/--blocks/--sparsities; layer: issue 23's rows")
    parser.add_argument("--isas", nargs="+", choices=cpu_kernels.ISAS,
                        help="CPU kernel paths to run, each forced in turn (default: the one picked for this CPU)")
    parser.add_argument("--shapes", nargs="+", default=["cifar-fc1", "cifar-fc2", "imagenet-fc1", "imagenet-fc2"],
                        choices=list(SHAPES), help="layer shapes (default: the ResMLP-S12 ones; add square-4096)")
    parser.add_argument("--blocks", nargs="+", type=int, default=[4, 16, 64], help="default: 4 16 64")
    parser.add_argument("--sparsities", nargs="+", type=float, default=[0.0, 0.3, 0.5, 0.7, 0.9],
                        help="default: 0 0.3 0.5 0.7 0.9")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement (default: %(default)s)")
    parser.add_argument("--out", help="JSON path (default: benchmarks/results/kernels-<device>[-layer].json)")
    args = parser.parse_args()
    meta = run_metadata()
    device = jax.devices()[0].device_kind
    if jax.default_backend() != "gpu":
        print(f"# {jax.default_backend()}: pallas backend skipped (compiled Pallas kernels need a GPU)", file=sys.stderr)
    rows = []
    for isa in args.isas or [None]:
        if isa:
            os.environ[cpu_kernels.ISA_ENV] = cpu_kernels.resolve_isa(isa)
            jax.clear_caches()  # traces made under the previous path must not be reused
        if args.suite == "layer":
            rows += [row for shape in LAYER_SHAPES for row in measure_layer(shape, args.reps)]
        else:
            path = cpu_kernels.resolve_isa() if jax.default_backend() == "cpu" else "-"
            rows += [dict(row, path=path) for shape in args.shapes for row in measure_shape(shape, args)]
    if args.isas:
        meta["cpu_kernel_isa"] += f" by default; forced per row: {' '.join(args.isas)}"
    (print_layer_table if args.suite == "layer" else print_table)(rows)
    print(f"\n{footer(meta)}")
    suffix = "-layer" if args.suite == "layer" else ""
    out = args.out or f"benchmarks/results/kernels-{device.replace(' ', '_')}{suffix}.json"
    write_json(out, meta, dict(rows=rows))


if __name__ == "__main__":
    main()
