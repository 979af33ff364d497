"""The memory-time plane: every measured setting's compiled peak against its modelled step time,
each as a fraction of the dense step's on the same target, one panel per model and target.

Reads what other benchmarks wrote (nothing is compiled here): ``compiled_memory.json`` (dense,
JAX's remat policies, micro-batching, compression; docs/RESULTS.md section 10), ``plan_table.json`` (the plans at
0.3 / 0.5 / 0.7 of dense's peak, section 12) and ``device_check-h100.json`` (the same steps run on
a real H100, section 13: hollow markers, measured time and allocator peak over dense's). Settings
are told apart by marker and colour in one legend, so no label overlaps another.

    python -m benchmarks.memory.plane        # writes docs/results/plane.png

Writes docs/results/plane.png (README, docs/RESULTS.md section 10.1).
"""

from __future__ import annotations

import argparse
import json
import os

RESULTS = "benchmarks/results"
MODELS = {"resmlp-s12": "ResMLP-S12, B=128", "vit-b16": "ViT-B/16, B=64", "lm-12x768": "LM 12x768 bf16, T=2048 B=8", "resnet50": "ResNet-50, B=64"}
TARGETS = {"h100": "H100 (roofline)", "tpu-v5p": "TPU v5p (XLA's model)"}
# setting -> (legend, colour, marker): JAX's own choices in blues, compression in reds, ours in green.
STYLE = {
    "dense": ("dense", "black", "o"),
    "remat": ("nn.remat per block", "tab:blue", "s"),
    "remat-dots": ("remat, dots_with_no_batch_dims_saveable", "tab:cyan", "s"),
    "remat-dots-all": ("remat, dots_saveable", "navy", "s"),
    "remat-offload": ("remat, offload dots to host", "tab:purple", "s"),
    "lean": ("lean neighbours only (exact)", "tab:olive", "D"),
    "int4": ("int4 storage, every dW residual", "tab:red", "v"),
    "all-s0-b16-int8": ("int8 storage, every dW residual", "tab:orange", "v"),
    "int4-dx8": ("int4 + int8 dx (approximate dx)", "darkred", "^"),
    "topk": ("top-k 0.7, block 16 (the paper)", "tab:brown", "x"),
    "pool2": ("conv inputs pooled 2x2", "tab:pink", "P"),
    "microbatch-2": ("micro-batching, k = 2 (exact)", "tab:gray", "<"),
    "microbatch-4": ("micro-batching, k = 4 (exact)", "dimgray", ">"),
}
PLAN_STYLE = ("bsr_jax.plan at budget 0.3 / 0.5 / 0.7", "tab:green", "*")
REAL = "hollow: the same step on a real H100 (measured time, allocator peak)"


def _load(name: str) -> list[dict]:
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return []
    data = json.load(open(path))
    return data if isinstance(data, list) else data.get("runs") or data.get("rows") or []


def plot(out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows, plans, device = _load("compiled_memory.json"), _load("plan_table.json"), _load("device_check-h100.json")
    dense = {(r["model"], r["target"]): r for r in rows if r["setting"] == "dense"}
    device_dense = {r["model"]: r for r in device if r["setting"] == "dense"}
    fig, axes = plt.subplots(len(TARGETS), len(MODELS), figsize=(4.2 * len(MODELS), 3.8 * len(TARGETS)), squeeze=False)
    handles = {}
    for i, target in enumerate(TARGETS):
        for j, model in enumerate(MODELS):
            ax = axes[i][j]
            d = dense.get((model, target))
            for r in rows:
                if d is None or (r["model"], r["target"]) != (model, target) or r["setting"] not in STYLE or not r.get("modelled_seconds"):
                    continue
                label, color, marker = STYLE[r["setting"]]
                handles[label] = ax.scatter(r["modelled_seconds"] / d["modelled_seconds"], r["peak_mib"] / d["peak_mib"], c=color, marker=marker, s=40, label=label)
            for p in plans:
                if (p["model"], p["target"]) == (model, target) and p.get("time_ratio"):
                    handles[PLAN_STYLE[0]] = ax.scatter(p["time_ratio"], p["peak_ratio"], c=PLAN_STYLE[1], marker=PLAN_STYLE[2], s=110, label=PLAN_STYLE[0], zorder=3)
            if target == "h100" and model in device_dense:
                base = device_dense[model]
                for r in device:
                    if r["model"] == model and r["setting"] in STYLE:
                        label, color, marker = STYLE[r["setting"]]
                        ax.scatter(r["step_ms"] / base["step_ms"], r["peak_bytes_in_use_mib"] / base["peak_bytes_in_use_mib"],
                                   facecolors="none", edgecolors=color, marker=marker, s=90, linewidths=1.2)
                handles[REAL] = Line2D([], [], ls="", marker="o", markerfacecolor="none", markeredgecolor="grey", markersize=9)
            ax.set_title(f"{MODELS[model]}\n{TARGETS[target]}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.axhline(1, color="grey", lw=0.5)
            ax.axvline(1, color="grey", lw=0.5)
            if i == len(TARGETS) - 1:
                ax.set_xlabel("step time / dense (modelled)")
            if j == 0:
                ax.set_ylabel("compiled peak / dense")
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Full adamw training step: compiled peak and modelled time, each over dense's on the same target "
                 "(deviceless compiles; lower left is better)", fontsize=11)
    fig.tight_layout(rect=(0, 0.09, 1, 0.97))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/results/plane.png")
    print(plot(parser.parse_args(argv).out))


if __name__ == "__main__":
    main()
