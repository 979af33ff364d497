"""Per-layer weight-gradient error on real data, for every pruning option, from a trained run.

Loads a ``train.cifar`` run (its ``config.json`` and latest checkpoint) and one batch of real test
images, and reports for every pruned layer the relative error ``||g - g_dense|| / ||g_dense||``
of the parameter that pruning touches (Dense ``kernel``, Affine ``alpha``, LayerScale ``scale``;
biases, shifts and all input gradients are exact):

* ``s<S>``: sparsity S at ``--block`` with f32 blocks (``bsr_jax.rewrite.sensitivity``; because the forward
  pass and input gradients are exact, pruning all layers at once gives each layer the error it
  would have if pruned alone). Listed: the layers the run's model prunes (the blocks' linears,
  and Affine/LayerScale with ``--prune-scale-shift``);
* ``s0.7 <dtype>``: kept blocks stored as bfloat16 / int8 / float8_e4m3fn; the ``quant`` columns
  give the error against the f32-block gradient at the same sparsity (the rounding alone);
* ``s0.7 stochastic``: one draw of unbiased magnitude-proportional sampling, and the mean of
  ``--draws`` draws (its error shrinks towards 0 as draws grow if the estimate is unbiased).

    python -m benchmarks.accuracy.sensitivity --run runs/cifar_grid/dense-seed0 --data-dir ../shared/data/cifar10-jpg.tar.gz

Writes docs/RESULTS.md section 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp

from bsr_jax.rewrite.schedules import prunable_layer_paths
from bsr_jax.rewrite.sensitivity import gradient_sensitivity, layer_params, relative_error
from benchmarks.run_info import run_metadata, write_json
from train import data, loop, sharding
from train.checkpoint import Checkpoints
from train.config import TrainConfig

STORAGE_DTYPES = ("bfloat16", "int8", "float8_e4m3fn")


def load_run(run: str, data_dir: str | None) -> TrainConfig:
    """The run's training config, reading data from ``data_dir`` if given, never resuming."""
    with open(os.path.join(run, "config.json")) as f:
        fields = json.load(f)["config"]
    fields["layer_sparsity"] = tuple(tuple(rule) for rule in fields["layer_sparsity"])
    config = TrainConfig(**fields)
    return dataclasses.replace(config, data_dir=data_dir or config.data_dir, resume=False)


def pruned_by(config: TrainConfig, params: dict, path: str) -> bool:
    """Whether ``config``'s model prunes layer ``path`` (at non-zero sparsity)."""
    if "kernel" not in layer_params(params, path):
        return config.prune_scale_shift  # Affine / LayerScale
    return path.startswith("block") or (path, True) in (("stem", config.sparse_stem), ("head", config.sparse_head))


def measure(args) -> dict:
    config = load_run(args.run, args.data_dir)
    base = dataclasses.replace(
        config, sparsity=0.0, block=args.block, storage_dtype=None, stochastic=False,
        prune_scale_shift=args.prune_scale_shift, layer_sparsity=(),
    )  # fmt: skip
    test = data.load_split(base.dataset, "test", data_dir=base.data_dir, cache_dir=base.cache_dir)
    batch = next(data.eval_batches(test, args.batch_size))
    batch = {"image": jnp.asarray(batch["image"]), "label": jnp.asarray(batch["label"])}

    mesh = sharding.make_mesh(jax.devices()[:1])
    model = loop.create_model(base, test.num_classes)
    tx = loop.create_optimizer(base, loop.learning_rate_schedule(base, steps_per_epoch=1))
    state = loop.create_state(model, tx, batch["image"].shape, base.seed, mesh)
    checkpoints = Checkpoints(os.path.join(args.run, "checkpoints"))
    step = checkpoints.latest_step()
    params = {"params": checkpoints.restore(state)["params"]}
    checkpoints.close()
    paths = [p for p in prunable_layer_paths(model.apply, params, batch["image"]) if pruned_by(base, params["params"], p)]

    def grad_fn(variant: TrainConfig):
        loss_fn = loop.loss_function(loop.create_model(variant, test.num_classes), test.num_classes, base.label_smoothing)
        grad = jax.jit(jax.grad(lambda p, b, r: loss_fn(p, b, r)[0]))
        return lambda rng=None: grad(params["params"], batch, rng)

    def grads_for(variant: TrainConfig) -> dict:
        return grad_fn(variant)()

    def loss(p, b):
        return loop.loss_function(model, test.num_classes, base.label_smoothing)(p["params"], b)[0]

    print(f"# {args.run} step {step}: {len(paths)} layers, batch {args.batch_size}", file=sys.stderr, flush=True)
    table = {path: {} for path in paths}
    for path, errors in gradient_sensitivity(loss, params, batch, paths=paths, sparsities=args.sparsities).items():
        table[path].update({f"s{s}": e for s, e in errors.items()})
    dense = grads_for(base)
    pruned = grads_for(dataclasses.replace(base, sparsity=args.sparsity))
    for dtype in STORAGE_DTYPES:
        print(f"# storage {dtype}", file=sys.stderr, flush=True)
        quantized = grads_for(dataclasses.replace(base, sparsity=args.sparsity, storage_dtype=dtype))
        for path in paths:
            table[path][f"s{args.sparsity} {dtype}"] = relative_error(quantized, dense, path)
            table[path][f"s{args.sparsity} {dtype} quant"] = relative_error(quantized, pruned, path)
    print(f"# stochastic, {args.draws} draws", file=sys.stderr, flush=True)
    sample = grad_fn(dataclasses.replace(base, sparsity=args.sparsity, stochastic=True))
    draws = [sample(jax.random.key(i)) for i in range(args.draws)]
    mean = jax.tree.map(lambda *g: sum(g) / len(g), *draws)
    for path in paths:
        table[path][f"s{args.sparsity} stochastic"] = relative_error(draws[0], dense, path)
        table[path][f"s{args.sparsity} stochastic mean{args.draws}"] = relative_error(mean, dense, path)
    return dict(run=args.run, checkpoint_step=step, block=args.block, batch_size=args.batch_size,
                prune_scale_shift=args.prune_scale_shift, errors=table)  # fmt: skip


def print_table(result: dict) -> None:
    table = result["errors"]
    columns = list(next(iter(table.values())))
    print("| layer | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for path, errors in [*table.items(), ("mean", {c: sum(e[c] for e in table.values()) / len(table) for c in columns})]:
        print(f"| {path} | " + " | ".join(f"{errors[c]:.3f}" for c in columns) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="workdir of a finished train.cifar run (config.json, checkpoints/)")
    parser.add_argument("--data-dir", help="overrides the run's --data-dir")
    parser.add_argument("--batch-size", type=int, default=256, help="test images in the batch (default: %(default)s)")
    parser.add_argument("--block", type=int, default=16, help="square block size (default: %(default)s)")
    parser.add_argument("--sparsities", nargs="+", type=float, default=[0.3, 0.5, 0.7, 0.9], help="default: 0.3 0.5 0.7 0.9")
    parser.add_argument("--sparsity", type=float, default=0.7,
                        help="sparsity of the storage-dtype and stochastic columns (default: %(default)s)")
    parser.add_argument("--draws", type=int, default=8, help="stochastic draws averaged (default: %(default)s)")
    parser.add_argument("--prune-scale-shift", action="store_true", help="also prune Affine and LayerScale inputs")
    parser.add_argument("--out", default="benchmarks/results/sensitivity.json", help="JSON path (default: %(default)s)")
    args = parser.parse_args()
    meta = run_metadata()
    result = measure(args)
    print_table(result)
    write_json(args.out, meta, result)


if __name__ == "__main__":
    main()
