"""The training flags' allowed values (both trainers'), and the image trainers' own --help texts
(``train.config`` builds the parser from them and ``train.common_config``'s shared ones).

Nothing here imports JAX, so ``--help`` and flag errors answer at once.
"""

from __future__ import annotations

DATASETS = ("cifar10", "cifar100", "imagenet2012", "imagefolder")
OPTIMIZERS = ("adamw", "lamb")
DTYPES = ("float32", "bfloat16")
AUGMENTS = ("cifar", "imagenet", "none")
# The names of train.models.PRESETS and the library's option lists (bsr_jax.storage.format's CRITERIA,
# SELECTIONS, STORAGE_DTYPES, bsr_jax.backends.dispatch.BACKENDS), repeated so that flags are checked
# without importing JAX; tests/train/test_cli.py checks that they match.
RESMLP_MODELS = ("tiny", "s12", "s24", "b24")
RESNET_MODELS = ("resnet18", "resnet50")  # train.resnet.PRESETS
MODELS = RESMLP_MODELS + RESNET_MODELS
# ResMLP-only settings: a ResNet run must leave them at their defaults.
RESMLP_ONLY = ("depth", "sparse_stem", "sparse_head", "prune_scale_shift", "layer_sparsity", "dx", "remat")
# --compression: window side of bsr_jax.Pooling on every ResNet convolution's input.
POOLING_FACTORS = {"pool2": 2, "pool4": 4}
COMPRESSIONS = tuple(POOLING_FACTORS)
CRITERIA = ("l2", "l1")
SELECTIONS = ("global", "column")
STORAGE_DTYPES = ("bfloat16", "float8_e4m3fn", "int8", "int4")
DX_FORMATS = ("int8", "int4")  # bsr_jax.ops.dx.DX_FORMATS
PLAN_TARGETS = ("h100", "tpu-v5p")  # bsr_jax.measure.compiled.DEVICELESS_TARGETS
ROUNDINGS = ("nearest", "stochastic")
STOCHASTIC_ROUNDING_DTYPES = ("int8", "int4")
BACKENDS = ("auto", "cpu", "xla", "pallas", "reference", "fused")
# What a resumed run may change: where it stops, where its data and logs are, how it computes
# dW (all backends agree to float rounding). --epochs also stretches the learning-rate schedule.
RESUME_OVERRIDES = ("steps", "epochs", "log_every", "checkpoint_every", "keep_checkpoints", "eval_batch_size",
                    "data_dir", "cache_dir", "backend")  # fmt: skip

# What train.common_config.HELP does not say, or the image trainers word for their models.
HELP = {
    "dataset": "dataset name; 'imagefolder' reads any <root>/{train,test}/<class>/<image> tree in --data-dir",
    "data_dir": "file or directory holding the data (archive, extracted folder or a tfds data_dir); default: "
    "tfds' manual dir and data dir, then <cache dir>/downloads, where CIFAR is downloaded if missing",
    "cache_dir": "where decoded uint8 arrays are cached; default $BSR_JAX_CACHE or ~/.cache/bsr_jax",
    "image_size": "model input side in pixels",
    "augment": "training augmentation: 'cifar' pad-4 random crop + flip, 'imagenet' random resized crop + flip",
    "model": "ResMLP preset (tiny: dim 128 depth 4; s12: 384x12; s24: 384x24; b24: 768x24) or ResNet v1.5 "
    "(resnet18, resnet50; BatchNorm; 3x3 stem for images up to 64 px, else the 7x7 ImageNet stem)",
    "patch_size": "side of the square patches (ResMLP)",
    "dim": "override the preset's channels per token (ResNet: filters of the stem and first stage, default 64)",
    "depth": "override the preset's number of blocks (ResMLP)",
    "remat": "ResMLP only: recompute each block in the backward pass (nn.remat per block). Alone, a block keeps only its "
    "input (the least memory, one more forward); with compression (--sparsity, --storage-dtype, --stochastic, "
    "--layer-sparsity, --dx) it keeps its compressed residuals and matmul outputs and recomputes the elementwise ops "
    "(bsr_jax.remat_policy())",
    "sparsity": "fraction of activation blocks dropped from the weight-gradient residuals (0 = dense); "
    "ResNet: every convolution's input as (N*H*W, C) blocks",
    "block": "block of the pruning and of the per-block scales: a square side (16) or ROWSxCOLUMNS (1x128: one scale "
    "per token and 128 features, the fused kernels' format)",
    "sparse_stem": "also prune the patch embedding's input",
    "sparse_head": "also prune the classifier's input",
    "prune_scale_shift": "also prune the inputs of Affine and LayerScale (their scale gradients)",
    "dx": f"approximate input gradients: store the GELU input, which GELU's exact backward needs, in one of {', '.join(DX_FORMATS)} "
          "(per-row scales every 128 values); default exact",
    "compression": "ResNet only: keep the window means of every convolution's input for its weight gradient, "
    "2x2 (pool2) or 4x4 (pool4) windows (bsr_jax.Pooling; Barley & Froning 2024); --storage-dtype applies to them",
    "sparsity_warmup_epochs": "ramp every layer's sparsity from 0 to its target over this many epochs, in 4 stairs",
    "layer_sparsity": "PATTERN=VALUE, repeatable: layers whose module path matches PATTERN (fnmatch, e.g. "
    "'block*/fc2' or 'block0/*') use sparsity VALUE; first match wins; applies to every bsr_jax layer, "
    "Affine/LayerScale/stem/head included",
    "optimizer": "optimizer (decoupled weight decay on kernels only)",
    "lr": "peak learning rate",
    "weight_decay": "weight decay on kernels (none on biases, Affine and LayerScale)",
    "warmup_epochs": "linear warmup length in epochs (capped at 20%% of the run)",
    "label_smoothing": "label smoothing of the cross-entropy",
    "epochs": "epochs; the learning-rate schedule spans all of them",
    "batch_size": "global training batch, split over all devices",
    "eval_batch_size": "global evaluation batch",
    "seed": "seed of initialisation, data order and augmentation",
    "steps": "stop after this many steps in total (quick runs); the schedule still spans --epochs",
}
