"""Image-classification data: splits as uint8 arrays, and deterministic, resumable batches of them.

`load_split` finds a split in this order (the first hit wins):
  1. local files under `data_dir` and `data_dir/downloads/manual` (tfds' manual_dir; not for
     "imagefolder", which tfds does not know, nor is it asked in step 2), or, without
     `data_dir`, under `$TFDS_DATA_DIR/downloads/manual` (default ~/tensorflow_datasets) and
     `<cache_dir>/downloads`: the CIFAR python archives (cifar-10-python.tar.gz,
     cifar-100-python.tar.gz or their extracted directories), the ImageNet tars
     ILSVRC2012_img_{train,val}.tar, or an image folder <root>/{train,test}/<class>/<image> as a
     directory or a .tar/.tar.gz (details and naming rules in `train.data_sources`);
  2. a dataset prepared by tensorflow-datasets (array_record, read without TensorFlow) in
     `data_dir` or tfds' data dir, when tensorflow-datasets is installed (the `tfds` extra) and
     that directory has a folder for the dataset;
  3. CIFAR-10/100 without `data_dir`: downloaded from its canonical URL into
     `<cache_dir>/downloads` (`train.download`), where step 1 finds it next time.
Otherwise `DataNotFoundError` says where it looked and how to provide the data; an archive that
cannot be read or downloaded raises `DataError` naming the file or URL.

A split is decoded once and cached as uint8 arrays under `cache_dir` (default $BSR_JAX_CACHE or
~/.cache/bsr_jax), keyed by the source's paths, sizes and mtimes (`Source.fingerprint`); nothing
is written beside the data. Images of datasets with varying sizes (ImageNet) are stored as squares of side
round(image_size / 0.875) (shorter side resized, centre crop: 256 for 224), so a split fits in
memory or in a memory-mapped cache file; training crops `image_size` out of them (random resized
crop), evaluation takes the central `image_size` square (the usual resize-256 / crop-224).

"test" means ImageNet's validation split (its test split has no labels).
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import os
import pickle
import tarfile
import zlib
from typing import Any, Callable, Iterator, Literal

import numpy as np
from PIL import UnidentifiedImageError

from train import augment as aug
from train import progress
from train.data_cache import CacheWriter, CachedSplit, cache_name, read_cache, resolve_cache_dir
from train.data_decode import CHUNK, Chunk, MixedSizes, UnreadableImage, decode_chunks, stored_size
from train.data_sources import (
    ILSVRC_TARS, SPLIT_DIRS, DataError, Source, find_local_source, not_found_message, read_source, tfds_data_dir,
)
from train.download import CIFAR_ARCHIVES, MIRROR_VAR, download_cifar
from train.prefetch import prefetch  # noqa: F401 - re-exported: callers use data.prefetch

DATASETS = ("cifar10", "cifar100", "imagenet2012", "imagefolder")
# Per-channel mean and std of the training pixels in [0, 1].
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MEAN_STD = {
    "cifar10": (CIFAR10_MEAN, CIFAR10_STD),
    "cifar100": (CIFAR100_MEAN, CIFAR100_STD),
    "imagenet2012": (IMAGENET_MEAN, IMAGENET_STD),
    # Custom image folders: ImageNet statistics, the usual default for natural images.
    "imagefolder": (IMAGENET_MEAN, IMAGENET_STD),
}
NUM_CLASSES = {"cifar10": 10, "cifar100": 100, "imagenet2012": 1000}
_PERMUTATION_STREAM, _AUGMENT_STREAM = 0, 1


class DataNotFoundError(DataError):
    """No data for the requested split; the message lists every place looked at and the remedies."""


# What reading a truncated or corrupt archive, pickle or image raises.
_UNREADABLE = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, pickle.UnpicklingError, UnidentifiedImageError)


@dataclasses.dataclass(frozen=True, eq=False)
class ArrayDataset:
    """One split in memory (or memory-mapped).

    images: uint8 (N, H, W, 3). labels: int32 (N,) in [0, num_classes).
    mean, std: per-channel statistics of pixels / 255 used by the batch iterators.
    """

    images: np.ndarray
    labels: np.ndarray
    num_classes: int
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def __post_init__(self):
        if self.images.dtype != np.uint8 or self.images.ndim != 4 or self.images.shape[-1] != 3:
            got = f"{self.images.dtype} {self.images.shape}"
            raise ValueError(f"images must be uint8 (N, H, W, 3), got {got}")
        if self.labels.dtype != np.int32 or self.labels.shape != self.images.shape[:1]:
            got = f"{self.labels.dtype} {self.labels.shape}"
            raise ValueError(f"labels must be int32 ({len(self.images)},), got {got}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        if len(self.labels) and not 0 <= self.labels.min() <= self.labels.max() < self.num_classes:
            got = f"[{self.labels.min()}, {self.labels.max()}]"
            raise ValueError(f"labels must lie in [0, {self.num_classes}), got {got}")

    def __len__(self) -> int:
        return len(self.labels)


def load_split(
    dataset: str,
    split: Literal["train", "test"],
    data_dir: str | None = None,
    cache_dir: str | None = None,
    image_size: int | None = None,
) -> ArrayDataset:
    """Load a split as uint8 arrays, decoding and caching it on first use (see module docstring).

    Args:
      dataset: "cifar10", "cifar100", "imagenet2012", or "imagefolder" (any image folder in
        `data_dir`, normalised with ImageNet statistics).
      split: "train" or "test" (ImageNet: its validation set).
      data_dir: file or directory to search first (also a tfds data_dir).
      cache_dir: where decoded arrays are cached; default $BSR_JAX_CACHE, else ~/.cache/bsr_jax.
      image_size: model input size. None keeps native sizes (all images must agree, as in CIFAR);
        else images are stored as squares of side round(image_size / 0.875). Required for
        imagenet2012.

    Returns:
      ArrayDataset with images uint8 (N, H, W, 3), labels int32 (N,) and the dataset's mean/std.

    Raises:
      DataNotFoundError: nothing found; the message says where it looked and what to provide.
      DataError: the data found cannot be read, or the CIFAR download failed.
    """
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if image_size is not None and image_size < 1:
        raise ValueError(f"image_size must be a positive int or None, got {image_size}")
    if dataset == "imagenet2012" and image_size is None:
        raise ValueError("image_size is required for imagenet2012 (its images vary in size), e.g. 224")
    cache_root = resolve_cache_dir(cache_dir)
    downloads = os.path.join(cache_root, "downloads")
    source, looked = find_local_source(dataset, data_dir, downloads)
    tfds_dir = os.path.join(os.path.abspath(os.path.expanduser(data_dir or tfds_data_dir())), dataset)
    # tfds has no "imagefolder" dataset: it is never asked (nor named in the message).
    has_tfds = dataset != "imagefolder" and importlib.util.find_spec("tensorflow_datasets") is not None
    if source is None and has_tfds and os.path.isdir(tfds_dir):
        cached = _load_tfds(dataset, split, data_dir, image_size, cache_root, looked)
    else:
        if source is None and dataset in CIFAR_ARCHIVES and data_dir is None:
            try:
                source = Source("cifar_python", download_cifar(dataset, downloads))
            except DataError as error:  # the cause, where it looked before downloading, what to do offline
                raise DataError(f"{error}\n  Looked in {', '.join(looked)} first.\n  Offline: pass --data-dir "
                                f"{CIFAR_ARCHIVES[dataset][1]} from elsewhere, or an image folder; or set ${MIRROR_VAR}.") from None  # fmt: skip
        if source is None:
            reason = f"no {tfds_dir}" if has_tfds else "tensorflow-datasets is not installed"
            # tfds reads directories only (nothing to say about a file or a missing path), and never an imagefolder.
            if dataset == "imagefolder" or (data_dir is not None and not os.path.isdir(os.path.expanduser(data_dir))):
                reason = None
            raise DataNotFoundError(not_found_message(dataset, split, data_dir, looked, reason, downloadable=dataset in CIFAR_ARCHIVES))
        cached = _load_local(source, dataset, split, image_size, cache_root, data_dir)
    num_classes = cached.meta["num_classes"]
    if dataset in NUM_CLASSES and num_classes != NUM_CLASSES[dataset]:
        # Labels would index a head of the wrong size, and the accuracies would not be CIFAR's.
        raise DataError(f"{cached.meta['source']} has {num_classes} classes, but {dataset} has {NUM_CLASSES[dataset]}: "
                        "pass --dataset imagefolder to train on it as it is, or point --data-dir at the dataset")  # fmt: skip
    mean, std = MEAN_STD[dataset]
    return ArrayDataset(cached.images, cached.labels, num_classes, mean, std)


def _load_local(
    source: Source, dataset: str, split: str, image_size: int | None, cache_root: str, data_dir: str | None
) -> CachedSplit:
    description = {"dataset": dataset, "image_size": image_size, "source": dataclasses.asdict(source),
                   "files": source.fingerprint()}  # fmt: skip
    name = cache_name({**description, "split": split})
    cached = read_cache(cache_root, name)
    if cached is None:
        classes: list[str] = []
        chunks = read_source(source, split, classes)
        name_of = lambda s: cache_name({**description, "split": s})  # noqa: E731
        meta = {"dataset": dataset, "source": source.path}
        try:
            _decode_to_cache(chunks, classes, image_size, cache_root, name_of, meta)
        except UnreadableImage as error:
            raise DataError(f"{error} (a truncated or corrupt image? replace or delete it)") from None
        except _UNREADABLE as error:
            raise DataError(f"cannot read {source.path}: {type(error).__name__}: {error} "
                            "(a truncated or corrupt file? replace it, or point --data-dir elsewhere)") from None  # fmt: skip
        except MixedSizes as error:  # without image_size, which train.loop passes unless the flags below are missing
            raise DataError(f"{error} in {source.path}, which --augment cifar and the CIFAR datasets keep as stored; "
                            "to resize them all to N x N, pass --dataset imagefolder --augment imagenet (or none) --image-size N") from None  # fmt: skip
        cached = read_cache(cache_root, name)
    if cached is None:
        if source.kind == "ilsvrc":
            wanted = f"ImageNet needs {ILSVRC_TARS[split]} there"
        else:
            wanted = f"an image folder needs {' or '.join(d + '/<class>/<image>' for d in SPLIT_DIRS[split])}"
        passed = data_dir and os.path.abspath(os.path.expanduser(data_dir))
        # A source found below --data-dir is named with the folder the user passed.
        where = f"{dataset}, found in --data-dir {data_dir}" if passed and passed != source.path else dataset
        raise DataNotFoundError(f"{source.path} ({where}) has no '{split}' images: {wanted}, with at least one "
                                "image. Add them or point --data-dir elsewhere.")  # fmt: skip
    return cached


def _decode_to_cache(
    chunks: Iterator[Chunk],
    classes: list[str],
    image_size: int | None,
    cache_root: str,
    name_of: Callable[[str], str],
    meta: dict[str, Any],
) -> None:
    """Decode every chunk into a cache entry per split; `classes` is complete once chunks are exhausted."""
    writers: dict[str, CacheWriter] = {}
    try:
        for chunk in decode_chunks(chunks, stored_size(image_size)):
            if chunk.split not in writers:
                writers[chunk.split] = CacheWriter(cache_root)
            writers[chunk.split].append(chunk.images, chunk.labels)
        for split, dir_names in SPLIT_DIRS.items():
            found = next((d for d in dir_names if d in writers), None)
            if found is not None:
                split_meta = {**meta, "split": split, "split_dir": found}
                writers.pop(found).commit(name_of(split), classes, split_meta)
    finally:
        for writer in writers.values():
            writer.discard()


def _load_tfds(
    dataset: str,
    split: str,
    data_dir: str | None,
    image_size: int | None,
    cache_root: str,
    looked: list[str],
) -> CachedSplit:
    import tensorflow_datasets as tfds  # lazy: importing tfds costs about a second

    tfds_split = "validation" if dataset == "imagenet2012" and split == "test" else split
    try:
        source = tfds.data_source(dataset, split=tfds_split, data_dir=data_dir, download=False)
    except Exception as error:  # noqa: BLE001 - tfds raises many types; all mean "not available here"
        reason = _tfds_reason(tfds, dataset, data_dir, error)
        raise DataNotFoundError(not_found_message(dataset, split, data_dir, looked, reason, downloadable=dataset in CIFAR_ARCHIVES)) from None
    info = source.dataset_info
    where = str(info.data_dir)
    paths = sorted(os.path.join(where, n) for n in os.listdir(where)) if os.path.isdir(where) else []
    files = [[p, os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in paths]
    description = {"dataset": dataset, "split": split, "image_size": image_size, "num_examples": len(source),
                   "source": {"kind": "tfds", "path": where, "files": files}}  # fmt: skip
    name = cache_name(description)
    cached = read_cache(cache_root, name)
    if cached is None:
        classes = list(info.features["label"].names)
        meta = {"dataset": dataset, "source": f"tfds:{where}"}
        _decode_to_cache(_tfds_chunks(source, split), classes, image_size, cache_root, lambda _: name, meta)
        cached = read_cache(cache_root, name)
    return cached


def _tfds_chunks(source: Any, split: str) -> Iterator[Chunk]:
    for start in progress.bar(range(0, len(source), CHUNK), desc="reading tfds", unit="chunk", mininterval=1.0):
        examples = [source[i] for i in range(start, min(start + CHUNK, len(source)))]
        yield Chunk(split, [int(e["label"]) for e in examples], [e["image"] for e in examples])


def _tfds_reason(tfds: Any, dataset: str, data_dir: str | None, error: Exception) -> str:
    """One line on why tfds could not serve the dataset (the message must stay one paragraph)."""
    first_line = (str(error).splitlines() or [type(error).__name__])[0]
    try:
        builder = tfds.builder(dataset, data_dir=data_dir)
        if builder.is_prepared():
            file_format = builder.info.file_format.value
            return f"prepared at {builder.data_dir} as {file_format}, not array_record ({first_line})"
        return f"not prepared at {builder.data_dir}"
    except Exception:  # noqa: BLE001 - the reason is best effort; the original error says enough
        return first_line


def steps_per_epoch(data: ArrayDataset, batch_size: int) -> int:
    """Full training batches per epoch (the last partial batch is dropped)."""
    if not 1 <= batch_size <= len(data):
        raise ValueError(f"batch_size must be in [1, {len(data)}] (the split size), got {batch_size}")
    return len(data) // batch_size


def train_batches(
    data: ArrayDataset,
    batch_size: int,
    *,
    seed: int,
    epoch: int,
    start_batch: int = 0,
    augment: Literal["cifar", "imagenet", "none"] = "cifar",
    image_size: int | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Shuffled, augmented, normalised batches of one epoch, from batch `start_batch` on.

    The order is a permutation drawn from (seed, epoch); each batch's augmentation is drawn from
    (seed, epoch, batch index), so starting at `start_batch` yields exactly the batches an
    uninterrupted epoch yields from there. Augmentations: "cifar" random crop with 4-pixel zero
    padding + horizontal flip; "imagenet" random resized crop to `image_size` + flip; "none"
    central `image_size` crop (or nothing).

    Yields:
      {"image": float32 (B, S, S, 3) normalised with data.mean/std, "label": int32 (B,)} with
      S = image_size, or the stored size when None.
    """
    steps = steps_per_epoch(data, batch_size)
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    if not 0 <= start_batch <= steps:
        raise ValueError(f"start_batch must be in [0, {steps}], got {start_batch}")
    stored = data.images.shape[1]
    if augment == "cifar" and image_size not in (None, stored):
        raise ValueError(f"augment='cifar' keeps the stored size {stored}; image_size must be None or {stored}")
    if augment not in ("cifar", "imagenet", "none"):
        raise ValueError(f"augment must be 'cifar', 'imagenet' or 'none', got {augment!r}")
    order = np.random.default_rng([seed, epoch, _PERMUTATION_STREAM]).permutation(len(data))
    for step in range(start_batch, steps):
        idx = order[step * batch_size : (step + 1) * batch_size]
        images = data.images[idx]
        rng = np.random.default_rng([seed, epoch, _AUGMENT_STREAM, step])
        if augment == "cifar":
            images = aug.pad_crop_flip(images, rng)
        elif augment == "imagenet":
            images = aug.random_resized_crop(images, rng, image_size or stored)
        elif image_size is not None:
            images = aug.center_crop(images, image_size)
        yield {"image": aug.normalize(images, data.mean, data.std), "label": data.labels[idx]}


def eval_batches(
    data: ArrayDataset, batch_size: int, *, image_size: int | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """Every example exactly once, in order; the last batch is padded to `batch_size`.

    Yields:
      {"image": float32 (B, S, S, 3) normalised (central `image_size` crop when given, zeros in
      padding), "label": int32 (B,) (0 in padding), "mask": float32 (B,) 1 for real examples, 0 for padding}.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, len(data), batch_size):
        images = data.images[start : start + batch_size]
        if image_size is not None:
            images = aug.center_crop(images, image_size)
        real = len(images)
        batch = {
            "image": np.zeros((batch_size, *images.shape[1:]), np.float32),
            "label": np.zeros(batch_size, np.int32),
            "mask": np.zeros(batch_size, np.float32),
        }
        batch["image"][:real] = aug.normalize(images, data.mean, data.std)
        batch["label"][:real] = data.labels[start : start + batch_size]
        batch["mask"][:real] = 1.0
        yield batch
