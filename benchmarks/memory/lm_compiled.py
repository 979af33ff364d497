"""Compiled peak and modelled time of ``train.lm``'s training step for the ``gpt2-small`` and ``1b``
presets on H100 and TPU v5p, compiled deviceless (issue 34's compiled table).

Each row is one preset, target and setting: ``train.lm``'s own model, loss (``train.lm_loop.loss_function``:
with ``--loss-chunk`` the chunked head + cross-entropy) and optimizer (AdamW with clipping and
the warmup-cosine schedule, ``create_optimizer``), the whole step (loss, grad, update; params and
optimizer state donated) compiled by XLA for ``target`` on this machine with
``bsr_jax.compiled_memory(..., breakdown=True)``: its peak, modelled step time (the roofline on
H100, XLA:TPU's own model on TPU), FLOPs, the ten largest buffers live at the peak and whether a
logits-sized one is among them. Rows are written to the JSON as they finish; rows already there
are skipped, so an interrupted run resumes.

    python -m benchmarks.memory.lm_compiled --targets h100              # seconds to a minute per row
    nice -n 10 python -m benchmarks.memory.lm_compiled --targets tpu-v5p # minutes per row; one process (libtpu)
    python -m benchmarks.memory.lm_compiled --table-only

Shapes: bf16 compute, f32 parameters and optimizer state, T=2048 (``--seq-len``), vocabulary
32768 (the presets'); B=8 windows for both presets (gpt2-small's documented batch,
docs/RESULTS.md section 11; the 1b preset documents none, the same B=8 is used: 16384 tokens
per step). Layers as a Python loop (the trainer's default).

Settings: ``dense``; ``int8`` / ``int4`` (every linear layer's weight-gradient residual in int8 /
int4 16 x 16 blocks at sparsity 0; int4 is the recommended setting); ``topk`` (s0.7 / 16);
``int4-dx8`` (int4 with ``--dx int8``); ``remat`` (``--remat``: ``nn.remat`` per layer, nothing
saved inside); ``remat-dots`` (``nn.remat`` per layer with
``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``). A ``+chunk`` suffix adds
``--loss-chunk 1024``. The head stays dense unless chunked (the trainer's rule).

Writes docs/RESULTS.md section 11.2.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
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
from bsr_jax.measure.compiled import DEVICELESS_TARGETS  # noqa: E402
from benchmarks.run_info import footer, run_metadata  # noqa: E402
from train import lm_model  # noqa: E402
from train.lm_config import LMConfig  # noqa: E402
from train.lm_loop import create_model, create_optimizer, learning_rate_schedule, loss_function, model_shape  # noqa: E402

MIB = 2**20
MODELS = ("gpt2-small", "1b")
BATCH = {"gpt2-small": 8, "1b": 8}
CHUNK = 1024
BASE = {
    "dense": {},
    "int8": dict(storage_dtype="int8", block=16),
    "int4": dict(storage_dtype="int4", block=16),
    "topk": dict(sparsity=0.7, block=16),
    "int4-dx8": dict(storage_dtype="int4", block=16, dx="int8"),
    "remat": dict(remat=True),
    "remat-dots": {},  # the trainer's model with its layer class swapped for nn.remat(Layer, policy=...)
}
# Measured in this order (the goals first): every setting, then its chunked-loss row.
SETTINGS = ("dense", "int4", "dense+chunk", "int4+chunk", "int8", "topk", "int4-dx8", "remat", "remat-dots",
            "int8+chunk", "topk+chunk", "int4-dx8+chunk", "remat+chunk", "remat-dots+chunk", "dense-nolimit")  # fmt: skip
# XLA:GPU rematerialises a step whose peak exceeds its memory limit for the device (about 0.77 of
# the H100's 80 GiB; it warns only when it cannot get below it): the 1b dense step at B=8 needs
# more and is compiled to recompute. "-nolimit" lifts the limit (xla_gpu_memory_limit_slop_factor
# 1000%, H100 only): what the step itself needs.
NO_LIMIT = {"xla_gpu_memory_limit_slop_factor": 1000}


def config_of(model: str, setting: str, seq_len: int, batch: int | None = None) -> LMConfig:
    base, _, chunk = setting.removesuffix("-nolimit").partition("+")
    return LMConfig(model=model, seq_len=seq_len, batch_size=batch or BATCH[model], dtype="bfloat16", loss_chunk=CHUNK if chunk else 0,
                    **BASE[base])  # fmt: skip


@contextlib.contextmanager
def layer_policy(setting: str):
    """``remat-dots``: ``train.lm_model.Layer`` (which ``LM`` calls by its module-level name) is
    ``nn.remat(Layer, policy=dots_with_no_batch_dims_saveable)`` for the duration."""
    if not setting.startswith("remat-dots"):
        yield
        return
    original = lm_model.Layer
    lm_model.Layer = nn.remat(original, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    try:
        yield
    finally:
        lm_model.Layer = original


@contextlib.contextmanager
def no_memory_limit(lifted: bool):
    """XLA:GPU compiled without its device memory limit (``NO_LIMIT``) for the duration, when ``lifted``."""
    from bsr_jax.measure import compiled

    original = compiled._GPU_OPTIONS
    if lifted:
        compiled._GPU_OPTIONS = {**original, **NO_LIMIT}
    try:
        yield
    finally:
        compiled._GPU_OPTIONS = original


def step_args(config: LMConfig, model: nn.Module | None = None):
    """``train.lm``'s step without its data-parallel wrapper: ``(params, opt_state, tokens) ->
    (params, opt_state, loss)`` and its abstract arguments; ``model``: the config's unless given."""
    shape = model_shape(config)
    model = model or create_model(config, shape)
    loss_fn = loss_function(model, config)
    tx = create_optimizer(config, learning_rate_schedule(config))
    init_tokens = jnp.zeros((1, shape.seq_len), jnp.int32)
    params = jax.eval_shape(lambda: create_model(config, shape, compressed=False).init(jax.random.key(0), init_tokens)["params"])
    opt = jax.eval_shape(tx.init, params)
    tokens = jax.ShapeDtypeStruct((config.batch_size, shape.seq_len + 1), jnp.int32)

    def step(params, opt, tokens):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, {"tokens": tokens}, None)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    return step, (params, opt, tokens), shape


# Ops of the head and the plain loss: the head's matmul, the logits' cast to f32 at the LM's top
# level, log-softmax / logsumexp, the label gather (its gradient is take_along_axis' scatter-add).
HEAD_OPS = re.compile(r"head/|take_along_axis|softmax|logsumexp|cross_entropy|[/(]LM(\.apply)?\)*/convert_element_type")


def logits_sized(top: list[dict], logits_f32_bytes: float) -> list[str]:
    """The ops among ``top`` (``{"op", "mib"}``) holding a logits-sized buffer: at least the
    (B, T, V) array in bf16 (half the f32 logits), produced by the head or the loss (``HEAD_OPS``).
    A size alone is not enough: one layer's f32 attention probabilities, or bsr_jax.ops.dx's stored
    codes of all layers summed under one op name, can be as large."""
    return [b["op"] for b in top if b["mib"] * MIB >= logits_f32_bytes / 2 and HEAD_OPS.search(b["op"])]


def measure(model: str, setting: str, target: str, seq_len: int, batch: int | None = None) -> dict:
    config = config_of(model, setting, seq_len, batch)
    lifted = setting.endswith("-nolimit")
    if lifted and target != "h100":
        raise SystemExit(f"{setting}: the memory limit is lifted for h100 only")
    with layer_policy(setting), no_memory_limit(lifted):
        step, args, shape = step_args(config)
        # cuBLAS GEMMs: the instrument of lm_compiled.json's rows (RESULTS 11.2), which new rows join.
        r = bsr_jax.compiled_memory(step, *args, target=target, donate_argnums=(0, 1), breakdown=True, triton_gemm=False)
    logits_f32 = config.batch_size * shape.seq_len * shape.vocab_size * 4
    top = [{"op": b.op, "mib": b.bytes / MIB} for b in r.live_at_peak[:10]]
    logits_in_top = logits_sized(top, logits_f32)
    return dict(model=model, setting=setting, target=target, batch=config.batch_size, seq_len=shape.seq_len,
                vocab=shape.vocab_size, num_params=lm_model.num_params(shape), config=config.to_json(),
                peak_mib=r.peak / MIB, temp_mib=r.temp / MIB, arguments_mib=r.arguments / MIB,
                live_peak_mib=(r.live_peak or 0) / MIB, flops=r.flops, modelled_seconds=r.modelled_seconds,
                roofline_seconds=r.roofline_seconds, optimal_seconds=r.optimal_seconds, logits_f32_mib=logits_f32 / MIB,
                top10_at_peak=top, logits_in_top10=bool(logits_in_top), logits_sized_ops=logits_in_top, by_module=dict(list(r.by_module(depth=2).items())[:8]))  # fmt: skip


def table(rows: list[dict]) -> str:
    dense = {(r["model"], r["target"], r["batch"]): r for r in rows if r["setting"] == "dense"}
    unlimited = {(r["model"], r["target"], r["batch"]): r for r in rows if r["setting"] == "dense-nolimit"}
    lines = ["| model | target | setting | peak MiB | peak vs dense | modelled ms | time vs dense | vs dense without XLA's memory limit: "
             "peak, time | logits-sized buffer in top 10 at peak |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    order = lambda r: (MODELS.index(r["model"]), r["batch"], DEVICELESS_TARGETS.index(r["target"]), SETTINGS.index(r["setting"]))  # noqa: E731
    for r in sorted(rows, key=order):
        d = dense.get((r["model"], r["target"], r["batch"]))
        u = unlimited.get((r["model"], r["target"], r["batch"]))
        ratio = lambda k, d=d: f"{r[k] / d[k]:.2f}x" if d and r.get(k) and d.get(k) else "-"  # noqa: E731
        ms = f"{r['modelled_seconds'] * 1e3:.1f}" if r.get("modelled_seconds") else "-"
        biggest = r["top10_at_peak"][0] if r["top10_at_peak"] else None
        logits = "yes" if logits_sized(r["top10_at_peak"], r["logits_f32_mib"] * MIB) else "no"
        if biggest:
            logits += f" (largest: {biggest['mib']:.0f} MiB)"
        lines.append(f"| {r['model']} B={r['batch']} | {r['target']} | {r['setting']} | {r['peak_mib']:.0f} | {ratio('peak_mib')} | "
                     f"{ms} | {ratio('modelled_seconds')} | {ratio('peak_mib', u)}, {ratio('modelled_seconds', u)} | {logits} |")  # fmt: skip
    return "\n".join(lines)


def pivot(rows: list[dict]) -> str:
    """docs/RESULTS.md's form: one table per model and batch, a row per setting, H100 and TPU v5p side
    by side: peak MiB (x dense), modelled ms (x dense), logits-sized buffer among the ten largest."""
    by = {(r["model"], r["batch"], r["target"], r["setting"]): r for r in rows}
    out = []
    for model, batch in sorted({(r["model"], r["batch"]) for r in rows}, key=lambda mb: (MODELS.index(mb[0]), mb[1])):
        lines = [f"{model}, B={batch}, T={next(r['seq_len'] for r in rows if r['model'] == model)}:", "",
                 "| setting | H100 peak MiB | H100 modelled ms | TPU v5p peak MiB | TPU v5p modelled ms | logits in top 10 (H100 / TPU) |",
                 "|---|---|---|---|---|---|"]  # fmt: skip
        for setting in SETTINGS:
            cells, logits = [], []
            for target in DEVICELESS_TARGETS:
                r, d = by.get((model, batch, target, setting)), by.get((model, batch, target, "dense"))
                if r is None:
                    cells += ["", ""]
                    logits.append("")
                    continue
                x = lambda k: f" ({r[k] / d[k]:.2f}x)" if d and r.get(k) and d.get(k) else ""  # noqa: E731
                cells += [f"{r['peak_mib']:.0f}{x('peak_mib')}", f"{r['modelled_seconds'] * 1e3:.1f}{x('modelled_seconds')}" if r.get("modelled_seconds") else "-"]
                logits.append("yes" if logits_sized(r["top10_at_peak"], r["logits_f32_mib"] * MIB) else "no")
            if any(cells):
                lines.append(f"| {setting} | " + " | ".join(c or "-" for c in cells) + f" | {' / '.join(l or '-' for l in logits)} |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--targets", nargs="+", choices=DEVICELESS_TARGETS, default=list(DEVICELESS_TARGETS))
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--seq-len", type=int, default=2048, help="T (default: %(default)s)")
    parser.add_argument("--batch", type=int, help="B for every model (default: BATCH, 8 for both presets)")
    parser.add_argument("--out", default="benchmarks/results/lm_compiled.json")
    parser.add_argument("--table-only", action="store_true", help="print the table of --out and exit")
    parser.add_argument("--markdown", action="store_true", help="print docs/RESULTS.md's form (settings by target) instead")
    parser.add_argument("--remeasure", action="store_true", help="measure the chosen rows again even where --out has them")
    args = parser.parse_args(argv)
    saved = json.load(open(args.out)) if os.path.exists(args.out) else {"runs": []}
    if not args.table_only:
        meta = run_metadata()
        key = lambda r: (r["model"], r["setting"], r["target"], r["seq_len"], r["batch"])  # noqa: E731
        done = set() if args.remeasure else {key(r) for r in saved["runs"]}
        for target in args.targets:
            for setting in args.settings:
                for model in args.models:
                    if (model, setting, target, args.seq_len, args.batch or BATCH[model]) in done:
                        continue
                    if setting.endswith("-nolimit") and target != "h100":
                        continue  # the lifted limit is XLA:GPU's option
                    print(f"[lm_compiled] {model} B={args.batch or BATCH[model]} {target} {setting} ...", file=sys.stderr, flush=True)
                    row = measure(model, setting, target, args.seq_len, args.batch)
                    row["meta"] = {k: meta[k] for k in ("commit", "date", "machine", "cpu", "jax")}
                    saved["runs"] = [r for r in saved["runs"] if key(r) != key(row)] + [row]
                    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                    with open(args.out + ".tmp", "w") as f:
                        json.dump(saved, f, indent=1)
                    os.replace(args.out + ".tmp", args.out)
                    print(f"[lm_compiled]   peak {row['peak_mib']:.0f} MiB, modelled {(row['modelled_seconds'] or 0) * 1e3:.1f} ms, "
                          f"logits in top 10: {row['logits_in_top10']}", file=sys.stderr, flush=True)  # fmt: skip
        print(footer(meta))
    print(pivot(merged(args.out)) if args.markdown else table(merged(args.out)))


def merged(out: str) -> list[dict]:
    """The rows of ``out`` and of its siblings ``OUT-*.json`` (written by other processes: one
    process per file, as each rewrites its whole file)."""
    rows: dict[tuple, dict] = {}
    for path in [out, *sorted(glob.glob(out.removesuffix(".json") + "-*.json"))]:
        if os.path.exists(path):
            for r in json.load(open(path))["runs"]:
                rows[(r["model"], r["setting"], r["target"], r["seq_len"], r["batch"])] = r
    return list(rows.values())


if __name__ == "__main__":
    main()
