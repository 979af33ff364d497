"""Text for ``python -m train.lm``: a corpus of files, a tokenizer, a token stream, batches of windows.

* Corpus (``find_corpus``): by default the running interpreter's standard library, every ``*.py``
  under ``sysconfig.get_paths()["stdlib"]`` (without ``site-packages``, whose content differs from
  machine to machine): real text that needs no download. ``data_dir`` takes any folder of text
  files instead (every file under it, hidden ones and files holding NUL bytes left out). A file
  goes to validation when a hash of its path relative to the root falls in the first
  ``val_fraction`` of the hash range: the split depends on the path only, never on the listing
  order or the machine, and a file never changes split when others are added.
  ``Corpus.content_hash`` (sha256 over each path and content) names the corpus in caches and
  ``config.json``, with the Python version it came from.
* Tokenizer (``load_tokenizer``): ``"bpe"``, a byte-level BPE (Hugging Face ``tokenizers``) trained
  on the training split, cached under ``<cache dir>/lm/`` by corpus hash and vocabulary size; or
  ``"bytes"``: UTF-8 bytes (ids 0..255). Either way the last id, ``vocab_size - 1``, ends each file.
* Token stream (``token_stream``): each split's files encoded and concatenated (each followed by
  the end-of-file id), cached as ``.npy``.
* Batches (``train_batch``): the step-``s`` batch is a function of ``(seed, s)`` only, so a
  resumed run reads exactly the batches the interrupted one would have (``--resume`` is
  bit-identical). Each epoch cuts the stream into ``T + 1``-token windows (consecutive windows
  share one token, the next one's first input is the previous one's last label) at an offset in
  ``[0, T)`` drawn per epoch, and takes them in a permutation drawn per epoch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np

from train.data_cache import resolve_cache_dir
from train.data_sources import DataError

Tokenizer = Literal["bpe", "bytes"]
TOKENIZERS = ("bpe", "bytes")
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_HASH_RANGE = 2**32


# ----------------------------------------------------------------------------- corpus


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Text files under ``root`` split by path hash. Paths are relative to ``root``, sorted."""

    root: str
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    content_hash: str  # sha256 hex of (path, content) of every file, in sorted path order
    train_bytes: int
    val_bytes: int
    source: str  # "stdlib" or "data_dir"
    val_fraction: float

    @property
    def val_fraction_key(self) -> str:
        """The split's part of cache names (the content hash does not depend on it)."""
        return f"val{self.val_fraction:g}"

    def read(self, split: Literal["train", "validation"]) -> Iterator[str]:
        """The split's files as text (UTF-8; undecodable bytes become U+FFFD), in path order."""
        for name in self.train_files if split == "train" else self.val_files:
            with open(os.path.join(self.root, name), "rb") as f:
                yield f.read().decode("utf-8", errors="replace")

    def describe(self) -> dict:
        """What ``config.json`` records about the corpus."""
        return {
            "source": self.source, "root": self.root, "python": sys.version.split()[0], "content_hash": self.content_hash,
            "train_files": len(self.train_files), "val_files": len(self.val_files),
            "train_bytes": self.train_bytes, "val_bytes": self.val_bytes, "val_fraction": self.val_fraction,
        }  # fmt: skip


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_validation(relative_path: str, val_fraction: float) -> bool:
    """Whether the file at ``relative_path`` ('/'-separated) belongs to the validation split."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") < val_fraction * _HASH_RANGE


def _list_files(root: str, suffix: str | None) -> list[str]:
    found = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith("."))
        for name in names:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                found.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return sorted(found)


def find_corpus(data_dir: str | None = None, val_fraction: float = 0.05) -> Corpus:
    """The corpus of ``data_dir`` (any folder of text files), or of the standard library's ``*.py``.

    Raises:
      DataError: ``data_dir`` is not a folder, or a split would be empty (too few files).
    """
    if data_dir is None:
        root, suffix, source = stdlib_root(), ".py", "stdlib"
    else:
        root, suffix, source = os.path.abspath(os.path.expanduser(data_dir)), None, "data_dir"
        if not os.path.isdir(root):
            raise DataError(f"--data-dir {data_dir}: not a folder (train.lm reads every text file under a folder)")
    digest, sizes, train, val = hashlib.sha256(), {}, [], []
    for name in _list_files(root, suffix):
        with open(os.path.join(root, name), "rb") as f:
            content = f.read()
        if b"\0" in content:  # binary, not text
            continue
        digest.update(hashlib.sha256(name.encode()).digest() + hashlib.sha256(content).digest())
        sizes[name] = len(content)
        (val if is_validation(name, val_fraction) else train).append(name)
    if not train or not val:
        raise DataError(f"{root}: {len(train)} training and {len(val)} validation text files (split by path hash, "
                        f"{val_fraction:.0%} validation); both need at least one: add files")  # fmt: skip
    return Corpus(root, tuple(train), tuple(val), digest.hexdigest(), sum(sizes[n] for n in train), sum(sizes[n] for n in val), source, val_fraction)


# ----------------------------------------------------------------------------- tokenizer


class BytesTokenizer:
    """UTF-8 bytes as ids 0..255; id 256 ends a file."""

    vocab_size = 257

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class BPETokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` (byte-level BPE); its last id ends a file."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, np.uint32) for e in self._tokenizer.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])


END_OF_FILE = "<|endoftext|>"


def lm_cache_dir(cache_dir: str | None) -> str:
    """``<cache dir>/lm``: ``--cache-dir``, else ``$BSR_JAX_CACHE``, else ``~/.cache/bsr_jax``."""
    return os.path.join(resolve_cache_dir(cache_dir), "lm")


def _atomic_write(path: str, write) -> None:
    """``write(tmp_path)`` then rename into ``path``: readers never see a partial file, and two
    runs writing the same entry write the same content."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(path)[1], dir=os.path.dirname(path))
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def tokenizer_path(corpus: Corpus, vocab_size: int, cache_dir: str | None) -> str:
    return os.path.join(lm_cache_dir(cache_dir), f"tokenizer-{corpus.content_hash[:16]}-{corpus.val_fraction_key}-bpe{vocab_size}.json")


def load_tokenizer(kind: Tokenizer, corpus: Corpus, vocab_size: int = 8192, cache_dir: str | None = None):
    """The tokenizer ``kind`` for ``corpus``: ``BytesTokenizer``, or the BPE trained on its training
    split (read from the cache when trained before; training the default 8192 on the standard
    library takes about a minute on 2 cores).

    Raises:
      DataError: ``tokenizers`` is not installed (``pip install -e ".[train]"``).
    """
    if kind == "bytes":
        return BytesTokenizer()
    try:
        import tokenizers
    except ImportError:
        raise DataError("--tokenizer bpe needs Hugging Face tokenizers: pip install tokenizers (or -e \".[train]\"), "
                        "or pass --tokenizer bytes") from None  # fmt: skip
    path = tokenizer_path(corpus, vocab_size, cache_dir)
    if os.path.exists(path):
        return BPETokenizer(tokenizers.Tokenizer.from_file(path))
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # The end-of-file token comes last: ids then mean the same in both tokenizers' streams (its id is
    # vocab_size - 1); the 256-byte alphabet guarantees every text encodes.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus.read("train"), trainer, length=len(corpus.train_files))
    tokenizer.add_special_tokens([END_OF_FILE])
    _atomic_write(path, tokenizer.save)
    return BPETokenizer(tokenizer)


def token_stream(corpus: Corpus, split: Literal["train", "validation"], tokenizer, tokenizer_name: str,
                 cache_dir: str | None = None) -> np.ndarray:  # fmt: skip
    """The split's files encoded and concatenated, each followed by the end-of-file id
    ``tokenizer.vocab_size - 1``: uint16 (N,) when the vocabulary fits, else uint32. Cached."""
    name = f"tokens-{corpus.content_hash[:16]}-{corpus.val_fraction_key}-{tokenizer_name}-{split}.npy"
    path = os.path.join(lm_cache_dir(cache_dir), name)
    if os.path.exists(path):
        return np.load(path)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    eof = np.array([tokenizer.vocab_size - 1], dtype)
    pieces = []
    for ids in tokenizer.encode(list(corpus.read(split))):
        pieces += [ids.astype(dtype), eof]
    stream = np.concatenate(pieces)
    _atomic_write(path, lambda tmp: np.save(tmp, stream))
    return stream


# ----------------------------------------------------------------------------- batches


def windows_per_epoch(stream_length: int, seq_len: int) -> int:
    """Windows of ``seq_len + 1`` tokens an epoch takes, the same at every offset in ``[0, seq_len)``."""
    return max((stream_length - seq_len) // seq_len, 0)


def steps_per_epoch(stream_length: int, seq_len: int, batch_size: int) -> int:
    return windows_per_epoch(stream_length, seq_len) // batch_size


def _epoch_order(seed: int, epoch: int, stream_length: int, seq_len: int) -> tuple[int, np.ndarray]:
    rng = np.random.default_rng([seed, epoch])
    offset = int(rng.integers(seq_len))
    return offset, rng.permutation(windows_per_epoch(stream_length, seq_len))


def train_batch(stream: np.ndarray, step: int, *, seed: int, batch_size: int, seq_len: int) -> np.ndarray:
    """The training batch of global step ``step``: int32 ``(batch_size, seq_len + 1)`` windows of
    ``stream`` (inputs ``[:, :-1]``, labels ``[:, 1:]``). A function of ``(seed, step)`` only."""
    return next(train_batches(stream, step, seed=seed, batch_size=batch_size, seq_len=seq_len))


def train_batches(stream: np.ndarray, start_step: int, *, seed: int, batch_size: int, seq_len: int) -> Iterator[np.ndarray]:
    """``train_batch`` of steps ``start_step, start_step + 1, ...``, with each epoch's order drawn once."""
    per_epoch = steps_per_epoch(len(stream), seq_len, batch_size)
    step = start_step
    while True:
        epoch, index = divmod(step, per_epoch)
        offset, order = _epoch_order(seed, epoch, len(stream), seq_len)
        for i in range(index, per_epoch):
            starts = offset + seq_len * order[i * batch_size : (i + 1) * batch_size]
            yield np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int32)
        step = (epoch + 1) * per_epoch


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """int32 ``(W, seq_len + 1)`` validation windows at offset 0: all of them, or ``max_windows``
    spread evenly over the stream (the files are in path order, so the first ones would be one
    package's)."""
    count = windows_per_epoch(len(stream), seq_len)
    picked = np.arange(count) if max_windows is None or max_windows >= count else np.linspace(0, count - 1, max_windows).astype(np.int64)
    return np.stack([stream[seq_len * i : seq_len * i + seq_len + 1] for i in picked]).astype(np.int32)
