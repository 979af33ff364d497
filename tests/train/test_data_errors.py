"""Data a user points at by mistake, or that is damaged: every error names the file or folder and
says what to pass instead, on short lines."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from train import data


def _folder(classes: int, per_class: int = 1):
    """Items of ``fake_data.write_image_folder``: 8x8 images in classes c<k>, ``per_class`` train
    images and one test image each."""
    rng = np.random.default_rng(0)
    image = lambda: rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)  # noqa: E731
    return {"train": [(f"c{k}", image()) for k in range(classes) for _ in range(per_class)],
            "test": [(f"c{k}", image()) for k in range(classes)]}  # fmt: skip


@pytest.mark.parametrize("damage", ["not an image", "truncated"])
@pytest.mark.parametrize("form", ["dir", "tar"])
def test_a_corrupt_image_is_named(isolated_env, fake_data, damage, form):
    folder = isolated_env / "imgs"
    fake_data.write_image_folder(str(folder), _folder(2), ext=".jpg")
    bad = folder / "train" / "c1" / "0001.jpg"
    content = bad.read_bytes()
    bad.write_bytes(b"not a jpeg" * 10 if damage == "not an image" else content[: len(content) // 2])
    data_dir = str(folder) if form == "dir" else fake_data.tar_directory(str(folder), str(isolated_env / "imgs.tar"), "imgs")
    name = str(bad) if form == "dir" else f"imgs/train/c1/0001.jpg in {data_dir}"
    with pytest.raises(data.DataError) as info:
        data.load_split("imagefolder", "train", data_dir=data_dir, cache_dir=str(isolated_env / "c"))
    message = str(info.value)
    assert message.startswith(f"cannot read image {name}: ") and "\n" not in message and "BytesIO" not in message
    assert message.endswith("(a truncated or corrupt image? replace or delete it)")
    cache = isolated_env / "c"
    assert not cache.exists() or [n for n in os.listdir(cache) if n.startswith(".tmp")] == []  # no partial entry


def test_imagefolder_is_found_one_level_down_as_cifar10_is(isolated_env, fake_data):
    small = isolated_env / "small"
    fake_data.write_image_folder(str(small / "cifar10"), _folder(10))
    for dataset in ("cifar10", "imagefolder"):
        loaded = data.load_split(dataset, "train", data_dir=str(small), cache_dir=str(isolated_env / "c"))
        assert len(loaded) == 10 and loaded.num_classes == 10
    fake_data.write_image_folder(str(small / "other"), _folder(3))
    with pytest.raises(data.DataError, match=f"^{small} holds several image folders \\(cifar10/, other/\\): pass the one "
                                             "to train on as --data-dir$"):  # fmt: skip
        data.load_split("imagefolder", "train", data_dir=str(small), cache_dir=str(isolated_env / "c"))


@pytest.mark.parametrize("dataset, classes", [("cifar10", 2), ("cifar10", 11), ("cifar100", 10)])
def test_a_folder_with_another_number_of_classes_is_not_that_cifar(isolated_env, fake_data, dataset, classes):
    folder = isolated_env / dataset
    fake_data.write_image_folder(str(folder), _folder(classes))
    with pytest.raises(data.DataError) as info:
        data.load_split(dataset, "train", data_dir=str(folder), cache_dir=str(isolated_env / "c"))
    expected = 10 if dataset == "cifar10" else 100
    assert str(info.value) == (f"{folder} has {classes} classes, but {dataset} has {expected}: pass --dataset imagefolder "
                               "to train on it as it is, or point --data-dir at the dataset")  # fmt: skip
    assert data.load_split("imagefolder", "train", data_dir=str(folder), cache_dir=str(isolated_env / "c")).num_classes == classes


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100", "imagenet2012", "imagefolder"])
@pytest.mark.parametrize("where", ["missing archive", "a file", "empty dir", "no data dir"])
def test_not_found_is_three_short_lines_and_a_file_is_not_a_directory(isolated_env, dataset, where):
    if where == "missing archive":
        data_dir = str(isolated_env / "cifar-10-python.tar.gz")
    elif where == "a file":
        data_dir = str(isolated_env / "notes.txt")
        open(data_dir, "w").close()
    elif where == "empty dir":
        data_dir = str(isolated_env / "empty")
        os.mkdir(data_dir)
    else:
        data_dir = None
        if dataset.startswith("cifar"):
            pytest.skip("without --data-dir CIFAR is downloaded (tests/train/test_download.py)")
    with pytest.raises(data.DataNotFoundError) as info:
        data.load_split(dataset, "train", data_dir=data_dir, cache_dir=str(isolated_env / "c"), image_size=8)
    lines = str(info.value).splitlines()
    assert len(lines) == 3 and lines[1].startswith("  Looked in ") and lines[2].startswith("  Pass --data-dir ")
    for line in ["train.cifar: " + lines[0], *lines[1:]]:  # as the CLI prints them; only paths make a line long
        assert len(line.replace(data_dir or str(isolated_env), "").replace(str(isolated_env), "")) <= 120, line
    if where in ("missing archive", "a file"):
        assert "downloads/manual" not in lines[1] and "tfds" not in lines[1]  # a file is not a directory
        assert ("does not exist" if where == "missing archive" else "(a file, not a .tar/.tar.gz/.tgz archive)") in lines[1]
    if where == "no data dir":
        assert lines[1].startswith(f"  Looked in {isolated_env / 'tfds' / 'downloads' / 'manual'} (does not exist), ")


def test_not_found_message_lists_places_and_remedies(isolated_env):
    empty = isolated_env / "empty"
    empty.mkdir()
    with pytest.raises(data.DataNotFoundError) as info:
        data.load_split("cifar10", "train", data_dir=str(empty), cache_dir=str(isolated_env / "c"))
    tfds = f"no {empty / 'cifar10'}" if importlib.util.find_spec("tensorflow_datasets") else "tensorflow-datasets is not installed"
    assert str(info.value).splitlines() == [  # the cause, where it looked, what --data-dir can be
        f"No cifar10 'train' data found in --data-dir {empty}; without --data-dir it is downloaded.",
        f"  Looked in {empty}, {empty / 'downloads' / 'manual'} (does not exist); tfds: {tfds}.",
        "  Pass --data-dir cifar-10-python.tar.gz or cifar-10-batches-py/, or an image folder <dir>/{train,test}/<class>/*.jpg.",
    ]
    assert os.listdir(empty) == []  # tfds did not create anything there
    with pytest.raises(data.DataNotFoundError, match="does not exist"):
        data.load_split("cifar100", "test", data_dir=str(isolated_env / "missing"), cache_dir=str(isolated_env / "c"))
    with pytest.raises(data.DataNotFoundError, match=r"ILSVRC2012_img_\{train,val\}\.tar"):
        data.load_split("imagenet2012", "test", cache_dir=str(isolated_env / "c"), image_size=32)


def test_imagefolder_not_found_names_only_the_folder_passed_and_what_it_needs(isolated_env, fake_data):
    # Neither tfds' manual dir below --data-dir nor a tfds folder there: tfds has no imagefolder.
    empty, elsewhere = isolated_env / "empty", isolated_env / "photos"
    empty.mkdir()
    fake_data.write_image_folder(str(elsewhere / "holiday"), {"pictures": _folder(2)["train"]})  # no train/ anywhere
    for folder in (empty, elsewhere):
        with pytest.raises(data.DataNotFoundError) as info:
            data.load_split("imagefolder", "train", data_dir=str(folder), cache_dir=str(isolated_env / "c"))
        assert str(info.value).splitlines() == [
            f"No imagefolder 'train' data found in --data-dir {folder}.",
            f"  Looked in {folder} (no train/<class>/<image> in it or in a folder one level below it).",
            "  Pass --data-dir an image folder <dir>/{train,test}/<class>/*.jpg, a directory holding one, or its .tar/.tar.gz.",
        ]


def test_an_image_folder_found_below_data_dir_names_the_folder_passed_too(isolated_env, fake_data):
    fake_data.write_image_folder(str(isolated_env / "data" / "pets"), {"train": _folder(2)["train"]})  # no test/
    with pytest.raises(data.DataNotFoundError) as info:
        data.load_split("imagefolder", "test", data_dir=str(isolated_env / "data"), cache_dir=str(isolated_env / "c"))
    assert str(info.value) == (
        f"{isolated_env / 'data' / 'pets'} (imagefolder, found in --data-dir {isolated_env / 'data'}) has no 'test' images: "
        "an image folder needs test/<class>/<image> or val/<class>/<image> or validation/<class>/<image>, with at least "
        "one image. Add them or point --data-dir elsewhere.")  # fmt: skip
