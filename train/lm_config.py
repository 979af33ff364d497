"""``python -m train.lm``'s configuration: one frozen dataclass and its flags (``--batch-size`` ->
``batch_size``), as ``train.config`` does for the image CLIs; ``--resume`` follows
``train.settings``' rule, with ``RESUME_OVERRIDES`` the flags a resumed run may change.

Nothing here imports JAX, so ``--help`` and flag errors answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import ClassVar, Literal

from bsr_jax.planning.options import OPTIONS
from train import common_config, settings
from train.common_config import CommonSettings, Dtype
from train.options import DX_FORMATS
from train.settings import UsageError  # noqa: F401  (re-exported for train.lm's modules)

# train.lm_model.PRESETS' and train.lm_data.TOKENIZERS' names, repeated to stay JAX-free (a test keeps them equal).
LM_MODELS = ("cpu", "gpt2-small", "1b", "8b")
TOKENIZERS = ("bpe", "bytes")
ATTENTIONS = ("xla", "flash")  # train.lm_attention.ATTENTIONS
# bsr_jax.plan's remat options (bsr_jax.planning.options.OPTIONS): what --remat-policy names.
REMAT_POLICIES = tuple(name for name, option in OPTIONS.items() if option.remat)
# Where a resumed run stops, where its caches and logs are, how it computes dW (backends agree to
# rounding): nothing that changes what a step computes.
RESUME_OVERRIDES = ("stop_at", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "cache_dir", "backend")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMConfig(CommonSettings):
    """Everything an LM run depends on. ``stop_at`` and ``resume`` only decide where it stops/starts."""

    RESUME_OVERRIDES: ClassVar[tuple[str, ...]] = RESUME_OVERRIDES
    WRITER: ClassVar[str] = "train.lm"
    LAYOUT: ClassVar[tuple[str, ...]] = (
        "data_dir", "cache_dir", "val_fraction", "tokenizer", "vocab_size",
        "model", "dim", "depth", "heads", "kv_heads", "seq_len", "attention", "tie", "scan", "remat", "remat_policy", "dtype",
        "loss_chunk",
        "sparsity", "block", "criterion", "selection", "backend", "storage_dtype", "rounding", "stochastic", "sparse_head",
        "lean", "sparsity_warmup_steps", "layer_sparsity",
        "dx", "memory_budget", "target",
        "lr", "min_lr", "weight_decay", "warmup_steps", "clip_norm", "batch_size", "fsdp", "steps", "seed",
        "stop_at", "eval_every", "eval_windows", "log_every", "checkpoint_every", "keep_checkpoints", "resume",
    )  # fmt: skip

    # Data.
    val_fraction: float = 0.05
    tokenizer: Literal["bpe", "bytes"] = "bpe"
    vocab_size: int = 8192
    # Model.
    model: str = "cpu"
    heads: int | None = None
    kv_heads: int | None = None
    seq_len: int | None = None
    attention: Literal["xla", "flash"] = "xla"
    tie: bool = False
    scan: bool = False
    remat_policy: str = "remat"
    loss_chunk: int = 0
    # Compressed residuals (bsr_jax.compress_model with one Rule per --layer-sparsity, then "*").
    lean: bool = True
    sparsity_warmup_steps: int = 0
    # Optimisation.
    warmup_steps: int = 100
    clip_norm: float = 1.0
    steps: int = 2000
    # Data parallelism: parameters, gradients and AdamW state sharded over the devices (train.sharding's FSDP).
    fsdp: bool = False
    # Run control and logging.
    stop_at: int | None = None
    eval_every: int = 200
    eval_windows: int = 64
    # Shared settings whose defaults differ from the image trainers'.
    dtype: Dtype = "bfloat16"
    lr: float = 3e-3
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    batch_size: int = 16
    log_every: int = 20
    checkpoint_every: int = 500

    def checks(self) -> dict[str, tuple[bool, str]]:
        checks = super().checks()
        dx_ok, dx_allowed = checks["dx"]
        return {
            **checks,
            "val_fraction": (0 < self.val_fraction < 1, "in (0, 1)"),
            "tokenizer": (self.tokenizer in TOKENIZERS, f"one of {TOKENIZERS}"),
            "vocab_size": (self.vocab_size >= 258, ">= 258 (the 256 bytes, one merge and the end-of-file token)"),
            "model": (self.model in LM_MODELS, f"one of {LM_MODELS}"),
            "heads": (self.heads is None or self.heads >= 1, ">= 1"),
            "kv_heads": (self.kv_heads is None or self.kv_heads >= 1, ">= 1 (and dividing --heads)"),
            "seq_len": (self.seq_len is None or self.seq_len >= 1, ">= 1"),
            "attention": (self.attention in ATTENTIONS, f"one of {ATTENTIONS}"),
            "remat_policy": (self.remat_policy in REMAT_POLICIES and (self.remat or self.remat_policy == "remat"),
                             f"one of {REMAT_POLICIES}, with --remat"),
            "loss_chunk": (self.loss_chunk >= 0, ">= 0 (0: the plain head and loss)"),
            "sparse_head": (
                not (self.sparse_head and (self.tie or self.loss_chunk)),
                "off with --tie or --loss-chunk (the head is then the embedding, or a product inside the chunked loss)",
            ),
            "sparsity_warmup_steps": (self.sparsity_warmup_steps >= 0, ">= 0"),
            "dx": (dx_ok and (self.dx is None or self.lean), dx_allowed + ", with --lean (compress_model's lean pass stores what it keeps)"),
            "min_lr": (self.min_lr >= 0, ">= 0"),
            "warmup_steps": (self.warmup_steps >= 0, ">= 0"),
            "clip_norm": (self.clip_norm >= 0, ">= 0 (0: no clipping)"),
            "steps": (self.steps >= 1, ">= 1"),
            "stop_at": (self.stop_at is None or self.stop_at >= 1, ">= 1 or None"),
            "eval_every": (self.eval_every >= 1, ">= 1"),
            "eval_windows": (self.eval_windows >= 1, ">= 1"),
        }

    @property
    def compressed(self) -> bool:
        """Whether any layer keeps a compressed residual (else the plain model runs)."""
        return self.sparsity > 0 or self.storage_dtype is not None or bool(self.layer_sparsity) or self.dx is not None

    @property
    def stop_step(self) -> int:
        return min(self.stop_at or self.steps, self.steps)


# train.lm's own --help texts, and its wording of shared ones (train.common_config.HELP: the rest).
HELP = {
    "data_dir": "a folder of text files to train on (every file under it; 5%% of them, by path hash, for validation); "
    "default: this Python's standard library, its *.py files",
    "cache_dir": "where tokenizers and token streams are cached; default $BSR_JAX_CACHE or ~/.cache/bsr_jax",
    "val_fraction": "fraction of the files (by a hash of their path) held out for validation",
    "tokenizer": "'bpe': byte-level BPE trained on the training split (Hugging Face tokenizers); 'bytes': UTF-8 bytes",
    "vocab_size": "BPE vocabulary size (end-of-file token included)",
    "model": "preset: cpu (256 x 4 layers, 7.4M params at vocabulary 8192, T 128), gpt2-small (768 x 12, T 1024), 1b (2048 x 16, "
    "T 2048), 8b (Llama 3 8B's shape: 4096 x 32, 8 key/value heads, T 8192; for compiled memory)",
    "dim": "override the preset's width",
    "depth": "override the preset's number of layers",
    "heads": "override the preset's attention heads",
    "kv_heads": "key/value heads, dividing --heads: fewer than --heads is grouped-query attention (each serves "
    "heads/kv-heads query heads); default: the preset's (8 for 8b; the others: --heads, multi-head attention)",
    "seq_len": "tokens per training window (T); default: the preset's",
    "attention": "'xla': hand-written softmax attention holding (B, heads, T, T) scores; 'flash': "
    "flash attention by the platform lowered for, never holding the scores: cuDNN's (jax.nn.dot_product_attention) on a "
    "GPU in bfloat16, Pallas splash attention on a TPU (T and head dimension multiples of 128); XLA's on CPU",
    "tie": "tie the head to the token embedding",
    "scan": "stack the layers with nn.scan (parameters stacked on a leading axis; one traced layer)",
    "remat": "recompute each layer in the backward pass (nn.remat; inside the scan with --scan)",
    "remat_policy": "with --remat, what each layer keeps for its backward, as bsr_jax.plan's options of that name: "
    "'remat' nothing but its input; 'remat-dots' / 'remat-dots-all' JAX's dots_with_no_batch_dims_saveable / dots_saveable; "
    "'remat-dots-attention' those and cuDNN flash attention's output; "
    "'remat-offload' those dots in host memory; 'remat-minimal', 'remat-save-qkv', 'remat-save-dots-except-mlp', "
    "'remat-offload-qkv' MaxText's named policies on the linear layers' outputs (docs/planner.md)",
    "loss_chunk": "tokens per chunk of the head + cross-entropy (bsr_jax.ops.losses; the (B, T, V) logits never exist); "
    "0: the plain head and loss",
    "sparsity": "fraction of activation blocks dropped from each linear layer's weight-gradient residual (0 = dense)",
    "block": "block of the pruning and of the per-block scales: a square side (16) or ROWSxCOLUMNS (1x128)",
    "sparse_head": "also compress the head's input",
    "lean": "with compression, norms, SwiGLU and attention keep less too (exact; bsr_jax.compress_model's lean)",
    "sparsity_warmup_steps": "ramp every layer's sparsity from 0 to its target over this many steps, in 4 stairs",
    "layer_sparsity": "PATTERN=VALUE, repeatable: layers whose module path matches PATTERN (fnmatch, e.g. "
    "'layer_*/mlp/down' or, with --scan, 'layers/mlp/*') use sparsity VALUE; first match wins",
    "dx": f"approximate input gradients: store what the backward of every norm, SwiGLU and attention reads (their inputs, "
    f"q/k/v) in one of {', '.join(DX_FORMATS)} (per-row scales every 128 values; bsr_jax.ops.dx); default exact",
    "memory_budget": common_config.HELP["memory_budget"].replace("--dx", "--dx/--remat"),
    "lr": "peak learning rate (AdamW, b2 0.95)",
    "weight_decay": "AdamW weight decay, on kernels and embeddings (not on norm scales)",
    "warmup_steps": "linear warmup steps (capped at 20%% of --steps)",
    "clip_norm": "clip the global gradient norm to this (0: no clipping)",
    "batch_size": "global batch of windows, split over all devices",
    "fsdp": "shard the parameters, their gradients and AdamW moments over the devices as well as the batch (each leaf "
    "along its largest dimension the device count divides; leaves with none, e.g. a bias of odd length, stay "
    "replicated): each device stores 1/n of them and gathers the parameters for its step (with --scan layer by layer, "
    "each layer's as it runs and again for its backward; else all at the start); the same training up to the order of "
    "float sums",
    "steps": "training steps; the learning-rate schedule spans them",
    "seed": "seed of initialisation and data order",
    "stop_at": "stop at this step (the schedule still spans --steps); --resume continues",
    "eval_every": "steps between validation losses (one is also computed at the end)",
    "eval_windows": "validation windows per evaluation, spread evenly over the validation split",
}

_CHOICES = {"tokenizer": TOKENIZERS, "model": LM_MODELS, "attention": ATTENTIONS, "remat_policy": REMAT_POLICIES}


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """One flag per ``LMConfig`` field plus ``--workdir``; errors are one line, exit code 2."""
    return common_config.build_parser(prog, description, LMConfig(), HELP, _CHOICES, workdir="runs/lm")


def parse(prog: str, description: str, argv: Sequence[str] | None = None) -> tuple[LMConfig, str, list[str]]:
    """``argv`` as ``(config, workdir, notes)`` (``train.settings.parse``); ``notes`` names the
    ``RESUME_OVERRIDES`` a resumed run changes. Bad values, and flags that would change a resumed
    run, exit with code 2."""
    return settings.parse(build_parser(prog, description), LMConfig(), argv)
