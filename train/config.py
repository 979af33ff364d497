"""The training configuration: one frozen dataclass, and the argparse parser both CLIs share.

Each CLI passes its own defaults (``CIFAR_DEFAULTS``, ``IMAGENET_DEFAULTS``) to ``build_parser``;
``parse`` turns the flags into a ``TrainConfig``. Flags map one to one onto fields
(``--batch-size`` -> ``batch_size``). With ``--resume`` the run's own ``config.json`` is the
config: flags that repeat it are fine, flags that change it are an error, except the
``RESUME_OVERRIDES``, which are applied and reported. The flags of a run over several processes
(``--coordinator --num-processes --process-id``) are not training settings: ``parse_processes``
reads them into a ``Processes``.

Nothing here imports JAX, so ``--help`` and flag errors answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

from train import run_dir
# The option lists are re-exported: callers and tests find every flag's allowed values here.
from train.options import (  # noqa: F401
    AUGMENTS, BACKENDS, COMPRESSIONS, CRITERIA, DATASETS, DTYPES, DX_FORMATS, HELP, MODELS, OPTIMIZERS, PLAN_TARGETS,
    POOLING_FACTORS, RESMLP_MODELS, RESMLP_ONLY, RESNET_MODELS, RESUME_OVERRIDES, ROUNDINGS, SELECTIONS, STOCHASTIC_ROUNDING_DTYPES,
    STORAGE_DTYPES,
)


class UsageError(ValueError):
    """A run cannot start as configured (e.g. a batch that does not divide over the devices); the
    message is meant for the user, and the CLIs print it without a traceback."""


class InvalidSetting(UsageError):
    """A ``TrainConfig`` field outside its allowed values; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class _Parser(argparse.ArgumentParser):
    """Errors are one line (``PROG: argument --flag: why (see --help)``), not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description keeps its lines (example commands stay one per line); flags show their defaults."""


_NOT_GIVEN = object()


def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):  # layer rules
        return " ".join(f"{pattern}={sparsity}" for pattern, sparsity in value) or "none"
    return str(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a run depends on. ``steps`` and ``resume`` only decide where a run stops/starts."""

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
    # Approximate input gradients (bsr_jax.dx): the GELU input stored in this format.
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
                or not (self.sparsity or self.storage_dtype or self.dx or self.stochastic or self.layer_sparsity or self.compression),
                "None, or without --sparsity/--storage-dtype/--dx/--stochastic/--layer-sparsity/--compression (the plan chooses them)",
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
        for name in _FLOAT_FIELDS:  # inf or nan passes most comparisons and ruins a run silently
            if not math.isfinite(getattr(self, name)):
                checks[name] = (False, "a finite number")
        for name, (ok, allowed) in checks.items():
            if not ok:
                raise InvalidSetting(name, f"{name} must be {allowed}, got {getattr(self, name)!r}")
        if self.model in RESNET_MODELS:
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for name in RESMLP_ONLY:
                if getattr(self, name) != defaults[name]:
                    raise InvalidSetting(name, f"{name} applies to ResMLP models only, got {_show(getattr(self, name))} with model {self.model}")

    def to_json(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields["layer_sparsity"] = [list(rule) for rule in self.layer_sparsity]
        return fields

    @classmethod
    def from_json(cls, fields: dict[str, Any]) -> TrainConfig:
        """The inverse of ``to_json``; unknown fields raise ``UsageError`` naming them."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise UsageError(f"unknown settings {unknown} (written by another version of train?)")
        return cls(**{**fields, "layer_sparsity": tuple(map(tuple, fields.get("layer_sparsity", ())))})

    def resume_conflicts(self, saved: TrainConfig) -> list[str]:
        """``--flag VALUE (the run has SAVED)`` for each setting that differs from ``saved`` and is
        not in ``RESUME_OVERRIDES``: continuing with it would mix two trainings."""
        return [
            f"{_flag(name)} {_show(getattr(self, name))} (the run has {_show(getattr(saved, name))})"
            for name in _field_names()
            if name not in (*RESUME_OVERRIDES, "resume") and getattr(self, name) != getattr(saved, name)
        ]


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
        for name, (ok, allowed) in checks.items():
            if not ok:
                raise InvalidSetting(name, f"{name} must be {allowed}, got {getattr(self, name)!r}")


_FLOAT_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.type == "float")


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
    """An argparse parser with one flag per ``TrainConfig`` field plus ``--workdir``."""
    parser = _Parser(prog=prog, description=description, formatter_class=_HelpFormatter)
    parser.add_argument("--workdir", default=f"runs/{prog.split('.')[-1]}", help="where metrics, config and checkpoints go")
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
    for field in dataclasses.fields(TrainConfig):
        default = getattr(defaults, field.name)
        if field.name == "layer_sparsity":
            parser.add_argument("--layer-sparsity", type=_layer_rule, action="append", default=list(default),
                                metavar="PATTERN=VALUE", help=HELP["layer_sparsity"])  # fmt: skip
            continue
        if field.type == "bool":
            parser.add_argument(_flag(field.name), action=argparse.BooleanOptionalAction, default=default, help=HELP[field.name])
            continue
        kind = {"int": int, "float": float}.get(field.type.split(" ")[0], str)  # "int | None" -> int
        parser.add_argument(_flag(field.name), type=kind, default=default, choices=choices.get(field.name), help=HELP[field.name])
    _add_process_flags(parser)
    return parser


def _add_process_flags(parser: argparse.ArgumentParser) -> None:
    for field in dataclasses.fields(Processes):
        kind = int if field.type == "int" else str
        parser.add_argument(_flag(field.name), type=kind, default=field.default, help=_PROCESS_HELP[field.name])


def parse_processes(prog: str, argv: Sequence[str] | None = None) -> Processes:
    """The ``Processes`` flags of ``argv`` (the others are ``parse``'s); a bad value exits with
    argparse's usage error (code 2) naming the flag."""
    parser = _Parser(prog=prog, add_help=False)
    _add_process_flags(parser)
    given, _ = parser.parse_known_args(argv)
    try:
        return Processes(**vars(given))
    except InvalidSetting as error:
        parser.error(f"argument {_flag(error.field)}: {error}")


def _layer_rule(text: str) -> tuple[str, float]:
    pattern, sep, value = text.rpartition("=")
    try:
        sparsity = float(value)
    except ValueError:
        sparsity = None
    if not sep or not pattern or sparsity is None:
        raise argparse.ArgumentTypeError(f"expected PATTERN=VALUE (e.g. 'block*/fc2=0.9'), got {text!r}")
    return pattern, sparsity


def parse(
    prog: str, description: str, defaults: TrainConfig, datasets: Sequence[str], argv: Sequence[str] | None = None
) -> tuple[TrainConfig, str, list[str]]:
    """Parse ``argv`` into ``(config, workdir, notes)``.

    With ``--resume`` and a ``config.json`` in the workdir, the config is the saved one with the
    flags given on the command line applied; ``notes`` says which ``RESUME_OVERRIDES`` changed.
    Bad values, and flags that would change a resumed run's settings, exit with argparse's usage
    error (code 2).
    """
    parser = build_parser(prog, description, defaults, datasets)
    # Parsed into a namespace that already holds every field, so it ends up holding only the flags
    # given (argparse fills in defaults only for names it does not find); layer rules accumulate.
    given = vars(parser.parse_args(argv, argparse.Namespace(**{n: _NOT_GIVEN for n in _field_names()} | {"layer_sparsity": []})))
    workdir = given.pop("workdir")
    for field in dataclasses.fields(Processes):  # parse_processes' flags
        given.pop(field.name)
    given = {n: tuple(v) if n == "layer_sparsity" else v for n, v in given.items() if v is not _NOT_GIVEN and v != []}
    saved = run_dir.read_saved(workdir) if given.get("resume") else None
    if given.get("resume") and saved is None:  # a mistyped --workdir would otherwise train from step 0
        parser.error(f"argument --resume: nothing to resume in {workdir}: it has no config.json; "
                     "pass the --workdir of an earlier run, or drop --resume")  # fmt: skip
    try:
        if saved is None:
            return dataclasses.replace(defaults, **given), workdir, []
        saved_config = TrainConfig.from_json(saved["config"])
        config = dataclasses.replace(saved_config, **given)
    except InvalidSetting as error:
        where = f"{run_dir.config_path(workdir)}: " if saved else f"argument {_flag(error.field)}: "
        parser.error(where + str(error))
    except UsageError as error:
        parser.error(f"{run_dir.config_path(workdir)}: {error}")
    conflicts = config.resume_conflicts(saved_config)
    if conflicts:
        parser.error(f"{workdir} was trained with other settings; to resume it, drop {'; '.join(conflicts)}. "
                     "To train these settings, pass another --workdir")  # fmt: skip
    notes = [f"{_flag(n)} {_show(getattr(saved_config, n))} -> {_show(getattr(config, n))}"
             for n in RESUME_OVERRIDES if getattr(config, n) != getattr(saved_config, n)]  # fmt: skip
    return config, workdir, notes
