"""``train.lm``'s own training step, compiled for several devices of a deviceless target.

``sharded_step(config, target, devices)`` builds what ``lm_loop.train_and_evaluate`` compiles (the
same model, loss, AdamW, ``make_train_step`` and state shardings, ``--fsdp`` included) on a mesh of
``devices`` devices of ``"h100"`` (8 GPUs of one host) or ``"tpu-v5p"`` (a 2x2x2 slice), with no
data and nothing run: give its result to ``bsr_jax.compiled_memory(step, state, batch,
target=target, devices=devices)`` for the per-device peak and modelled time, collectives counted.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from bsr_jax.measure import compiled
from train import lm_loop, sharding
from train.lm_config import LMConfig


def sharded_step(config: LMConfig, target: str, devices: int) -> tuple[Any, Any, Any]:
    """``(step, state, batch)``: the jitted step and shape structs of its state and batch, placed
    as the loop places them on ``devices`` devices of ``target`` (``config.batch_size`` over all of
    them; the vocabulary is the config's ``vocab_size``)."""
    if config.batch_size % devices:
        raise ValueError(f"batch_size must be a multiple of the {devices} devices, got {config.batch_size}")
    mesh = compiled.target_mesh(target, devices)
    shape = lm_loop.model_shape(config, config.vocab_size)
    schedule = lm_loop.learning_rate_schedule(config)
    tx = lm_loop.create_optimizer(config, schedule)
    abstract = jax.eval_shape(lm_loop.initial_state(config, shape, tx))
    state_sharding = sharding.state_shardings(abstract, mesh, config.fsdp, lm_loop.stacked_layers(config))
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sharding)
    batch = {"tokens": jax.ShapeDtypeStruct((config.batch_size, shape.seq_len + 1), jnp.int32, sharding=sharding.batch_sharding(mesh))}
    loss_fn = lm_loop.loss_function(lm_loop.create_model(config, shape), config)
    step = lm_loop.make_train_step(loss_fn, tx, schedule, mesh, lm_loop.pruning_seed(config), state_sharding, config.fsdp,
                                   lm_loop.stacked_layers(config))
    return step, state, batch
