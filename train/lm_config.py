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

from train import settings
from train.settings import Settings, UsageError  # noqa: F401  (UsageError: re-exported for train.lm's modules)
from train.options import (BACKENDS, CRITERIA, DTYPES, DX_FORMATS, HELP as IMAGE_HELP, PLAN_TARGETS, ROUNDINGS, SELECTIONS,
                           STOCHASTIC_ROUNDING_DTYPES, STORAGE_DTYPES)  # fmt: skip

# train.lm_model.PRESETS' and train.lm_data.TOKENIZERS' names, repeated to stay JAX-free (a test keeps them equal).
LM_MODELS = ("cpu", "gpt2-small", "1b")
TOKENIZERS = ("bpe", "bytes")
# Where a resumed run stops, where its caches and logs are, how it computes dW (backends agree to
# rounding): nothing that changes what a step computes.
RESUME_OVERRIDES = ("stop_at", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "cache_dir", "backend")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMConfig(Settings):
    """Everything an LM run depends on. ``stop_at`` and ``resume`` only decide where it stops/starts."""

    RESUME_OVERRIDES: ClassVar[tuple[str, ...]] = RESUME_OVERRIDES
    WRITER: ClassVar[str] = "train.lm"

    # Data.
    data_dir: str | None = None
    cache_dir: str | None = None
    val_fraction: float = 0.05
    tokenizer: Literal["bpe", "bytes"] = "bpe"
    vocab_size: int = 8192
    # Model.
    model: str = "cpu"
    dim: int | None = None
    depth: int | None = None
    heads: int | None = None
    seq_len: int | None = None
    tie: bool = False
    scan: bool = False
    remat: bool = False
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    loss_chunk: int = 0
    # Compressed residuals (bsr_jax.compress_model with one Rule per --layer-sparsity, then "*").
    sparsity: float = 0.0
    block: int = 16
    criterion: Literal["l2", "l1"] = "l2"
    selection: Literal["global", "column"] = "global"
    backend: str | None = None
    storage_dtype: Literal["bfloat16", "float8_e4m3fn", "int8", "int4"] | None = None
    rounding: Literal["nearest", "stochastic"] = "nearest"
    stochastic: bool = False
    sparse_head: bool = False
    lean: bool = True
    sparsity_warmup_steps: int = 0
    layer_sparsity: tuple[tuple[str, float], ...] = ()
    # Approximate input gradients (bsr_jax.ops.dx): what norms, SwiGLU and attention keep for their
    # backward (their inputs, q/k/v) stored in this format; None: exact.
    dx: Literal["int8", "int4"] | None = None
    # The planner (train.planning): a memory budget for the step on a target accelerator.
    memory_budget: str | None = None
    target: Literal["h100", "tpu-v5p"] = "h100"
    # Optimisation.
    lr: float = 3e-3
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    warmup_steps: int = 100
    clip_norm: float = 1.0
    batch_size: int = 16
    steps: int = 2000
    seed: int = 0
    # Run control and logging.
    stop_at: int | None = None
    eval_every: int = 200
    eval_windows: int = 64
    log_every: int = 20
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    resume: bool = False

    def __post_init__(self):
        checks = {
            "val_fraction": (0 < self.val_fraction < 1, "in (0, 1)"),
            "tokenizer": (self.tokenizer in TOKENIZERS, f"one of {TOKENIZERS}"),
            "vocab_size": (self.vocab_size >= 258, ">= 258 (the 256 bytes, one merge and the end-of-file token)"),
            "model": (self.model in LM_MODELS, f"one of {LM_MODELS}"),
            "dim": (self.dim is None or self.dim >= 1, ">= 1"),
            "depth": (self.depth is None or self.depth >= 1, ">= 1"),
            "heads": (self.heads is None or self.heads >= 1, ">= 1"),
            "seq_len": (self.seq_len is None or self.seq_len >= 1, ">= 1"),
            "dtype": (self.dtype in DTYPES, f"one of {DTYPES}"),
            "loss_chunk": (self.loss_chunk >= 0, ">= 0 (0: the plain head and loss)"),
            "sparsity": (0.0 <= self.sparsity < 1.0, "in [0, 1)"),
            "block": (self.block >= 1, ">= 1"),
            "criterion": (self.criterion in CRITERIA, f"one of {CRITERIA}"),
            "selection": (self.selection in SELECTIONS, f"one of {SELECTIONS}"),
            "backend": (self.backend in (None, *BACKENDS), f"None or one of {BACKENDS}"),
            "storage_dtype": (self.storage_dtype in (None, *STORAGE_DTYPES), f"None or one of {STORAGE_DTYPES}"),
            "rounding": (
                self.rounding == "nearest" or (self.rounding in ROUNDINGS and self.storage_dtype in STOCHASTIC_ROUNDING_DTYPES),
                f"one of {ROUNDINGS}; 'stochastic' needs --storage-dtype {' or '.join(STOCHASTIC_ROUNDING_DTYPES)}",
            ),
            "sparse_head": (
                not (self.sparse_head and (self.tie or self.loss_chunk)),
                "off with --tie or --loss-chunk (the head is then the embedding, or a product inside the chunked loss)",
            ),
            "sparsity_warmup_steps": (self.sparsity_warmup_steps >= 0, ">= 0"),
            "dx": (
                self.dx is None or (self.dx in DX_FORMATS and self.lean),
                f"None or one of {DX_FORMATS}, with --lean (compress_model's lean pass stores what it keeps)",
            ),
            "layer_sparsity": (all(0.0 <= v < 1.0 for _, v in self.layer_sparsity), "PATTERN=VALUE rules with VALUE in [0, 1)"),
            "memory_budget": (
                self.memory_budget is None
                or not (self.sparsity or self.storage_dtype or self.dx or self.stochastic or self.layer_sparsity or self.remat),
                "None, or without --sparsity/--storage-dtype/--dx/--stochastic/--layer-sparsity/--remat (the plan chooses them)",
            ),
            "target": (self.target in PLAN_TARGETS, f"one of {PLAN_TARGETS}"),
            "lr": (self.lr > 0, "> 0"),
            "min_lr": (self.min_lr >= 0, ">= 0"),
            "weight_decay": (self.weight_decay >= 0, ">= 0"),
            "warmup_steps": (self.warmup_steps >= 0, ">= 0"),
            "clip_norm": (self.clip_norm >= 0, ">= 0 (0: no clipping)"),
            "batch_size": (self.batch_size >= 1, ">= 1"),
            "steps": (self.steps >= 1, ">= 1"),
            "seed": (self.seed >= 0, ">= 0"),
            "stop_at": (self.stop_at is None or self.stop_at >= 1, ">= 1 or None"),
            "eval_every": (self.eval_every >= 1, ">= 1"),
            "eval_windows": (self.eval_windows >= 1, ">= 1"),
            "log_every": (self.log_every >= 1, ">= 1"),
            "checkpoint_every": (self.checkpoint_every >= 1, ">= 1"),
            "keep_checkpoints": (self.keep_checkpoints >= 1, ">= 1"),
        }
        settings.check(self, checks)

    @property
    def compressed(self) -> bool:
        """Whether any layer keeps a compressed residual (else the plain model runs)."""
        return self.sparsity > 0 or self.storage_dtype is not None or bool(self.layer_sparsity) or self.dx is not None

    @property
    def stop_step(self) -> int:
        return min(self.stop_at or self.steps, self.steps)


HELP = {
    "data_dir": "a folder of text files to train on (every file under it; 5%% of them, by path hash, for validation); "
    "default: this Python's standard library, its *.py files",
    "cache_dir": "where tokenizers and token streams are cached; default $BSR_JAX_CACHE or ~/.cache/bsr_jax",
    "val_fraction": "fraction of the files (by a hash of their path) held out for validation",
    "tokenizer": "'bpe': byte-level BPE trained on the training split (Hugging Face tokenizers); 'bytes': UTF-8 bytes",
    "vocab_size": "BPE vocabulary size (end-of-file token included)",
    "model": "preset: cpu (256 x 4 layers, 7.4M params at vocabulary 8192, T 128), gpt2-small (768 x 12, T 1024), 1b (2048 x 16, T 2048)",
    "dim": "override the preset's width",
    "depth": "override the preset's number of layers",
    "heads": "override the preset's attention heads",
    "seq_len": "tokens per training window (T); default: the preset's",
    "tie": "tie the head to the token embedding",
    "scan": "stack the layers with nn.scan (parameters stacked on a leading axis; one traced layer)",
    "remat": "recompute each layer in the backward pass (nn.remat; inside the scan with --scan)",
    "dtype": "computation dtype (params and optimizer state stay float32)",
    "loss_chunk": "tokens per chunk of the head + cross-entropy (bsr_jax.ops.losses; the (B, T, V) logits never exist); "
    "0: the plain head and loss",
    "sparsity": "fraction of activation blocks dropped from each linear layer's weight-gradient residual (0 = dense)",
    "block": "square block side of the pruning and of the per-block scales",
    "criterion": "block magnitude used for ranking",
    "selection": "'global': largest blocks of the whole tensor; 'column': same number per block-column",
    "backend": "dW backend (cpu, xla, pallas, reference); default: $BSR_JAX_BACKEND or the platform's",
    "storage_dtype": f"store kept blocks in lower precision ({', '.join(STORAGE_DTYPES)}), dequantized in the backward pass",
    "rounding": "rounding of int8/int4 kept blocks: 'stochastic' is unbiased (draws from the run's pruning keys)",
    "stochastic": "sample kept blocks with probability by magnitude and rescale them (unbiased weight gradients)",
    "sparse_head": "also compress the head's input",
    "lean": "with compression, norms, SwiGLU and attention keep less too (exact; bsr_jax.compress_model's lean)",
    "sparsity_warmup_steps": "ramp every layer's sparsity from 0 to its target over this many steps, in 4 stairs",
    "layer_sparsity": "PATTERN=VALUE, repeatable: layers whose module path matches PATTERN (fnmatch, e.g. "
    "'layer_*/mlp/down' or, with --scan, 'layers/mlp/*') use sparsity VALUE; first match wins",
    "dx": f"approximate input gradients: store what the backward of every norm, SwiGLU and attention reads (their inputs, "
    f"q/k/v) in one of {', '.join(DX_FORMATS)} (per-row scales every 128 values; bsr_jax.ops.dx); default exact",
    "memory_budget": IMAGE_HELP["memory_budget"].replace("--dx", "--dx/--remat"),
    "target": IMAGE_HELP["target"],
    "lr": "peak learning rate (AdamW, b2 0.95)",
    "min_lr": "final learning rate of the cosine decay",
    "weight_decay": "AdamW weight decay, on kernels and embeddings (not on norm scales)",
    "warmup_steps": "linear warmup steps (capped at 20%% of --steps)",
    "clip_norm": "clip the global gradient norm to this (0: no clipping)",
    "batch_size": "global batch of windows, split over all devices",
    "steps": "training steps; the learning-rate schedule spans them",
    "seed": "seed of initialisation and data order",
    "stop_at": "stop at this step (the schedule still spans --steps); --resume continues",
    "eval_every": "steps between validation losses (one is also computed at the end)",
    "eval_windows": "validation windows per evaluation, spread evenly over the validation split",
    "log_every": "steps between metric lines",
    "checkpoint_every": "steps between checkpoints (one is also written at the end and on SIGINT/SIGTERM)",
    "keep_checkpoints": "checkpoints kept in WORKDIR/checkpoints",
    "resume": "continue the run in --workdir from its last checkpoint with its config.json (same data order, "
    "bit-for-bit; a damaged newest checkpoint is moved to WORKDIR/damaged_checkpoints and the newest intact one "
    "used, with a note); other flags must match it, except " + ", ".join("--" + n.replace("_", "-") for n in RESUME_OVERRIDES),
}

_CHOICES = {"tokenizer": TOKENIZERS, "model": LM_MODELS, "dtype": DTYPES, "criterion": CRITERIA, "selection": SELECTIONS,
            "backend": BACKENDS, "storage_dtype": STORAGE_DTYPES, "rounding": ROUNDINGS, "dx": DX_FORMATS,
            "target": PLAN_TARGETS}  # fmt: skip


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """One flag per ``LMConfig`` field plus ``--workdir``; errors are one line, exit code 2."""
    return settings.build_parser(prog, description, LMConfig(), HELP, _CHOICES, workdir="runs/lm")


def parse(prog: str, description: str, argv: Sequence[str] | None = None) -> tuple[LMConfig, str, list[str]]:
    """``argv`` as ``(config, workdir, notes)`` (``train.settings.parse``); ``notes`` names the
    ``RESUME_OVERRIDES`` a resumed run changes. Bad values, and flags that would change a resumed
    run, exit with code 2."""
    return settings.parse(build_parser(prog, description), LMConfig(), argv)
