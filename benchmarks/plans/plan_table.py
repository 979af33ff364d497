"""The planner's table: ``bsr_jax.plan`` on ResMLP-S12, ViT-B/16, the 12x768 LM and ResNet-50, for
H100 and TPU v5p, at budgets of 0.3, 0.5 and 0.7 of the dense step's compiled peak.

Per plan: its compiled peak and modelled time as ratios to the dense step's on the same target,
what it chose, and two baselines that fit the same budget: the fastest of JAX's own ``nn.remat``
per block (default, ``dots_with_no_batch_dims_saveable``, ``dots_saveable``, offload; the rows of
benchmarks/results/compiled_memory.json, the model as its authors would wrap it) and the fastest
of the planner's own uniform remat candidates (the same policies through ``compress_model(remat=)``).
Compiles are shared between the three budgets of a model and target; rows are written as they
come, and rows already in the JSON are skipped, so an interrupted run resumes.

    python -m benchmarks.plans.plan_table --models resmlp-s12 --targets h100
    python -m benchmarks.plans.plan_table --table-only

"compiles": candidates compiled for that model and target so far (budgets share them); "search":
the wall time of that budget's plan (the first budget of a model and target compiles the dense
step, remat on every block and the cost model's probes, which the others reuse). The uniform
remat baselines are compiled after each search, outside its time.

Writes docs/RESULTS.md section 12.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Before jax starts: deviceless compiles need jax's CUDA plugin registered without its driver check.
import bsr_jax  # noqa: F401  isort: skip
import jax.numpy as jnp
import optax

from benchmarks.memory import compiled_memory as cm
from benchmarks.run_info import footer, run_metadata
from bsr_jax.planning import search as planner

BUDGETS = (0.3, 0.5, 0.7)
REMAT_SETTINGS = ("remat", "remat-dots", "remat-dots-all", "remat-offload")


def _loss_fn(module, variables, x, y):
    stats = [k for k in variables if k != "params"]
    out = module.apply(variables, x, mutable=stats) if stats else module.apply(variables, x)
    logits = out[0] if stats else out
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def _batch(shape):
    tokens = len(shape) == 2
    x = cm.jax.ShapeDtypeStruct(shape, jnp.int32 if tokens else jnp.float32)
    return x, cm.jax.ShapeDtypeStruct(shape if tokens else shape[:1], jnp.int32)


def _jax_remat(rows, name, target, limit_ratio):
    """The fastest nn.remat-per-block row of compiled_memory.json within the budget: (setting, peak ratio, time ratio)."""
    by = {r["setting"]: r for r in rows if r["model"] == name and r["target"] == target and "modelled_seconds" in r}
    if "dense" not in by:
        return None
    dense = by["dense"]
    fits = [(by[s]["modelled_seconds"] / dense["modelled_seconds"], by[s]["peak_mib"] / dense["peak_mib"], s)
            for s in REMAT_SETTINGS if s in by and by[s]["peak_mib"] <= limit_ratio * dense["peak_mib"]]  # fmt: skip
    return min(fits) if fits else ("none fits", None, None)


def measure(name, target, budgets, options, cache, remat_rows, loss_chunk=0, plain=None):
    """Yields one row per budget, as each plan is made. With ``loss_chunk`` the loss runs through
    ``bsr_jax.chunked_head_loss`` and budgets and ratios refer to ``plain``, the plain loss's dense
    step (``{"peak_mib", "ms"}``), so that both rows answer the same budget in bytes."""
    model, shape, _, context = cm.MODELS[name]("dense")
    x, y = _batch(shape)
    loss_fn = bsr_jax.chunked_head_loss(_loss_fn, chunk=loss_chunk) if loss_chunk else _loss_fn
    baselines = {}
    with context:
        for budget in budgets:
            start = time.time()
            try:
                p = planner.plan(model, loss_fn, x, y, optimizer=optax.adamw(1e-3), target=target, options=options, cache=cache,
                                 budget=int(budget * plain["peak_mib"] * 2**20) if plain else budget)  # fmt: skip
            except ValueError as e:
                yield dict(model=name, target=target, budget=budget, loss_chunk=loss_chunk, error=str(e))
                continue
            seconds = time.time() - start
            dense_mib, dense_ms = (plain["peak_mib"], plain["ms"]) if plain else (p.dense.peak / 2**20, p.dense.seconds * 1e3)
            # The baseline: each remat policy on every block (compiled after the search, not timed
            # with it; the planner compiles only remat itself, unless it predicts another fastest).
            # A cache of their own: the next budget's search must not find them compiled.
            uniform = planner.Candidates(planner.Linen(model, loss_fn, (x, y), None, None), {"plain": loss_fn}, (x, y), optax.adamw(1e-3),
                                      target, False, baselines)  # fmt: skip
            n = len(uniform.family.blocks)
            uniform_remat = [m for m in (uniform.measure([s] * n, "keep") for s in REMAT_SETTINGS) if m.peak <= p.budget]
            best_uniform = min(uniform_remat, key=lambda m: m.seconds, default=None)
            jax_remat = _jax_remat(remat_rows, name, target, budget)
            print(p, file=sys.stderr)
            yield dict(
                model=name, target=target, budget=budget, loss_chunk=loss_chunk, peak_ratio=p.peak / 2**20 / dense_mib,
                time_ratio=p.modelled_seconds * 1e3 / dense_ms, peak_mib=p.peak / 2**20, modelled_ms=p.modelled_seconds * 1e3,
                dense_mib=dense_mib, dense_ms=dense_ms, chosen=p.label,
                compiles=len(p.tried), seconds=seconds, options=list(options),
                uniform_remat=None if best_uniform is None else dict(
                    label=best_uniform.label,
                    peak_ratio=best_uniform.peak / 2**20 / dense_mib, time_ratio=best_uniform.seconds * 1e3 / dense_ms),
                jax_remat=None if jax_remat is None else dict(setting=jax_remat[2] or jax_remat[0], time_ratio=jax_remat[0] if jax_remat[1] else None,
                                                              peak_ratio=jax_remat[1]),
            )  # fmt: skip


def table(rows):
    lines = ["| model | target | budget | plan peak | plan time | chosen | nn.remat best within budget (peak / time) | uniform remat via compress_model (peak / time) | compiles | search |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in sorted(rows, key=lambda r: (r["model"], r["target"], r.get("loss_chunk", 0), r["budget"])):
        model = r["model"] + (f" + chunked loss ({r['loss_chunk']})" if r.get("loss_chunk") else "")
        if "error" in r:
            lines.append(f"| {model} | {r['target']} | {r['budget']} | - | - | {r['error'].split(', with ')[0]} | | | | |")
            continue
        j, u = r["jax_remat"], r["uniform_remat"]
        jt = "-" if j is None else (j["setting"] if j["time_ratio"] is None else f"{j['setting']}: {j['peak_ratio']:.2f} / {j['time_ratio']:.2f}")
        ut = "none fits" if u is None else f"{u['label'].split(',')[0]}: {u['peak_ratio']:.2f} / {u['time_ratio']:.2f}"
        lines.append(f"| {model} | {r['target']} | {r['budget']} | {r['peak_ratio']:.2f} | {r['time_ratio']:.2f} | {r['chosen']} | {jt} | {ut} | {r['compiles']} | {r['seconds'] / 60:.0f} min |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(cm.MODELS), default=list(cm.MODELS))
    parser.add_argument("--targets", nargs="+", choices=cm.DEVICELESS_TARGETS, default=list(cm.DEVICELESS_TARGETS))
    parser.add_argument("--budgets", nargs="+", type=float, default=list(BUDGETS))
    # The opt-in named policies only when asked: each option searched costs compiles per plan.
    parser.add_argument("--options", nargs="+", choices=list(planner.OPTIONS), default=[o for o, option in planner.OPTIONS.items() if not option.opt_in])
    parser.add_argument("--loss-chunk", type=int, default=0, help="the loss through bsr_jax.chunked_head_loss with this chunk; "
                        "budgets and ratios against the plain loss's dense step, from that model's plain rows (default: 0, plain)")
    parser.add_argument("--out", default="benchmarks/results/plan_table.json")
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args(argv)
    saved = json.load(open(args.out)) if os.path.exists(args.out) else {"rows": []}
    if not args.table_only:
        meta = run_metadata()
        remat_path = "benchmarks/results/compiled_memory.json"
        remat_rows = json.load(open(remat_path))["runs"] if os.path.exists(remat_path) else []
        for name in args.models:
            for target in args.targets:
                mine = [r for r in saved["rows"] if r["model"] == name and r["target"] == target]
                todo = [b for b in args.budgets if not any(r["budget"] == b and r.get("loss_chunk", 0) == args.loss_chunk for r in mine)]
                if not todo:
                    continue
                plain = next(({"peak_mib": r["dense_mib"], "ms": r["dense_ms"]} for r in mine if "dense_mib" in r and not r.get("loss_chunk")), None)
                if args.loss_chunk and plain is None:
                    sys.exit(f"--loss-chunk: no plain row of {name} on {target} in {args.out} to take the dense step from; run without it first")
                print(f"{name} {target} budgets {todo} ...", file=sys.stderr, flush=True)
                for row in measure(name, target, todo, tuple(args.options), {}, remat_rows, args.loss_chunk, plain if args.loss_chunk else None):
                    row["meta"] = {k: meta[k] for k in ("commit", "date", "machine", "cpu", "jax")}
                    saved["rows"].append(row)
                    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                    with open(args.out, "w") as f:
                        json.dump(saved, f, indent=1)
        print(footer(meta))
    print(table(saved["rows"]))


if __name__ == "__main__":
    main()
