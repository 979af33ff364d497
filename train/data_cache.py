"""On-disk cache of decoded splits: one directory per (source, split, image size).

Layout of `<cache_root>/<name>-<hash>/`:
  images.u8   raw uint8 pixels, C order, shape (N, H, W, 3) (raw so it can be written while
              decoding, without holding the split in memory, and memory-mapped when large)
  labels.npy  int32 (N,)
  meta.json   shape, num_classes, class names, source, split
A split is written into a temporary sibling directory and renamed into place when complete, so
readers never see a partial cache and concurrent writers cannot corrupt it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from train.data_decode import MixedSizes

CACHE_ENV_VAR = "BSR_JAX_CACHE"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "bsr_jax")
_FORMAT_VERSION = 1
# Splits larger than this are memory-mapped instead of read into RAM (ImageNet-size caches).
_IN_MEMORY_LIMIT_BYTES = 4 << 30


def resolve_cache_dir(cache_dir: str | None) -> str:
    """`cache_dir`, else $BSR_JAX_CACHE, else ~/.cache/bsr_jax (user-expanded, absolute)."""
    chosen = cache_dir or os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_DIR
    return os.path.abspath(os.path.expanduser(chosen))


def cache_name(description: dict[str, Any]) -> str:
    """Directory name for a split: readable prefix plus a hash of everything that defines it.

    `description` must include the source's fingerprint (paths, sizes, mtimes), so editing the
    source data produces a new name and the stale entry is simply never read again.
    """
    payload = json.dumps({"format": _FORMAT_VERSION, **description}, sort_keys=True)
    digest = hashlib.sha256(payload.encode()).hexdigest()[:16]
    size = description.get("image_size") or "native"
    return f"{description['dataset']}-{description['split']}-{size}-{digest}"


@dataclass(frozen=True)
class CachedSplit:
    """A cache entry read back: images uint8 (N, H, W, 3) read-only, labels int32 (N,)."""

    images: np.ndarray
    labels: np.ndarray
    meta: dict[str, Any]


def read_cache(cache_root: str, name: str) -> CachedSplit | None:
    """The cached split `name`, or None when it has not been written (completely) yet."""
    entry = os.path.join(cache_root, name)
    try:
        with open(os.path.join(entry, "meta.json")) as f:
            meta = json.load(f)
        labels = np.load(os.path.join(entry, "labels.npy"))
    except FileNotFoundError:
        return None
    shape = tuple(meta["shape"])
    path = os.path.join(entry, "images.u8")
    if int(np.prod(shape)) > _IN_MEMORY_LIMIT_BYTES:
        images = np.memmap(path, dtype=np.uint8, mode="r", shape=shape)
    else:
        images = np.fromfile(path, dtype=np.uint8).reshape(shape)
        # Shared cache contents: forbid in-place edits by callers.
        images.flags.writeable = False
    return CachedSplit(images=images, labels=labels.astype(np.int32, copy=False), meta=meta)


class CacheWriter:
    """Streams one split into a temporary directory; `commit` renames it into place."""

    def __init__(self, cache_root: str):
        os.makedirs(cache_root, exist_ok=True)
        self._root = cache_root
        self._tmp = tempfile.mkdtemp(prefix=".tmp-", dir=cache_root)
        self._images = open(os.path.join(self._tmp, "images.u8"), "wb")
        self._label_keys: list[Any] = []
        self._image_shape: tuple[int, ...] | None = None

    @property
    def count(self) -> int:
        """Number of images appended so far."""
        return len(self._label_keys)

    def append(self, images: np.ndarray, label_keys: list[Any]) -> None:
        """Append uint8 (n, H, W, 3) images and their n labels (ints or class names)."""
        if self._image_shape is None:
            self._image_shape = images.shape[1:]
        elif images.shape[1:] != self._image_shape:
            raise MixedSizes([self._image_shape[:2], images.shape[1:3]])
        self._images.write(np.ascontiguousarray(images, dtype=np.uint8).tobytes())
        self._label_keys.extend(label_keys)

    def commit(self, name: str, classes: list[str], meta: dict[str, Any]) -> None:
        """Publish the split as cache entry `name`, atomically.

        Class-name labels become their index in `classes`; integer labels are kept.
        """
        self._images.close()
        index = {c: i for i, c in enumerate(classes)}
        labels = [index[k] if isinstance(k, str) else k for k in self._label_keys]
        np.save(os.path.join(self._tmp, "labels.npy"), np.asarray(labels, np.int32))
        shape = [len(labels), *(self._image_shape or (0, 0, 3))]
        meta = {**meta, "shape": shape, "num_classes": len(classes), "classes": classes}
        with open(os.path.join(self._tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        final = os.path.join(self._root, name)
        try:
            os.rename(self._tmp, final)
        except OSError:
            # Another process published the same entry first; its content is identical.
            if not os.path.exists(os.path.join(final, "meta.json")):
                raise
            shutil.rmtree(self._tmp, ignore_errors=True)

    def discard(self) -> None:
        """Delete the temporary directory (on error, or for an unwanted split)."""
        if not self._images.closed:
            self._images.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
