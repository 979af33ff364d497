"""Seconds per ResNet training step on CIFAR shapes, per width and configuration: what sizes the
accuracy study (``benchmarks/accuracy/resnet_study.py``, issue 14) to its time budget.

Each row takes one of the study's configurations (``benchmarks/accuracy/cifar_grid.py`` ``RESNET_STUDY``:
its ``train.cifar`` flags, with ``--dim`` set to the row's width), builds the run's own model and
jitted train step (``train.loop``: the model ``create_model`` makes, AdamW, BatchNorm statistics) at
batch 128, 32 px, compiles it, runs one warm-up step, then times ``--steps`` steps on random images
(no data loading, no evaluation). ``epochs/h`` is 3600 / (390 steps x s/step), the CIFAR-10 epochs an hour of this
machine's compute gives, evaluation excluded. Timings on a machine shared with other jobs are upper
bounds: say what else ran.

    python -m benchmarks.speed.resnet_step_time --widths 64 32 16 --steps 5

Writes nothing of its own: it sized docs/RESULTS.md section 8's ResNet study.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from train import loop, sharding
from train.config import CIFAR_DEFAULTS, TrainConfig, parse

from benchmarks.accuracy.cifar_grid import CONFIGS, RESNET_STUDY
from benchmarks.run_info import run_metadata, write_json

CIFAR_TRAIN_IMAGES = 50_000


def study_config(name: str, width: int, batch_size: int) -> TrainConfig:
    """The ``TrainConfig`` ``train.cifar`` makes of configuration ``name``'s flags at this width."""
    argv = [*CONFIGS[name], "--dim", str(width), "--batch-size", str(batch_size)]  # the last --dim wins
    return parse("train.cifar", "", CIFAR_DEFAULTS, ("cifar10",), argv)[0]


def step_seconds(config: TrainConfig, steps: int) -> float:
    """Mean wall seconds of ``steps`` train steps after one warm-up step (compilation excluded)."""
    mesh = sharding.make_mesh()
    model = loop.create_model(config, 10)
    steps_per_epoch = CIFAR_TRAIN_IMAGES // config.batch_size
    schedule = loop.learning_rate_schedule(config, steps_per_epoch)
    tx = loop.create_optimizer(config, schedule)
    shape = (config.batch_size, config.image_size, config.image_size, 3)
    state = loop.create_state(model, tx, shape, config.seed, mesh)
    step = loop.make_train_step(loop.loss_function(model, 10, config.label_smoothing), tx, schedule, mesh)
    keys = jax.random.split(jax.random.key(0), steps + 1)
    batches = [
        jax.device_put({"image": jax.random.normal(k, shape), "label": jnp.arange(shape[0]) % 10}, sharding.batch_sharding(mesh))
        for k in keys
    ]
    state, metrics = step(state, batches[0])
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for batch in batches[1:]:
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)  # one step in flight, as train.loop runs them
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 32, 16], help="--dim values (default: 64 32 16)")
    parser.add_argument("--configs", nargs="+", default=list(RESNET_STUDY), choices=list(RESNET_STUDY))
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (default: %(default)s)")
    parser.add_argument("--json", default="benchmarks/results/resnet_step_time.json")
    args = parser.parse_args()
    meta = run_metadata()
    rows = []
    print("| model | width | config | s/step | images/s | epochs/h |\n|---|---|---|---|---|---|")
    for width in args.widths:
        for name in args.configs:
            config = study_config(name, width, args.batch_size)
            seconds = step_seconds(config, args.steps)
            epochs_per_hour = 3600 / (seconds * (CIFAR_TRAIN_IMAGES // args.batch_size))
            rows.append(dict(model=config.model, width=width, config=name, step_s=seconds, epochs_per_hour=epochs_per_hour))
            print(f"| {config.model} | {width} | {name} | {seconds:.2f} | {args.batch_size / seconds:.0f} | {epochs_per_hour:.2f} |", flush=True)
    write_json(args.json, meta, {"rows": rows, "batch_size": args.batch_size, "steps": args.steps})


if __name__ == "__main__":
    main()
