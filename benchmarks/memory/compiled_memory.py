"""Compiled peak memory of a full training step on H100 and TPU v5p, compiled deviceless.

Each row is one model and one setting: the whole step (loss, grad, optax adamw; params and optimizer
state donated) compiled by XLA's GPU or TPU compiler on this machine (``bsr_jax.compiled_memory``),
with its peak, its modelled step time (XLA:TPU's own model on TPU, ``bsr_jax.measure.roofline`` on H100,
and the roofline on both), each as a ratio to the dense step on the same target, FLOPs, the five
largest modules live at the peak and the ten costliest kernels (the plane of every model and target is drawn from this JSON by
``benchmarks/memory/plane.py``). Results are appended to the JSON as they come, and
rows already there are skipped, so an interrupted run resumes.

    python -m benchmarks.memory.compiled_memory --models resmlp-s12 vit-b16 --targets h100 tpu-v5p
    python -m benchmarks.memory.compiled_memory --table-only       # print the table of the JSON

Settings: ``dense``; ``topk`` (s0.7/16 on linear inputs: the paper's method); ``topk-all``
(ResMLP only: s0.7/16 on the Affine/LayerScale inputs too, ``--prune-scale-shift``); ``topk-wide``
(s0.7 in blocks of 8 x 128, XLA:TPU's tile); ``int4`` (every
parameter-gradient residual in int4, the recommended setting); ``lean`` (compress_model with
``Rule("*", None)``: lean neighbours only); ``remat`` (``nn.remat`` per block); ``remat-dots``
(per block, ``dots_with_no_batch_dims_saveable``); ``remat-dots-all`` (``dots_saveable``);
``remat-offload`` (``offload_dot_with_no_batch_dims`` to ``pinned_host``); ``int4-dx8`` and
``int4-dx4`` (``int4`` with what exact dx needs stored in int8 / int4, ``bsr_jax.ops.dx``: ResMLP's
GELU input; in ViT and the LM, ``compress_model(dx=...)``: every norm, activation and attention
input; approximate dx); ``remat-int4`` (int4 inside blocks remat'd with
``bsr_jax.remat_policy()``); ``int4-rows`` (``int4`` with blocks of 1 x 128: one scale per 128
values of a row, lane-dense as blocks on TPU); ``int8-row`` and ``int4-row`` (every residual with
one scale per token row, ``block="row"``: not ResNet); ``int4-nolean`` and ``int4-row-nolean`` (ViT and
the LM: the same storage with compress_model's ``lean=False``, attention keeping its probabilities); ``int8-fused`` and
``int4-fused`` (every residual in 1 x 128 blocks through ``backend="fused"``: the forward GEMM writes the codes, dW's
reads them; ResMLP's Affine/LayerScale residuals take the unfused path; ``int4-fused-nolean`` without lean neighbours); the settings of ``presets.MEASURED``
(ResMLP only: ``all-s0-b16-int8`` ...: every residual under that Pruning); ``pool2`` (ResNet-50 only: every convolution keeps its input
average-pooled 2x2, the conv paper's method); ``microbatch-2`` and ``microbatch-4`` (the dense step accumulating its gradient
over 2 / 4 slices of the batch by ``lax.scan``, then one update: exact; not ResNet-50, whose BatchNorm statistics would have
to run through the slices).

Writes docs/RESULTS.md sections 10 and 10.1.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import bsr_jax  # noqa: E402
from bsr_jax import Pooling, Pruning, Rule
from bsr_jax.rewrite import presets  # noqa: E402
from bsr_jax.measure.compiled import DEVICELESS_TARGETS  # noqa: E402
from benchmarks.memory.models import remat_blocks  # noqa: E402
from benchmarks.run_info import footer, run_metadata  # noqa: E402
from tests import third_party_models as tpm  # noqa: E402
from train import models as train_models  # noqa: E402
from train import resnet as train_resnet  # noqa: E402

MIB = 2**20
SETTINGS = ("dense", "topk", "topk-all", "topk-wide", "int4", "int4-rows", "int8-row", "int4-row", "int4-nolean", "int4-row-nolean", "pool2", "lean", "remat", "remat-dots", "remat-dots-all",
            "remat-offload", "remat-int4", "int4-dx8", "int4-dx4", "int8-fused", "int4-fused", "int4-fused-nolean", "microbatch-2", "microbatch-4",
            "int4-outdense", "int8-fused-outdense")
TOPK = Pruning(0.7, block=16)
TOPK_WIDE = Pruning(0.7, block=(8, 128))  # XLA:TPU's own tile (docs/memory.md section 0.1)
INT4 = Pruning(0.0, block=16, storage_dtype="int4")
# The same storage with one scale per 128 values of a row: lane-dense as blocks on TPU (docs/memory.md).
INT4_ROWS = Pruning(0.0, block=(1, 128), storage_dtype="int4")
# One scale per token row (block="row"): the codes XLA:GPU's dW GEMM reads as stored (docs/RESULTS.md 14.1).
TOKEN_ROWS = {"int8-row": Pruning(0.0, block="row", storage_dtype="int8"), "int4-row": Pruning(0.0, block="row", storage_dtype="int4")}
# The 1 x 128 formats through backend="fused": codes written by the forward GEMM, read by dW's
# (bsr_jax.backends.fused; on TPU the unfused path, the same codes).
FUSED = {"int8-fused": Pruning(0.0, block=(1, 128), storage_dtype="int8", backend="fused"),
         "int4-fused": Pruning(0.0, block=(1, 128), storage_dtype="int4", backend="fused")}
# int4 with approximate dx (bsr_jax.ops.dx): ResMLP's GELU input, a compress_model'd model's every
# recognised norm, activation and attention input (compress_model(dx=...)) stored in int8 / int4.
DX_SETTINGS = {"int4-dx8": "int8", "int4-dx4": "int4"}
# presets.recommended's measured settings (every residual under one Pruning), peaks read back by
# presets.MEASURED: named as in the accuracy study.
PRESET_SETTINGS = {m.config: m.pruning for m in presets.MEASURED if m.config != "dense"}
SETTINGS += tuple(PRESET_SETTINGS)
# JAX's own remat choices, per block: the competition. "remat-offload" keeps the matmul outputs
# without batch dimensions on the host (pinned_host) instead of recomputing them.
REMAT_POLICIES = {
    "remat": None,
    "remat-dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "remat-dots-all": jax.checkpoint_policies.dots_saveable,
    "remat-offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


def _resmlp(setting: str):
    pruning = ({"topk": TOPK, "topk-all": TOPK, "topk-wide": TOPK_WIDE, "int4": INT4, "int4-rows": INT4_ROWS, "remat-int4": INT4,
                "int4-dx8": INT4, "int4-dx4": INT4, **TOKEN_ROWS, **FUSED}.get(setting) or PRESET_SETTINGS.get(setting))  # fmt: skip
    if setting in ("lean", "pool2") or setting.endswith(("-nolean", "-outdense")):
        return None  # ResMLP's own layers: nothing for lean neighbours to change, no attention; no convolutions
    remat = setting.startswith("remat")
    policy = bsr_jax.remat_policy() if setting == "remat-int4" else REMAT_POLICIES.get(setting)
    every_residual = setting in ("topk-all", "int4", "int4-rows", "remat-int4", "int4-dx8", "int4-dx4", *TOKEN_ROWS, *FUSED) or setting in PRESET_SETTINGS
    affine, layerscale = train_models.scale_shift_defs(pruning if every_residual else None)
    model = train_models.ResMLP(
        num_classes=10, patch_size=4, dense=train_models.dense_def(pruning), stem_dense=train_models.dense_def(),
        head_dense=train_models.dense_def(), affine=affine, layerscale=layerscale, remat=remat, remat_policy=policy,
        dx=DX_SETTINGS.get(setting), **train_models.PRESETS["s12"],
    )
    return model, (128, 32, 32, 3), 10, contextlib.nullcontext()


def _third_party(name: str, setting: str):
    if setting in ("pool2", "topk-all") or setting in PRESET_SETTINGS:
        return None  # no convolutions to pool
    if name == "vit-b16":
        c = tpm.Config(layers=12, width=768, mlp=3072, heads=12, batch=64, image=224, patch=16, classes=1000)
        model, shape, stand_in = tpm.vit(c), (c.batch, 224, 224, 3), "vit"
    else:  # lm1b-style LM, 12 x 768, T=2048, computing in bfloat16 as lm1b does
        c = tpm.Config(layers=12, width=768, mlp=3072, heads=12, batch=8, length=2048, vocab=32000)
        model, shape, stand_in = tpm.lm(c, dtype=jnp.bfloat16), (c.batch, c.length), "lm"
    rules = {"topk": [Rule("*", TOPK)], "topk-wide": [Rule("*", TOPK_WIDE)], "int4": [Rule("*", INT4)], "int4-rows": [Rule("*", INT4_ROWS)], "remat-int4": [Rule("*", INT4)],
             "lean": [Rule("*", None)], "int4-dx8": [Rule("*", INT4)], "int4-dx4": [Rule("*", INT4)],
             **{name: [Rule("*", pruning)] for name, pruning in (TOKEN_ROWS | FUSED).items()}}
    # "-nolean": the same storage with compress_model's lean neighbours off (attention keeps its probabilities).
    nolean = setting.endswith("-nolean")
    rules |= {f"{name}-nolean": rules[name] for name in ("int4", "int4-row", "int4-fused")}
    # "-outdense": the attention's output projection left exact, so the lean attention keeps its output
    # (which that layer then shares) instead of recomputing its backward without it (docs/RESULTS.md 14.7).
    rules |= {f"{name}-outdense": [Rule("*/out", None), *rules[name]] for name in ("int4", "int8-fused")}
    if setting in rules:
        model = bsr_jax.compress_model(model, rules[setting], dx=DX_SETTINGS.get(setting), lean=not nolean)
    context = contextlib.nullcontext()
    if setting.startswith("remat"):
        policy = bsr_jax.remat_policy() if setting == "remat-int4" else REMAT_POLICIES[setting]
        context = remat_blocks(stand_in, policy)
    return model, shape, c.vocab if name == "lm-12x768" else c.classes, context


def _resnet50(setting: str):
    # flax examples' ResNet-50 (train/resnet.py), ImageNet 224 px, B=64, BatchNorm in training mode.
    # Convolutions take the conv paper's compression where the setting names one; there are no
    # lean neighbours to add (BatchNorm and ReLU are already what XLA recomputes).
    compression = {"topk": TOPK, "int4": Pooling(factor=1, storage_dtype="int4"), "remat-int4": Pooling(factor=1, storage_dtype="int4"),
                   "pool2": Pooling(factor=2)}.get(setting)
    if setting in ("lean", "int4-rows", "topk-all", "topk-wide", *TOKEN_ROWS, *FUSED) or setting.endswith(("-nolean", "-outdense")) or setting in PRESET_SETTINGS or setting in DX_SETTINGS:
        return None  # ResMLP/transformer settings: convolutions quantize in Pooling's own blocks
    if setting in MICROBATCHES:
        return None  # BatchNorm's statistics would have to run through the micro-batches: not measured
    block = train_resnet.BottleneckResNetBlock
    if setting.startswith("remat"):
        policy = bsr_jax.remat_policy() if setting == "remat-int4" else REMAT_POLICIES[setting]
        block = nn.remat(block, policy=policy)
    rules = train_resnet.compression_rules(compression) if compression else None
    model = train_resnet.ResNet50(num_classes=1000, block_cls=block)
    if rules:
        model = bsr_jax.compress_model(model, rules)
    return model, (64, 224, 224, 3), 1000, contextlib.nullcontext()


# Gradient accumulation (exact): the dense step over k slices of the batch, one optimizer update.
MICROBATCHES = {"microbatch-2": 2, "microbatch-4": 4}
MODELS = {"resmlp-s12": _resmlp, "resnet50": _resnet50, "vit-b16": functools.partial(_third_party, "vit-b16"), "lm-12x768": functools.partial(_third_party, "lm-12x768")}


def step_args(model, shape, classes, microbatches: int = 1):
    """The adamw training step of ``model`` and its abstract arguments (variables, opt state, x, y).

    Only ``variables["params"]`` is trained; other collections (BatchNorm's ``batch_stats``) are
    updated by the forward pass and returned, as a training loop would. ``microbatches`` > 1: the
    gradient is accumulated over that many slices of the batch, one at a time
    (``bsr_jax.accumulated_value_and_grad``), before the one update; models without other
    collections only."""
    tokens = len(shape) == 2
    x = jax.ShapeDtypeStruct(shape, jnp.int32 if tokens else jnp.float32)
    y = jax.ShapeDtypeStruct(shape if tokens else shape[:1], jnp.int32)
    init_x = jnp.zeros((1,) + shape[1:], x.dtype)
    variables = jax.eval_shape(lambda: model.init({"params": jax.random.key(0), "pruning": jax.random.key(1)}, init_x))
    tx = optax.adamw(1e-3)
    opt = jax.eval_shape(tx.init, variables["params"])
    if microbatches > 1 and set(variables) != {"params"}:
        raise ValueError(f"microbatches={microbatches}: collections besides params ({sorted(set(variables) - {'params'})}) would have "
                         "to run through the slices; not measured")

    def step(variables, opt, x, y):
        params = variables["params"]
        stats = {k: v for k, v in variables.items() if k != "params"}

        def loss(params, x, y):
            logits, new_stats = model.apply({"params": params} | stats, x, rngs={"pruning": jax.random.key(2)}, mutable=list(stats))
            return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean(), new_stats

        if microbatches == 1:
            (value, new_stats), grads = jax.value_and_grad(loss, has_aux=True)(params, x, y)
        else:  # no collections besides params (checked above): nothing to carry between the slices
            value, grads = bsr_jax.accumulated_value_and_grad(lambda p, x, y: loss(p, x, y)[0], microbatches)(params, x, y)
            new_stats = stats
        updates, opt = tx.update(grads, opt, params)
        return {"params": optax.apply_updates(params, updates)} | new_stats, opt, value

    return step, (variables, opt, x, y)


def measure(name: str, setting: str, target: str, triton_gemm: bool | None = None) -> dict | None:
    built = MODELS[name](setting)
    if built is None:
        return None
    model, shape, classes, context = built
    with context:
        step, args = step_args(model, shape, classes, MICROBATCHES.get(setting, 1))
        r = bsr_jax.compiled_memory(step, *args, target=target, donate_argnums=(0, 1), breakdown=True, triton_gemm=triton_gemm)
    # Summed over the repeated blocks, so the table shows what each block keeps in all.
    live: dict[str, float] = {}
    for module, nbytes in r.by_module(depth=2).items():
        key = re.sub(r"(?<=[a-z_])\d+(?=/)", "*", module)
        live[key] = live.get(key, 0.0) + nbytes / MIB
    top = sorted(live.items(), key=lambda kv: -kv[1])[:5]
    kernels = [dict(op=k.op, us=k.seconds * 1e6, mib=k.bytes / MIB, gflop=k.flops / 1e9, count=k.count) for k in r.kernels[:10]]
    return dict(model=name, setting=setting, target=target, triton_gemm=r.triton_gemm, peak_mib=r.peak / MIB, temp_mib=r.temp / MIB,
                live_peak_mib=r.live_peak / MIB, flops=r.flops, optimal_seconds=r.optimal_seconds,
                modelled_seconds=r.modelled_seconds, roofline_seconds=r.roofline_seconds, live_at_peak_mib=dict(top),
                costliest_kernels=kernels)


def table(rows: list[dict]) -> str:
    dense = {(r["model"], r["target"]): r for r in rows if r["setting"] == "dense"}
    # "live": the most bytes live at once in the arrays' own sizes; the peak adds tile padding and
    # the heap's packing. "modelled": XLA:TPU's optimal_seconds on TPU, the roofline on H100; the
    # roofline column is the same roofline on both targets (on TPU: the check of the method).
    lines = ["| model | target | setting | peak MiB | live MiB | peak vs dense | modelled ms | time vs dense | roofline vs dense | "
             "FLOPs vs dense | largest live at peak (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = dense.get((r["model"], r["target"]))
        ratio = lambda k: f"{r[k] / d[k]:.2f}" if d and r.get(k) and d.get(k) else "-"  # noqa: E731
        live = ", ".join(f"{k} {v:.0f}" for k, v in list(r["live_at_peak_mib"].items())[:3])
        live_peak = f"{r['live_peak_mib']:.0f}" if r.get("live_peak_mib") else "-"
        modelled = f"{r['modelled_seconds'] * 1e3:.2f}" if r.get("modelled_seconds") else "-"
        lines.append(f"| {r['model']} | {r['target']} | {r['setting']} | {r['peak_mib']:.0f} | {live_peak} | {ratio('peak_mib')} | "
                     f"{modelled} | {ratio('modelled_seconds')} | {ratio('roofline_seconds')} | {ratio('flops')} | {live} |")
    return "\n".join(lines)


def plane_table(rows: list[dict]) -> str:
    """Peak and modelled time as ratios to dense, both targets side by side, one line per model and
    setting; on TPU the roofline's own ratio and its agreement with XLA's model (roofline seconds /
    XLA:TPU's seconds) beside."""
    by = {(r["model"], r["target"], r["setting"]): r for r in rows if r.get("modelled_seconds") or r.get("roofline_seconds")}
    ratio = lambda r, d, key: f"{r[key] / d[key]:.2f}" if r and d and r.get(key) and d.get(key) else "-"  # noqa: E731
    lines = ["| model | setting | H100 peak | H100 time | TPU v5p peak | TPU v5p time | TPU roofline time | roofline / XLA:TPU |",
             "|---|---|---|---|---|---|---|---|"]
    order = lambda ms: (list(MODELS).index(ms[0]), SETTINGS.index(ms[1]))  # noqa: E731
    for model, setting in sorted(dict.fromkeys((m, s) for m, _, s in by), key=order):
        cells = []
        for target in DEVICELESS_TARGETS:
            r, d = by.get((model, target, setting)), by.get((model, target, "dense"))
            cells += [ratio(r, d, "peak_mib"), ratio(r, d, "modelled_seconds")]
        r, d = by.get((model, "tpu-v5p", setting)), by.get((model, "tpu-v5p", "dense"))
        known = r and r.get("modelled_seconds") and r.get("roofline_seconds")
        agreement = f"{r['roofline_seconds'] / r['modelled_seconds']:.2f}" if known else "-"
        cells += [ratio(r, d, "roofline_seconds"), agreement]
        lines.append(f"| {model} | {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--targets", nargs="+", choices=DEVICELESS_TARGETS, default=list(DEVICELESS_TARGETS))
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    # One instrument per JSON: rows are skipped and replaced by (model, setting, target), and the
    # plane divides each row by the dense row of its file.
    parser.add_argument("--triton-gemm", choices=("auto", "on", "off"), default="off",
                        help="H100 GEMMs: cuBLAS (off, the default: the instrument of RESULTS 10-13 and of --out's default), "
                             "Triton fusions where XLA tiles them deviceless (auto) or always (on)")
    parser.add_argument("--out", help="default: benchmarks/results/compiled_memory.json (off), compiled_memory-triton.json (auto, on)")
    parser.add_argument("--table-only", action="store_true", help="print the table of --out and exit")
    parser.add_argument("--remeasure", action="store_true", help="measure the chosen rows again even where --out has them")
    args = parser.parse_args(argv)
    args.out = args.out or f"benchmarks/results/compiled_memory{'' if args.triton_gemm == 'off' else '-triton'}.json"
    saved = json.load(open(args.out)) if os.path.exists(args.out) else {"runs": []}
    if not args.table_only:
        meta = run_metadata()
        # Rows measured before the modelled time existed are measured again and replaced.
        done = set() if args.remeasure else {(r["model"], r["setting"], r["target"]) for r in saved["runs"] if "modelled_seconds" in r}
        for name in args.models:
            for target in args.targets:
                for setting in args.settings:
                    if (name, setting, target) in done:
                        continue
                    print(f"{name} {target} {setting} ...", file=sys.stderr, flush=True)
                    row = measure(name, setting, target, {"auto": None, "on": True, "off": False}[args.triton_gemm])
                    if row is None:
                        continue
                    row["meta"] = {k: meta[k] for k in ("commit", "date", "machine", "cpu", "jax")}
                    key = (name, setting, target)
                    saved["runs"] = [r for r in saved["runs"] if (r["model"], r["setting"], r["target"]) != key] + [row]
                    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                    with open(args.out, "w") as f:
                        json.dump(saved, f, indent=1)
        print(footer(meta))
    print(table(saved["runs"]))
    print()
    print(plane_table(saved["runs"]))


if __name__ == "__main__":
    main()
