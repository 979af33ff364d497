"""train.data: every source format on tiny generated data, the cache, batches, resume, errors."""

from __future__ import annotations

import io
import os
import tarfile
import threading
import time

import chex
import jax
import numpy as np
import pytest
from PIL import Image

from train import augment, data, data_decode


def _file_snapshot(root) -> dict[str, tuple[int, int]]:
    return {os.path.join(d, f): (os.stat(os.path.join(d, f)).st_size, os.stat(os.path.join(d, f)).st_mtime_ns)
            for d, _, names in os.walk(root) for f in names}  # fmt: skip


def _sorted_by_content(images: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Canonical order (by label, then bytes) to compare loads whose example order may differ."""
    keys = [(int(l), im.tobytes()) for im, l in zip(images, labels)]
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return images[order], labels[order]


def _forbid_decoding(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("decoded although the split is cached")

    monkeypatch.setattr(data_decode, "decode_images", fail)


# ----------------------------------------------------------------------------- CIFAR python release


@pytest.mark.parametrize("dataset, num_classes", [("cifar10", 10), ("cifar100", 100)])
@pytest.mark.parametrize("archive", [True, False], ids=["tar.gz", "extracted"])
def test_cifar_python_release(isolated_env, fake_data, dataset, num_classes, archive):
    rng = np.random.default_rng(0)
    train = fake_data.random_split(rng, 15, num_classes, size=32)
    test = fake_data.random_split(rng, 4, num_classes, size=32)
    source_dir = isolated_env / "downloads"
    source_dir.mkdir()
    path = fake_data.write_cifar_python(str(source_dir), dataset, train, test, archive=archive)
    cache = str(isolated_env / "cache")
    # The file itself, or the directory holding it, both work.
    for data_dir in (path, str(source_dir)):
        for split, expected in (("train", train), ("test", test)):
            loaded = data.load_split(dataset, split, data_dir=data_dir, cache_dir=cache)
            assert loaded.images.dtype == np.uint8 and loaded.labels.dtype == np.int32
            assert loaded.num_classes == num_classes
            # Exact pixels in data_batch_1..5 order: the CHW rows were transposed correctly.
            np.testing.assert_array_equal(loaded.images, expected.images)
            np.testing.assert_array_equal(loaded.labels, expected.labels)
            assert (loaded.mean, loaded.std) == data.MEAN_STD[dataset]


# ----------------------------------------------------------------------------- image folders


# Ten classes, as a folder loaded as cifar10 must have; these appear in train only, once each.
_MORE_CLASSES = [f"other{i}" for i in range(7)]


def _folder_splits(rng, size=8):
    """Classes created in non-alphabetical order; 'mango' appears only in train."""
    def items(classes):
        return [(c, rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for c in classes]

    return {"train": items(["zebra", "apple", "mango", "zebra", "apple", *_MORE_CLASSES]),
            "test": items(["zebra", "apple", "zebra"])}  # fmt: skip


def _expected(items):
    index = {c: i for i, c in enumerate(["apple", "mango", *_MORE_CLASSES, "zebra"])}
    return np.stack([im for _, im in items]), np.asarray([index[c] for c, _ in items], np.int32)


@pytest.mark.parametrize("form", ["dir", "nested dir", "tar.gz nested", "tar top", "dir with named tar"])
def test_image_folder_forms(isolated_env, fake_data, form):
    splits = _folder_splits(np.random.default_rng(1))
    tree = isolated_env / "tree"
    fake_data.write_image_folder(str(tree), splits)
    data_root = isolated_env / "data"
    data_root.mkdir()
    if form == "dir":
        data_dir = str(tree)
    elif form == "nested dir":  # <data_dir>/<dataset name>/<x>/train/...
        os.rename(tree, data_root / "cifar10")
        data_dir = str(data_root)
    elif form == "tar.gz nested":  # like cifar10-jpg.tar.gz: cifar10/train/<class>/*.jpg
        data_dir = fake_data.tar_directory(str(tree), str(data_root / "anything.tar.gz"), "cifar10")
    elif form == "tar top":
        data_dir = fake_data.tar_directory(str(tree), str(data_root / "plain.tar"), ".")
    else:  # found by name among other archives; cifar100-*.tar.gz must not match "cifar10"
        fake_data.tar_directory(str(tree), str(data_root / "cifar10-jpg.tar.gz"), "cifar10")
        other = isolated_env / "other"
        fake_data.write_image_folder(str(other), {"train": [("x", np.zeros((4, 4, 3), np.uint8))]})
        fake_data.tar_directory(str(other), str(data_root / "cifar100-jpg.tar.gz"), "cifar100")
        data_dir = str(data_root)
    before = _file_snapshot(isolated_env / "data")
    for split in ("train", "test"):
        loaded = data.load_split("cifar10", split, data_dir=data_dir, cache_dir=str(isolated_env / "cache"))
        images, labels = _expected(splits[split])
        assert loaded.num_classes == 10  # union of both splits' classes, alphabetical
        got = _sorted_by_content(loaded.images, loaded.labels)
        want = _sorted_by_content(images, labels)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    assert _file_snapshot(isolated_env / "data") == before  # nothing written beside the data


def test_image_folder_jpeg_and_val_dir(isolated_env, fake_data):
    rng = np.random.default_rng(2)
    root = isolated_env / "imgs"
    splits = {"train": [("b", rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)) for _ in range(3)],
              "val": [("a", rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))]}  # fmt: skip
    fake_data.write_image_folder(str(root), splits, ext=".jpg")
    loaded = data.load_split("imagefolder", "test", data_dir=str(root), cache_dir=str(isolated_env / "c"))
    with Image.open(root / "val" / "a" / "0000.jpg") as image:
        expected = np.asarray(image.convert("RGB"))
    np.testing.assert_array_equal(loaded.images[0], expected)
    assert loaded.labels.tolist() == [0] and loaded.num_classes == 2
    assert (loaded.mean, loaded.std) == (data.IMAGENET_MEAN, data.IMAGENET_STD)


def test_image_sizes_must_agree_unless_image_size(isolated_env, fake_data):
    root = isolated_env / "imgs"
    fake_data.write_image_folder(str(root), {"train": [("a", np.zeros((8, 8, 3), np.uint8)),
                                                       ("b", np.zeros((12, 10, 3), np.uint8))]})  # fmt: skip
    with pytest.raises(data.DataError, match=r"^images have different sizes 8x8 and 12x10 in .* --image-size N$"):
        data.load_split("imagefolder", "train", data_dir=str(root), cache_dir=str(isolated_env / "c"))
    loaded = data.load_split("imagefolder", "train", data_dir=str(root), cache_dir=str(isolated_env / "c"),
                             image_size=7)  # fmt: skip
    assert loaded.images.shape == (2, 8, 8, 3)  # stored side round(7 / 0.875) = 8


def test_missing_split_or_empty_class_folders_are_reported(isolated_env, fake_data):
    root = isolated_env / "imgs"
    fake_data.write_image_folder(str(root), {"train": [("a", np.zeros((4, 4, 3), np.uint8))]})
    with pytest.raises(data.DataNotFoundError, match=f"^{root} \\(imagefolder\\) has no 'test' images: an image "
                       "folder needs test/<class>/<image> or val/"):  # fmt: skip
        data.load_split("imagefolder", "test", data_dir=str(root), cache_dir=str(isolated_env / "c"))
    empty = isolated_env / "empty_classes"
    for split_dir in ("train/a", "train/b", "test/a"):
        (empty / split_dir).mkdir(parents=True)
    with pytest.raises(data.DataNotFoundError, match="has no 'train' images: an image folder needs train/<class>/<image>"):
        data.load_split("imagefolder", "train", data_dir=str(empty), cache_dir=str(isolated_env / "c"))


@pytest.mark.parametrize("damage", ["truncated", "not_gzip"])
def test_unreadable_archive_is_one_error_naming_the_file(isolated_env, fake_data, damage):
    rng = np.random.default_rng(0)
    split = fake_data.random_split(rng, 10, 10, size=32)
    archive = fake_data.write_cifar_python(str(isolated_env), "cifar10", split, split, archive=True)
    content = open(archive, "rb").read()
    with open(archive, "wb") as f:
        f.write(content[: len(content) // 2] if damage == "truncated" else b"not an archive" * 100)
    with pytest.raises(data.DataError, match=f"^cannot read {archive}: .*truncated or corrupt") as info:
        data.load_split("cifar10", "train", data_dir=archive, cache_dir=str(isolated_env / "c"))
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- ImageNet (ILSVRC tars)


def _tfds_imagenet_lines(name: str) -> list[str]:
    import tensorflow_datasets

    path = os.path.join(os.path.dirname(tensorflow_datasets.__file__), "datasets", "imagenet2012", name)
    with open(path) as f:
        return f.read().split()


def test_ilsvrc_tars_in_manual_dir(isolated_env, fake_data):
    wnids = _tfds_imagenet_lines("labels.txt")
    val_wnids = _tfds_imagenet_lines("validation_labels.txt")
    manual = isolated_env / "tfds" / "downloads" / "manual"
    manual.mkdir(parents=True)
    rng = np.random.default_rng(3)
    sizes = [(20, 30), (40, 24), (24, 24)]

    def image(i):
        return rng.integers(0, 256, (*sizes[i % 3], 3), dtype=np.uint8)

    with tarfile.open(manual / "ILSVRC2012_img_train.tar", "w") as outer:
        for wnid in (wnids[7], wnids[2]):
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as class_tar:
                for i in range(2):
                    fake_data.add_bytes(class_tar, f"{wnid}_{i}.JPEG", fake_data.jpeg_bytes(image(i)))
            fake_data.add_bytes(outer, f"{wnid}.tar", inner.getvalue())
    with tarfile.open(manual / "ILSVRC2012_img_val.tar", "w") as val:
        for k in (3, 1, 2):
            fake_data.add_bytes(val, f"ILSVRC2012_val_{k:08d}.JPEG", fake_data.jpeg_bytes(image(k)))
    cache = str(isolated_env / "cache")
    # No data_dir: tfds' manual_dir under $TFDS_DATA_DIR is searched.
    train = data.load_split("imagenet2012", "train", cache_dir=cache, image_size=14)
    assert train.images.shape == (4, 16, 16, 3) and train.num_classes == 1000  # 16 = round(14 / 0.875)
    assert train.labels.tolist() == [7, 7, 2, 2]
    test = data.load_split("imagenet2012", "test", cache_dir=cache, image_size=14)
    assert test.labels.tolist() == [wnids.index(val_wnids[k - 1]) for k in (3, 1, 2)]
    with pytest.raises(ValueError, match="image_size is required"):
        data.load_split("imagenet2012", "train", cache_dir=cache)


# ----------------------------------------------------------------------------- tfds


def test_tfds_data_source_under_mock_data(isolated_env):
    tfds = pytest.importorskip("tensorflow_datasets")
    cache = str(isolated_env / "cache")
    for name in ("cifar10", "imagenet2012"):  # tfds is asked only when its data dir has the dataset
        (isolated_env / "tfds" / name).mkdir(parents=True)
    with tfds.testing.mock_data(num_examples=6):
        train = data.load_split("cifar10", "train", cache_dir=cache)
        imagenet = data.load_split("imagenet2012", "test", cache_dir=cache, image_size=14)
    assert train.images.shape == (6, 32, 32, 3) and train.num_classes == 10
    assert 0 <= train.labels.min() and train.labels.max() < 10
    assert imagenet.images.shape == (6, 16, 16, 3) and imagenet.num_classes == 1000


# ----------------------------------------------------------------------------- cache


def test_cache_hit_skips_decoding_and_stays_in_cache_dir(isolated_env, fake_data, monkeypatch):
    tree = isolated_env / "tree"
    fake_data.write_image_folder(str(tree), _folder_splits(np.random.default_rng(4)))
    archive = fake_data.tar_directory(str(tree), str(isolated_env / "set.tar.gz"), "root")
    monkeypatch.setenv("BSR_JAX_CACHE", str(isolated_env / "env_cache"))
    first = data.load_split("cifar10", "train", data_dir=archive)
    entries = sorted(os.listdir(isolated_env / "env_cache"))
    assert len(entries) == 2 and not any(e.startswith(".") for e in entries)  # both splits, no temp dir
    assert not (isolated_env / "home").exists()  # the env var overrode ~/.cache/bsr_jax
    _forbid_decoding(monkeypatch)
    again = data.load_split("cifar10", "train", data_dir=archive)
    np.testing.assert_array_equal(again.images, first.images)
    data.load_split("cifar10", "test", data_dir=archive)  # decoded in the same pass as train
    with pytest.raises(ValueError, match="read-only"):
        again.images[0, 0, 0, 0] = 1  # the cached array is shared: no in-place edits


def test_cache_default_dir_and_invalidation(isolated_env, fake_data):
    root = isolated_env / "imgs"
    image = np.full((4, 4, 3), 10, np.uint8)
    fake_data.write_image_folder(str(root), {"train": [("a", image)]})
    first = data.load_split("imagefolder", "train", data_dir=str(root))
    assert os.listdir(isolated_env / "home" / ".cache" / "bsr_jax")
    # A new image in an existing class changes only that directory's mtime: a new cache entry.
    Image.fromarray(image + 5).save(root / "train" / "a" / "0001.png")
    second = data.load_split("imagefolder", "train", data_dir=str(root))
    assert len(first) == 1 and second.images[:, 0, 0, 0].tolist() == [10, 15]


# ----------------------------------------------------------------------------- batches


def _dataset(n=20, size=8, num_classes=5, seed=0):
    split = np.random.default_rng(seed)
    images = split.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    return data.ArrayDataset(images, np.arange(n, dtype=np.int32) % num_classes, num_classes, (0.5, 0.4, 0.3), (0.2, 0.3, 0.4))


@pytest.mark.parametrize("aug, image_size, out", [("cifar", None, 8), ("imagenet", 6, 6), ("none", 6, 6), ("none", None, 8)])
def test_train_batches_deterministic_and_resumable(aug, image_size, out):
    ds = _dataset()
    kwargs = dict(seed=3, augment=aug, image_size=image_size)
    full = list(data.train_batches(ds, 6, epoch=1, **kwargs))
    assert len(full) == data.steps_per_epoch(ds, 6) == 3  # 20 // 6, last partial batch dropped
    for batch in full:
        assert batch["image"].shape == (6, out, out, 3) and batch["image"].dtype == np.float32
        assert batch["label"].shape == (6,) and batch["label"].dtype == np.int32
    again = list(data.train_batches(ds, 6, epoch=1, **kwargs))
    resumed = list(data.train_batches(ds, 6, epoch=1, start_batch=2, **kwargs))
    for a, b in zip(full + full[2:], again + resumed):
        np.testing.assert_array_equal(a["image"], b["image"])  # bit-identical
        np.testing.assert_array_equal(a["label"], b["label"])
    other_epoch = list(data.train_batches(ds, 6, epoch=2, **kwargs))
    assert not all(np.array_equal(a["label"], b["label"]) for a, b in zip(full, other_epoch))


def test_train_batches_permute_the_dataset():
    ds = data.ArrayDataset(np.zeros((12, 2, 2, 3), np.uint8), np.arange(12, dtype=np.int32), 12)
    labels = np.concatenate([b["label"] for b in data.train_batches(ds, 4, seed=0, epoch=0, augment="none")])
    assert sorted(labels.tolist()) == list(range(12)) and labels.tolist() != list(range(12))


def test_normalisation_uses_dataset_statistics():
    ds = _dataset()
    batch = next(data.eval_batches(ds, 4))
    pixels = batch["image"] * np.asarray(ds.std, np.float32) + np.asarray(ds.mean, np.float32)
    chex.assert_trees_all_close(pixels, ds.images[:4] / 255.0, atol=1e-6, rtol=0)


def test_eval_batches_cover_every_example_once_with_mask():
    ds = _dataset(n=10)
    batches = list(data.eval_batches(ds, 4, image_size=6))
    assert len(batches) == 3 and all(set(b) == {"image", "label", "mask"} for b in batches)
    mask = np.concatenate([b["mask"] for b in batches])
    assert mask.dtype == np.float32 and mask.tolist() == [1.0] * 10 + [0.0] * 2
    labels = np.concatenate([b["label"] for b in batches])[:10]
    np.testing.assert_array_equal(labels, ds.labels)
    images = np.concatenate([b["image"] for b in batches])
    expected = augment.normalize(ds.images[:, 1:7, 1:7], ds.mean, ds.std)  # central 6x6 of 8x8
    np.testing.assert_array_equal(images[:10], expected)
    assert not images[10:].any()


def test_pad_crop_flip_is_a_shifted_possibly_mirrored_crop():
    images = np.random.default_rng(5).integers(1, 256, (16, 6, 6, 3), dtype=np.uint8)
    out = augment.pad_crop_flip(images, np.random.default_rng(0), pad=2)
    padded = np.pad(images, ((0, 0), (2, 2), (2, 2), (0, 0)))
    outcomes = set()
    for image, result in zip(padded, out):
        matches = [(dy, dx, flip) for dy in range(5) for dx in range(5) for flip in (False, True)
                   if np.array_equal(result, (image[:, ::-1] if flip else image)[dy : dy + 6, dx : dx + 6])]  # fmt: skip
        assert matches, "output is not a crop of the padded (flipped) image"
        outcomes.update(matches)
    assert len(outcomes) > 4  # offsets and flips do vary


def test_random_resized_crop_of_the_whole_image_is_the_image_or_its_mirror():
    images = np.random.default_rng(6).integers(0, 256, (8, 5, 5, 3), dtype=np.uint8)
    out = augment.random_resized_crop(images, np.random.default_rng(1), 5, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    flipped = [np.array_equal(o, i[:, ::-1]) for o, i in zip(out, images)]
    unflipped = [np.array_equal(o, i) for o, i in zip(out, images)]
    assert all(f or u for f, u in zip(flipped, unflipped)) and any(flipped) and any(unflipped)
    general = augment.random_resized_crop(images, np.random.default_rng(2), 3)
    assert general.shape == (8, 3, 3, 3) and general.dtype == np.float32
    assert general.min() >= 0 and general.max() <= 255


# ----------------------------------------------------------------------------- prefetch


def test_prefetch_preserves_order_errors_and_sharding():
    items = [{"x": np.full((4, 2), i, np.float32)} for i in range(5)]
    got = list(data.prefetch(iter(items), size=2))
    assert [int(g["x"][0, 0]) for g in got] == list(range(5))

    def failing():
        yield items[0]
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        list(data.prefetch(failing()))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    placed = next(data.prefetch(iter(items), sharding=sharding))
    assert isinstance(placed["x"], jax.Array) and placed["x"].sharding == sharding
    chex.assert_trees_all_close(placed["x"], items[0]["x"], atol=0, rtol=0)


def test_abandoned_prefetch_stops_its_thread():
    def endless():
        while True:
            yield np.zeros(3)

    stream = data.prefetch(endless(), size=1)
    next(stream)
    stream.close()
    deadline = time.time() + 5
    while any(t.name == "prefetch" for t in threading.enumerate()) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "prefetch" for t in threading.enumerate())


# ----------------------------------------------------------------------------- argument checks


def test_bad_arguments_raise_clear_errors(tmp_path):
    ds = _dataset()
    with pytest.raises(ValueError, match="dataset must be one of"):
        data.load_split("mnist", "train", cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="split must be"):
        data.load_split("cifar10", "validation", cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="batch_size must be in"):
        data.steps_per_epoch(ds, 21)
    with pytest.raises(ValueError, match="start_batch must be in"):
        next(data.train_batches(ds, 4, seed=0, epoch=0, start_batch=6))
    with pytest.raises(ValueError, match="augment must be"):
        next(data.train_batches(ds, 4, seed=0, epoch=0, augment="mixup"))
    with pytest.raises(ValueError, match="labels must lie in"):
        data.ArrayDataset(ds.images, ds.labels, 3)
    with pytest.raises(ValueError, match="images must be uint8"):
        data.ArrayDataset(ds.images.astype(np.float32), ds.labels, 5)
