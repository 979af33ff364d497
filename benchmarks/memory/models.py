"""Whole models users bring: what their backward pass keeps, and what a step costs, per strategy.

For small equivalents of vision_transformer's Mixer and ViT and flax examples' lm1b LM
(tests/third_party_models.py; issue 13's configuration: 4 layers, width 128, MLP 512, batch 8),
each strategy a user could pick is traced and timed side by side with the dense model:

* ``dense``: the model as written;
* ``dense-only``: ``compress_model(..., lean=False)``: only the linear layers' inputs pruned;
* ``compress``: ``compress_model(model, [Rule("*", Pruning(0.7, block=16))])`` (lean neighbours on);
* ``compress+int8``: the same with int8 kept blocks;
* ``remat-block``: every block under ``nn.remat`` (dense layers): the usual alternative;
* ``dots-saveable``: the whole loss under ``jax.checkpoint(policy=dots_saveable)``.

Columns: activation MiB (``residual_bytes`` activations + inputs, each distinct array once;
parameters apart) and its ratio to dense; the grad step's FLOPs (XLA cost analysis, dW through the
``reference`` backend so a pruned dW counts as a dense one) and their ratio to dense; the median
per-step time ratio to dense (each strategy timed alternately with dense in the same run).

    python -m benchmarks.memory.models                        # table + benchmarks/results/models.json

Writes docs/RESULTS.md section 7.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
from collections.abc import Callable, Iterator

import flax.linen as nn
import jax

import bsr_jax
from bsr_jax import Pruning, Rule, compress_model
from tests import third_party_models as tpm

from benchmarks.run_info import alternating_time_ratios, run_metadata, write_json

MIB = 2**20
BLOCK_CLASSES = {"mixer": "MixerBlock", "vit": "Encoder1DBlock", "lm": "EncoderDecoder1DBlock"}


def model_case(name: str, c: tpm.Config):
    """(model, input, loss(model_output)) of a third-party stand-in."""
    if name == "lm":
        x = tpm.tokens(c)
        return tpm.lm(c), x, lambda out: tpm.lm_loss(out, x)
    y = tpm.labels(c)
    return {"mixer": tpm.mixer, "vit": tpm.vit}[name](c), tpm.images(c), lambda out: tpm.classifier_loss(out, y)


@contextlib.contextmanager
def remat_blocks(name: str, policy: Callable[..., bool] | None = None) -> Iterator[None]:
    # The stand-ins call their block class by its module-level name, as upstream code does, so the
    # baseline a user would write (nn.remat of the block, with an optional policy) is swapped in
    # for the duration.
    attr = BLOCK_CLASSES[name]
    original = getattr(tpm, attr)
    remat = nn.remat(original, policy=policy)
    remat.__name__ = original.__name__  # auto-named submodules (MixerBlock_0) keep their param paths
    setattr(tpm, attr, remat)
    try:
        yield
    finally:
        setattr(tpm, attr, original)


def strategies(name: str, c: tpm.Config) -> dict[str, tuple[Callable, contextlib.AbstractContextManager]]:
    """strategy -> (loss(params, x), context to trace it in)."""
    model, _, loss = model_case(name, c)
    prune = [Rule("*", Pruning(0.7, block=16))]
    int8 = [Rule("*", Pruning(0.7, block=16, storage_dtype="int8"))]
    of = lambda m: (lambda p, x: loss(m.apply(p, x)))  # noqa: E731
    remat_model = model_case(name, c)[0]  # built inside the context below, where the block is remat
    dots = jax.checkpoint(of(model), policy=jax.checkpoint_policies.dots_saveable)
    return {
        "dense": (of(model), contextlib.nullcontext()),
        "dense-only": (of(compress_model(model, prune, lean=False)), contextlib.nullcontext()),
        "compress": (of(compress_model(model, prune)), contextlib.nullcontext()),
        "compress+int8": (of(compress_model(model, int8)), contextlib.nullcontext()),
        "remat-block": (of(remat_model), remat_blocks(name)),
        "dots-saveable": (dots, contextlib.nullcontext()),
    }


def measure(name: str, c: tpm.Config, reps: int) -> list[dict]:
    model, x, _ = model_case(name, c)
    params = tpm.jitter(model.init(jax.random.key(0), x))
    rows, steps = [], {}
    for label, (loss, context) in strategies(name, c).items():
        with context:
            res = bsr_jax.residual_bytes(loss, params, x)
            step = jax.jit(jax.grad(loss))
            os.environ["BSR_JAX_BACKEND"] = "reference"  # FLOPs: a pruned dW counts as a dense one
            flops = step.lower(params, x).compile().cost_analysis().get("flops", float("nan"))
            del os.environ["BSR_JAX_BACKEND"]
            steps[label] = jax.jit(jax.grad(loss)).lower(params, x).compile()
        rows.append(dict(model=name, strategy=label, act_mib=(res.activations + res.inputs) / MIB, flops=flops))
    dense = rows[0]
    timed = alternating_time_ratios({label: functools.partial(c, params, x) for label, c in steps.items()}, reps, "dense")
    for row in rows:
        row["act_ratio"] = row["act_mib"] / dense["act_mib"]
        row["flops_ratio"] = row["flops"] / dense["flops"]
        row["step_ms"] = 1e3 * timed[row["strategy"]]["seconds"]
        row["time_ratio"] = timed[row["strategy"]]["ratio"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(BLOCK_CLASSES), choices=list(BLOCK_CLASSES))
    parser.add_argument("--reps", type=int, default=15, help="timed steps per strategy (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="the unit tests' TINY configuration (smoke run)")
    parser.add_argument("--out", default="benchmarks/results/models.json")
    args = parser.parse_args()
    meta = run_metadata()
    config = tpm.TINY if args.tiny else tpm.ISSUE
    rows = [row for name in args.models for row in measure(name, config, args.reps)]
    print("| model | strategy | act MiB | vs dense | GFLOP | vs dense | step ms | time vs dense |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['strategy']} | {r['act_mib']:.2f} | {r['act_ratio']:.3f} | {r['flops'] / 1e9:.3f} "
            f"| {r['flops_ratio']:.3f} | {r['step_ms']:.1f} | {r['time_ratio']:.2f} |"
        )
    write_json(args.out, meta, dict(config=vars(config), rows=rows))


if __name__ == "__main__":
    main()
