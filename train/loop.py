"""The train loop both CLIs share: ``train_and_evaluate(config, workdir)``.

One run: load the data, build the model (ResMLP, or ResNet with BatchNorm, whose ``batch_stats``
the state carries: updated by every train step, used as running averages in evaluation, saved in
checkpoints) and the optimizer, restore the last checkpoint if asked,
then train with a jitted, data-parallel step (see ``train.sharding`` for the per-device pruning
semantics and multi-host use), evaluating at the end of every epoch. Everything it reports is
printed and appended as JSON lines to ``WORKDIR/metrics.jsonl``:

* ``{"kind": "memory", ...}`` once: residual activation MiB per device (``bsr_jax.residual_bytes``
  of the loss at the per-device batch; what the backward pass keeps), the compiled step's peak and
  temporaries (XLA ``memory_analysis``; on CPU a secondary figure, see docs/memory.md), and the
  fraction of activation blocks the pruned layers really keep (capacities round up; absent for
  pooled convolutions, which keep no blocks);
* ``{"kind": "train", ...}`` every ``log_every`` steps: loss, accuracy, gradient norm, learning
  rate, step time, images/s, and the device's peak bytes where the backend reports them (GPU);
* ``{"kind": "eval", ...}`` after every epoch and at the end: test loss and accuracy.

The run ends with a summary (``train.metrics.run_summary``), printed and returned.
``WORKDIR/config.json`` holds the config and run facts; ``WORKDIR/checkpoints`` the Orbax
checkpoints (every ``checkpoint_every`` steps, at the end, and on SIGINT/SIGTERM, after which the
run stops within one step). A NaN or infinite loss stops the run with ``FloatingPointError``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from train import data, metrics, planning, progress, run_dir, settings, sharding, steps, stopping
from train.checkpoint import Checkpoints
from train.config import TrainConfig, UsageError
from bsr_jax.rewrite.schedules import SparsityRules, layer_sparsity, scale_rules
from train.models import check_layer_rules, create_model, dense_counterpart, predict

# {"step": int32 (), "params": pytree, "opt_state": pytree}, plus "batch_stats" for BatchNorm models.
State = dict[str, Any]


# ----------------------------------------------------------------------------- model & optimizer


def learning_rate_schedule(config: TrainConfig, steps_per_epoch: int) -> optax.Schedule:
    """Linear warmup (at most 20% of the run) then cosine decay to ``min_lr`` at the last epoch."""
    total = config.epochs * steps_per_epoch
    warmup = min(round(config.warmup_epochs * steps_per_epoch), total // 5)
    return optax.warmup_cosine_decay_schedule(0.0, config.lr, warmup, total, end_value=config.min_lr)


def decay_mask(params: Any) -> Any:
    """True for kernels only: no weight decay on biases, Affine (alpha, beta) and LayerScale."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", params)


def create_optimizer(config: TrainConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    if config.optimizer == "lamb":
        return optax.lamb(schedule, weight_decay=config.weight_decay, mask=decay_mask)
    return optax.adamw(schedule, weight_decay=config.weight_decay, mask=decay_mask)


def loss_function(model: nn.Module, num_classes: int, label_smoothing: float, rules: SparsityRules = ()):
    """``(params, batch, rng=None, batch_stats=None) -> (mean smoothed cross-entropy, {"accuracy"})``
    over the batch.

    ``rules`` are per-layer sparsities (``bsr_jax.rewrite.schedules.layer_sparsity``); ``rng`` feeds the
    ``"pruning"`` stream of stochastic layers. With ``batch_stats`` (a BatchNorm model) the model
    runs in training mode (batch statistics) and the aux also holds the updated ``"batch_stats"``.
    """

    def loss_fn(params, batch, rng=None, batch_stats=None):
        rngs = None if rng is None else {"pruning": rng}
        with layer_sparsity(rules):
            if batch_stats is None:
                logits = model.apply({"params": params}, batch["image"], rngs=rngs)
            else:
                variables = {"params": params, "batch_stats": batch_stats}
                logits, updated = model.apply(variables, batch["image"], train=True, mutable=["batch_stats"], rngs=rngs)
        targets = optax.smooth_labels(jax.nn.one_hot(batch["label"], num_classes), label_smoothing)
        loss = optax.softmax_cross_entropy(logits, targets).mean()
        aux = {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}
        if batch_stats is not None:
            aux["batch_stats"] = updated["batch_stats"]
        return loss, aux

    return loss_fn


# ----------------------------------------------------------------------------- steps


def create_state(model: nn.Module, tx: optax.GradientTransformation, image_shape, seed: int, mesh) -> State:
    """Initial state, replicated over ``mesh``. ``image_shape`` is ``(B, H, W, C)`` (B unused but > 0)."""

    def init():
        variables = model.init(jax.random.key(seed), jnp.zeros(image_shape, jnp.float32))
        params = variables["params"]
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
        if "batch_stats" in variables:
            state["batch_stats"] = variables["batch_stats"]
        return state

    return jax.jit(init, out_shardings=sharding.replicated(mesh))()


def make_train_step(loss_fn, tx: optax.GradientTransformation, schedule: optax.Schedule, mesh, rng_seed: int | None = None):
    """Jitted ``(state, batch) -> (state, metrics)``; the state is donated, the batch is sharded.

    With ``rng_seed``, step ``t`` draws its pruning randomness from ``fold_in(key(rng_seed), t)``,
    so a resumed run draws what the uninterrupted one would have.
    """
    grad_fn = sharding.data_parallel_grad(loss_fn, mesh)

    def step(state, batch):
        rng = None if rng_seed is None else jax.random.fold_in(jax.random.key(rng_seed), state["step"])
        (loss, aux), grads = grad_fn(state["params"], batch, rng, state.get("batch_stats"))
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        if "batch_stats" in state:
            new_state["batch_stats"] = aux.pop("batch_stats")
        reported = {"loss": loss, **aux, "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"])}
        return new_state, reported

    rep = sharding.replicated(mesh)
    return jax.jit(step, in_shardings=(rep, sharding.batch_sharding(mesh)), out_shardings=(rep, rep), donate_argnums=0)


def make_eval_step(model: nn.Module, mesh):
    """Jitted ``(variables, batch) -> {"loss_sum", "correct", "count"}`` over the real (mask 1)
    examples; ``variables``: ``model_variables(state)``."""

    def step(variables, batch):
        logits = predict(model, variables, batch["image"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        correct = (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
        mask = batch["mask"]
        return {"loss_sum": jnp.sum(losses * mask), "correct": jnp.sum(correct * mask), "count": jnp.sum(mask)}

    rep = sharding.replicated(mesh)
    return jax.jit(step, in_shardings=(rep, sharding.batch_sharding(mesh)), out_shardings=rep)


def model_variables(state: State) -> dict[str, Any]:
    """The model's variables in ``state``: params, and batch_stats where the model has them."""
    return {name: state[name] for name in ("params", "batch_stats") if name in state}


def evaluate(eval_step, variables, batches: Iterator[dict], mesh, num_batches: int, stop: stopping.StopRequest | None = None):
    """``{"test_loss", "test_accuracy"}`` over ``batches``, with a progress bar; None when ``stop``
    was requested on the way (the evaluation is abandoned: a resumed run redoes it)."""
    totals = None
    placed = data.prefetch(map(sharding.local_rows, batches), sharding=sharding.batch_sharding(mesh))
    with contextlib.closing(placed):
        for batch in progress.bar(placed, total=num_batches, desc="evaluating", unit="batch", leave=False, hidden=_quiet()):
            if stop is not None and stop.agreed() is not None:
                return None
            out = eval_step(variables, batch)
            totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
    totals = jax.device_get(totals)
    return {"test_loss": float(totals["loss_sum"] / totals["count"]), "test_accuracy": float(totals["correct"] / totals["count"])}


# ----------------------------------------------------------------------------- train_and_evaluate


def train_and_evaluate(config: TrainConfig, workdir: str) -> dict[str, Any]:
    """Train ``config`` in ``workdir``.

    Returns:
      ``{"memory", "train", "eval"}`` (the last record of each kind; "train" and "eval" are absent
      when no step ran), ``"step"`` reached, ``"stopped_by"``: the signal number that stopped the
      run early (by any process of the run), or None, and ``"summary"`` (``train.metrics.run_summary``;
      None on processes other than 0, which do not own the records). A resumed run that had
      already finished returns ``{"step", "stopped_by": None, "summary": None}`` and writes nothing.

    Raises:
      train.data.DataError: the dataset cannot be found, read or downloaded (the message says why).
      train.config.UsageError: workdir holds checkpoints but ``config.resume`` is false; a resumed
        run's settings differ from its config.json; a batch size does not divide over the devices.
      FloatingPointError: the loss became NaN or infinite.
    """
    started = time.perf_counter()
    saved = run_dir.read_saved(workdir) if config.resume else None  # a fresh run rewrites config.json, damaged or not
    # Evaluations the run already logged, read by every process before process 0 rewrites the log.
    evaluated = run_dir.evaluated_steps(workdir) if config.resume else set()
    done = settings.check_workdir(config, workdir, saved, lambda: run_dir.finished_at(workdir, config.steps, config.epochs))
    if done is not None:
        metrics.say(f"the run in {workdir} already finished at step {done}")
        return {"step": done, "stopped_by": None, "summary": None}
    check_layer_rules(config)  # before the data: a typo should not wait for a download
    planning.check_budget(config.memory_budget, UsageError)
    mesh = sharding.make_mesh()
    for name, size in (("batch_size", config.batch_size), ("eval_batch_size", config.eval_batch_size)):
        if size % mesh.devices.size:
            raise UsageError(f"{name} must be a multiple of the {mesh.devices.size} devices, got {size}")
    checkpoints = Checkpoints(run_dir.checkpoint_dir(workdir), config.keep_checkpoints)

    # ------------------------------------------------------------------ data
    # CIFAR and pad-crop augmentation use images at their stored size; otherwise the data layer
    # stores squares of side image_size / 0.875 and batches are cropped to image_size.
    native = config.dataset in ("cifar10", "cifar100") or config.augment == "cifar"
    load = dict(data_dir=config.data_dir, cache_dir=config.cache_dir, image_size=None if native else config.image_size)
    train_data = data.load_split(config.dataset, "train", **load)
    test_data = data.load_split(config.dataset, "test", **load)
    crop = None if config.augment == "cifar" else config.image_size
    (height, width), size = train_data.images.shape[1:3], config.image_size
    resize = "--dataset imagefolder --augment imagenet (or none) --image-size N to resize them to N x N"
    if crop is None and (height, width) != (size, size):
        smaller = ", or --augment imagenet" if size < height else ""  # crops of the stored images
        fix = f"pass --image-size {height}{smaller}" if height == width else f"pass {resize}"
        raise UsageError(f"--image-size {size} does not match the {height}x{width} {config.dataset} images, which "
                         f"--augment cifar keeps as stored: {fix}")  # fmt: skip
    if crop is not None and crop > min(height, width):  # only CIFAR's images are not stored larger than the crop
        raise UsageError(f"--image-size {size} is larger than the {height}x{width} {config.dataset} images that "
                         f"--augment {config.augment} crops from: pass --image-size {min(height, width)} or less, or {resize}")  # fmt: skip
    if config.batch_size > len(train_data):
        raise UsageError(f"--batch-size {config.batch_size} is more than the {len(train_data)} training images: "
                         f"it must be in [1, {len(train_data)}]")  # fmt: skip
    steps_per_epoch = data.steps_per_epoch(train_data, config.batch_size)
    os.makedirs(workdir, exist_ok=True)  # only now: a run without data leaves nothing behind
    total_steps = config.epochs * steps_per_epoch
    stop_step = run_dir.stop_step(config.steps, config.epochs, steps_per_epoch)

    # ------------------------------------------------------------------ model, optimizer, state
    model = create_model(config, train_data.num_classes)
    schedule = learning_rate_schedule(config, steps_per_epoch)
    tx = create_optimizer(config, schedule)
    image_shape = (config.batch_size, config.image_size, config.image_size, 3)
    planned = None
    if config.memory_budget is not None:
        example = {"image": jax.ShapeDtypeStruct(image_shape, jnp.float32), "label": jax.ShapeDtypeStruct(image_shape[:1], jnp.int32)}
        loss_of = lambda m: loss_function(m, train_data.num_classes, config.label_smoothing)  # noqa: E731
        resumed = (saved or {}).get("run", {}).get("plan") if config.resume else None
        model, planned = planning.planned_model(model, loss_of, example, tx, example["image"], config.memory_budget, config.target, UsageError, resumed)
    loss_fn = loss_function(model, train_data.num_classes, config.label_smoothing, config.layer_sparsity)
    state = create_state(model, tx, image_shape, config.seed, mesh)
    if config.resume and checkpoints.latest_step() is not None:
        state = checkpoints.restore_newest_intact(state, metrics.say)
    start_step = int(state["step"])
    sharding.sync_processes("read the workdir")  # before process 0 rewrites metrics.jsonl and config.json
    log = metrics.MetricsLog(workdir, keep_until_step=start_step if config.resume else None)
    batch_struct = {
        "image": jax.ShapeDtypeStruct(image_shape, jnp.float32, sharding=sharding.batch_sharding(mesh)),
        "label": jax.ShapeDtypeStruct(image_shape[:1], jnp.int32, sharding=sharding.batch_sharding(mesh)),
    }
    rng_seed = config.seed if config.stochastic or config.rounding == "stochastic" else None
    warmup_steps = round(config.sparsity_warmup_epochs * steps_per_epoch)

    def compile_step(level: float):
        level_model = model if planned else create_model(config, train_data.num_classes, level)
        rules = scale_rules(config.layer_sparsity, level)
        level_loss = loss_function(level_model, train_data.num_classes, config.label_smoothing, rules)
        return make_train_step(level_loss, tx, schedule, mesh, rng_seed).lower(state, batch_struct).compile()

    # One executable per sparsity level (a single one without warmup), compiled on first use; the
    # full-sparsity one is compiled here and reports the memory of the run's steady state.
    train_steps = {1.0: compile_step(1.0)}
    eval_step = make_eval_step(model, mesh)
    num_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    # A resumed run keeps its config.json, rewritten only for changed RESUME_OVERRIDES.
    fresh = saved is None or not config.resume
    if jax.process_index() == 0 and (fresh or {**config.to_json(), "resume": saved["config"]["resume"]} != saved["config"]):
        run = dict(
            devices=mesh.devices.size,
            platform=jax.default_backend(),
            num_params=num_params,
            steps_per_epoch=steps_per_epoch,
            total_steps=total_steps,
            train_examples=len(train_data),
            test_examples=len(test_data),
        )
        if planned:
            run["plan"] = planned
        with open(run_dir.config_path(workdir), "w") as f:
            json.dump({"config": config.to_json(), "run": run}, f, indent=2)
    dense = dense_counterpart(config)
    dense_loss = loss_function(create_model(dense, train_data.num_classes), train_data.num_classes, config.label_smoothing)
    memory = metrics.memory_report(model, loss_fn, train_steps[1.0], state, image_shape, mesh, config.layer_sparsity, dense_loss_fn=dense_loss)
    log({"step": start_step, **memory})
    metrics.say(f"{num_params:,} params, {mesh.devices.size} device(s), {steps_per_epoch} steps/epoch, steps {start_step} -> {stop_step}")

    # ------------------------------------------------------------------ train
    eval_batches = math.ceil(len(test_data) / config.eval_batch_size)

    def evaluate_step(step: int, state, stop: stopping.StopRequest) -> dict | None:
        test_batches = data.eval_batches(test_data, config.eval_batch_size, image_size=crop)
        scores = evaluate(eval_step, model_variables(state), test_batches, mesh, eval_batches, stop)
        return None if scores is None else {"kind": "eval", "step": step, "epoch": step / steps_per_epoch, **scores}

    state, result = steps.run_steps(
        state, _batches_from(start_step, steps_per_epoch, train_data, config, crop, mesh), start_step=start_step,
        stop_step=stop_step, steps_per_epoch=steps_per_epoch, items_per_step=config.batch_size, items="images",
        train_steps=train_steps, compile_step=compile_step, warmup_steps=warmup_steps, log_every=config.log_every,
        checkpoint_every=config.checkpoint_every, eval_due=lambda step: step % steps_per_epoch == 0 or step == stop_step,
        evaluate=evaluate_step, evaluated=evaluated, checkpoints=checkpoints, log=log,
    )  # fmt: skip
    result["memory"] = memory
    step, stopped_by = result["step"], result["stopped_by"]
    if jax.process_index() != 0:  # the records are process 0's
        return {**result, "summary": None}
    result["summary"] = metrics.run_summary(
        workdir, run_dir.read_records(workdir), step=step, stop_step=stop_step, stopped_by=stopped_by,
        wall_time_s=time.perf_counter() - started, checkpoint=os.path.join(run_dir.checkpoint_dir(workdir), str(step)),
    )  # fmt: skip
    return result


def _quiet() -> bool:
    """Progress bars on process 0 only (and there, as every bar, on a terminal only: ``train.progress``)."""
    return jax.process_index() != 0


def _batches_from(step: int, steps_per_epoch: int, train_data: data.ArrayDataset, config: TrainConfig, crop, mesh) -> Iterator[dict]:
    """Device-placed training batches from global step ``step`` on, epoch after epoch."""
    epoch, start_batch = divmod(step, steps_per_epoch)
    while True:
        batches = data.train_batches(
            train_data, config.batch_size, seed=config.seed, epoch=epoch, start_batch=start_batch,
            augment=config.augment, image_size=crop,
        )  # fmt: skip
        with contextlib.closing(data.prefetch(map(sharding.local_rows, batches), sharding=sharding.batch_sharding(mesh))) as placed:
            yield from placed
        epoch, start_batch = epoch + 1, 0
