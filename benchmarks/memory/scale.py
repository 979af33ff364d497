"""train.lm's step at the scale where memory runs out: the 1b and 8b presets on 8 devices of a
deviceless target (8 H100s of one host, a TPU v5p 2x2x2 slice), per-device batch 1 or 2, compiled
with ``train.lm_deviceless.sharded_step`` and measured by ``bsr_jax.compiled_memory``: per-device
peak and the roofline's modelled time of the per-device program, collectives counted (XLA:TPU's own
model times none of these 8-device programs).

Settings: ``replicated`` (data parallel, the whole state on every device), ``fsdp`` (``--fsdp``:
parameters, gradients and AdamW moments sharded; with ``--scan`` gathered layer by layer, as each
layer runs and again for its backward), ``fsdp-remat`` (and ``nn.remat`` per layer), ``fsdp-int4`` /
``fsdp-int8`` (and every residual in that format), ``fsdp-int4-remat``, and ``fsdp-<policy>`` for
JAX's and MaxText's policies per layer (``--remat --remat-policy <policy>``). Every row: ``--scan``
(one traced layer), bf16 compute, f32 master weights, ``--attention flash``
(cuDNN's flash attention on H100 where the cuDNN library is installed, ``pip install
nvidia-cudnn-cu12``, without it XLA's attention, which holds the scores; Pallas splash attention on
TPU v5p since 2026-11-28, XLA's attention in rows measured before: said per row).
Rows are appended to the JSON as they finish; rows already there are skipped (resumable).

``--plan-budgets 0.5 0.7`` (fractions of the device's memory, ``HBM_GIB``) adds ``bsr_jax.plan``'s
choice for each budget, per device, over the same 8 devices (``train.lm_deviceless.plan_inputs``:
the dense model, its parameters FSDP-sharded), every exact option and MaxText's named policies, the
chunked loss; each row with what the search compiled (its own dense and remat per layer among them)
and how long it took. ``--plan-step shard_map`` (the default) plans the loop's own step (its FSDP
gradient through ``plan(value_and_grad=...)``: rows ``plan <fraction>``), ``jit`` the model
``jax.jit``-ed over the sharded arrays, which XLA's SPMD partitioner splits (rows ``plan-jit``).

    python -m benchmarks.memory.scale --models 1b --targets h100 --batch 1
    python -m benchmarks.memory.scale --models 8b --targets h100 --plan-budgets 0.5 0.7 --settings
    python -m benchmarks.memory.scale --table-only

Writes docs/RESULTS.md sections 15.1 and 15.2 (JSON: benchmarks/results/scale-layerwise.json; section 15's
rows, gathered whole and with XLA's attention, are in benchmarks/results/scale.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import bsr_jax  # noqa: E402
from benchmarks.run_info import footer, run_metadata  # noqa: E402
from train import lm_deviceless  # noqa: E402
from bsr_jax.planning.candidates import over_device_memory  # noqa: E402
from train.lm_config import LMConfig  # noqa: E402

GIB = 2**30
DEVICES = 8
SETTINGS = {
    "replicated": {},
    "fsdp": {"fsdp": True},
    "fsdp-remat": {"fsdp": True, "remat": True},
    "fsdp-int4": {"fsdp": True, "storage_dtype": "int4"},
    "fsdp-int4-remat": {"fsdp": True, "storage_dtype": "int4", "remat": True},
    "fsdp-int8": {"fsdp": True, "storage_dtype": "int8"},
    # compress_model without its lean pass (whose per-module checkpoints keep the gathered kernels)
    "fsdp-int4-not-lean": {"fsdp": True, "storage_dtype": "int4", "lean": False},
    "fsdp-int4-not-lean-remat-dots": {"fsdp": True, "storage_dtype": "int4", "lean": False, "remat": True, "remat_policy": "remat-dots"},
    # JAX's and MaxText's policies per layer (train.lm --remat-policy: bsr_jax.plan's options of those names)
    **{f"fsdp-{policy}": {"fsdp": True, "remat": True, "remat_policy": policy}
       for policy in ("remat-dots", "remat-dots-attention", "remat-minimal", "remat-save-qkv", "remat-save-dots-except-mlp", "remat-offload-qkv")},
}
TARGETS = ("h100", "tpu-v5p")
ATTENTION = {"h100": "cuDNN flash", "tpu-v5p": "Pallas splash"}  # --attention flash by target (T 8192: splash's shapes)
HBM_GIB = {"h100": 80.0, "tpu-v5p": 95.0}  # memory per device: an H100 SXM's 80 GiB, a TPU v5p chip's 95 GiB


def lm_config(model: str, batch: int, seq_len: int, **overrides) -> LMConfig:
    """Every row's train.lm config: ``--scan``, bf16, ``--attention flash``, ``batch`` sequences per device."""
    return LMConfig(model=model, seq_len=seq_len, batch_size=batch * DEVICES, dtype="bfloat16", scan=True, attention="flash",
                    vocab_size={"1b": 32768, "8b": 128256}[model], **overrides)  # fmt: skip


def measure(model: str, target: str, setting: str, batch: int, seq_len: int) -> dict:
    config = lm_config(model, batch, seq_len, **SETTINGS[setting])
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, state, tokens = lm_deviceless.sharded_step(config, target, DEVICES)
        r = bsr_jax.compiled_memory(step, state, tokens, target=target, devices=DEVICES)
    fallback = any("attention" in str(w.message) for w in caught)
    return dict(model=model, target=target, setting=setting, batch_per_device=batch, seq_len=seq_len, peak_gib=r.peak / GIB,
                roofline_ms=r.roofline_seconds * 1e3, xla_tpu_ms=r.optimal_seconds and r.optimal_seconds * 1e3,
                attention="XLA (holds the scores)" if fallback else ATTENTION[target],
                compile_s=time.perf_counter() - started)  # fmt: skip


PLAN_OPTIONS = ("keep", "lean", "remat", "remat-dots", "remat-dots-all", "remat-dots-attention", "remat-minimal", "remat-save-qkv",
                "remat-save-dots-except-mlp")  # fmt: skip
LOSS_CHUNK = 2048  # plan(loss_chunk=): the head and loss 2048 tokens at a time where that is faster or needed


PLAN_STEPS = {"shard_map": "plan", "jit": "plan-jit"}  # --plan-step -> the rows' setting prefix


def plan_row(model: str, target: str, fraction: float, batch: int, seq_len: int, cache: dict, step: str = "shard_map") -> dict:
    """``bsr_jax.plan`` of the model's FSDP step (``step``: ``PLAN_STEPS``) within ``fraction`` of the device's memory."""
    config = lm_config(model, batch, seq_len, fsdp=True)
    lm, loss_fn, tokens, variables, tx = lm_deviceless.plan_inputs(config, DEVICES)
    started, cached = time.perf_counter(), len(cache)
    plan = bsr_jax.plan(lm, loss_fn, tokens, variables=variables, optimizer=tx, budget=f"{fraction * HBM_GIB[target]}GiB", target=target,
                        options=PLAN_OPTIONS, loss_chunk=LOSS_CHUNK, cache=cache,
                        value_and_grad=lm_deviceless.fsdp_value_and_grad(config) if step == "shard_map" else None)  # fmt: skip
    return dict(model=model, target=target, setting=f"{PLAN_STEPS[step]} {fraction}", batch_per_device=batch, seq_len=seq_len, peak_gib=plan.peak / GIB,
                roofline_ms=plan.compiled.roofline_seconds * 1e3, modelled_ms=plan.modelled_seconds * 1e3, chosen=plan.label, search_s=time.perf_counter() - started, compiles=len(cache) - cached,
                tried=[dict(label=m.label, peak_gib=m.peak / GIB, modelled_ms=m.seconds * 1e3) for m in plan.tried],
                attention=ATTENTION[target])  # fmt: skip


def plans(rows: list[dict]) -> str:
    """The plan rows beside the search's own dense and remat per layer (the same step) and the
    fastest ``shard_map`` setting above that fits the device. Times are the planner's
    (``CompiledStep.modelled_seconds``: the roofline on H100; on TPU v5p XLA's model where it times
    the step, else the roofline scaled as it timed the first), the settings' the roofline's."""
    lines = ["| model | target | batch/device | step planned | budget | chosen | peak GiB | modelled ms (planner's) | its dense | its remat per layer | vs its remat | "
             "fastest shard_map setting within the device | search s (compiles) |", "|---|---|---:|---|---|---|---:|---:|---|---|---:|---|---:|"]  # fmt: skip
    for r in (r for r in rows if "chosen" in r):
        tried = {t["label"]: t for t in r["tried"]}
        dense, remat = tried.get("1xkeep, rest keep"), tried.get("1xremat, rest keep")
        fits = [o for o in rows if "chosen" not in o and (o["model"], o["target"], o["batch_per_device"]) == (r["model"], r["target"], r["batch_per_device"])
                and o["peak_gib"] <= HBM_GIB[r["target"]]]  # fmt: skip
        best = min(fits, key=lambda o: o["roofline_ms"], default=None)
        cell = lambda t: (f"{t['peak_gib']:.1f} GiB, {t['modelled_ms']:.0f} ms" if math.isfinite(t["modelled_ms"]) else  # noqa: E731
                          f"over the device (XLA needs {t['peak_gib']:.0f} GiB)") if t else ""  # fmt: skip
        modelled = tried[r["chosen"]]["modelled_ms"]
        versus = f"{modelled / remat['modelled_ms']:.3f}x" if remat else ""
        shard_map = f"{best['setting']}: {best['peak_gib']:.1f} GiB, {best['roofline_ms']:.0f} ms" if best else "none measured"
        lines.append(f"| {r['model']} | {r['target']} | {r['batch_per_device']} | {r['setting'].split()[0]} | {r['setting'].split()[1]} x {HBM_GIB[r['target']]:.0f} GiB | "
                     f"{r['chosen']} | {r['peak_gib']:.1f} | {modelled:.0f} | {cell(dense)} | {cell(remat)} | {versus} | {shard_map} | "
                     f"{r['search_s']:.0f} ({r['compiles']}) |")  # fmt: skip
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| model | target | batch/device | setting | peak GiB/device | modelled ms (roofline) | vs fastest that fits the device | attention |",
             "|---|---|---:|---|---:|---:|---:|---|"]  # fmt: skip
    settings = [r for r in rows if "chosen" not in r]
    for r in settings:
        if r.get("refused"):
            lines.append(f"| {r['model']} | {r['target']} | {r['batch_per_device']} | {r['setting']} | refused by XLA: needs at least "
                         f"{r['peak_gib']:.1f} | | over the device | |")  # fmt: skip
            continue
        fits = [o["roofline_ms"] for o in settings if not o.get("refused") and o["peak_gib"] <= HBM_GIB[o["target"]]
                and (o["model"], o["target"], o["batch_per_device"]) == (r["model"], r["target"], r["batch_per_device"])]  # fmt: skip
        ratio = f"{r['roofline_ms'] / min(fits):.2f}x" if fits else "nothing fits"
        lines.append(f"| {r['model']} | {r['target']} | {r['batch_per_device']} | {r['setting']} | {r['peak_gib']:.1f} | {r['roofline_ms']:.0f} | "
                     f"{ratio} | {r['attention']} |")  # fmt: skip
    return "\n".join(lines)


def within_budgets(rows: list[dict], fractions: tuple[float, ...] = (0.5, 0.7)) -> str:
    """The fastest measured setting whose peak fits each budget (a fraction of the device's memory,
    ``HBM_GIB``), beside remat per layer: a choice among whole-model settings, not ``bsr_jax.plan``
    (which does not plan over a mesh yet)."""
    lines = ["| model | target | budget | fastest setting within it | peak GiB | modelled ms | vs fsdp-remat |", "|---|---|---|---|---:|---:|---:|"]
    settings = [r for r in rows if "chosen" not in r]
    for key in dict.fromkeys((r["model"], r["target"], r["batch_per_device"]) for r in settings):
        group = [r for r in settings if (r["model"], r["target"], r["batch_per_device"]) == key]
        remat = next((r["roofline_ms"] for r in group if r["setting"] == "fsdp-remat"), None)
        hbm_gib = HBM_GIB[key[1]]
        for fraction in fractions:
            fits = [r for r in group if r["peak_gib"] <= fraction * hbm_gib]
            if not fits:
                lines.append(f"| {key[0]} | {key[1]} | {fraction:.1f} x {hbm_gib:.0f} GiB | nothing fits | | | |")
                continue
            best = min(fits, key=lambda r: r["roofline_ms"])
            ratio = f"{best['roofline_ms'] / remat:.3f}x" if remat else ""
            lines.append(f"| {key[0]} | {key[1]} | {fraction:.1f} x {hbm_gib:.0f} GiB | {best['setting']} | {best['peak_gib']:.1f} | "
                         f"{best['roofline_ms']:.0f} | {ratio} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=("1b", "8b"), default=["1b", "8b"])
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    parser.add_argument("--settings", nargs="*", choices=list(SETTINGS), default=list(SETTINGS), help="none: only the plans")
    parser.add_argument("--plan-budgets", nargs="*", type=float, default=[], help="bsr_jax.plan within these fractions of the device's memory")
    parser.add_argument("--plan-step", choices=list(PLAN_STEPS), default="shard_map", help="the step planned: train.lm's own, or jax.jit's")
    parser.add_argument("--batch", type=int, choices=(1, 2), default=1, help="sequences per device")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--out", default="benchmarks/results/scale-layerwise.json")
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            rows = json.load(f)
    if not args.table_only:
        done = {(r["model"], r["target"], r["setting"], r["batch_per_device"], r["seq_len"]) for r in rows}
        for model in args.models:
            for target in args.targets:
                for setting in args.settings:
                    if (model, target, setting, args.batch, args.seq_len) in done:
                        continue
                    print(f"[scale] {model} {target} {setting} batch {args.batch}/device T {args.seq_len} ...", file=sys.stderr, flush=True)
                    try:
                        row = measure(model, target, setting, args.batch, args.seq_len)
                    except Exception as error:  # XLA raises its own runtime error type
                        needs = over_device_memory(error)
                        if needs is None:
                            raise
                        row = dict(model=model, target=target, setting=setting, batch_per_device=args.batch, seq_len=args.seq_len,
                                   peak_gib=needs / GIB, roofline_ms=None, refused=True)  # fmt: skip
                    rows.append(row | {"run": run_metadata()})
                    print(f"[scale]   {row['peak_gib']:.1f} GiB, " + (f"{row['roofline_ms']:.0f} ms, compiled in {row['compile_s']:.0f} s"
                          if not row.get("refused") else "refused by XLA: more than the device holds"), file=sys.stderr, flush=True)  # fmt: skip
                    with open(args.out, "w") as f:
                        json.dump(rows, f, indent=1)
                cache: dict = {}  # the budgets' searches share their compiles
                for fraction in args.plan_budgets:
                    if (model, target, f"{PLAN_STEPS[args.plan_step]} {fraction}", args.batch, args.seq_len) in done:
                        continue
                    print(f"[scale] {model} {target} plan within {fraction} of {HBM_GIB[target]:.0f} GiB batch {args.batch}/device ...",
                          file=sys.stderr, flush=True)  # fmt: skip
                    rows.append(plan_row(model, target, fraction, args.batch, args.seq_len, cache, args.plan_step) | {"run": run_metadata()})
                    print(f"[scale]   {rows[-1]['chosen']}: {rows[-1]['peak_gib']:.1f} GiB, {rows[-1]['roofline_ms']:.0f} ms, "
                          f"searched in {rows[-1]['search_s']:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
                    with open(args.out, "w") as f:
                        json.dump(rows, f, indent=1)
    print(table(rows))
    print()
    print(plans(rows))
    print()
    print(within_budgets(rows))
    print(footer(run_metadata()))


if __name__ == "__main__":
    main()
