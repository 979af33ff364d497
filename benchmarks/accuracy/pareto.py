"""Accuracy at memory: the long-run CIFAR-10 study as a Pareto front (issue 15).

Reads the finished runs under ROOT (``benchmarks/accuracy/cifar_grid.py --root ROOT --epochs 10``), and for
each configuration reports the final test accuracy (mean over seeds; "seed spread": max minus min
of the seeds' final accuracies), the accuracy at epoch 3 and
the gap to dense at epochs 3 and at the end (dense minus it for each seed both were run with,
averaged: same-seed runs share initialisation and data order), the residual activation memory of the tiny model
(each run's memory record) and of ResMLP-S12 at CIFAR shapes (B=128; the run's pruning flags on
the s12 preset, traced with ``residual_bytes``; nothing runs), and whether the configuration is on
the front (no other configuration keeps at most as much ResMLP-S12 memory at a smaller gap),
and the gradient-step time of each run's model and flags against dense's (``--step-reps`` steps
each, timed alternately in this process: the runs' own images/s shared the CPU at varying load).
Writes ``OUT/pareto.md``, ``OUT/pareto.json`` and ``OUT/pareto.png``.

    python -m benchmarks.accuracy.pareto runs/long docs/results

Writes docs/RESULTS.md section 9 and docs/results/pareto.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import bsr_jax  # noqa: E402
from train.config import TrainConfig  # noqa: E402
from train.loop import create_model, loss_function  # noqa: E402

from benchmarks.accuracy.grid_report import summarise
from benchmarks.run_info import alternating_time_ratios

MIB = 2**20


def _run_loss(run_config: dict, **overrides):
    """``(loss(params, images, labels), params as ShapeDtypeStructs)`` of a run's config.json
    settings (``overrides`` replace some, e.g. the model), with a fixed pruning key (stochastic
    options: shapes and costs do not depend on it)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    config = dataclasses.replace(TrainConfig.from_json({k: v for k, v in run_config.items() if k in fields}), **overrides)
    model = create_model(config, num_classes=10)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"])
    loss = loss_function(model, 10, config.label_smoothing, config.layer_sparsity)
    rng = jax.random.key(0)
    return (lambda p, x, y: loss(p, {"image": x, "label": y}, rng)[0]), params


def s12_activation_mib(run_config: dict, batch: int = 128) -> float:
    """Activation residual MiB of ResMLP-S12 (CIFAR shapes) under a run's pruning flags."""
    loss, params = _run_loss(run_config, model="s12", dim=None, depth=None)
    images = jax.ShapeDtypeStruct((batch, 32, 32, 3), jnp.float32)
    res = bsr_jax.residual_bytes(loss, params, images, jax.ShapeDtypeStruct((batch,), jnp.int32))
    return (res.activations + res.inputs) / MIB


def step_time_ratios(run_configs: dict[str, dict], reps: int, batch: int = 128) -> dict[str, dict[str, float]]:
    """Median gradient-step time of each run's own model and flags (the tiny preset, CIFAR batch
    ``batch``) and its median ratio to the ``"dense"`` run's, timed alternately in this process."""
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(batch, 32, 32, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, batch), jnp.int32)
    steps = {}
    for name, run_config in run_configs.items():
        loss, shapes = _run_loss(run_config)
        params = jax.tree.map(lambda s: jnp.asarray(rng.normal(scale=0.02, size=s.shape), s.dtype), shapes)
        compiled = jax.jit(jax.grad(loss)).lower(params, images, labels).compile()
        steps[name] = functools.partial(compiled, params, images, labels)
    return alternating_time_ratios(steps, reps, "dense")


def _seed_accuracy(row: dict, epoch: float | None) -> dict[int, float]:
    """Test accuracy of each of the row's seeds at ``epoch`` (None: its last evaluation)."""
    found = {}
    for seed, curve in zip(row["seed_ids"], row["curves"]):
        values = [acc for e, acc in curve if epoch is None or abs(e - epoch) < 1e-9]
        if values:
            found[seed] = values[-1]
    return found


def accuracy_at(row: dict, epoch: float) -> float | None:
    """Mean over the row's seeds at ``epoch``; None unless every seed was evaluated there."""
    values = _seed_accuracy(row, epoch)
    return statistics.mean(values.values()) if len(values) == row["seeds"] else None


def paired_gap(dense: dict, row: dict, epoch: float | None) -> float | None:
    """Dense minus ``row`` at ``epoch`` (None: the end), averaged over the seeds both have.

    Runs of one seed share initialisation and data order, so the same-seed difference is far less
    noisy than a difference of means over different seeds (dense's two seeds end 1.8 points apart).
    """
    ours, reference = _seed_accuracy(row, epoch), _seed_accuracy(dense, epoch)
    common = sorted(set(ours) & set(reference))
    if not common or (epoch is not None and len(ours) < row["seeds"]):
        return None
    return statistics.mean(reference[s] - ours[s] for s in common)


def front(rows: list[dict]) -> None:
    """Marks ``on_front``: no other row has at most the memory and a smaller gap to dense (same seeds)."""
    for r in rows:
        r["on_front"] = not any(o is not r and o["s12_mib"] <= r["s12_mib"] and o["gap_final"] < r["gap_final"] for o in rows)


def plot(rows: list[dict], path: str) -> None:
    """Gap to dense (same seeds) against ResMLP-S12 memory, the front as a step line."""
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, r in enumerate(rows):
        vs_dense = -100 * r["gap_final"]
        ax.scatter(r["s12_ratio"], vs_dense, color=f"C{i}", s=40, marker="o" if r["on_front"] else "x")
        ax.annotate(f"{r['config']} ({r['seeds']} seed{'s' * (r['seeds'] > 1)})", (r["s12_ratio"], vs_dense), fontsize=8,
                    xytext=(6, 5 if r["on_front"] else -12), textcoords="offset points")  # fmt: skip
    on = sorted((r for r in rows if r["on_front"]), key=lambda r: r["s12_ratio"])
    xs = [r["s12_ratio"] for r in on] + [max(r["s12_ratio"] for r in rows)]
    ys = [-100 * r["gap_final"] for r in on]
    ax.step(xs, ys + ys[-1:], where="post", color="k", alpha=0.5, label="Pareto front")
    ax.set(xlabel="activation memory vs dense (ResMLP-S12, CIFAR shapes)",
           ylabel="test accuracy minus dense (points)",
           title="Accuracy at memory: tiny ResMLP, CIFAR-10, 10 epochs (gaps against dense's same seeds)")  # fmt: skip
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(root: str, out: str, step_reps: int = 10) -> list[dict]:
    rows = summarise(root, [])
    run_configs = {}
    for row in rows:
        with open(os.path.join(root, f"{row['config']}-seed{row['seed_ids'][0]}", "config.json")) as f:
            run_configs[row["config"]] = json.load(f)["config"]
        row["s12_mib"] = s12_activation_mib(run_configs[row["config"]])
    timed = step_time_ratios(run_configs, step_reps) if step_reps else {}
    for row in rows:
        row["step_time_ratio"] = timed[row["config"]]["ratio"] if timed else None
    dense = next(r for r in rows if r["config"] == "dense")
    for row in rows:
        row["s12_ratio"] = row["s12_mib"] / dense["s12_mib"]
        row["acc_epoch3"] = accuracy_at(row, 3.0)
        row["gap_epoch3"] = paired_gap(dense, row, 3.0)
        row["gap_final"] = paired_gap(dense, row, None)
        if row["gap_final"] is None:
            raise SystemExit(f"{row['config']}: no finished seed in common with dense (seeds {row['seed_ids']})")
    front(rows)
    fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
    lines = [
        "| config | seeds | epochs | test acc | seed spread | dense minus it, same seeds | acc @3 | dense minus it @3, same seeds | tiny MiB | S12 MiB | S12 vs dense | step time vs dense | front |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["s12_mib"]):
        lines.append(
            f"| {r['config']} | {r['seeds']} | {r['epochs']:.0f} | {r['final_accuracy']:.2%} "
            f"| {fmt(100 * r['accuracy_spread'] if r['seeds'] > 1 else None, '{:.2f} pt')} "
            f"| {fmt(None if r['gap_final'] is None else 100 * r['gap_final'], '{:+.2f} pt')} "
            f"| {fmt(r['acc_epoch3'], '{:.2%}')} | {fmt(None if r['gap_epoch3'] is None else 100 * r['gap_epoch3'], '{:+.2f} pt')} "
            f"| {fmt(r['residual_activation_mib'], '{:.1f}')} | {r['s12_mib']:.0f} | {r['s12_ratio']:.2f} "
            f"| {fmt(r['step_time_ratio'], '{:.2f}')} | {'yes' if r['on_front'] else ''} |"
        )
    table = "\n".join(lines) + "\n"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "pareto.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out, "pareto.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, os.path.join(out, "pareto.png"))
    print(table)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", help="the study's runs (benchmarks/accuracy/cifar_grid.py --root)")
    parser.add_argument("out", help="where pareto.md, pareto.json and pareto.png go")
    parser.add_argument("--step-reps", type=int, default=10,
                        help="alternating timed gradient steps per configuration, 0 to skip (default: %(default)s)")  # fmt: skip
    args = parser.parse_args()
    main(args.root, args.out, args.step_reps)
