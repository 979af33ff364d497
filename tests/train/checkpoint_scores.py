"""A run's test loss and accuracy recomputed from its saved checkpoint, apart from ``train.loop``.

Tests compare these with what ``train_and_evaluate`` reported: the loop evaluates in padded,
masked, sharded batches and sums per batch; this is one forward pass over the real examples, so
the two agree only if the loop's padding, masking, summation and sharding are right.
"""

from __future__ import annotations

import json

import jax
import numpy as np

from train import augment, data, loop, models, run_dir, sharding
from train.checkpoint import Checkpoints
from train.config import TrainConfig


def checkpoint_scores(workdir: str, step: int) -> dict[str, float]:
    """``{"test_loss", "test_accuracy", "test_examples"}`` of checkpoint ``step`` in ``workdir``.

    The run's config.json rebuilds the model and finds the test split (loaded with
    ``train.data.load_split``); all of it goes through the model at once (float32 logits, float64 loss). Only runs that
    evaluate at the images' stored size (augment "cifar") are supported.
    """
    with open(run_dir.config_path(workdir)) as f:
        config = TrainConfig.from_json(json.load(f)["config"])
    if config.augment != "cifar":
        raise ValueError(f"checkpoint_scores needs a run with augment 'cifar', got {config.augment!r}")
    test = data.load_split(config.dataset, "test", data_dir=config.data_dir, cache_dir=config.cache_dir, image_size=None)
    model = loop.create_model(config, test.num_classes)
    tx = loop.create_optimizer(config, loop.learning_rate_schedule(config, steps_per_epoch=1))
    image_shape = (1, *test.images.shape[1:])
    like = loop.create_state(model, tx, image_shape, config.seed, sharding.make_mesh(jax.devices()[:1]))
    checkpoints = Checkpoints(run_dir.checkpoint_dir(workdir))
    variables = loop.model_variables(checkpoints.restore(like, step))  # params (and batch_stats)
    checkpoints.close()
    images = augment.normalize(test.images, test.mean, test.std)
    logits = np.asarray(jax.jit(lambda v, x: models.predict(model, v, x))(variables, images), np.float64)
    top = logits.max(-1)
    log_normaliser = top + np.log(np.exp(logits - top[:, None]).sum(-1))
    losses = log_normaliser - logits[np.arange(len(test.labels)), test.labels]
    return {
        "test_loss": float(np.mean(losses)),
        "test_accuracy": float(np.mean(np.argmax(logits, -1) == test.labels)),
        "test_examples": len(test.labels),
    }
