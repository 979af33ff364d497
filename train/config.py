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

from train import common_config, settings
from train.common_config import CommonSettings
# UsageError and InvalidSetting are re-exported: the image trainers' modules take them from here.
from train.settings import InvalidSetting, Parser, UsageError, flag, show  # noqa: F401
# The option lists are re-exported: callers and tests find every flag's allowed values here.
from train.options import (  # noqa: F401
    AUGMENTS, BACKENDS, COMPRESSIONS, CRITERIA, DATASETS, DTYPES, DX_FORMATS, HELP, MODELS, OPTIMIZERS, PLAN_TARGETS,
    POOLING_FACTORS, RESMLP_MODELS, RESMLP_ONLY, RESNET_MODELS, RESUME_OVERRIDES, ROUNDINGS, SELECTIONS, STOCHASTIC_ROUNDING_DTYPES,
    STORAGE_DTYPES,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(CommonSettings):
    """Everything a run depends on. ``steps`` and ``resume`` only decide where a run stops/starts."""

    RESUME_OVERRIDES: ClassVar[tuple[str, ...]] = RESUME_OVERRIDES
    LAYOUT: ClassVar[tuple[str, ...]] = (
        "dataset", "data_dir", "cache_dir", "image_size", "augment",
        "model", "patch_size", "dim", "depth", "dtype", "remat",
        "sparsity", "block", "criterion", "selection", "backend", "sparse_stem", "sparse_head", "prune_scale_shift",
        "storage_dtype", "rounding", "compression", "stochastic", "sparsity_warmup_epochs", "layer_sparsity",
        "dx", "memory_budget", "target",
        "optimizer", "lr", "min_lr", "weight_decay", "warmup_epochs", "label_smoothing", "epochs", "batch_size",
        "eval_batch_size", "seed",
        "steps", "log_every", "checkpoint_every", "keep_checkpoints", "resume",
    )  # fmt: skip

    # Data.
    dataset: Literal["cifar10", "cifar100", "imagenet2012", "imagefolder"] = "cifar10"
    image_size: int = 32
    augment: Literal["cifar", "imagenet", "none"] = "cifar"
    # Model.
    model: str = "tiny"
    patch_size: int = 4
    # Block-sparse residuals.
    sparse_stem: bool = False
    prune_scale_shift: bool = False
    compression: Literal["pool2", "pool4"] | None = None
    sparsity_warmup_epochs: float = 0.0
    # Optimisation.
    optimizer: Literal["adamw", "lamb"] = "adamw"
    warmup_epochs: float = 5.0
    label_smoothing: float = 0.1
    epochs: int = 100
    eval_batch_size: int = 500
    # Run control.
    steps: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.model in RESNET_MODELS:
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for name in RESMLP_ONLY:
                if getattr(self, name) != defaults[name]:
                    raise InvalidSetting(name, f"{name} applies to ResMLP models only, got {show(getattr(self, name))} with model {self.model}")

    def checks(self) -> dict[str, tuple[bool, str]]:
        checks = super().checks()
        rounding_ok, rounding_allowed = checks["rounding"]
        return {
            **checks,
            "dataset": (self.dataset in DATASETS, f"one of {DATASETS}"),
            "augment": (self.augment in AUGMENTS, f"one of {AUGMENTS}"),
            "model": (self.model in MODELS, f"one of {MODELS}"),
            "optimizer": (self.optimizer in OPTIMIZERS, f"one of {OPTIMIZERS}"),
            "rounding": (rounding_ok and (self.rounding == "nearest" or self.compression is None), rounding_allowed + " and no --compression"),
            "compression": (
                self.compression is None
                or (self.compression in COMPRESSIONS and self.model in RESNET_MODELS and self.sparsity == 0 and not self.stochastic),
                f"None or one of {COMPRESSIONS}, with a ResNet model {RESNET_MODELS} and without --sparsity/--stochastic",
            ),
            "sparsity_warmup_epochs": (self.sparsity_warmup_epochs >= 0, ">= 0"),
            "image_size": (self.image_size >= 1, ">= 1"),
            # ResMLP cuts the image into patches; ResNet has none.
            "patch_size": (
                self.patch_size >= 1 and (self.model in RESNET_MODELS or self.image_size % self.patch_size == 0),
                f">= 1 and divide --image-size {self.image_size}",
            ),
            "epochs": (self.epochs >= 1, ">= 1"),
            "eval_batch_size": (self.eval_batch_size >= 1, ">= 1"),
            "steps": (self.steps is None or self.steps >= 1, ">= 1 or None"),
            "warmup_epochs": (self.warmup_epochs >= 0, ">= 0"),
            "label_smoothing": (0.0 <= self.label_smoothing < 1.0, "in [0, 1)"),
            "min_lr": (0 <= self.min_lr <= self.lr, f"in [0, --lr {self.lr}]"),
        }


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
    choices = {"dataset": tuple(datasets), "augment": AUGMENTS, "model": MODELS, "optimizer": OPTIMIZERS, "compression": COMPRESSIONS}
    parser = common_config.build_parser(prog, description, defaults, HELP, choices, workdir=f"runs/{prog.split('.')[-1]}")
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
