"""Markdown tables for docs/RESULTS.md from the benchmarks' JSON files (nothing is measured here).

    python benchmarks/tables.py memory benchmarks/results/memory.json --model "resmlp-s12 cifar"
    python benchmarks/tables.py kernels benchmarks/results/kernels-cpu.json --sparsity 0.7
    python benchmarks/tables.py sensitivity benchmarks/results/sensitivity.json

Each table ends with the run's metadata line (command, commit, date, machine, jax, device).
"""

from __future__ import annotations

import argparse
import json


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _meta_line(meta: dict) -> str:
    return (f"\n<sub>`{meta['command']}` at commit `{meta['commit']}`, {meta['date']}, {meta['machine']}, "
            f"jax {meta['jax']}, device `{meta['device']}`</sub>\n")  # fmt: skip


def memory(doc: dict, model: str) -> str:
    rows = [r for r in doc["rows"] if r["model"].startswith(model)]
    dense = next(r for r in rows if r["config"] == "dense")
    lines = [
        "| config | activation MiB | vs dense | linear-input MiB (reduction) | program-order peak MiB (vs dense) | CPU compiled temp MiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        linear = "-" if "linear_input_mib" not in r else (
            f"{r['linear_input_mib']:.1f}" + (f" ({r['linear_input_reduction']:.1%})" if "linear_input_reduction" in r else "")
        )  # fmt: skip
        peak = f"{r['program_peak_mib']:.1f} ({r['program_peak_mib'] / dense['program_peak_mib'] - 1:+.1%})"
        lines.append(
            f"| {r['config']} | {r['act_mib']:.1f} | {r['act_ratio'] - 1:+.1%} | {linear} | {peak} | "
            f"{_fmt(r.get('compiled_temp_mib'), '.1f')} |"
        )
    return f"**{dense['model']}**\n\n" + "\n".join(lines) + "\n" + _meta_line(doc["meta"])


def kernels(doc: dict, sparsity: float | None) -> str:
    lines = [
        "| shape (M, K, N) | block | sparsity | selection | backend | dense ms | sparse ms | sparse / dense | "
        "sparse GFLOP/s (dense) | compress / fwd |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        if sparsity is None or r["sparsity"] == sparsity:
            lines.append(
                f"| {r['shape']} ({r['m']}, {r['k']}, {r['n']}) | {r['block']} | {r['sparsity']} | {r['selection']} | "
                f"{r['backend']} | {r['dense_ms']:.1f} | {r['sparse_ms']:.1f} | **{r['ratio']:.2f}** | "
                f"{r['sparse_tflops'] * 1e3:.0f} ({r['dense_tflops'] * 1e3:.0f}) | {r['compress_over_forward']:.2f} |"
            )
    return "\n".join(lines) + "\n" + _meta_line(doc["meta"])


def sensitivity(doc: dict) -> str:
    table = doc["errors"]
    columns = list(next(iter(table.values())))
    lines = ["| layer | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    mean = {c: sum(e[c] for e in table.values()) / len(table) for c in columns}
    for path, errors in [*table.items(), ("**mean**", mean)]:
        lines.append(f"| {path} | " + " | ".join(f"{errors[c]:.3f}" for c in columns) + " |")
    return "\n".join(lines) + "\n" + _meta_line(doc["meta"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["memory", "kernels", "sensitivity"])
    parser.add_argument("path", help="the benchmark's JSON output")
    parser.add_argument("--model", default="resmlp-s12 cifar", help="memory: model name prefix (default: %(default)s)")
    parser.add_argument("--sparsity", type=float, help="kernels: only this sparsity")
    args = parser.parse_args()
    with open(args.path) as f:
        doc = json.load(f)
    if args.kind == "memory":
        print(memory(doc, args.model))
    elif args.kind == "kernels":
        print(kernels(doc, args.sparsity))
    else:
        print(sensitivity(doc))


if __name__ == "__main__":
    main()
