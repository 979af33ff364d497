"""Tiny datasets in every on-disk format `train.data` reads, generated in tmp_path.

Pixels are random but known, so tests can compare what was loaded with what was written; PNG
keeps them exact (JPEG tests compare against PIL's own decode of the same file). The writers are
offered through the `fake_data` fixture (a namespace), since test modules cannot import conftest.
"""

from __future__ import annotations

import io
import os
import pickle
import tarfile
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@dataclass
class FakeSplit:
    """Expected content: images uint8 (N, H, W, 3), labels int32 (N,)."""

    images: np.ndarray
    labels: np.ndarray


def random_split(rng: np.random.Generator, n: int, num_classes: int, size: int = 8) -> FakeSplit:
    images = rng.integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)
    return FakeSplit(images, rng.integers(0, num_classes, size=n).astype(np.int32))


def write_cifar_python(
    directory: str, dataset: str, train: FakeSplit, test: FakeSplit, archive: bool
) -> str:
    """The CIFAR python release's files and pickle keys (bytes keys, as Python 2 pickles load).

    CIFAR-10: cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}, train split evenly
    over the 5 batches; CIFAR-100: cifar-100-python/{train, test, meta} with fine and coarse labels.
    Rows are CHW-flattened (N, 3072) uint8, so images must be 32x32. Returns the archive
    (members in a scrambled order, like the real one) or the extracted directory.
    """
    cifar10 = dataset == "cifar10"
    folder = os.path.join(directory, "cifar-10-batches-py" if cifar10 else "cifar-100-python")
    os.makedirs(folder)

    def rows(images: np.ndarray) -> np.ndarray:
        return images.transpose(0, 3, 1, 2).reshape(len(images), -1)

    def dump(name: str, content: dict) -> None:
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(content, f, protocol=2)

    if cifar10:
        for i, part in enumerate(np.array_split(np.arange(len(train.labels)), 5)):
            dump(f"data_batch_{i + 1}", {b"batch_label": b"training batch", b"labels": train.labels[part].tolist(),
                                         b"data": rows(train.images[part])})  # fmt: skip
        dump("test_batch", {b"labels": test.labels.tolist(), b"data": rows(test.images)})
        dump("batches.meta", {b"label_names": [c.encode() for c in CIFAR10_CLASSES], b"num_vis": 3072})
    else:
        for name, split in (("train", train), ("test", test)):
            dump(name, {b"fine_labels": split.labels.tolist(), b"coarse_labels": (split.labels // 5).tolist(),
                        b"data": rows(split.images)})  # fmt: skip
        dump("meta", {b"fine_label_names": [f"class{i:03d}".encode() for i in range(100)],
                      b"coarse_label_names": [f"super{i:02d}".encode() for i in range(20)]})  # fmt: skip
    if not archive:
        return folder
    path = os.path.join(directory, "cifar-10-python.tar.gz" if cifar10 else "cifar-100-python.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        for name in sorted(os.listdir(folder), reverse=True):
            tar.add(os.path.join(folder, name), arcname=f"{os.path.basename(folder)}/{name}")
    return path


def write_image_folder(root: str, splits: dict[str, list[tuple[str, np.ndarray]]], ext: str = ".png") -> None:
    """root/<split dir>/<class>/<index><ext> for each (class name, uint8 (H, W, 3) image)."""
    for split_dir, items in splits.items():
        for i, (class_name, image) in enumerate(items):
            os.makedirs(os.path.join(root, split_dir, class_name), exist_ok=True)
            Image.fromarray(image).save(os.path.join(root, split_dir, class_name, f"{i:04d}{ext}"))


def tar_directory(source: str, path: str, arcname: str, seed: int = 0) -> str:
    """Archive every file under `source` as `arcname/...`, in a shuffled (but fixed) member order."""
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(source) for f in names)
    order = np.random.default_rng(seed).permutation(len(files))
    mode = "w:gz" if path.endswith((".gz", ".tgz")) else "w"
    with tarfile.open(path, mode) as tar:
        for i in order:
            tar.add(files[i], arcname=os.path.join(arcname, os.path.relpath(files[i], source)))
    return path


def jpeg_bytes(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG")
    return buffer.getvalue()


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def isolated_env(tmp_path, monkeypatch):
    """Point HOME, TFDS_DATA_DIR and BSR_JAX_CACHE away from the real machine's data and caches."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    monkeypatch.delenv("BSR_JAX_CACHE", raising=False)
    return tmp_path


@pytest.fixture
def fake_data() -> SimpleNamespace:
    """The writers above: fake_data.random_split(rng, n, num_classes, size), .write_cifar_python(...),
    .write_image_folder(...), .tar_directory(...), .jpeg_bytes(image), .add_bytes(tar, name, data)."""
    return SimpleNamespace(
        FakeSplit=FakeSplit,
        random_split=random_split,
        write_cifar_python=write_cifar_python,
        write_image_folder=write_image_folder,
        tar_directory=tar_directory,
        jpeg_bytes=jpeg_bytes,
        add_bytes=add_bytes,
        CIFAR10_CLASSES=CIFAR10_CLASSES,
    )


@pytest.fixture(scope="session")
def cifar_image_folder(tmp_path_factory):
    """A CIFAR-10-style image folder of 32x32 PNGs under ``<root>/cifar10``: 40 train (5 steps of
    8), 12 test; ``<root>`` is returned (pass it as ``--data-dir`` or as the run's home)."""
    root = tmp_path_factory.mktemp("cifar_image_folder")
    rng = np.random.default_rng(0)
    for split, count in (("train", 40), ("test", 12)):
        for i in range(count):
            folder = root / "cifar10" / split / f"class{i % 10}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i:04d}.png")
    return root
