"""Offline dataset sources: where they are looked for under a data directory, and how they are read.

Three local formats, found in this order in each searched directory R (R = --data-dir, then
R/downloads/manual, tfds' manual_dir; without --data-dir the latter under tfds' data dir, then the
directory CIFAR archives are downloaded to, <cache dir>/downloads):
  1. the CIFAR python release: R/cifar-10-batches-py/ or R/cifar-10-python.tar.gz
     (cifar-100-python/, cifar-100-python.tar.gz), or R itself being one of these;
  2. the ImageNet release as tfds' manual_dir holds it: R/ILSVRC2012_img_train.tar and
     R/ILSVRC2012_img_val.tar (the test split is ILSVRC's validation set, labels from tfds);
  3. an image folder <root>/train/<class>/<image> and <root>/test/<class>/<image> (or val/,
     validation/), labels = alphabetical index of <class> over both splits; <root> is R, a
     sub-directory of R, or the top of a .tar/.tar.gz/.tgz archive (or one level inside it).
     Sub-directories and archives must be named after the dataset (cifar10*, cifar-10*,
     imagenet*) unless R is the archive; for dataset "imagefolder", R or the one sub-directory of
     R holding train/.
Readers yield `Chunk`s of encoded images for `train.data_decode.decode_chunks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import os
import pickle
import re
import tarfile
from typing import Any, BinaryIO, Iterator, Literal

from tqdm import tqdm

from train import progress
from train.data_decode import CHUNK, Chunk

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
SPLIT_DIRS = {"train": ("train",), "test": ("test", "val", "validation")}
NAME_PREFIXES = {
    "cifar10": ("cifar10", "cifar-10"),
    "cifar100": ("cifar100", "cifar-100"),
    "imagenet2012": ("imagenet2012", "imagenet"),
    "imagefolder": (),
}
CIFAR_PYTHON = {  # dataset -> (archive, extracted dir, train files, test file, label key, names key)
    "cifar10": ("cifar-10-python.tar.gz", "cifar-10-batches-py",
                tuple(f"data_batch_{i}" for i in range(1, 6)), "test_batch",
                b"labels", ("batches.meta", b"label_names")),
    "cifar100": ("cifar-100-python.tar.gz", "cifar-100-python", ("train",), "test",
                 b"fine_labels", ("meta", b"fine_label_names")),
}  # fmt: skip
ILSVRC_TARS = {"train": "ILSVRC2012_img_train.tar", "test": "ILSVRC2012_img_val.tar"}
_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_PROGRESS_BYTES = 16 << 20
_PROGRESS_FILES = 4096


class DataError(Exception):
    """Data that cannot be found, read or downloaded; the message names the file and says why."""


@dataclasses.dataclass(frozen=True)
class Source:
    """A located dataset. kind: "cifar_python" | "ilsvrc" | "image_folder"; path: file or directory;
    root: for an image-folder directory, the directory holding train/ (path or one level below);
    unused for archives, whose root is found while reading."""

    kind: Literal["cifar_python", "ilsvrc", "image_folder"]
    path: str
    root: str = ""

    @property
    def reads_all_splits(self) -> bool:
        """True when reading one split reads them all (archives), so all are decoded together."""
        return self.kind == "cifar_python" or (self.kind == "image_folder" and os.path.isfile(self.path))

    def fingerprint(self) -> list[Any]:
        """Paths, sizes and mtimes that identify the data's version (for the cache key).

        Files: the file itself. Directories: the root, its entries and their entries (split and
        class directories), whose mtimes change when images are added, removed or renamed, but not
        when an image is rewritten in place (stat-ing every image would cost seconds on ImageNet).
        """
        paths = [self.path]
        if self.kind == "ilsvrc":
            paths = [os.path.join(self.path, n) for n in ILSVRC_TARS.values()]
            paths = [p for p in paths if os.path.exists(p)]
        elif os.path.isdir(self.path):
            root = self.root or self.path
            paths = [root] + [os.path.join(root, n) for n in _listdir(root)]
            for split_dir in [p for p in paths[1:] if os.path.isdir(p)]:
                paths += [os.path.join(split_dir, n) for n in _listdir(split_dir)]
        stats = [os.stat(p) for p in paths]
        return [[p, s.st_size, s.st_mtime_ns] for p, s in zip(paths, stats)]


def tfds_data_dir() -> str:
    """tensorflow-datasets' default data directory: $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
    return os.path.expanduser(os.environ.get("TFDS_DATA_DIR") or os.path.join("~", "tensorflow_datasets"))


def find_local_source(dataset: str, data_dir: str | None, downloads: str) -> tuple[Source | None, list[str]]:
    """First local source of `dataset` (see module docstring) and the places looked in (directories
    or files, with a note where one does not exist or is not an archive); `downloads` is where
    downloaded archives are kept (searched without `data_dir`). Several unnamed image folders one
    level down (dataset "imagefolder") raise `DataError`: which one is meant is not known."""
    if data_dir is None:
        roots = [os.path.join(tfds_data_dir(), "downloads", "manual"), downloads]
    else:
        data_dir = os.path.abspath(os.path.expanduser(data_dir))
        # tfds' manual_dir inside it only when it is a directory: a file (an archive of another
        # name, a typo's path) has no downloads/manual; tfds has no "imagefolder" dataset to keep there.
        manual = os.path.isdir(data_dir) and dataset != "imagefolder"
        roots = [data_dir] + ([os.path.join(data_dir, "downloads", "manual")] if manual else [])
    looked: list[str] = []
    for root in roots:
        source = _find_in(dataset, root, looked)
        if source is not None:
            return source, looked
    return None, looked


def _find_in(dataset: str, root: str, looked: list[str]) -> Source | None:
    if not os.path.exists(root):
        looked.append(f"{root} (does not exist)")
        return None
    cifar_names = CIFAR_PYTHON[dataset][:2] if dataset in CIFAR_PYTHON else ()
    if os.path.basename(root) in cifar_names:
        return Source("cifar_python", root)
    if os.path.isfile(root):
        if root.endswith(_ARCHIVE_SUFFIXES):
            return Source("image_folder", root)
        looked.append(f"{root} (a file, not a {'/'.join(_ARCHIVE_SUFFIXES)} archive)")
        return None
    looked.append(root)
    for name in cifar_names:
        if os.path.exists(os.path.join(root, name)):
            return Source("cifar_python", os.path.join(root, name))
    if dataset == "imagenet2012":
        if any(os.path.isfile(os.path.join(root, name)) for name in ILSVRC_TARS.values()):
            return Source("ilsvrc", root)
    if _is_image_folder(root):
        return Source("image_folder", root, root)
    entries = [os.path.join(root, n) for n in _listdir(root)]
    if dataset == "imagefolder":
        # Nothing to go by but train/: one level down, as <root>/cifar10*/train is found for cifar10.
        found = [path for path in entries if _is_image_folder(path)]
        if len(found) > 1:
            names = ", ".join(os.path.basename(p) + "/" for p in found)
            raise DataError(f"{root} holds several image folders ({names}): pass the one to train on as --data-dir")
        if not found:  # what was looked for, in the folder the user passed
            looked[-1] = f"{root} (no train/<class>/<image> in it or in a folder one level below it)"
            return None
        return Source("image_folder", found[0], found[0])
    named = [path for path in entries if _named_after(os.path.basename(path), dataset)]
    for path in filter(os.path.isdir, named):
        for sub in filter(_is_image_folder, [path] + [os.path.join(path, n) for n in _listdir(path)]):
            return Source("image_folder", path, sub)
    for path in filter(os.path.isfile, named):
        if path.endswith(_ARCHIVE_SUFFIXES):
            return Source("image_folder", path)
    return None


# What --data-dir can be, one short line per dataset (the module docstring has the naming rules).
_PROVIDE = {
    "cifar10": "cifar-10-python.tar.gz or cifar-10-batches-py/, or an image folder <dir>/{train,test}/<class>/*.jpg",
    "cifar100": "cifar-100-python.tar.gz or cifar-100-python/, or an image folder <dir>/{train,test}/<class>/*.jpg",
    "imagenet2012": "a directory with ILSVRC2012_img_{train,val}.tar, or an image folder <dir>/{train,val}/<class>/*.jpg",
    "imagefolder": "an image folder <dir>/{train,test}/<class>/*.jpg, a directory holding one, or its .tar/.tar.gz",
}


def not_found_message(dataset: str, split: str, data_dir: str | None, looked: list[str], tfds_reason: str | None,
                      downloadable: bool) -> str:  # fmt: skip
    """Three short lines: the cause, the places looked in (and why tfds had nothing, where it was
    asked), then what --data-dir can be. Only paths make a line long."""
    download = "; without --data-dir it is downloaded" if downloadable else ""
    if data_dir is None:
        cause = f"No {dataset} '{split}' data in tfds' manual dir or the download directory"
    elif not os.path.exists(os.path.expanduser(data_dir)):
        cause = f"No {dataset} '{split}' data: --data-dir {data_dir} does not exist{download}"
    else:
        cause = f"No {dataset} '{split}' data found in --data-dir {data_dir}{download}"
    tfds = f"; tfds: {tfds_reason}" if tfds_reason else ""
    return f"{cause}.\n  Looked in {', '.join(looked)}{tfds}.\n  Pass --data-dir {_PROVIDE[dataset]}."


def _named_after(name: str, dataset: str) -> bool:
    """cifar10-jpg.tar.gz is named after cifar10; cifar100.tar is not (digit after the prefix)."""
    lowered = name.lower()
    return any(re.match(re.escape(p) + r"($|[^0-9])", lowered) for p in NAME_PREFIXES[dataset])


def _is_image_folder(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "train"))


def _listdir(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if not n.startswith((".", "__MACOSX")))


def read_source(source: Source, split: str, classes: list[str]) -> Iterator[Chunk]:
    """Chunks of `split` (of every split for archives) in a deterministic order.

    Fills `classes` with the class names in label order by the time the iterator is exhausted.
    """
    if source.kind == "cifar_python":
        return _read_cifar_python(source.path, split, classes)
    if source.kind == "ilsvrc":
        return _read_ilsvrc(source.path, split, classes)
    if source.reads_all_splits:
        return _read_folder_archive(source.path, classes)
    return _read_folder_dir(source.root, split, classes)


def _read_cifar_python(path: str, split: str, classes: list[str]) -> Iterator[Chunk]:
    dataset = next(d for d, spec in CIFAR_PYTHON.items() if os.path.basename(path) in spec[:2])
    _, _, train_files, test_file, label_key, (meta_file, names_key) = CIFAR_PYTHON[dataset]
    wanted = {meta_file: "meta", test_file: "test", **{f: "train" for f in train_files}}
    found: dict[str, Any] = {}
    if os.path.isdir(path):
        for name in wanted:
            with open(os.path.join(path, name), "rb") as f:
                found[name] = pickle.load(f, encoding="bytes")
    else:
        with _open_tar(path) as tar:
            for member in tar:
                name = os.path.basename(member.name)
                if member.isfile() and name in wanted:
                    found[name] = pickle.load(tar.extractfile(member), encoding="bytes")
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise DataError(f"{path} is not a complete CIFAR python release: missing {missing}")
    classes.extend(n.decode() for n in found[meta_file][names_key])
    # Fixed file order (tar order is arbitrary) so train is data_batch_1..5, as tfds has it.
    for name in [f for f, s in wanted.items() if s != "meta"]:
        batch = found[name]
        images = batch[b"data"].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        yield Chunk(wanted[name], list(batch[label_key]), images)


def _read_ilsvrc(root: str, split: str, classes: list[str]) -> Iterator[Chunk]:
    wnids = _tfds_imagenet_file("labels.txt")
    classes.extend(wnids)
    index = {w: i for i, w in enumerate(wnids)}
    path = os.path.join(root, ILSVRC_TARS[split])
    if not os.path.isfile(path):
        return
    if split == "test":
        # Line k of tfds' file labels ILSVRC2012_val_{k+1:08d}.JPEG (images sorted by name).
        val_wnids = _tfds_imagenet_file("validation_labels.txt")
        for chunk in _chunks_of(((n, blob, f"{n} in {path}") for n, blob in _tar_images(path)), "test"):
            chunk.labels = [index[val_wnids[int(re.findall(r"\d+", n)[-1]) - 1]] for n in chunk.labels]
            yield chunk
        return
    def train_images() -> Iterator[tuple[int, bytes, str]]:
        with _open_tar(path) as outer:
            for member in outer:
                if member.isfile() and member.name.endswith(".tar"):
                    wnid = os.path.basename(member.name)[: -len(".tar")]
                    inner = io.BytesIO(outer.extractfile(member).read())
                    with tarfile.open(fileobj=inner, mode="r|") as class_tar:
                        for image in class_tar:
                            if image.isfile():
                                yield index[wnid], class_tar.extractfile(image).read(), f"{member.name}/{image.name} in {path}"

    yield from _chunks_of(train_images(), "train")


def _tfds_imagenet_file(name: str) -> list[str]:
    """Lines of tfds' bundled ImageNet metadata (found without importing tfds)."""
    spec = importlib.util.find_spec("tensorflow_datasets")
    if spec is None:
        raise DataError("labelling the ILSVRC tars needs tensorflow-datasets' metadata: pip install -e '.[tfds]'")
    package = list(spec.submodule_search_locations)[0]
    with open(os.path.join(package, "datasets", "imagenet2012", name)) as f:
        return f.read().split()


def _tar_images(path: str) -> Iterator[tuple[str, bytes]]:
    with _open_tar(path) as tar:
        for member in tar:
            if member.isfile() and member.name.lower().endswith(IMAGE_EXTENSIONS):
                yield member.name, tar.extractfile(member).read()


def _chunks_of(items: Iterator[tuple[Any, bytes, str]], split: str) -> Iterator[Chunk]:
    """Chunks of ``(label, encoded image, its name)`` items."""
    chunk = Chunk(split, [], [])
    for label, blob, name in items:
        chunk.labels.append(label)
        chunk.images.append(blob)
        chunk.names.append(name)
        if len(chunk.images) == CHUNK:
            yield chunk
            chunk = Chunk(split, [], [])
    if chunk.images:
        yield chunk


def _read_folder_archive(path: str, classes: list[str]) -> Iterator[Chunk]:
    all_splits = {d for dirs in SPLIT_DIRS.values() for d in dirs}
    pending: dict[str, Chunk] = {}
    top: str | None = None
    seen_classes: set[str] = set()
    for name, blob in _tar_images(path):
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if any(p.startswith((".", "__MACOSX")) for p in parts):
            continue
        # <split>/<class>/<file>, or one level down: <top>/<split>/<class>/<file>.
        prefix, rest = ("", parts) if len(parts) == 3 else (parts[0], parts[1:])
        if len(rest) != 3 or rest[0] not in all_splits:
            continue
        if top is None:
            top = prefix
        elif prefix != top:
            raise DataError(f"{path} holds several image folders ({top!r} and {prefix!r}); keep one")
        split_dir, class_name = rest[0], rest[1]
        seen_classes.add(class_name)
        chunk = pending.setdefault(split_dir, Chunk(split_dir, [], []))
        chunk.labels.append(class_name)
        chunk.images.append(blob)
        chunk.names.append(f"{name} in {path}")
        if len(chunk.images) == CHUNK:
            yield pending.pop(split_dir)
    yield from pending.values()
    classes.extend(sorted(seen_classes))


def _read_folder_dir(root: str, split: str, classes: list[str]) -> Iterator[Chunk]:
    split_dirs = {s: next((d for d in dirs if os.path.isdir(os.path.join(root, d))), None)
                  for s, dirs in SPLIT_DIRS.items()}  # fmt: skip
    class_names = sorted({c for d in split_dirs.values() if d for c in _listdir(os.path.join(root, d))})
    classes.extend(class_names)
    if split_dirs[split] is None:
        return
    split_root = os.path.join(root, split_dirs[split])
    files = [(label, os.path.join(split_root, c, n))
             for label, c in enumerate(class_names) if os.path.isdir(os.path.join(split_root, c))
             for n in _listdir(os.path.join(split_root, c)) if n.lower().endswith(IMAGE_EXTENSIONS)]  # fmt: skip
    bar = progress.bar(files, desc=f"decoding {split_root}", unit="img", mininterval=1.0,
                       hidden=len(files) < _PROGRESS_FILES)  # fmt: skip

    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    yield from _chunks_of(((label, read(path), path) for label, path in bar), split)


class _ProgressFile(io.RawIOBase):
    """Read-only file wrapper that advances a tqdm bar by the bytes read (archive progress)."""

    def __init__(self, raw: BinaryIO, bar: tqdm):
        self._raw, self._bar = raw, bar

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._raw.readinto(buffer)
        self._bar.update(n)
        return n

    def close(self) -> None:
        self._raw.close()
        self._bar.close()
        super().close()


@contextlib.contextmanager
def _open_tar(path: str) -> Iterator[tarfile.TarFile]:
    """Sequential ("r|*": any compression, single pass) reader with a byte progress bar."""
    size = os.path.getsize(path)
    bar = progress.bar(total=size, desc=f"reading {os.path.basename(path)}", unit="B", unit_scale=True,
                       mininterval=1.0, hidden=size < _PROGRESS_BYTES)  # fmt: skip
    with io.BufferedReader(_ProgressFile(open(path, "rb"), bar), buffer_size=1 << 20) as stream:
        with tarfile.open(fileobj=stream, mode="r|*") as tar:
            yield tar
