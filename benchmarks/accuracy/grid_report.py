"""Summarise a grid of train.cifar runs: a markdown table, JSON and two plots.

Per configuration (runs named ``<config>-seed<S>``; unfinished runs are left out): final test accuracy (mean and spread over
seeds), epochs until test accuracy first reaches 90% of the dense run's final accuracy (the
paper's "delayed convergence", mean over seeds; "-" if never), training images/s (median of the
logged intervals after the first, which includes compilation), residual activation MiB and
compiled peak MiB (from each run's memory record), and the kept-block fraction.

    python -m benchmarks.accuracy.grid_report runs/cifar_grid docs/results

Writes the tables and plots of docs/RESULTS.md sections 2 and 9 (called by ``cifar_grid``).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_run(workdir: str) -> dict:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    by_kind = defaultdict(list)
    for r in records:
        by_kind[r["kind"]].append(r)
    return by_kind


def is_finished(workdir: str, run: dict) -> bool:
    """The run evaluated after its last configured epoch (an unfinished run would mix epochs); a run
    stopped before it wrote its config.json has not started."""
    if not os.path.exists(os.path.join(workdir, "config.json")):
        return False
    with open(os.path.join(workdir, "config.json")) as f:
        epochs = json.load(f)["config"]["epochs"]
    return bool(run["eval"]) and run["eval"][-1]["epoch"] >= epochs - 1e-9


def summarise(root: str, order: list[str]) -> list[dict]:
    runs: dict[str, list[dict]] = defaultdict(list)
    for entry in sorted(os.listdir(root)):
        match = re.fullmatch(r"(.+)-seed(\d+)", entry)
        if match and os.path.exists(os.path.join(root, entry, "metrics.jsonl")):
            run = load_run(os.path.join(root, entry))
            if is_finished(os.path.join(root, entry), run):
                runs[match.group(1)].append({**run, "seed": int(match.group(2))})
            else:
                print(f"[report] {entry}: not finished, left out", file=sys.stderr)
    if "dense" not in runs:
        raise SystemExit(f"no finished dense run under {root}: it is the reference for every row")
    dense_final = statistics.mean(run["eval"][-1]["test_accuracy"] for run in runs["dense"])
    rows = []
    for name in sorted(runs, key=lambda n: order.index(n) if n in order else len(order)):
        seeds = runs[name]
        finals = [run["eval"][-1]["test_accuracy"] for run in seeds]
        reach = [next((e["epoch"] for e in run["eval"] if e["test_accuracy"] >= 0.9 * dense_final), None) for run in seeds]
        speeds = [r["images_per_s"] for run in seeds for r in run["train"][1:] if "images_per_s" in r]
        memory = seeds[0]["memory"][0] if seeds[0]["memory"] else {}
        rows.append(
            dict(
                config=name,
                seeds=len(seeds),
                epochs=seeds[0]["eval"][-1]["epoch"],
                final_accuracy=statistics.mean(finals),
                accuracy_spread=max(finals) - min(finals),
                epochs_to_90pct_dense=statistics.mean(reach) if None not in reach else None,
                images_per_s=statistics.median(speeds) if speeds else None,
                residual_activation_mib=memory.get("residual_activation_mib"),
                compiled_peak_mib=memory.get("compiled_peak_mib"),
                kept_block_fraction=memory.get("kept_block_fraction"),
                seed_ids=[run["seed"] for run in seeds],
                curves=[[(e["epoch"], e["test_accuracy"]) for e in run["eval"]] for run in seeds],
            )
        )
    return rows


def markdown(rows: list[dict]) -> str:
    fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
    lines = [
        "| config | seeds | epochs | test acc | spread | epochs to 90% dense | images/s | residual MiB | compiled peak MiB | kept |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['seeds']} | {r['epochs']:.0f} | {r['final_accuracy']:.2%} | {r['accuracy_spread']:.2%} | "
            f"{fmt(r['epochs_to_90pct_dense'], '{:.2f}')} | {fmt(r['images_per_s'], '{:.0f}')} | "
            f"{fmt(r['residual_activation_mib'], '{:.1f}')} | {fmt(r['compiled_peak_mib'], '{:.1f}')} | "
            f"{fmt(r['kept_block_fraction'], '{:.3f}')} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        for i, curve in enumerate(r["curves"]):
            epochs, accs = zip(*curve)
            ax.plot(epochs, accs, marker="o", ms=3, color=f"C{rows.index(r)}", alpha=0.9 if i == 0 else 0.4,
                    label=r["config"] if i == 0 else None)
    ax.set(xlabel="epoch", ylabel="test accuracy", title="ResMLP tiny on CIFAR-10 (JPEG copy): test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "cifar_grid_accuracy.png"), dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(rows):
        if r["residual_activation_mib"] is not None:
            ax.scatter(r["residual_activation_mib"], r["final_accuracy"], color=f"C{i}", s=40)
            ax.annotate(r["config"], (r["residual_activation_mib"], r["final_accuracy"]), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
    ax.set(xlabel="residual activation MiB per step (per device)", ylabel="final test accuracy",
           title="Accuracy vs activation memory")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "cifar_grid_tradeoff.png"), dpi=120)
    plt.close(fig)


def report(root: str, out: str, order: list[str]) -> list[dict]:
    rows = summarise(root, order)
    os.makedirs(out, exist_ok=True)
    table = markdown(rows)
    with open(os.path.join(out, "cifar_grid.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out, "cifar_grid.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, out)
    print(table)
    return rows


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m benchmarks.accuracy.grid_report RUNS_ROOT OUT_DIR")
    report(sys.argv[1], sys.argv[2], [])
