"""Relative gradient error of approximate dx (``compress_model(dx=...)``), per layer kind.

``compress_model(model, Rule("*", None), dx=fmt)`` keeps no linear input compressed (no dW
compression) and stores, for the backward pass, what each recognised norm, activation and attention
reads in ``fmt`` (``bsr_jax.ops.dx``: int8 / int4 codes, one float32 scale per 1 x 128 group): only dx
is approximate, and every gradient error below comes from it.

For each of the five small third-party models of ``tests/third_party_models.py`` (Mixer, ViT, lm1b
LM, GPT-2, Llama at storage_error's configuration: 4 layers, width 128, MLP 512, batch 8;
parameters at their init plus 0.05 normal noise, inputs normal images / random tokens from fixed
seeds) and each format, dx is turned on for one kind of layer at a time with dx rules by module
path (``[(path, fmt), ..., ("*", None)]``):

* ``act``: segments whose backward differentiates GELU / SiLU / tanh (an ``erf``, ``tanh`` or
  ``logistic``), the MLP activation;
* ``norm``: segments with an ``rsqrt`` (LayerNorm, RMSNorm), wherever lean_graph evaluates them (a
  parent that reads a norm's output recomputes the norm in its own segment: Mixer's first
  LayerNorm is stored under ``MixerBlock_i``, the final norms under the root module);
* ``attn``: segments with a product with batch axes (``q k^T``, ``p v``): q, k, v stored;
* ``all``: ``dx=fmt``, every recognised segment;
* ``none``: ``dx=[("*", None)]``, lean neighbours only: the float-reassociation floor.

Columns: ``paths``, the module paths the kind's rules name (a segment's path: the module whose
own computation it is); ``codes``, the int8 arrays the backward pass keeps with those rules in
int8 (the stored dx inputs, from ``jax.vjp``'s residuals); ``input``, the input-gradient error;
``params``, parameter leaves dx changes / all; ``p.min`` / ``p.median`` / ``p.max`` (below).

The kinds are found by tracing the model once with ``dx=fmt`` and reading, for every segment that
stores an input in ``fmt``, its module path and the primitives it differentiates; the segments and
the arrays they store are listed in the JSON. Reported against plain autodiff of the unmodified
model: the relative Frobenius error ``||g - g_exact|| / ||g_exact||`` of the input gradient (d loss
/ d image; for token models d loss / d the token embedding's output, the first layer's output,
through a zero added to it) and, over the parameter leaves (what the optimizer sees; leaves whose
exact gradient norm is below 1e-6 left out: the attention key bias, which softmax's shift
invariance makes zero up to rounding), the median and max, the number of leaves dx changes at all
(relative error above 1e-5; the others, a head after the last approximate segment, stay exact) and
the min over those.

The same on real CIFAR-10 test batches for the tiny ResMLP of ``train/models.py`` (``dx`` on its
GELU inputs, the only dx it has; plain Dense otherwise), at its init (``resmlp/init``) and, with
``--run``, at a trained run's latest checkpoint (``resmlp/step<N>``): errors per batch, the mean
over ``--batches`` batches (the worst batch for the parameters' max).

    nice -n 19 python -m benchmarks.accuracy.dx_error --data-dir ../shared/data/cifar10-jpg.tar.gz \\
        --run runs/long/all-s0-b16-int4-dx8-seed0    # table on stdout, JSON in benchmarks/results/

Writes the error table of docs/memory.md section 1.2 (and the README's of docs/usage.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core

from benchmarks.run_info import run_metadata, write_json
from benchmarks.accuracy.storage_error import _models  # the same five models, inputs and losses
from bsr_jax import Rule, compress_model
from bsr_jax.rewrite import lean_graph
from bsr_jax.ops import dx as dx_lib

from tests import third_party_models as tpm  # noqa: E402

FORMATS = ("int8", "int4")
KINDS = ("none", "act", "norm", "attn", "all")
# Parameter leaves whose exact gradient is below this norm are left out (relative error meaningless).
TINY_GRADIENT = 1e-6
# Leaves with a relative error at or below this are exact up to float reassociation (the ``none`` rows: < 2e-6).
AFFECTED = 1e-5
# The token models' embedding module (its __call__ output is the first layer's output).
EMBEDDING = {"lm": "embed", "gpt2": "wte", "llama": "embed_tokens"}
EMBEDDING_FREE = ("mixer", "vit")


# ---- which segments store what, and of which kind ----


def _primitives(jaxpr: Any) -> set[str]:
    """Names of every primitive in ``jaxpr`` and the jaxprs it calls; ``dot_general`` with batch
    axes as ``batched_dot``."""
    names: set[str] = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general" and any(eqn.params["dimension_numbers"][1]):
            name = "batched_dot"
        names.add(name)
        for sub in jax_core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


def kind_of(primitives: set[str]) -> str:
    """The layer kind of a segment that stores inputs in the dx format, by what it differentiates."""
    if "batched_dot" in primitives:
        return "attn"
    if "rsqrt" in primitives:
        return "norm"
    if primitives & {"erf", "tanh", "logistic"}:
        return "act"
    return "other"


@contextlib.contextmanager
def _recording(found: list[dict[str, Any]]) -> Iterator[None]:
    """While active, every lean_graph segment that stores an input in a dx format appends
    ``{path, kind, stored}`` to ``found``: its module path, its kind (``kind_of``) and the shapes of
    the arrays it compresses. lean_graph decides which segments get dx; this only watches the two
    functions it calls for that (wrapped, and restored on exit): the one that looks up a segment's
    format by its path (``Treatment.dx_format``; ``_segment_dx`` before it), right before the
    ``bsr_jax.ops.dx.stored_compressed`` of the same segment."""
    last_path = [""]
    stored_compressed = lean_graph.stored_compressed
    treatment = getattr(lean_graph, "Treatment", None)
    owner, name = (treatment, "dx_format") if hasattr(treatment, "dx_format") else (lean_graph, "_segment_dx")
    lookup = getattr(owner, name)

    def watch_path(*args):
        last_path[0] = args[-2] if owner is lean_graph else args[1]  # (path, dx) or (self, path)
        return lookup(*args)

    def watch_stored(fn, fmt, only=None, unread=None):
        inner, path = stored_compressed(fn, fmt, only=only, unread=unread), last_path[0]

        def call(*values):
            marked = [True] * len(values) if only is None else only
            shrunk = [tuple(v.shape) for v, m in zip(values, marked) if m and dx_lib._compressible(v)]
            out = inner(*values)
            if shrunk and jax.tree.leaves(out):  # a segment whose outputs a reader recomputes returns none: dead
                found.append(dict(path=path, kind=kind_of(_primitives(jax.make_jaxpr(fn)(*values).jaxpr)), stored=shrunk))
            return out

        return call

    setattr(owner, name, watch_path)
    lean_graph.stored_compressed = watch_stored
    try:
        yield
    finally:
        setattr(owner, name, lookup)
        lean_graph.stored_compressed = stored_compressed


# ---- gradients ----


def _with_probe(name: str | None, delta: jax.Array | None):
    """An interceptor adding ``delta`` to the output of the ``nn.Embed`` named ``name`` (its
    ``__call__``, not ``attend``): d loss / d delta is the gradient at the first layer's output."""

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__" and isinstance(context.module, nn.Embed) and context.module.name == name:
            return out + delta
        return out

    return nn.intercept_methods(interceptor) if name else contextlib.nullcontext()


def gradients(model: nn.Module, params: Any, x: jax.Array, loss: Callable, embedding: str | None) -> tuple[Any, jax.Array]:
    """(parameter gradients, input gradient) of ``loss(model.apply(params, x))``; the input is the
    image, or for token models (``embedding`` named) the embedding module's output."""
    if embedding is None:
        return jax.jit(jax.grad(lambda p, x: loss(model.apply(p, x)), argnums=(0, 1)))(params, x)
    width = tpm.ISSUE.width

    def f(p, delta):
        with _with_probe(embedding, delta):
            return loss(model.apply(p, x))

    return jax.jit(jax.grad(f, argnums=(0, 1)))(params, jnp.zeros((*x.shape, width), jnp.float32))


def kept_codes(model: nn.Module, params: Any, x: jax.Array, loss: Callable, dx: Any) -> int:
    """How many int8 arrays the backward pass keeps (the residuals of ``jax.vjp``, run op by op):
    with ``Rule("*", None)`` and ``dx`` in int8, the stored dx inputs, each counted once."""
    compressed = compress_model(model, Rule("*", None), dx=dx)
    _, vjp = jax.vjp(lambda p: loss(compressed.apply(p, x)), params)
    return sum(1 for r in jax.tree.leaves(vjp) if getattr(r, "dtype", None) == jnp.int8)


def relative(g: Any, w: Any) -> float:
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    return float(np.linalg.norm(g - w) / np.linalg.norm(w))


def errors(got: tuple[Any, jax.Array], exact: tuple[Any, jax.Array]) -> dict[str, Any]:
    """Input-gradient error, and per parameter leaf (by path) the relative error."""
    leaves = {}
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got[0])[0], jax.tree.leaves(exact[0])):
        if float(np.linalg.norm(np.asarray(w, np.float64))) >= TINY_GRADIENT:
            leaves[jax.tree_util.keystr(path, simple=True, separator="/")] = relative(g, w)
    return dict(input=relative(got[1], exact[1]), params=leaves)


def summary(e: dict[str, Any]) -> dict[str, Any]:
    """Over the parameter leaves: median and max over all, min over those dx changes at all
    (``affected``: error above AFFECTED; the others, e.g. a head after the last approximate segment,
    are exact)."""
    values = sorted(e["params"].values())
    affected = [v for v in values if v > AFFECTED]
    return dict(input=e["input"], leaves=len(values), affected=len(affected), min=affected[0] if affected else values[0],
                median=statistics.median(values), max=values[-1], worst=max(e["params"], key=e["params"].get))  # fmt: skip


def kind_rules(found: list[dict[str, Any]], kind: str, fmt: str) -> Any:
    """dx rules turning ``fmt`` on for the module paths of ``kind``'s segments only."""
    if kind == "none":
        return [("*", None)]
    if kind == "all":
        return fmt
    paths = sorted({s["path"] for s in found if s["kind"] == kind})
    # Each path with and without its root module's class name: the form dx rules match.
    patterns = [pattern for p in paths for pattern in dict.fromkeys((p, p.partition("/")[2]))]
    return [*[(p, fmt) for p in patterns], ("*", None)] if paths else None


def third_party(names: list[str], rows: list[dict], detail: dict) -> None:
    rule = Rule("*", None)
    for name, (model, x, loss) in _models(tpm.ISSUE).items():
        if name not in names:
            continue
        params = tpm.jitter(model.init(jax.random.key(0), x))
        embedding = EMBEDDING.get(name)
        exact = gradients(model, params, x, loss, embedding)
        found: list[dict[str, Any]] = []
        with _recording(found):
            jax.make_jaxpr(jax.grad(lambda p: loss(compress_model(model, rule, dx="int8").apply(p, x))))(params)
        by_path: dict[str, set[str]] = {}
        for s in found:
            by_path.setdefault(s["path"], set()).add(s["kind"])
        mixed = {p: sorted(k) for p, k in by_path.items() if len(k) > 1}
        if mixed:
            print(f"# {name}: module paths with segments of several kinds (their rule turns all on): {mixed}", file=sys.stderr)
        detail[name] = dict(segments=found)
        codes = {kind: kept_codes(model, params, x, loss, kind_rules(found, kind, "int8")) for kind in KINDS}
        for fmt in FORMATS:
            for kind in KINDS:
                dx = kind_rules(found, kind, fmt)
                paths = {s["path"] for s in found if kind == "all" or s["kind"] == kind} if kind != "none" else set()
                row = dict(data="synthetic", model=name, dx=fmt, kind=kind, paths=len(paths), codes=codes[kind])
                if dx is None:  # nothing of this kind is stored in the dx format: exact
                    rows.append(dict(row, input=None, leaves=0, affected=0, min=None, median=None, max=None, worst="(not applied)"))
                    _print(rows[-1])
                    continue
                e = errors(gradients(compress_model(model, rule, dx=dx), params, x, loss, embedding), exact)
                detail[name][f"{fmt}/{kind}"] = e["params"]
                rows.append(dict(row, **summary(e)))
                _print(rows[-1])


# ---- the tiny ResMLP on CIFAR-10 ----


def cifar(args, rows: list[dict], detail: dict) -> None:
    from train import data, loop, models, sharding
    from train.checkpoint import Checkpoints
    from train.config import TrainConfig

    test = data.load_split("cifar10", "test", data_dir=args.data_dir)
    batches = []
    for batch in data.eval_batches(test, args.batch_size):
        batches.append({"image": jnp.asarray(batch["image"]), "label": jnp.asarray(batch["label"])})
        if len(batches) == args.batches:
            break
    preset = models.PRESETS["tiny"]
    resmlp = lambda dx: models.ResMLP(num_classes=test.num_classes, patch_size=4, dx=dx, **preset)  # noqa: E731
    states = {"init": resmlp(None).init(jax.random.key(0), batches[0]["image"])["params"]}
    if args.run:
        from benchmarks.accuracy.sensitivity import load_run

        config = dataclasses.replace(load_run(args.run, args.data_dir), sparsity=0.0, storage_dtype=None, dx=None,
                                     prune_scale_shift=False, layer_sparsity=())  # fmt: skip
        mesh = sharding.make_mesh(jax.devices()[:1])
        template = loop.create_model(config, test.num_classes)
        tx = loop.create_optimizer(config, loop.learning_rate_schedule(config, steps_per_epoch=1))
        state = loop.create_state(template, tx, batches[0]["image"].shape, config.seed, mesh)
        checkpoints = Checkpoints(os.path.join(args.run, "checkpoints"))
        step = checkpoints.latest_step()
        states[f"step{step}"] = checkpoints.restore(state)["params"]
        checkpoints.close()
    smoothing = TrainConfig().label_smoothing

    def grad_fn(dx):
        loss_fn = loop.loss_function(resmlp(dx), test.num_classes, smoothing)
        return jax.jit(jax.grad(lambda p, image, label: loss_fn(p, {"image": image, "label": label})[0], argnums=(0, 1)))

    exact_fn = grad_fn(None)
    for label, params in states.items():
        exact = [exact_fn(params, b["image"], b["label"]) for b in batches]
        for fmt in FORMATS:
            approx_fn = grad_fn(fmt)
            per_batch = [errors(approx_fn(params, b["image"], b["label"]), e) for b, e in zip(batches, exact)]
            summaries = [summary(e) for e in per_batch]
            worst = max(summaries, key=lambda s: s["max"])
            row = dict(data=f"cifar10 test, {len(batches)} x {args.batch_size}", model=f"resmlp/{label}", dx=fmt, kind="act",
                       paths=preset["depth"], codes=preset["depth"], input=statistics.mean(s["input"] for s in summaries),
                       leaves=summaries[0]["leaves"], affected=max(s["affected"] for s in summaries), min=statistics.mean(s["min"] for s in summaries),
                       median=statistics.mean(s["median"] for s in summaries), max=worst["max"], worst=worst["worst"])  # fmt: skip
            rows.append(row)
            detail[f"resmlp/{label}/{fmt}"] = [e["params"] for e in per_batch]
            _print(row)


# ---- output ----

HEADER = (f"{'model':<15} {'dx':<5} {'kind':<5} {'paths':>5} {'codes':>5} {'input':>8} {'params':>7} {'p.min':>8} {'p.median':>8} "
          f"{'p.max':>8}  worst parameter")


def _cell(v: float | None) -> str:
    return f"{'-':>8}" if v is None else f"{v:>8.4f}" if v >= 1e-4 else f"{v:>8.1e}"


def _print(row: dict) -> None:
    params = f"{row['affected']}/{row['leaves']}"
    print(f"{row['model']:<15} {row['dx']:<5} {row['kind']:<5} {row['paths']:>5} {row['codes']:>5} {_cell(row['input'])} {params:>7} {_cell(row['min'])} "
          f"{_cell(row['median'])} {_cell(row['max'])}  {row['worst']}", flush=True)  # fmt: skip


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table, int8 and int4 side by side (docs/RESULTS.md section 9.2)."""
    fmt = lambda v: "-" if v is None else f"{v:.4f}" if v >= 1e-4 else f"{v:.0e}"  # noqa: E731
    stats = lambda r: "-" if r["input"] is None else f"{fmt(r['min'])} / {fmt(r['median'])} / {fmt(r['max'])}"  # noqa: E731
    lines = ["| model | kind | paths | int8 codes | params changed | int8: input | int8: params min / median / max "
             "| int4: input | int4: params min / median / max |", "|---" * 9 + "|"]  # fmt: skip
    by_key = {(r["model"], r["kind"], r["dx"]): r for r in rows}
    for (model, kind, dx), r in by_key.items():
        if dx != "int8":
            continue
        r4 = by_key[(model, kind, "int4")]
        changed = "-" if r["input"] is None else f"{max(r['affected'], r4['affected'])}/{r['leaves']}"
        lines.append(f"| {model} | {kind} | {r['paths']} | {r['codes']} | {changed} | {fmt(r['input'])} | {stats(r)} "
                     f"| {fmt(r4['input'])} | {stats(r4)} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/dx_error.json")
    parser.add_argument("--data-dir", default="../shared/data/cifar10-jpg.tar.gz", help="CIFAR-10 (train.data.load_split); '' skips CIFAR")
    parser.add_argument("--run", help="a train.cifar run of the tiny ResMLP: its latest checkpoint's parameters too")
    parser.add_argument("--models", nargs="*", default=list(EMBEDDING_FREE + tuple(EMBEDDING)), help="third-party models (default: all five)")
    parser.add_argument("--batches", type=int, default=4, help="CIFAR-10 test batches (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--markdown", action="store_true", help="print --out's rows as a markdown table; measure nothing")
    args = parser.parse_args(argv)
    if args.markdown:
        with open(args.out) as f:
            print(markdown(json.load(f)["rows"]))
        return
    meta = run_metadata()
    rows: list[dict] = []
    detail: dict[str, Any] = {}
    print(HEADER)
    third_party(args.models, rows, detail)
    if args.data_dir:
        cifar(args, rows, detail)
    write_json(args.out, meta, dict(config=str(tpm.ISSUE), tiny_gradient=TINY_GRADIENT, rows=rows, detail=detail))


if __name__ == "__main__":
    main()
