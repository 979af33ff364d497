"""What both trainers' configurations share: ``CommonSettings``, the fields that mean the same in
``train.config.TrainConfig`` (train.cifar, train.imagenet) and ``train.lm_config.LMConfig``
(train.lm), with their checks, --help texts and allowed values.

Each trainer's class adds its own fields and checks (``checks``), redeclares a shared field where
its default differs, gives the texts that say more for its models (its help overrides ``HELP``), and
lists every flag in its --help order (``LAYOUT``). Nothing here imports JAX, so ``--help`` and flag
errors answer at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

from train import settings
from train.options import (BACKENDS, CRITERIA, DTYPES, DX_FORMATS, PLAN_TARGETS, ROUNDINGS, SELECTIONS,
                           STOCHASTIC_ROUNDING_DTYPES, STORAGE_DTYPES)  # fmt: skip
from train.settings import Parser, Settings, flag

# Named so that a trainer redeclaring dtype's default does not repeat the allowed values.
Dtype = Literal["float32", "bfloat16"]
# The settings bsr_jax.plan chooses for --memory-budget, in its error's order; a trainer without one
# (train.lm has no --compression) skips it.
PLAN_CHOOSES = ("sparsity", "storage_dtype", "dx", "stochastic", "layer_sparsity", "compression", "remat")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommonSettings(Settings):
    """The settings both trainers have; the defaults are the image trainers' (``LMConfig`` redeclares its own)."""

    # Data.
    data_dir: str | None = None
    cache_dir: str | None = None
    # Model.
    dim: int | None = None  # overrides the preset's width
    depth: int | None = None  # overrides the preset's number of blocks or layers
    dtype: Dtype = "float32"
    remat: bool = False
    # Compressed residuals.
    sparsity: float = 0.0
    block: int | tuple[int, int] = 16  # a square side, or (rows, columns)
    criterion: Literal["l2", "l1"] = "l2"
    selection: Literal["global", "column"] = "global"
    backend: str | None = None
    sparse_head: bool = False
    storage_dtype: Literal["bfloat16", "float8_e4m3fn", "int8", "int4"] | None = None
    rounding: Literal["nearest", "stochastic"] = "nearest"
    stochastic: bool = False
    layer_sparsity: tuple[tuple[str, float], ...] = ()
    # Approximate input gradients (bsr_jax.ops.dx): what the backward passes read, stored in this format.
    dx: Literal["int8", "int4"] | None = None
    # The planner (train.planning): a memory budget for the step on a target accelerator.
    memory_budget: str | None = None
    target: Literal["h100", "tpu-v5p"] = "h100"
    # Optimisation.
    lr: float = 1e-3
    min_lr: float = 1e-6
    weight_decay: float = 0.05
    batch_size: int = 128
    seed: int = 0
    # Run control and logging.
    log_every: int = 50
    checkpoint_every: int = 1000
    keep_checkpoints: int = 2
    resume: bool = False

    def __post_init__(self):
        checks = self.checks()
        # Several bad settings: the error names the first in --help's order.
        settings.check(self, {name: checks[name] for name in self.LAYOUT if name in checks})

    def _fused_format(self) -> bool:
        """Whether the settings ask for the format the fused kernels write (bsr_jax.backends.fused)."""
        return (self.block == (1, 128) and self.sparsity == 0 and self.storage_dtype in ("int8", "int4")
                and self.rounding == "nearest" and not self.stochastic)  # fmt: skip

    def checks(self) -> dict[str, tuple[bool, str]]:
        """``settings.check``'s ``{field: (ok, allowed)}`` of the shared fields; a trainer adds its
        own to these and may narrow one (min_lr has none here: the trainers bound it differently)."""
        planned = [name for name in PLAN_CHOOSES if hasattr(self, name)]
        return {
            # A zero width or depth fails deep inside the model (a division by zero, a negative shape).
            "dim": (self.dim is None or self.dim >= 1, ">= 1"),
            "depth": (self.depth is None or self.depth >= 1, ">= 1"),
            "dtype": (self.dtype in DTYPES, f"one of {DTYPES}"),
            "sparsity": (0.0 <= self.sparsity < 1.0, "in [0, 1)"),
            "block": (all(side >= 1 for side in _sides(self.block)), "a side >= 1 or ROWSxCOLUMNS with both >= 1"),
            "criterion": (self.criterion in CRITERIA, f"one of {CRITERIA}"),
            "selection": (self.selection in SELECTIONS, f"one of {SELECTIONS}"),
            "backend": (
                self.backend in (None, *BACKENDS) and (self.backend != "fused" or self._fused_format()),
                f"None or one of {BACKENDS}; 'fused' needs --block 1x128 --sparsity 0 --storage-dtype int8 or int4 and --rounding nearest",
            ),
            "storage_dtype": (self.storage_dtype in (None, *STORAGE_DTYPES), f"None or one of {STORAGE_DTYPES}"),
            "rounding": (
                self.rounding == "nearest" or (self.rounding in ROUNDINGS and self.storage_dtype in STOCHASTIC_ROUNDING_DTYPES),
                f"one of {ROUNDINGS}; 'stochastic' needs --storage-dtype {' or '.join(STOCHASTIC_ROUNDING_DTYPES)}",
            ),
            "layer_sparsity": (all(0.0 <= v < 1.0 for _, v in self.layer_sparsity), "PATTERN=VALUE rules with VALUE in [0, 1)"),
            "dx": (self.dx in (None, *DX_FORMATS), f"None or one of {DX_FORMATS}"),
            "memory_budget": (
                self.memory_budget is None or not any(getattr(self, name) for name in planned),
                f"None, or without {'/'.join(map(flag, planned))} (the plan chooses them)",
            ),
            "target": (self.target in PLAN_TARGETS, f"one of {PLAN_TARGETS}"),
            "lr": (self.lr > 0, "> 0"),
            "weight_decay": (self.weight_decay >= 0, ">= 0"),
            "batch_size": (self.batch_size >= 1, ">= 1"),
            "seed": (self.seed >= 0, ">= 0"),
            "log_every": (self.log_every >= 1, ">= 1"),
            "checkpoint_every": (self.checkpoint_every >= 1, ">= 1"),
            "keep_checkpoints": (self.keep_checkpoints >= 1, ">= 1"),
        }


def _sides(block: int | tuple[int, int]) -> tuple[int, ...]:
    return block if isinstance(block, tuple) else (block,)


# The --help texts both trainers give; a trainer's own text for a field replaces its entry here.
HELP = {
    "dtype": "computation dtype (params and optimizer state stay float32)",
    "criterion": "block magnitude used for ranking",
    "selection": "'global': largest blocks of the whole tensor; 'column': same number per block-column",
    "backend": "dW backend (cpu, xla, pallas, reference; fused: the forward and dW GEMMs write and read 1x128 int8/int4 codes, "
    "compiled on a GPU, interpreted on the CPU: for tests); default: $BSR_JAX_BACKEND or the platform's",
    "storage_dtype": f"store kept blocks in lower precision ({', '.join(STORAGE_DTYPES)}), dequantized in the backward pass",
    "rounding": "rounding of int8/int4 kept blocks: 'stochastic' is unbiased (draws from the run's pruning keys)",
    "stochastic": "sample kept blocks with probability by magnitude and rescale them (unbiased weight gradients)",
    "memory_budget": "fit the training step into this budget at the least modelled time: bsr_jax.plan chooses per block "
    "among its exact options (lean neighbours, remat policies, host offload; gradients unchanged), compiled for --target "
    "(a size with its unit like 12GiB or 800MB, or a fraction of the dense step's peak in (0, 1] like 0.5); "
    "leave --sparsity/--storage-dtype/--dx unset",
    "target": f"the accelerator --memory-budget plans for, compiled deviceless ({', '.join(PLAN_TARGETS)})",
    "min_lr": "final learning rate of the cosine decay",
    "log_every": "steps between metric lines",
    "checkpoint_every": "steps between checkpoints (one is also written at the end and on SIGINT/SIGTERM)",
    "keep_checkpoints": "checkpoints kept in WORKDIR/checkpoints",
}
# --resume's text ends with the trainer's RESUME_OVERRIDES.
_RESUME_HELP = ("continue the run in --workdir from its last checkpoint with its config.json (same data order, "
                "bit-for-bit; a damaged newest checkpoint is moved to WORKDIR/damaged_checkpoints and the newest intact one "
                "used, with a note); other flags must match it, except ")  # fmt: skip
CHOICES = {"dtype": DTYPES, "criterion": CRITERIA, "selection": SELECTIONS, "backend": BACKENDS, "storage_dtype": STORAGE_DTYPES,
           "rounding": ROUNDINGS, "dx": DX_FORMATS, "target": PLAN_TARGETS}  # fmt: skip


def build_parser(prog: str, description: str, defaults: CommonSettings, help: Mapping[str, str],
                 choices: Mapping[str, Sequence[str]], workdir: str) -> Parser:  # fmt: skip
    """``settings.build_parser`` with the shared texts and allowed values, under the trainer's own
    ``help`` and ``choices``."""
    resume = _RESUME_HELP + ", ".join(map(flag, type(defaults).RESUME_OVERRIDES))
    return settings.build_parser(prog, description, defaults, {**HELP, "resume": resume, **help}, {**CHOICES, **choices}, workdir)
