"""``python -m train.lm``'s loop: ``train_and_evaluate(config, workdir)`` for a decoder-only LM.

The pieces the image loop uses serve here too: the data-parallel step (``train.sharding``: each
device compresses its own shard's residuals, gradients ``pmean``-ed; with ``--fsdp`` parameters,
gradients and AdamW state sharded too), ``train.stopping`` (SIGINT /
SIGTERM stop after the step in flight, with a checkpoint), ``train.checkpoint`` (Orbax),
``train.metrics`` (``metrics.jsonl`` records, printed) and ``train.run_dir`` (the workdir's layout).
What differs: the data (``train.lm_data``: windows of a token stream, a function of (seed, step)),
the model (``train.lm_model``, compressed by ``bsr_jax.compress_model`` with rules by path), the
schedule (in steps) and the evaluation (validation loss every ``eval_every`` steps).

Records in ``WORKDIR/metrics.jsonl``: ``{"kind": "memory"}`` once (residual activation MiB per
device, the compiled step's peak and temporaries), ``{"kind": "train"}`` every ``log_every`` steps
(loss, gradient norm, learning rate, step time, tokens/s), ``{"kind": "eval"}`` (``val_loss``, its
perplexity, bits per byte of the validation text).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import bsr_jax
from bsr_jax.planning.options import OPTIONS
from train import lm_data, metrics, planning, run_dir, settings, sharding, steps, stopping
from train.checkpoint import Checkpoints
from train.data import prefetch
from train.lm_config import LMConfig, UsageError
from train.lm_model import LM, PRESETS, LMShape, head_kernel

MIB = 2**20


# ----------------------------------------------------------------------------- model & optimizer


def model_shape(config: LMConfig, vocab_size: int | None = None) -> LMShape:
    """The preset's shape with the config's overrides; ``vocab_size``: the tokenizer's (else the preset's)."""
    overrides = {k: getattr(config, k) for k in ("dim", "depth", "heads", "kv_heads", "seq_len") if getattr(config, k) is not None}
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    shape = dataclasses.replace(PRESETS[config.model], **overrides)
    if shape.dim % shape.heads or (shape.dim // shape.heads) % 2:
        raise UsageError(f"--dim {shape.dim} must be a multiple of --heads {shape.heads} with an even head dimension (RoPE rotates pairs)")
    if shape.heads % shape.kv:  # each key/value head serves a whole group of query heads
        divisors = [n for n in range(1, shape.heads + 1) if shape.heads % n == 0]
        raise UsageError(f"--kv-heads {shape.kv} must divide --heads {shape.heads}: one of {divisors}")
    return shape


def compression_rules(config: LMConfig, level: float = 1.0) -> list[bsr_jax.Rule]:
    """``compress_model``'s rules for ``config``, at ``level`` times its sparsities (the warmup):
    each ``--layer-sparsity`` first, then the head (dense unless ``--sparse-head``), then ``"*"``."""
    base = bsr_jax.Pruning(round(config.sparsity * level, 6), block=config.block, criterion=config.criterion,
                           selection=config.selection, storage_dtype=config.storage_dtype, stochastic=config.stochastic,
                           rounding=config.rounding)  # fmt: skip
    rules = [bsr_jax.Rule(p, dataclasses.replace(base, sparsity=round(v * level, 6))) for p, v in config.layer_sparsity]
    if not (config.tie or config.loss_chunk or config.sparse_head):  # with those the head is not a Dense call
        rules.append(bsr_jax.Rule("head", None))
    return [*rules, bsr_jax.Rule("*", base)]


def create_model(config: LMConfig, shape: LMShape, level: float = 1.0, compressed: bool = True):
    """``LM`` of ``shape``, through ``bsr_jax.compress_model`` when the config compresses anything
    (and ``compressed``): forward bit-identical, weight gradients from compressed residuals, and
    with ``dx`` input gradients from what norms, SwiGLU and attention keep in that format."""
    dtype = jnp.bfloat16 if config.dtype == "bfloat16" else jnp.float32
    model = LM(shape, tie=config.tie, scan=config.scan, remat=config.remat, remat_policy=OPTIONS[config.remat_policy].policy, dtype=dtype,
               attention=config.attention)  # fmt: skip
    if compressed and not config.compressed and config.remat_policy != "remat":
        # MaxText's named policies read the tensor names compress_model gives (its dense rule, lean off: nothing changes)
        return bsr_jax.compress_model(model, [bsr_jax.Rule("*", None)], lean=False)
    if not (compressed and config.compressed):
        return model
    return bsr_jax.compress_model(model, compression_rules(config, level), lean=config.lean, dx=config.dx)


def decay_mask(params: Any) -> Any:
    """Weight decay on kernels and embeddings, not on norm scales."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in ("kernel", "embedding"), params)


def learning_rate_schedule(config: LMConfig) -> optax.Schedule:
    """Linear warmup (at most 20% of the run), then cosine decay to ``min_lr`` at ``steps``."""
    warmup = min(config.warmup_steps, config.steps // 5)
    return optax.warmup_cosine_decay_schedule(0.0, config.lr, warmup, config.steps, end_value=config.min_lr)


def create_optimizer(config: LMConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(config.clip_norm), adamw) if config.clip_norm else adamw


def initial_state(config: LMConfig, shape: LMShape, tx: optax.GradientTransformation):
    """``() -> state``: step 0, the dense model's parameters from ``config.seed`` and ``tx``'s state."""

    def init():
        params = create_model(config, shape, compressed=False).init(jax.random.key(config.seed), jnp.zeros((1, shape.seq_len), jnp.int32))
        return {"step": jnp.zeros((), jnp.int32), "params": params["params"], "opt_state": tx.init(params["params"])}

    return init


def pruning_seed(config: LMConfig) -> int | None:
    """The seed of the steps' pruning keys: only where pruning or rounding is stochastic."""
    return config.seed if config.stochastic or config.rounding == "stochastic" else None


def loss_function(model, config: LMConfig):
    """``(params, batch, rng=None) -> (mean next-token cross-entropy, {})`` of ``batch["tokens"]``
    int32 ``(B, T + 1)``; with ``loss_chunk`` the head and loss run chunk by chunk
    (``bsr_jax.ops.losses``), never holding the ``(B, T, V)`` logits."""

    def loss_fn(params, batch, rng=None):
        inputs, labels = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        rngs = None if rng is None else {"pruning": rng}
        if config.loss_chunk:
            from bsr_jax.ops.losses import chunked_softmax_cross_entropy

            features = model.apply({"params": params}, inputs, features_only=True, rngs=rngs)
            w = head_kernel(params, config.tie)  # f32: its gradient accumulates over chunks in f32
            return chunked_softmax_cross_entropy(features, w, labels, chunk=config.loss_chunk).mean(), {}
        logits = model.apply({"params": params}, inputs, rngs=rngs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), {}

    return loss_fn


# ----------------------------------------------------------------------------- steps


def stacked_layers(config: LMConfig) -> str | None:
    """The parameters' key the FSDP step gathers layer by layer (``train.sharding``): a scanned
    model's stacked ``layers``; None unscanned, where every parameter is gathered at the start."""
    return "layers" if config.scan else None


def make_train_step(loss_fn, tx, schedule, mesh, rng_seed: int | None, state_sharding, fsdp: bool, layers: str | None = None):
    """Jitted ``(state, batch) -> (state, metrics)``, state donated and placed as ``state_sharding``
    (``sharding.state_shardings``: replicated, or sharded with ``fsdp``); step ``t`` draws its pruning
    randomness from ``fold_in(key(rng_seed), t)``, so a resumed run draws what an uninterrupted one would."""
    grad_fn = sharding.data_parallel_grad(loss_fn, mesh, fsdp, layers)

    def step(state, batch):
        rng = None if rng_seed is None else jax.random.fold_in(jax.random.key(rng_seed), state["step"])
        (loss, _), grads = grad_fn(state["params"], batch, rng)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"])}

    rep = sharding.replicated(mesh)
    return jax.jit(step, in_shardings=(state_sharding, sharding.batch_sharding(mesh)), out_shardings=(state_sharding, rep),
                   donate_argnums=0)  # fmt: skip


def make_eval_step(loss_fn, mesh, params_sharding):
    """Jitted ``(params, batch) -> summed token losses`` of a batch of windows; ``params`` placed as
    ``params_sharding``."""
    rep = sharding.replicated(mesh)

    def tokens(params, batch):
        # FSDP's shards gathered whole first: the evaluation is then the replicated run's program,
        # rather than whatever split of each product XLA would choose for sharded weights.
        params = jax.lax.with_sharding_constraint(params, rep)
        return loss_fn(params, batch)[0] * batch["tokens"][:, 1:].size

    return jax.jit(tokens, in_shardings=(params_sharding, sharding.batch_sharding(mesh)), out_shardings=rep)


def memory_report(loss_fn, dense_loss_fn, compiled, params, batch_shape: tuple[int, int], mesh) -> dict[str, Any]:
    """Per-device memory of a training step from shapes (nothing runs): residual activation MiB
    (``bsr_jax.residual_bytes`` at the per-device batch), dense's, and XLA's compiled peak / temp."""
    tokens = jax.ShapeDtypeStruct((batch_shape[0] // mesh.devices.size, batch_shape[1]), jnp.int32)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)

    def residual_mib(loss) -> float:
        kept = bsr_jax.residual_bytes(lambda p, t: loss(p, {"tokens": t}, jax.random.key(0))[0], params, tokens)
        return (kept.activations + kept.inputs) / MIB

    peak = bsr_jax.CompiledMemory.of(compiled)
    return {"kind": "memory", "per_device_batch": tokens.shape[0], "residual_activation_mib": residual_mib(loss_fn),
            "dense_residual_activation_mib": residual_mib(dense_loss_fn), "compiled_peak_mib": peak.peak / MIB,
            "compiled_temp_mib": peak.temp / MIB}  # fmt: skip


# ----------------------------------------------------------------------------- train_and_evaluate


def prepare_data(config: LMConfig) -> tuple[lm_data.Corpus, Any, np.ndarray, np.ndarray]:
    """``(corpus, tokenizer, train stream, validation stream)``; raises ``DataError``."""
    corpus = lm_data.find_corpus(config.data_dir, config.val_fraction)
    tokenizer = lm_data.load_tokenizer(config.tokenizer, corpus, config.vocab_size, config.cache_dir)
    name = "bytes" if config.tokenizer == "bytes" else f"bpe{config.vocab_size}"
    streams = [lm_data.token_stream(corpus, split, tokenizer, name, config.cache_dir) for split in ("train", "validation")]
    return corpus, tokenizer, *streams


def train_and_evaluate(config: LMConfig, workdir: str) -> dict[str, Any]:
    """Train ``config`` in ``workdir``.

    Returns ``{"memory", "train", "eval"}`` (the last record of each kind), ``"step"`` reached,
    ``"stopped_by"`` (the signal that stopped the run, or None) and ``"summary"``.

    Raises:
      train.data_sources.DataError: the corpus cannot be read or is too small (the message says why).
      UsageError: checkpoints in ``workdir`` without ``resume``; a batch that does not divide over
        the devices or is larger than the corpus; a ``--layer-sparsity`` pattern matching no layer.
      FloatingPointError: the loss became NaN or infinite.
    """
    started = time.perf_counter()
    saved = run_dir.read_saved(workdir) if config.resume else None  # a fresh run rewrites config.json, damaged or not
    done = settings.check_workdir(config, workdir, saved, lambda: run_dir.finished_at_step(workdir, config.stop_step))
    if done is not None:
        metrics.say(f"the run in {workdir} already finished at step {done}")
        return {"step": done, "stopped_by": None, "summary": None}
    planning.check_budget(config.memory_budget, UsageError)
    mesh = sharding.make_mesh()
    if config.batch_size % mesh.devices.size:
        raise UsageError(f"batch_size must be a multiple of the {mesh.devices.size} devices, got {config.batch_size}")

    # ------------------------------------------------------------------ data
    corpus, tokenizer, train_stream, val_stream = prepare_data(config)
    shape = model_shape(config, tokenizer.vocab_size)
    seq_len = shape.seq_len
    per_epoch = lm_data.steps_per_epoch(len(train_stream), seq_len, config.batch_size)
    if per_epoch < 1 or lm_data.windows_per_epoch(len(val_stream), seq_len) < 1:
        raise UsageError(f"the corpus holds {len(train_stream)} training and {len(val_stream)} validation tokens: too few for "
                         f"one batch of {config.batch_size} windows of {seq_len + 1}; lower --batch-size or --seq-len")  # fmt: skip
    val_windows = lm_data.eval_windows(val_stream, seq_len, config.eval_windows)
    os.makedirs(workdir, exist_ok=True)  # only now: a run without data leaves nothing behind

    # ------------------------------------------------------------------ model, optimizer, state
    schedule = learning_rate_schedule(config)
    tx = create_optimizer(config, schedule)
    model = create_model(config, shape)
    tokens_struct = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    planned = None
    if config.memory_budget is not None:
        example = {"tokens": jax.ShapeDtypeStruct((config.batch_size, seq_len + 1), jnp.int32)}
        resumed = (saved or {}).get("run", {}).get("plan") if config.resume else None
        model, planned = planning.planned_model(create_model(config, shape, compressed=False), lambda m: loss_function(m, config), example,
                                                tx, tokens_struct, config.memory_budget, config.target, UsageError, resumed)  # fmt: skip
    try:  # compress_model resolves its rules at init: a --layer-sparsity typo fails here
        jax.eval_shape(model.init, jax.random.key(0), tokens_struct)
    except ValueError as error:
        if "matched no layer" not in str(error):
            raise
        plain = jax.eval_shape(create_model(config, shape, compressed=False).init, jax.random.key(0), tokens_struct)
        paths = sorted({"/".join(k.key for k in path[:-1]) for path, _ in jax.tree_util.tree_flatten_with_path(plain)[0] if path[-1].key == "kernel"})
        raise UsageError(f"--layer-sparsity: {error}; the model's linear layers are {', '.join(paths)}") from None

    init = initial_state(config, shape, tx)
    state_sharding = sharding.state_shardings(jax.eval_shape(init), mesh, config.fsdp, stacked_layers(config))
    state = jax.jit(init, out_shardings=state_sharding)()
    checkpoints = Checkpoints(run_dir.checkpoint_dir(workdir), config.keep_checkpoints)
    if config.resume and checkpoints.latest_step() is not None:
        state = checkpoints.restore_newest_intact(state, metrics.say)
    start_step, stop_step = int(state["step"]), config.stop_step
    sharding.sync_processes("read the workdir")
    log = metrics.MetricsLog(workdir, keep_until_step=start_step if config.resume else None)
    batch_struct = {"tokens": jax.ShapeDtypeStruct((config.batch_size, seq_len + 1), jnp.int32, sharding=sharding.batch_sharding(mesh))}
    rng_seed = pruning_seed(config)

    def compile_step(level: float):
        level_model = model if planned else create_model(config, shape, level)
        step_fn = make_train_step(loss_function(level_model, config), tx, schedule, mesh, rng_seed, state_sharding, config.fsdp,
                                  stacked_layers(config))
        return step_fn.lower(state, batch_struct).compile()

    previous_env = os.environ.get(bsr_jax.backends.dispatch.ENV_VAR)
    if config.backend is not None:  # compress_model's layers read the dW backend from it when traced
        os.environ[bsr_jax.backends.dispatch.ENV_VAR] = config.backend
    try:
        train_steps = {1.0: compile_step(1.0)}
        num_params = sum(x.size for x in jax.tree.leaves(state["params"]))
        if jax.process_index() == 0 and (not config.resume or saved is None or {**config.to_json(), "resume": saved["config"]["resume"]} != saved["config"]):
            facts = dict(devices=mesh.devices.size, platform=jax.default_backend(), num_params=num_params, shape=dataclasses.asdict(shape),
                       tokens_per_step=config.batch_size * seq_len, steps_per_epoch=per_epoch, train_tokens=len(train_stream),
                       val_tokens=len(val_stream), val_windows=len(val_windows), corpus=corpus.describe())  # fmt: skip
            if planned:
                facts["plan"] = planned
            with open(run_dir.config_path(workdir), "w") as f:
                json.dump({"config": config.to_json(), "run": facts}, f, indent=2)
        loss_fn = loss_function(model, config)
        dense_loss = loss_function(create_model(config, shape, compressed=False), config)
        memory = memory_report(loss_fn, dense_loss, train_steps[1.0], state["params"], (config.batch_size, seq_len), mesh)
        log({"step": start_step, **memory})
        metrics.say(f"{num_params:,} params, {mesh.devices.size} device(s), {len(train_stream):,} training tokens "
                    f"({per_epoch} steps/epoch), steps {start_step} -> {stop_step}")  # fmt: skip
        run = _Run(config, workdir, mesh, seq_len, train_stream, val_windows, len(val_stream) / corpus.val_bytes, log, checkpoints,
                   compile_step, make_eval_step(dense_loss, mesh, state_sharding["params"]), started)  # fmt: skip
        return _train(run, state, train_steps, memory, start_step)
    finally:
        if previous_env is None:
            os.environ.pop(bsr_jax.backends.dispatch.ENV_VAR, None)
        else:
            os.environ[bsr_jax.backends.dispatch.ENV_VAR] = previous_env


@dataclasses.dataclass(frozen=True)
class _Run:
    """What the train loop reads and never changes."""

    config: LMConfig
    workdir: str
    mesh: Any
    seq_len: int
    train_stream: np.ndarray
    val_windows: np.ndarray  # int32 (W, seq_len + 1)
    val_tokens_per_byte: float  # of the validation text: bits per byte = loss / ln 2 x this
    log: metrics.MetricsLog
    checkpoints: Checkpoints
    compile_step: Any  # level -> compiled train step
    eval_step: Any
    started: float  # perf_counter at the start of train_and_evaluate


def _train(run: _Run, state, train_steps: dict[float, Any], memory: dict, start_step: int) -> dict[str, Any]:
    """Steps ``start_step`` -> ``config.stop_step``, evaluating, logging and saving as configured."""
    config, workdir, mesh, seq_len, val_windows = run.config, run.workdir, run.mesh, run.seq_len, run.val_windows
    log, checkpoints, eval_step, stop_step = run.log, run.checkpoints, run.eval_step, config.stop_step
    tokens_per_step = config.batch_size * seq_len
    usable = len(val_windows) - len(val_windows) % mesh.devices.size  # whole shards only

    def evaluate(step: int, state, stop: stopping.StopRequest) -> dict | None:
        """The eval record; None when a stop was requested (the evaluation is dropped: a resumed run redoes it)."""
        total = 0.0
        for i in range(0, usable, config.batch_size):
            if stop.agreed() is not None:
                return None
            rows = sharding.local_rows(val_windows[i : min(i + config.batch_size, usable)])
            total += float(eval_step(state["params"], {"tokens": jax.make_array_from_process_local_data(sharding.batch_sharding(mesh), rows)}))
        loss = total / (usable * seq_len)
        return {"kind": "eval", "step": step, "val_loss": loss, "val_perplexity": float(np.exp(min(loss, 50))),
                "val_bits_per_byte": loss / np.log(2) * run.val_tokens_per_byte}  # fmt: skip

    batches = lm_data.train_batches(run.train_stream, start_step, seed=config.seed, batch_size=config.batch_size, seq_len=seq_len)
    placed = prefetch(({"tokens": b} for b in map(sharding.local_rows, batches)), sharding=sharding.batch_sharding(mesh))
    state, result = steps.run_steps(
        state, placed, start_step=start_step, stop_step=stop_step,
        steps_per_epoch=lm_data.steps_per_epoch(len(run.train_stream), seq_len, config.batch_size),
        items_per_step=tokens_per_step, items="tokens", train_steps=train_steps, compile_step=run.compile_step,
        warmup_steps=config.sparsity_warmup_steps, log_every=config.log_every, checkpoint_every=config.checkpoint_every,
        eval_due=lambda step: step % config.eval_every == 0 or step == stop_step, evaluate=evaluate,
        evaluated=run_dir.evaluated_steps(workdir), checkpoints=checkpoints, log=log,
    )  # fmt: skip
    result["memory"] = memory
    step, stopped_by = result["step"], result["stopped_by"]
    result["summary"] = summary(workdir, step, stop_step, stopped_by, time.perf_counter() - run.started) if jax.process_index() == 0 else None
    return result


def summary(workdir: str, step: int, stop_step: int, stopped_by: int | None, wall_time_s: float) -> dict[str, Any]:
    """What the run achieved, from its records; printed as a block."""
    records = run_dir.read_records(workdir)
    evals = [r for r in records if r.get("kind") == "eval"]
    trains = [r for r in records if r.get("kind") == "train"]
    memory = [r for r in records if r.get("kind") == "memory"][-1]
    out = {
        "step": step, "stop_step": stop_step, "stopped_by": stopped_by, "wall_time_s": wall_time_s,
        "first_train_loss": trains[0]["loss"] if trains else None, "final_train_loss": trains[-1]["loss"] if trains else None,
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "best_val_loss": min((r["val_loss"] for r in evals), default=None),
        "tokens_per_s": trains[-1].get("tokens_per_s") if trains else None,
        "compiled_peak_mib": memory["compiled_peak_mib"], "residual_activation_mib": memory["residual_activation_mib"],
        "dense_residual_activation_mib": memory["dense_residual_activation_mib"],
        "checkpoint": os.path.join(run_dir.checkpoint_dir(workdir), str(step)),
    }  # fmt: skip
    status = f"{step} of {stop_step}" + (f", stopped by {signal.Signals(stopped_by).name}: continue with --resume" if stopped_by else "")
    fmt = lambda v: "-" if v is None else f"{v:.4f}"
    metrics.say("\n".join([
        f"run summary ({workdir})",
        f"  steps            {status}",
        f"  wall time        {wall_time_s:.0f} s (this session, data and compilation included)",
        f"  train loss       {fmt(out['first_train_loss'])} first record, {fmt(out['final_train_loss'])} last",
        f"  validation loss  {fmt(out['final_val_loss'])} final, {fmt(out['best_val_loss'])} best",
        f"  tokens/s         {out['tokens_per_s'] or 0:.0f} (last record)",
        *metrics.memory_summary(memory),
        f"  checkpoint       {out['checkpoint']}",
    ]))  # fmt: skip
    return out
