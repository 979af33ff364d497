"""``train.lm``'s own training step, compiled for several devices of a deviceless target; and its
model, loss and FSDP placement for ``bsr_jax.plan`` over a mesh (``plan_inputs``).

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
import optax
from jax.sharding import AbstractMesh, AxisType

from bsr_jax.measure import compiled
from train import lm_loop, sharding
from train.lm_config import LMConfig


def _check_batch(config: LMConfig, devices: int) -> None:
    if config.batch_size % devices:
        raise ValueError(f"batch_size must be a multiple of the {devices} devices, got {config.batch_size}")


def sharded_step(config: LMConfig, target: str, devices: int) -> tuple[Any, Any, Any]:
    """``(step, state, batch)``: the jitted step and shape structs of its state and batch, placed
    as the loop places them on ``devices`` devices of ``target`` (``config.batch_size`` over all of
    them; the vocabulary is the config's ``vocab_size``)."""
    _check_batch(config, devices)
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


def plan_inputs(config: LMConfig, devices: int) -> tuple[Any, Any, Any, Any, optax.GradientTransformation]:
    """``(model, loss_fn, tokens, variables, optimizer)`` for ``bsr_jax.plan(model, loss_fn, tokens,
    variables=variables, optimizer=optimizer, ...)``: the dense LM of ``config`` (no remat or
    compression of its own: the plan chooses them), the next-token cross-entropy, and shape structs
    placed on an ``AbstractMesh`` of ``devices`` along ``"data"``: the batch split by rows, the
    parameters as ``--fsdp`` splits them (``sharding.fsdp_spec``; stacked layers not along the layer
    axis). The plan's step is ``jax.jit`` over these sharded arrays, which XLA's SPMD partitioner
    splits; with ``value_and_grad=fsdp_value_and_grad(config)`` it is the loop's own step instead."""
    _check_batch(config, devices)
    mesh = AbstractMesh((devices,), (sharding.DATA_AXIS,), axis_types=(AxisType.Auto,))
    shape = lm_loop.model_shape(config, config.vocab_size)
    model = lm_loop.create_model(config, shape, compressed=False)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(config.seed), jnp.zeros((1, shape.seq_len), jnp.int32)))
    placed = sharding.state_shardings(abstract, mesh, config.fsdp, lm_loop.stacked_layers(config))
    variables = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, placed)
    tokens = jax.ShapeDtypeStruct((config.batch_size, shape.seq_len + 1), jnp.int32, sharding=sharding.batch_sharding(mesh))

    def loss_fn(module, variables, tokens):  # the loop's loss, of the module plan gives it
        return lm_loop.loss_function(module, config)(variables["params"], {"tokens": tokens})[0]

    return model, loss_fn, tokens, variables, lm_loop.create_optimizer(config, lm_loop.learning_rate_schedule(config))


def fsdp_value_and_grad(config: LMConfig):
    """``plan(value_and_grad=...)`` for the loop's own ``--fsdp`` gradient: ``shard_map`` over the
    plan's mesh (``jax.sharding.get_abstract_mesh()`` while it traces), each device differentiating
    its rows, a scanned model's layers gathered layer by layer (``sharding.data_parallel_grad``)."""

    def value_and_grad(loss):
        def of(params, tokens):
            grad = sharding.data_parallel_grad(lambda p, b, rng: (loss(p, b), {}), jax.sharding.get_abstract_mesh(), config.fsdp,
                                               lm_loop.stacked_layers(config))  # fmt: skip
            (value, _), grads = grad(params, tokens)
            return value, grads

        return of

    return value_and_grad
