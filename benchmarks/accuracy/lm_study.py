"""The LM loss study of issue 34: ``python -m train.lm`` (the cpu preset) under each setting and
seed at equal tokens, resumable, then a table and a plot of the validation loss curves.

Runs one ``python -m train.lm`` subprocess per (setting, seed), one after the other, each in its
own workdir ``ROOT/SETTING-seedS``. A finished run (checkpoint and evaluation at the last step) is
skipped; an interrupted one continues from its last checkpoint (``--resume`` is passed to the
trainer), so re-running this script after a stop finishes the study. Seeds run in the outer loop:
every setting has seed 0 before any has seed 1. After each run the JSON (``--json``) is rewritten
and the table printed; ``--table-only`` only summarises the runs that exist (and plots them).

    python -m benchmarks.accuracy.lm_study                       # 6 settings x seeds 0 1, 200 steps each
    python -m benchmarks.accuracy.lm_study --table-only

Gaps are against dense's run of the same seed (same initialisation and data order). Wall time is
the sum of this script's sessions of the run (data, compilation and evaluations included).

Writes docs/RESULTS.md section 11.1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# name -> train.lm flags. "int4" is the recommended setting (bsr_jax.rewrite.presets: every residual in
# int4 16 x 16 blocks at sparsity 0); "int4-1x128" the fused kernels' format (int4 in 1 x 128 blocks: one scale per
# 128 columns of a token row; on the CPU the unfused path stores the same codes); "stochastic" is the stochastic setting bsr_jax.rewrite.presets
# documents (MEASURED's all-s0.5-b16-int8-stoch: half the blocks sampled by magnitude, rescaled,
# kept in int8); "dx8" is int4 with approximate input gradients (norms, SwiGLU, attention in int8).
# "reordered" is the control: every layer through compress_model at sparsity 0 in f32 (exact values,
# dW summed in another order), the size of the gap a perturbation of rounding alone makes (a
# --layer-sparsity rule makes the run compressed; "*" takes the other layers at the same 0).
SETTINGS: dict[str, list[str]] = {
    "dense": [],
    "reordered": ["--layer-sparsity", "layer_0/*=0", "--block", "16"],
    "int8": ["--sparsity", "0", "--storage-dtype", "int8", "--block", "16"],
    "int4": ["--sparsity", "0", "--storage-dtype", "int4", "--block", "16"],
    "int4-1x128": ["--sparsity", "0", "--storage-dtype", "int4", "--block", "1x128"],
    "topk": ["--sparsity", "0.7", "--block", "16"],
    "stochastic": ["--sparsity", "0.5", "--block", "16", "--storage-dtype", "int8", "--stochastic"],
    "dx8": ["--sparsity", "0", "--storage-dtype", "int4", "--block", "16", "--dx", "int8"],
}
WALL_FILE = "study_wall.jsonl"  # one {"wall_s", "exit"} line per session of a run, in its workdir


def records(workdir: str) -> list[dict]:
    try:
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def finished(workdir: str, steps: int) -> bool:
    evals = [r for r in records(workdir) if r.get("kind") == "eval"]
    has_checkpoint = os.path.isdir(os.path.join(workdir, "checkpoints", str(steps)))
    return has_checkpoint and bool(evals) and evals[-1]["step"] >= steps


def run_one(name: str, seed: int, args) -> None:
    workdir = os.path.join(args.root, f"{name}-seed{seed}")
    if finished(workdir, args.steps):
        print(f"[lm_study] {name} seed {seed}: done, skipped", flush=True)
        return
    checkpoints = os.path.join(workdir, "checkpoints")
    resume = os.path.isdir(checkpoints) and any(d.isdigit() for d in os.listdir(checkpoints))
    command = [sys.executable, "-m", "train.lm", "--model", "cpu", "--steps", str(args.steps), "--seed", str(seed),
               "--eval-every", str(args.eval_every), "--workdir", workdir, *SETTINGS[name], *args.extra,
               "--stop-at", str(args.steps)]  # fmt: skip  (a resumed run's config.json may hold an earlier --stop-at)
    if resume:
        command.append("--resume")
    print(f"[lm_study] {name} seed {seed}: {'resuming' if resume else 'starting'}: {' '.join(command)}", flush=True)
    os.makedirs(workdir, exist_ok=True)
    started = time.time()
    with open(os.path.join(workdir, "log.txt"), "a") as log:
        status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    with open(os.path.join(workdir, WALL_FILE), "a") as f:
        f.write(json.dumps({"wall_s": time.time() - started, "exit": status, "ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
    if status != 0:
        sys.exit(f"[lm_study] {name} seed {seed} ended with exit code {status}; see {workdir}/log.txt "
                 "(run the study again to continue it)")  # fmt: skip


def summarise(root: str, steps: int, seeds: list[int]) -> dict:
    """The study's rows (one per existing run) and curves, from the workdirs."""
    rows, curves = [], {}
    for seed in seeds:
        for name in SETTINGS:
            workdir = os.path.join(root, f"{name}-seed{seed}")
            recs = records(workdir)
            if not recs:
                continue
            evals = [r for r in recs if r.get("kind") == "eval"]
            trains = [r for r in recs if r.get("kind") == "train" and r.get("tokens_per_s")]
            memory = [r for r in recs if r.get("kind") == "memory"]
            walls = []
            try:
                with open(os.path.join(workdir, WALL_FILE)) as f:
                    walls = [json.loads(line)["wall_s"] for line in f if line.strip()]
            except FileNotFoundError:
                pass
            done = finished(workdir, steps)
            rows.append({
                "setting": name, "seed": seed, "flags": SETTINGS[name], "finished": done,
                "step": evals[-1]["step"] if evals else 0,
                "final_val_loss": evals[-1]["val_loss"] if evals else None,
                "val_bits_per_byte": evals[-1]["val_bits_per_byte"] if evals else None,
                "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in trains) if trains else None,
                "wall_s": sum(walls) if walls else None,
                "residual_activation_mib": memory[-1]["residual_activation_mib"] if memory else None,
                "dense_residual_activation_mib": memory[-1]["dense_residual_activation_mib"] if memory else None,
            })  # fmt: skip
            curves[f"{name}-seed{seed}"] = [[r["step"], r["val_loss"]] for r in evals]
    dense = {r["seed"]: r for r in rows if r["setting"] == "dense" and r["finished"]}
    for row in rows:
        ref = dense.get(row["seed"])
        ok = row["finished"] and ref is not None
        row["gap_percent"] = 100 * (row["final_val_loss"] / ref["final_val_loss"] - 1) if ok else None
    return {"steps": steps, "settings": SETTINGS, "rows": rows, "curves": curves}


def table(study: dict) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    lines = ["| setting | seed | val loss @ step | gap to dense (same seed) | bits/byte | tokens/s (median) | wall | residual MiB (of dense) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in study["rows"]:
        at = f"{fmt(r['final_val_loss'], '.4f')} @ {r['step']}" + ("" if r["finished"] else " (running)")
        gap = "-" if r["gap_percent"] is None else ("0 (ref)" if r["setting"] == "dense" else f"{r['gap_percent']:+.2f}%")
        wall = "-" if r["wall_s"] is None else f"{r['wall_s'] / 60:.1f} min"
        kept, dense = r.get("residual_activation_mib"), r.get("dense_residual_activation_mib")
        residual = f"{kept:.1f} ({kept / dense:.0%})" if kept and dense else "-"
        lines.append(f"| {r['setting']} | {r['seed']} | {at} | {gap} | {fmt(r['val_bits_per_byte'], '.4f')} | "
                     f"{fmt(r['tokens_per_s_median'], '.0f')} | {wall} | {residual} |")  # fmt: skip
    return "\n".join(lines)


def plot(study: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = dict(zip(SETTINGS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    curves = {key: dict(curve) for key, curve in study["curves"].items() if curve}
    for key, curve in curves.items():
        name, seed = key.rsplit("-seed", 1)
        style = "-" if seed == "0" else "--"
        steps = sorted(curve)
        axes[0].plot(steps, [curve[s] for s in steps], style, color=colors[name], marker="o", markersize=3, label=f"{name} seed {seed}")
        dense = curves.get(f"dense-seed{seed}", {})
        shared = [s for s in steps if s in dense]
        if name != "dense" and shared:
            gaps = [100 * (curve[s] / dense[s] - 1) for s in shared]
            axes[1].plot(shared, gaps, style, color=colors[name], marker="o", markersize=3, label=f"{name} seed {seed}")
    axes[0].set_title("validation loss (cpu preset, 16 x 128 tokens per step)")
    axes[0].set_ylabel("validation loss (nats/token)")
    axes[1].axhline(0, color="black", lw=0.8)
    axes[1].set_title("gap to dense of the same seed")
    axes[1].set_ylabel("validation loss / dense's - 1 (%)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(args) -> dict:
    study = summarise(args.root, args.steps, args.seeds)
    study["command"] = "python -m benchmarks.accuracy.lm_study " + " ".join(sys.argv[1:])
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(study, f, indent=1)
    if args.plot and study["curves"]:
        plot(study, args.plot)
    print(table(study), flush=True)
    return study


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="runs/lm_study", help="one workdir per run below this (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="steps per run, equal for all (default: %(default)s)")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between validation losses (default: %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="default: 0 1")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), help="default: all")
    parser.add_argument("--json", default="benchmarks/results/lm_study.json", help="default: %(default)s")
    parser.add_argument("--plot", default="docs/results/lm_study.png", help="default: %(default)s ('' for none)")
    parser.add_argument("--table-only", action="store_true", help="only summarise (and plot) the runs that exist")
    parser.add_argument("extra", nargs="*", help="further train.lm flags, after --")
    args = parser.parse_args(argv)
    if not args.table_only:
        for seed in args.seeds:
            for name in args.settings:
                run_one(name, seed, args)
                report(args)
    report(args)


if __name__ == "__main__":
    main()
