"""train.lm's gpt2-small step with cuDNN flash attention on H100: what int4 storage of every linear
layer's weight-gradient residual costs through the fused backend, beside the unfused formats,
dense and remat, with and without the chunked loss and compress_model's lean neighbours.

Settings: ``dense``; ``remat`` (``--remat``); ``int4`` (16 x 16 blocks, the trainer's default
block); ``int4-rows`` (1 x 128 blocks, the format the fused kernels write, computed by XLA);
``int4-fused`` (1 x 128 through ``backend="fused"``: the forward GEMM writes the codes, dW's reads
them). ``-nolean`` drops compress_model's lean neighbours (flash attention keeps only its inputs,
output and log-sum-exp already); ``+chunk`` adds ``--loss-chunk 1024``. The model and rules are
``train.lm_loop.create_model``'s with the 1 x 128 block where named (train.lm's ``--block`` is square).
T 2048, B 8, bf16, deviceless H100 with Triton GEMMs where XLA tiles them.

    python -m benchmarks.memory.fused_lm          # ~20 s a row; resumes from the JSON
    python -m benchmarks.memory.fused_lm --live int4-fused-nolean+chunk   # what is live at its peak

Writes docs/RESULTS.md section 14.2 (JSON: benchmarks/results/fused_lm.json).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import bsr_jax  # noqa: E402
from benchmarks.memory.lm_compiled import step_args  # noqa: E402
from benchmarks.run_info import footer, run_metadata  # noqa: E402
from train.lm_config import LMConfig  # noqa: E402
from train.lm_loop import compression_rules, create_model, model_shape  # noqa: E402

MIB = 2**20
SETTINGS = ("dense", "remat", "int4", "int4-rows", "int4-fused", "int4-nolean", "int4-fused-nolean")
SETTINGS += tuple(f"{s}+chunk" for s in SETTINGS)
ROWS = (1, 128)


def build(setting: str):
    name, _, chunk = setting.partition("+")
    base = name.removesuffix("-nolean")
    config = LMConfig(model="gpt2-small", seq_len=2048, batch_size=8, dtype="bfloat16", attention="flash", lean=not name.endswith("-nolean"),
                      loss_chunk=1024 if chunk else 0, remat=base == "remat", storage_dtype="int4" if base.startswith("int4") else None)  # fmt: skip
    if base not in ("int4-rows", "int4-fused"):
        return config, None
    rules = compression_rules(config)
    rules[-1] = bsr_jax.Rule("*", dataclasses.replace(rules[-1].compression, block=ROWS, backend="fused" if base == "int4-fused" else None))
    model = create_model(config, model_shape(config), compressed=False)
    return config, bsr_jax.compress_model(model, rules, lean=config.lean)


def compiled(setting: str, breakdown: bool = False) -> bsr_jax.CompiledStep:
    """The setting's whole step compiled for H100 (the fused settings through ``backend="fused"``)."""
    config, model = build(setting)
    step, args, _ = step_args(config, model)
    return bsr_jax.compiled_memory(step, *args, target="h100", donate_argnums=(0, 1), breakdown=breakdown)


def measure(setting: str) -> dict:
    r = compiled(setting)
    return {"setting": setting, "peak_mib": r.peak / MIB, "modelled_seconds": r.modelled_seconds, "triton_gemm": r.triton_gemm}


def live_at_peak(setting: str, top: int = 12) -> str:
    """The arrays live at the setting's peak, summed over layers (layer_3/attn/v -> layer_*/attn/v)."""
    r = compiled(setting, breakdown=True)
    mib, count = collections.Counter(), collections.Counter()
    for buffer in r.live_at_peak:
        op = re.sub(r"\{\d+\}", "", re.sub(r"layer_\d+", "layer_*", buffer.op))
        mib[op] += buffer.bytes / MIB
        count[op] += 1
    lines = [f"{setting}: peak {r.peak / MIB:.0f} MiB, live at the peak {r.live_peak / MIB:.0f} MiB", "| MiB | arrays | op |", "|---:|---:|---|"]
    return "\n".join(lines + [f"| {v:.0f} | {count[op]} | {op} |" for op, v in mib.most_common(top)])


def _ratio(row: dict, dense: dict | None, key: str) -> str:
    return f"{row[key] / dense[key]:.2f}" if dense else "-"


def table(rows: list[dict]) -> str:
    by = {r["setting"]: r for r in rows}
    lines = ["| gpt2-small, flash attention, H100 | peak MiB | vs dense | modelled ms | vs dense |", "|---|---:|---:|---:|---:|"]
    for s in SETTINGS:
        if s in by:
            r, d = by[s], by.get("dense+chunk" if "+chunk" in s else "dense")
            lines.append(f"| {s} | {r['peak_mib']:.0f} | {_ratio(r, d, 'peak_mib')} | {r['modelled_seconds'] * 1e3:.2f} | "
                         f"{_ratio(r, d, 'modelled_seconds')}x |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--out", default="benchmarks/results/fused_lm.json")
    parser.add_argument("--live", choices=SETTINGS, help="print what is live at this setting's peak instead")
    args = parser.parse_args(argv)
    if args.live:
        print(live_at_peak(args.live))
        return
    rows = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            rows = json.load(f)
    meta = run_metadata()
    for setting in args.settings:
        if any(r["setting"] == setting for r in rows):
            continue
        print(f"{setting} ...", file=sys.stderr, flush=True)
        rows.append(measure(setting) | {"meta": {k: meta[k] for k in ("commit", "date", "machine", "cpu", "jax")}})
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))
    print(footer(meta))


if __name__ == "__main__":
    main()
