"""Relative weight-gradient error of ``train.lm``'s compressed settings at initialisation, per layer
kind: a check that a setting's loss gap is not a systematic error (int8 must be far closer to dense
than int4). One batch of random tokens, a small ``train.lm`` model (bf16 compute, as trained).

    python -m benchmarks.accuracy.lm_grad_error
    python -m benchmarks.accuracy.lm_grad_error --workdir runs/lm_study/dense-seed0   # a trained run, real text

Error: ``||g - g_dense|| / ||g_dense||`` of each linear layer's kernel gradient, median over layers.
With ``--workdir``: the run's model (its config.json) at its last checkpoint, on ``--batch`` of its
validation windows. ``--systematic``: the batch split in two halves, per setting and layer the
cosine between the two halves' errors ``g - g_dense`` (near 0 where the error is noise that
averages out over steps, near 1 where it points the same way every step: a bias) and the
projection ``<g, g_dense> / <g_dense, g_dense>`` (below 1: gradients shrunk), medians over layers.

Writes docs/RESULTS.md section 11.1 (the gradient-error table).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp

from train.lm_config import LMConfig
from train.lm_loop import create_model, loss_function, model_shape

SETTINGS = {
    "int8": dict(storage_dtype="int8", block=16),
    "int4": dict(storage_dtype="int4", block=16),
    "topk": dict(sparsity=0.7, block=16),
    "int4-dx8": dict(storage_dtype="int4", block=16, dx="int8"),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--workdir", help="a train.lm run: its model at its last checkpoint, its validation text")
    parser.add_argument("--systematic", action="store_true", help="the errors' cosine between two half batches and the projection")
    args = parser.parse_args(argv)
    if args.workdir:
        base, shape, params, batch = trained(args.workdir, args.batch)
    else:
        base = LMConfig(dim=args.dim, depth=args.depth, heads=4, seq_len=args.seq_len)
        shape = model_shape(base, vocab_size=args.vocab)
        tokens = jnp.zeros((1, args.seq_len), jnp.int32)
        params = create_model(base, shape, compressed=False).init(jax.random.key(0), tokens)["params"]
        batch = {"tokens": jax.random.randint(jax.random.key(1), (args.batch, args.seq_len + 1), 0, args.vocab)}

    def grads(config, batch=batch):
        model = create_model(config, shape)
        return jax.jit(jax.grad(lambda p: loss_function(model, config)(p, batch)[0]))(params)

    if args.systematic:
        return systematic(base, grads, batch)

    dense = jax.tree_util.tree_flatten_with_path(grads(base))[0]
    kinds = sorted({"/".join(k.key for k in path[1:-1]) for path, _ in dense if path[0].key.startswith("layer_") and path[-1].key == "kernel"})
    print("| setting | " + " | ".join(kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for name, fields in SETTINGS.items():
        got = jax.tree.leaves(grads(dataclasses.replace(base, **{"block": 16, **fields})))
        errors: dict[str, list[float]] = {}
        for (path, want), g in zip(dense, got):
            if path[0].key.startswith("layer_") and path[-1].key == "kernel":
                kind = "/".join(k.key for k in path[1:-1])
                errors.setdefault(kind, []).append(float(jnp.linalg.norm(g - want) / jnp.linalg.norm(want)))
        print(f"| {name} | " + " | ".join(f"{statistics.median(errors[k]):.4f}" for k in kinds) + " |")
    where = f"{args.workdir} at its last checkpoint, {args.batch} validation windows" if args.workdir else (
        f"initialisation, random tokens, B {args.batch}")
    print(f"\n(dim {shape.dim}, depth {shape.depth}, T {shape.seq_len}, vocabulary {shape.vocab_size}, {base.dtype} compute, {where}; "
          "||g - g_dense|| / ||g_dense|| of each kernel gradient, median over layers)")


def _kernels(tree) -> dict[str, jax.Array]:
    return {"/".join(k.key for k in path[:-1]): g for path, g in jax.tree_util.tree_flatten_with_path(tree)[0]
            if path[0].key.startswith("layer_") and path[-1].key == "kernel"}  # fmt: skip


def systematic(base: LMConfig, grads, batch: dict) -> None:
    """Per setting, medians over layers: the cosine between the errors of two half batches, and the projection on dense's."""
    tokens = batch["tokens"]
    halves = [{"tokens": tokens[: len(tokens) // 2]}, {"tokens": tokens[len(tokens) // 2 :]}]
    cos = lambda a, b: float(jnp.vdot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))  # noqa: E731
    dense = [_kernels(grads(base, h)) for h in halves]
    print("| setting | error cosine between halves (median / max over layers) | projection on dense (median / min) |")
    print("|---|---|---|")
    for name, fields in SETTINGS.items():
        got = [_kernels(grads(dataclasses.replace(base, **{"block": 16, **fields}), h)) for h in halves]
        cosines = [cos(got[0][k] - dense[0][k], got[1][k] - dense[1][k]) for k in dense[0]]
        projections = [float(jnp.vdot(got[i][k], dense[i][k]) / jnp.vdot(dense[i][k], dense[i][k])) for i in range(2) for k in dense[0]]
        print(f"| {name} | {statistics.median(cosines):.3f} / {max(cosines):.3f} | {statistics.median(projections):.4f} / {min(projections):.4f} |")


def trained(workdir: str, batch_size: int):
    """``(config without compression, shape, params at the last checkpoint, batch of validation windows)``."""
    import json
    import os

    import numpy as np
    import orbax.checkpoint as ocp

    from train import lm_data, run_dir
    from train.lm_loop import prepare_data

    saved = json.load(open(run_dir.config_path(workdir)))
    config = dataclasses.replace(LMConfig.from_json(saved["config"]), sparsity=0.0, storage_dtype=None, dx=None, stochastic=False,
                                 rounding="nearest", layer_sparsity=(), resume=False)  # fmt: skip
    _, tokenizer, _, val_stream = prepare_data(config)
    shape = model_shape(config, tokenizer.vocab_size)
    step = run_dir.latest_checkpoint_step(workdir)
    state = ocp.PyTreeCheckpointer().restore(os.path.abspath(os.path.join(run_dir.checkpoint_dir(workdir), str(step), "default")))
    params = jax.tree.map(jnp.asarray, state["params"])
    windows = lm_data.eval_windows(val_stream, shape.seq_len, batch_size)
    return config, shape, params, {"tokens": jnp.asarray(np.asarray(windows[:batch_size]), jnp.int32)}


if __name__ == "__main__":
    main()
