"""The planner's table: ``bsr_jax.plan`` on ResMLP-S12, ViT-B/16, the 12x768 LM and ResNet-50, for
H100 and TPU v5p, at budgets of 0.2, 0.3, 0.5 and 0.7 of the dense step's compiled peak.

Plans are ``plan(..., microbatches="auto")`` (``--microbatches``): the faster of the plan at one
micro-batch and the dense step at the fewest micro-batches that fits (not for ResNet-50, whose
BatchNorm statistics would be each slice's). Per plan: its compiled peak and modelled time as
ratios to the dense step's on the same target, what it chose, and the fastest baseline that fits
the same budget, compiled on the planner's instrument (``plan``'s ``Candidates``) after the first
search, outside any search's time: JAX's remat policies on every block
(default, ``dots_with_no_batch_dims_saveable``, ``dots_saveable``, offload, through
``compress_model(remat=)``: the same peaks and times as ``nn.remat`` per block, docs/RESULTS.md
12), MaxText's named policies on every block (``remat-minimal``, ``remat-save-qkv``,
``remat-save-dots-except-mlp``, ``remat-offload-qkv``), and micro-batching (k = 2, 4, 8 slices of
the batch, one update: the dense step and remat on every block; ResNet-50's BatchNorm then sees
each slice's statistics). Every baseline's peak and time is in the JSON. Compiles are shared
between the budgets of a model and target; rows are written as they come, and rows already in the
JSON are skipped, so an interrupted run resumes.

    python -m benchmarks.plans.plan_table --models resmlp-s12 --targets h100
    python -m benchmarks.plans.plan_table --table-only

"compiles": candidates compiled for that model and target so far (budgets share them); "search":
the wall time of that budget's plan (the first budget of a model and target compiles the dense
step, remat on every block and the cost model's probes, which the others reuse); "plan /
baseline": the plan's modelled time over the fastest fitting baseline's.

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

BUDGETS = (0.2, 0.3, 0.5, 0.7)
REMAT_SETTINGS = ("remat", "remat-dots", "remat-dots-all", "remat-offload")
# MaxText's named policies on the tensor names compress_model gives (docs/planner.md).
NAMED_SETTINGS = ("remat-minimal", "remat-save-qkv", "remat-save-dots-except-mlp", "remat-offload-qkv")
MICROBATCHES = (2, 4, 8)


def _loss_fn(module, variables, x, y):
    stats = [k for k in variables if k != "params"]
    out = module.apply(variables, x, mutable=stats) if stats else module.apply(variables, x)
    logits = out[0] if stats else out
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def _batch(shape):
    tokens = len(shape) == 2
    x = cm.jax.ShapeDtypeStruct(shape, jnp.int32 if tokens else jnp.float32)
    return x, cm.jax.ShapeDtypeStruct(shape if tokens else shape[:1], jnp.int32)


def baselines(family, loss_fn, batch, target):
    """Every baseline step of the model, budget-free: label -> Measured (``Candidates.measure``, the
    planner's instrument): JAX's remat policies and MaxText's named ones on every block, and the
    dense step and remat on every block at each micro-batch count of ``MICROBATCHES`` dividing the
    batch (``bsr_jax.accumulated_value_and_grad``). ``family``: the model's ``planner.Linen``."""
    found, shared = {}, {}  # one cache for every count: a step XLA cannot time is priced as one like it at another count
    for k in (1, *MICROBATCHES):
        if batch[0].shape[0] % k:
            continue
        steps = planner.Candidates(family, {"plain": loss_fn}, batch, optax.adamw(1e-3), target, False, shared, microbatches=k)
        n = len(family.blocks)
        measured = {}
        for setting in (("keep",) + REMAT_SETTINGS + NAMED_SETTINGS if k == 1 else ("keep", "remat")):
            label = "dense" if setting == "keep" else setting
            measured[label if k == 1 else f"{label} k={k}"] = steps.measure([setting] * n, "keep")
        # A step XLA's model could not time is rescaled once one like it is timed: read them again.
        found |= {label: steps.current(m) for label, m in measured.items()}
    return found


def against(others, budget, plain=None):
    """A row's baseline fields: the dense step (``plain``'s where given), every baseline's peak and
    time as ratios to it, and the fastest that fits ``budget`` of its peak."""
    dense = others["dense"]
    dense_mib, dense_ms = (plain["peak_mib"], plain["ms"]) if plain else (dense.peak / 2**20, dense.seconds * 1e3)
    limit = budget * dense_mib * 2**20
    fitting = {label: m for label, m in others.items() if m.compiled and m.peak <= limit}
    best = min(fitting, key=lambda label: fitting[label].seconds, default=None)
    return dict(dense_mib=dense_mib, dense_ms=dense_ms,
                baselines={label: dict(peak_ratio=m.peak / 2**20 / dense_mib, time_ratio=m.seconds * 1e3 / dense_ms if m.compiled else None)
                           for label, m in others.items()},
                best_baseline=best and dict(label=best, peak_ratio=fitting[best].peak / 2**20 / dense_mib,
                                            time_ratio=fitting[best].seconds * 1e3 / dense_ms))  # fmt: skip


def rebaseline(rows, name, target):
    """The baselines of ``rows`` (one model and target, the plain loss) measured again, their plans kept."""
    model, shape, _, context = cm.MODELS[name]("dense")
    x, y = _batch(shape)
    with context:
        others = baselines(planner.Linen(model, _loss_fn, (x, y), None, None), _loss_fn, (x, y), target)
    for row in rows:
        row.update(against(others, row["budget"]))


def measure(name, target, budgets, options, cache, loss_chunk=0, plain=None, microbatches="auto"):
    """Yields one row per budget, as each plan is made. With ``loss_chunk`` the loss runs through
    ``bsr_jax.chunked_head_loss`` and budgets and ratios refer to ``plain``, the plain loss's dense
    step (``{"peak_mib", "ms"}``), so that both rows answer the same budget in bytes."""
    model, shape, _, context = cm.MODELS[name]("dense")
    x, y = _batch(shape)
    loss_fn = bsr_jax.chunked_head_loss(_loss_fn, chunk=loss_chunk) if loss_chunk else _loss_fn
    others = None  # the baselines, budget-free: compiled after the first search, outside its time
    with context:
        family = planner.Linen(model, loss_fn, (x, y), None, None)
        if set(family.state) != {"params"}:
            microbatches = 1  # BatchNorm's statistics would be each slice's: not the same step
        for budget in budgets:
            start = time.time()
            try:
                # No options named: plan's own default with the approximate ones, less what this model cannot take.
                p = planner.plan(model, loss_fn, x, y, optimizer=optax.adamw(1e-3), target=target, options=options or None, approximate=True, cache=cache,
                                 budget=int(budget * plain["peak_mib"] * 2**20) if plain else budget, microbatches=microbatches)  # fmt: skip
            except ValueError as e:
                p, error = None, str(e)
            seconds = time.time() - start
            # In no cache the searches share: the next budget's search must not find them compiled.
            others = others or baselines(family, loss_fn, (x, y), target)
            row = dict(model=name, target=target, budget=budget, loss_chunk=loss_chunk, seconds=seconds, options=list(options) if options else "every one not opt-in",
                       microbatches_asked=microbatches, **against(others, budget, plain))  # fmt: skip
            dense_mib, dense_ms = row["dense_mib"], row["dense_ms"]
            if p is None:
                yield row | dict(error=error)
                continue
            print(p, file=sys.stderr)
            yield row | dict(
                peak_ratio=p.peak / 2**20 / dense_mib,
                time_ratio=p.modelled_seconds * 1e3 / dense_ms, peak_mib=p.peak / 2**20, modelled_ms=p.modelled_seconds * 1e3,
                chosen=p.label + (f", {p.microbatches} micro-batches" if p.microbatches > 1 else ""), microbatches=p.microbatches,
                compiles=len(p.tried),
            )  # fmt: skip


def table(rows):
    lines = ["| model | target | budget | plan peak | plan time | chosen | best baseline within budget (peak / time) | plan / baseline | compiles | search |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in sorted(rows, key=lambda r: (r["model"], r["target"], r.get("loss_chunk", 0), r["budget"])):
        model = r["model"] + (f" + chunked loss ({r['loss_chunk']})" if r.get("loss_chunk") else "")
        if "error" in r:
            b = r.get("best_baseline")
            bt = "-" if b is None else f"{b['label']}: {b['peak_ratio']:.2f} / {b['time_ratio']:.2f}"
            lines.append(f"| {model} | {r['target']} | {r['budget']} | - | - | {r['error'].split(', with ')[0]} | {bt} | | | {r.get('seconds', 0):.0f} s |")
            continue
        b = r.get("best_baseline", "old")
        if b == "old":  # rows before the baselines of every kind: the fastest uniform remat
            u = r["uniform_remat"]
            bt, vs = ("none fits", "-") if u is None else (f"{u['label'].split(',')[0]}: {u['peak_ratio']:.2f} / {u['time_ratio']:.2f}",
                                                        f"{r['time_ratio'] / u['time_ratio']:.3f}")
        else:
            bt, vs = ("none fits", "-") if b is None else (f"{b['label']}: {b['peak_ratio']:.2f} / {b['time_ratio']:.2f}",
                                                        f"{r['time_ratio'] / b['time_ratio']:.3f}")
        lines.append(f"| {model} | {r['target']} | {r['budget']} | {r['peak_ratio']:.2f} | {r['time_ratio']:.2f} | {r['chosen']} | {bt} | {vs} "
                     f"| {r['compiles']} | {r['seconds']:.0f} s |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(cm.MODELS), default=list(cm.MODELS))
    parser.add_argument("--targets", nargs="+", choices=cm.DEVICELESS_TARGETS, default=list(cm.DEVICELESS_TARGETS))
    parser.add_argument("--budgets", nargs="+", type=float, default=list(BUDGETS))
    # Default: every option but the opt-in ones (each option searched costs compiles per plan) that the model can take.
    parser.add_argument("--options", nargs="+", choices=list(planner.OPTIONS), default=())
    parser.add_argument("--microbatches", default="auto", help="plan(microbatches=...): 'auto' (default; 1 for models with "
                        "collections besides params, ResNet-50's BatchNorm) or a count")
    parser.add_argument("--loss-chunk", type=int, default=0, help="the loss through bsr_jax.chunked_head_loss with this chunk; "
                        "budgets and ratios against the plain loss's dense step, from that model's plain rows (default: 0, plain)")
    parser.add_argument("--out", default="benchmarks/results/plan_table.json")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--baselines-only", action="store_true", help="measure the baselines of the rows in --out of --models "
                        "and --targets again (their plans kept), e.g. after a change to the instrument")
    args = parser.parse_args(argv)
    saved = json.load(open(args.out)) if os.path.exists(args.out) else {"rows": []}
    if args.baselines_only:
        meta = run_metadata()
        for name in args.models:
            for target in args.targets:
                mine = [r for r in saved["rows"] if r["model"] == name and r["target"] == target and not r.get("loss_chunk")]
                if mine:
                    print(f"{name} {target}: baselines again (plain-loss rows) ...", file=sys.stderr, flush=True)
                    rebaseline(mine, name, target)
                    for row in mine:
                        row["baselines_meta"] = {k: meta[k] for k in ("commit", "date", "machine", "cpu", "jax")}
                    with open(args.out, "w") as f:
                        json.dump(saved, f, indent=1)
    elif not args.table_only:
        meta = run_metadata()
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
                for row in measure(name, target, todo, tuple(args.options), {}, args.loss_chunk, plain if args.loss_chunk else None,
                                   args.microbatches if args.microbatches == "auto" else int(args.microbatches)):
                    row["meta"] = {k: meta[k] for k in ("commit", "date", "machine", "cpu", "jax")}
                    saved["rows"].append(row)
                    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                    with open(args.out, "w") as f:
                        json.dump(saved, f, indent=1)
        print(footer(meta))
    print(table(saved["rows"]))


if __name__ == "__main__":
    main()
