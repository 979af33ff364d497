"""The image trainers' configuration: one frozen dataclass, and the argparse parser both CLIs share.

Each CLI passes its own defaults (``CIFAR_DEFAULTS``, ``IMAGENET_DEFAULTS``) to ``build_parser``;
``parse`` turns the flags into a ``TrainConfig``. Flags map one to one onto fields
(``--batch-size`` -> ``batch_size``); ``--resume`` follows ``train.settings``' rule, with
``RESUME_OVERRIDES`` the flags a resumed run may change. The flags of a run over several processes
(``--coordinator --num-processes --process-id``) are not training settings: ``parse_processes``
reads them into a ``Processes``.

Nothing here imports JAX, so ``--help`` and flag errors answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import ClassVar, Literal

from train import settings
# UsageError and InvalidSetting are re-exported: the image trainers' modules take them from here.
from train.settings import InvalidSetting, Parser, Settings, UsageError, flag, show  # noqa: F401
# The option lists are re-exported: callers and tests find every flag's allowed values here.
from train.options import (  # noqa: F401
    AUGMENTS, BACKENDS, COMPRESSIONS, CRITERIA, DATASETS, DTYPES, DX_FORMATS, HELP, MODELS, OPTIMIZERS, PLAN_TARGETS,
    POOLING_FACTORS, RESMLP_MODELS, RESMLP_ONLY, RESNET_MODELS, RESUME_OVERRIDES, ROUNDINGS, SELECTIONS, STOCHASTIC_ROUNDING_DTYPES,
    STORAGE_DTYPES,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(Settings):
    """Everything a run depends on. ``steps`` and ``resume`` only decide where a run stops/starts."""

    RESUME_OVERRIDES: ClassVar[tuple[str, ...]] = RESUME_OVERRIDES

    # Data.
    dataset: Literal["cifar10", "cifar100", "imagenet2012", "imagefolder"] = "cifar10"
    data_dir: str | None = None
    cache_dir: str | None = None
    image_size: int = 32
    augment: Literal["cifar", "imagenet", "none"] = "cifar"
    # Model.
    model: str = "tiny"
    patch_size: int = 4
    dim: int | None = None  # overrides the preset's width
    depth: int | None = None  # overrides the preset's number of blocks
    dtype: Literal["float32", "bfloat16"] = "float32"
    remat: bool = False  # nn.remat per ResMLP block (train.models.create_model says what a block keeps)
    # Block-sparse residuals.
    sparsity: float = 0.0
    block: int = 16
    criterion: Literal["l2", "l1"] = "l2"
    selection: Literal["global", "column"] = "global"
    backend: str | None = None
    sparse_stem: bool = False
    sparse_head: bool = False
    prune_scale_shift: bool = False
    storage_dtype: Literal["bfloat16", "float8_e4m3fn", "int8", "int4"] | None = None
    rounding: Literal["nearest", "stochastic"] = "nearest"
    compression: Literal["pool2", "pool4"] | None = None
    stochastic: bool = False
    sparsity_warmup_epochs: float = 0.0
    layer_sparsity: tuple[tuple[str, float], ...] = ()
    # Approximate input gradients (bsr_jax.ops.dx): the GELU input stored in this format.
    dx: Literal["int8", "int4"] | None = None
    # The planner (train.planning): a memory budget for the step on a target accelerator.
    memory_budget: str | None = None
    target: Literal["h100", "tpu-v5p"] = "h100"
    # Optimisation.
    optimizer: Literal["adamw", "lamb"] = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-6
    weight_decay: float = 0.05
    warmup_epochs: float = 5.0
    label_smoothing: float = 0.1
    epochs: int = 100
    batch_size: int = 128
    eval_batch_size: int = 500
    seed: int = 0
    # Run control and logging.
    steps: int | None = None
    log_every: int = 50
    checkpoint_every: int = 1000
    keep_checkpoints: int = 2
    resume: bool = False

    def __post_init__(self):
        checks = {
            "dataset": (self.dataset in DATASETS, f"one of {DATASETS}"),
            "augment": (self.augment in AUGMENTS, f"one of {AUGMENTS}"),
            "model": (self.model in MODELS, f"one of {MODELS}"),
            "dtype": (self.dtype in DTYPES, f"one of {DTYPES}"),
            "optimizer": (self.optimizer in OPTIMIZERS, f"one of {OPTIMIZERS}"),
            "sparsity": (0.0 <= self.sparsity < 1.0, "in [0, 1)"),
            "block": (self.block >= 1, ">= 1"),
            "criterion": (self.criterion in CRITERIA, f"one of {CRITERIA}"),
            "selection": (self.selection in SELECTIONS, f"one of {SELECTIONS}"),
            "backend": (self.backend in (None, *BACKENDS), f"None or one of {BACKENDS}"),
            "storage_dtype": (self.storage_dtype in (None, *STORAGE_DTYPES), f"None or one of {STORAGE_DTYPES}"),
            "dx": (self.dx in (None, *DX_FORMATS), f"None or one of {DX_FORMATS}"),
            "memory_budget": (
                self.memory_budget is None
                or not (self.sparsity or self.storage_dtype or self.dx or self.stochastic or self.layer_sparsity or self.compression
                        or self.remat),
                "None, or without --sparsity/--storage-dtype/--dx/--stochastic/--layer-sparsity/--compression/--remat (the plan chooses them)",
            ),
            "target": (self.target in PLAN_TARGETS, f"one of {PLAN_TARGETS}"),
            "rounding": (
                self.rounding == "nearest" or (self.rounding in ROUNDINGS and self.storage_dtype in STOCHASTIC_ROUNDING_DTYPES and self.compression is None),
                f"one of {ROUNDINGS}; 'stochastic' needs --storage-dtype {' or '.join(STOCHASTIC_ROUNDING_DTYPES)} and no --compression",
            ),
            "compression": (
                self.compression is None
                or (self.compression in COMPRESSIONS and self.model in RESNET_MODELS and self.sparsity == 0 and not self.stochastic),
                f"None or one of {COMPRESSIONS}, with a ResNet model {RESNET_MODELS} and without --sparsity/--stochastic",
            ),
            "sparsity_warmup_epochs": (self.sparsity_warmup_epochs >= 0, ">= 0"),
            "layer_sparsity": (all(0.0 <= v < 1.0 for _, v in self.layer_sparsity), "PATTERN=VALUE rules with VALUE in [0, 1)"),
            "image_size": (self.image_size >= 1, ">= 1"),
            # ResMLP cuts the image into patches; ResNet has none.
            "patch_size": (
                self.patch_size >= 1 and (self.model in RESNET_MODELS or self.image_size % self.patch_size == 0),
                f">= 1 and divide --image-size {self.image_size}",
            ),
            "epochs": (self.epochs >= 1, ">= 1"),
            "batch_size": (self.batch_size >= 1, ">= 1"),
            "eval_batch_size": (self.eval_batch_size >= 1, ">= 1"),
            "steps": (self.steps is None or self.steps >= 1, ">= 1 or None"),
            "log_every": (self.log_every >= 1, ">= 1"),
            "checkpoint_every": (self.checkpoint_every >= 1, ">= 1"),
            "keep_checkpoints": (self.keep_checkpoints >= 1, ">= 1"),
            "warmup_epochs": (self.warmup_epochs >= 0, ">= 0"),
            "label_smoothing": (0.0 <= self.label_smoothing < 1.0, "in [0, 1)"),
            "lr": (self.lr > 0, "> 0"),
            "min_lr": (0 <= self.min_lr <= self.lr, f"in [0, --lr {self.lr}]"),
            "weight_decay": (self.weight_decay >= 0, ">= 0"),
            # A zero width or depth fails deep inside the model (a division by zero, a negative shape).
            "dim": (self.dim is None or self.dim >= 1, ">= 1"),
            "depth": (self.depth is None or self.depth >= 1, ">= 1"),
            "seed": (self.seed >= 0, ">= 0"),
        }
        settings.check(self, checks)
        if self.model in RESNET_MODELS:
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for name in RESMLP_ONLY:
                if getattr(self, name) != defaults[name]:
                    raise InvalidSetting(name, f"{name} applies to ResMLP models only, got {show(getattr(self, name))} with model {self.model}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Processes:
    """This process's place in a run over several processes (``jax.distributed.initialize``).

    Not part of ``TrainConfig``: it says where a run executes, not what it computes (the mesh spans
    every process's devices, so a run on 2 processes x 2 devices computes what 1 x 4 does), and it
    differs between the processes of one run. The default is a single process.
    """

    coordinator: str | None = None  # HOST:PORT of process 0's coordination service
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self):
        host, _, port = (self.coordinator or "").rpartition(":")
        checks = {
            "num_processes": (self.num_processes >= 1, ">= 1"),
            "process_id": (0 <= self.process_id < self.num_processes, f"in [0, num_processes = {self.num_processes})"),
            "coordinator": (
                self.coordinator is None if self.num_processes == 1 else bool(host) and port.isdigit(),
                "HOST:PORT, given exactly when num_processes > 1",
            ),
        }
        settings.check(self, checks)


_PROCESS_HELP = {
    "coordinator": "HOST:PORT where process 0 serves JAX's coordination service (runs over several processes; "
    "every process passes the same address)",
    "num_processes": "processes of the run; their devices form one mesh and --batch-size is split over all of them",
    "process_id": "this process's index in [0, --num-processes); process 0 writes metrics.jsonl and config.json",
}


CIFAR_DEFAULTS = TrainConfig()
# ResMLP's ImageNet recipe (Touvron et al. 2021): LAMB, lr 5e-3, weight decay 0.2, 400 epochs,
# batch 1024; without its RandAugment/Mixup/CutMix, which this suite does not implement.
IMAGENET_DEFAULTS = TrainConfig(
    dataset="imagenet2012",
    image_size=224,
    augment="imagenet",
    model="s12",
    patch_size=16,
    optimizer="lamb",
    lr=5e-3,
    weight_decay=0.2,
    epochs=400,
    batch_size=1024,
    eval_batch_size=1000,
    checkpoint_every=2000,
)


def build_parser(
    prog: str, description: str, defaults: TrainConfig, datasets: Sequence[str] = DATASETS
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per ``TrainConfig`` field, ``--workdir`` and ``Processes``' flags."""
    choices = {
        "dataset": tuple(datasets),
        "augment": AUGMENTS,
        "model": MODELS,
        "dtype": DTYPES,
        "optimizer": OPTIMIZERS,
        "criterion": CRITERIA,
        "selection": SELECTIONS,
        "storage_dtype": STORAGE_DTYPES,
        "dx": DX_FORMATS,
        "target": PLAN_TARGETS,
        "rounding": ROUNDINGS,
        "backend": BACKENDS,
        "compression": COMPRESSIONS,
    }
    parser = settings.build_parser(prog, description, defaults, HELP, choices, workdir=f"runs/{prog.split('.')[-1]}")
    _add_process_flags(parser)
    return parser


def _add_process_flags(parser: argparse.ArgumentParser) -> None:
    for field in dataclasses.fields(Processes):
        kind = int if field.type == "int" else str
        parser.add_argument(flag(field.name), type=kind, default=field.default, help=_PROCESS_HELP[field.name])


def parse_processes(prog: str, argv: Sequence[str] | None = None) -> Processes:
    """The ``Processes`` flags of ``argv`` (the others are ``parse``'s); a bad value exits with
    argparse's usage error (code 2) naming the flag."""
    parser = Parser(prog=prog, add_help=False)
    _add_process_flags(parser)
    given, _ = parser.parse_known_args(argv)
    try:
        return Processes(**vars(given))
    except InvalidSetting as error:
        parser.error(f"argument {flag(error.field)}: {error}")


def parse(
    prog: str, description: str, defaults: TrainConfig, datasets: Sequence[str], argv: Sequence[str] | None = None
) -> tuple[TrainConfig, str, list[str]]:
    """Parse ``argv`` into ``(config, workdir, notes)`` (``train.settings.parse``): with ``--resume``,
    the run's saved config with the flags given applied; ``notes`` says which ``RESUME_OVERRIDES``
    changed. Bad values, and flags that would change a resumed run, exit with code 2."""
    return settings.parse(build_parser(prog, description, defaults, datasets), defaults, argv)
