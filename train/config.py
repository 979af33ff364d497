"""The training configuration: one frozen dataclass, and the argparse parser both CLIs share.

Each CLI passes its own defaults (``CIFAR_DEFAULTS``, ``IMAGENET_DEFAULTS``) to ``build_parser``;
``config_from_args`` turns the parsed flags into a ``TrainConfig``. Flags map one to one onto
fields (``--batch-size`` -> ``batch_size``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from bsr_jax.format import STORAGE_DTYPES
from train.models import PRESETS

DATASETS = ("cifar10", "cifar100", "imagenet2012", "imagefolder")
OPTIMIZERS = ("adamw", "lamb")
DTYPES = ("float32", "bfloat16")
AUGMENTS = ("cifar", "imagenet", "none")


class UsageError(ValueError):
    """A run cannot start as configured (e.g. a batch that does not divide over the devices); the
    message is meant for the user, and the CLIs print it without a traceback."""


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
    storage_dtype: Literal["bfloat16", "int8", "float8_e4m3fn"] | None = None
    stochastic: bool = False
    sparsity_warmup_epochs: float = 0.0
    layer_sparsity: tuple[tuple[str, float], ...] = ()
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
            "model": (self.model in PRESETS, f"one of {tuple(PRESETS)}"),
            "dtype": (self.dtype in DTYPES, f"one of {DTYPES}"),
            "optimizer": (self.optimizer in OPTIMIZERS, f"one of {OPTIMIZERS}"),
            "sparsity": (0.0 <= self.sparsity < 1.0, "in [0, 1)"),
            "storage_dtype": (self.storage_dtype in (None, *STORAGE_DTYPES), f"None or one of {STORAGE_DTYPES}"),
            "sparsity_warmup_epochs": (self.sparsity_warmup_epochs >= 0, ">= 0"),
            "layer_sparsity": (all(0.0 <= v < 1.0 for _, v in self.layer_sparsity), "PATTERN=VALUE rules with VALUE in [0, 1)"),
            "image_size": (self.image_size >= 1 and self.image_size % self.patch_size == 0, "a multiple of patch_size"),
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
            "seed": (self.seed >= 0, ">= 0"),
        }
        for name, (ok, allowed) in checks.items():
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

    def to_json(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields["layer_sparsity"] = [list(rule) for rule in self.layer_sparsity]
        return fields


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

_HELP = {
    "dataset": "dataset name; 'imagefolder' reads any <root>/{train,test}/<class>/<image> tree in --data-dir",
    "data_dir": "file or directory holding the data (archive, extracted folder or a tfds data_dir); "
    "default: tfds' manual dir and data dir",
    "cache_dir": "where decoded uint8 arrays are cached; default $BSR_JAX_CACHE or ~/.cache/bsr_jax",
    "image_size": "model input side in pixels",
    "augment": "training augmentation: 'cifar' pad-4 random crop + flip, 'imagenet' random resized crop + flip",
    "model": "ResMLP preset (tiny: dim 128 depth 4; s12: 384x12; s24: 384x24; b24: 768x24)",
    "patch_size": "side of the square patches",
    "dim": "override the preset's channels per token",
    "depth": "override the preset's number of blocks",
    "dtype": "computation dtype (params and optimizer state stay float32)",
    "sparsity": "fraction of activation blocks dropped from the weight-gradient residuals (0 = dense)",
    "block": "square block side of the pruning",
    "criterion": "block magnitude used for ranking",
    "selection": "'global': largest blocks of the whole tensor; 'column': same number per block-column",
    "backend": "dW backend (cpu, xla, pallas, reference); default: $BSR_JAX_BACKEND or the platform's",
    "sparse_stem": "also prune the patch embedding's input",
    "sparse_head": "also prune the classifier's input",
    "prune_scale_shift": "also prune the inputs of Affine and LayerScale (their scale gradients)",
    "storage_dtype": "store kept blocks in lower precision (per-block scales for int8/float8), dequantized in backward",
    "stochastic": "sample kept blocks with probability by magnitude and rescale them (unbiased weight gradients)",
    "sparsity_warmup_epochs": "ramp every layer's sparsity from 0 to its target over this many epochs, in 4 stairs",
    "layer_sparsity": "PATTERN=VALUE, repeatable: layers whose module path matches PATTERN (fnmatch, e.g. "
    "'block*/fc2' or 'block0/*') use sparsity VALUE; first match wins; applies to every bsr_jax layer, "
    "Affine/LayerScale/stem/head included",
    "optimizer": "optimizer (decoupled weight decay on kernels only)",
    "lr": "peak learning rate",
    "min_lr": "final learning rate of the cosine decay",
    "weight_decay": "weight decay on kernels (none on biases, Affine and LayerScale)",
    "warmup_epochs": "linear warmup length in epochs (capped at 20%% of the run)",
    "label_smoothing": "label smoothing of the cross-entropy",
    "epochs": "epochs; the learning-rate schedule spans all of them",
    "batch_size": "global training batch, split over all devices",
    "eval_batch_size": "global evaluation batch",
    "seed": "seed of initialisation, data order and augmentation",
    "steps": "stop after this many steps in total (smoke runs); the schedule still spans --epochs",
    "log_every": "steps between metric lines",
    "checkpoint_every": "steps between checkpoints (one is also written at the end and on SIGINT/SIGTERM)",
    "keep_checkpoints": "checkpoints kept in WORKDIR/checkpoints",
    "resume": "continue from the last checkpoint in --workdir (same data order, bit-for-bit)",
}


def build_parser(
    prog: str, description: str, defaults: TrainConfig, datasets: Sequence[str] = DATASETS
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per ``TrainConfig`` field plus ``--workdir``."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--workdir", default=f"runs/{prog.split('.')[-1]}", help="where metrics, config and checkpoints go")
    choices = {
        "dataset": tuple(datasets),
        "augment": AUGMENTS,
        "model": tuple(PRESETS),
        "dtype": DTYPES,
        "optimizer": OPTIMIZERS,
        "criterion": ("l2", "l1"),
        "selection": ("global", "column"),
        "storage_dtype": STORAGE_DTYPES,
    }
    parser.add_argument("--layer-sparsity", type=_layer_rule, action="append", default=list(defaults.layer_sparsity),
                        metavar="PATTERN=VALUE", help=_HELP["layer_sparsity"])
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        if field.name == "layer_sparsity":
            continue
        if field.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=_HELP[field.name])
            continue
        kind = {"int": int, "float": float}.get(field.type.split(" ")[0], str)  # "int | None" -> int
        parser.add_argument(flag, type=kind, default=default, choices=choices.get(field.name), help=_HELP[field.name])
    return parser


def _layer_rule(text: str) -> tuple[str, float]:
    pattern, sep, value = text.rpartition("=")
    try:
        sparsity = float(value)
    except ValueError:
        sparsity = None
    if not sep or not pattern or sparsity is None:
        raise argparse.ArgumentTypeError(f"expected PATTERN=VALUE (e.g. 'block*/fc2=0.9'), got {text!r}")
    return pattern, sparsity


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of parsed flags; invalid values raise ``ValueError`` naming the flag's field."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    values["layer_sparsity"] = tuple(values["layer_sparsity"])
    return TrainConfig(**values)


def parse(
    prog: str, description: str, defaults: TrainConfig, datasets: Sequence[str], argv: Sequence[str] | None = None
) -> tuple[TrainConfig, str]:
    """Parse ``argv`` into ``(config, workdir)``; bad values exit with argparse's usage error (code 2)."""
    parser = build_parser(prog, description, defaults, datasets)
    args = parser.parse_args(argv)
    try:
        return config_from_args(args), args.workdir
    except ValueError as error:
        parser.error(str(error))
