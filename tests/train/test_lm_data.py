"""train.lm_data: the corpus split, the tokenizer cache, the token stream and the batches' order."""

from __future__ import annotations

import os

import numpy as np
import pytest

from train import lm_data
from train.data_sources import DataError


def write_corpus(root, files: int = 40, seed: int = 0) -> str:
    """``files`` small Python-like text files under ``root/corpus`` (two folders deep)."""
    rng = np.random.default_rng(seed)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "None", "x", "y", "(", ")", ":", "\n    "]
    for i in range(files):
        path = root / "corpus" / f"pkg{i % 3}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(" ".join(rng.choice(words, size=200)) + f"\n# file {i} é\n")
    (root / "corpus" / ".hidden").write_text("left out")
    (root / "corpus" / "binary.bin").write_bytes(b"\0\1\2")
    return str(root / "corpus")


def test_stdlib_split_is_deterministic_disjoint_and_by_path():
    corpus = lm_data.find_corpus()
    assert corpus.source == "stdlib" and corpus.root == lm_data.stdlib_root()
    train, val = set(corpus.train_files), set(corpus.val_files)
    assert not train & val and len(val) > 0 and len(train) > 10 * len(val)
    assert all(name.endswith(".py") and "site-packages" not in name for name in train | val)
    assert 0.02 < len(val) / (len(train) + len(val)) < 0.08  # 5% by hash
    assert all(lm_data.is_validation(name, 0.05) for name in val)
    again = lm_data.find_corpus()
    assert (again.train_files, again.val_files, again.content_hash) == (corpus.train_files, corpus.val_files, corpus.content_hash)
    described = corpus.describe()
    assert described["python"].count(".") == 2 and len(described["content_hash"]) == 64


def test_data_dir_split_ignores_hidden_and_binary_files_and_hashes_content(tmp_path):
    root = write_corpus(tmp_path)
    corpus = lm_data.find_corpus(root, val_fraction=0.2)
    names = corpus.train_files + corpus.val_files
    assert len(names) == 40 and not set(corpus.train_files) & set(corpus.val_files)
    assert ".hidden" not in names and "binary.bin" not in names
    assert list(corpus.read("validation"))[0].endswith("é\n")
    # Adding a file leaves every other file in its split; editing one changes the content hash.
    (tmp_path / "corpus" / "new.py").write_text("x = 1\n")
    grown = lm_data.find_corpus(root, val_fraction=0.2)
    assert set(corpus.val_files) <= set(grown.val_files) and set(corpus.train_files) <= set(grown.train_files)
    assert grown.content_hash != corpus.content_hash


def test_data_dir_errors_name_the_problem(tmp_path):
    with pytest.raises(DataError, match="not a folder"):
        lm_data.find_corpus(str(tmp_path / "missing"))
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text("only one file")
    with pytest.raises(DataError, match="validation text files"):
        lm_data.find_corpus(str(tmp_path / "one"))


def test_bpe_tokenizer_is_trained_once_and_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BSR_JAX_CACHE", str(tmp_path / "cache"))
    corpus = lm_data.find_corpus(write_corpus(tmp_path), val_fraction=0.2)
    tokenizer = lm_data.load_tokenizer("bpe", corpus, vocab_size=300)
    path = lm_data.tokenizer_path(corpus, 300, None)
    assert path.startswith(str(tmp_path / "cache" / "lm")) and os.path.exists(path)
    assert tokenizer.vocab_size == 300
    text = next(corpus.read("train"))
    assert tokenizer.decode(tokenizer.encode([text])[0]) == text  # byte-level: lossless
    mtime = os.path.getmtime(path)
    calls = []
    monkeypatch.setattr("tokenizers.Tokenizer.train_from_iterator", lambda *a, **k: calls.append(a))
    cached = lm_data.load_tokenizer("bpe", corpus, vocab_size=300)
    assert not calls and os.path.getmtime(path) == mtime
    np.testing.assert_array_equal(cached.encode([text])[0], tokenizer.encode([text])[0])
    # Another vocabulary is another entry.
    assert lm_data.tokenizer_path(corpus, 400, None) != path


def test_token_stream_ends_each_file_and_is_cached(tmp_path):
    corpus = lm_data.find_corpus(write_corpus(tmp_path), val_fraction=0.2)
    tokenizer = lm_data.BytesTokenizer()
    stream = lm_data.token_stream(corpus, "validation", tokenizer, "bytes", str(tmp_path / "cache"))
    assert stream.dtype == np.uint16 and int((stream == 256).sum()) == len(corpus.val_files)
    assert len(stream) == corpus.val_bytes + len(corpus.val_files)
    cached = lm_data.token_stream(corpus, "validation", tokenizer, "bytes", str(tmp_path / "cache"))
    np.testing.assert_array_equal(cached, stream)


def test_batches_are_a_function_of_seed_and_step():
    stream = np.arange(1000, dtype=np.uint16)
    kw = dict(seed=3, batch_size=4, seq_len=10)
    per_epoch = lm_data.steps_per_epoch(len(stream), 10, 4)
    assert per_epoch == 99 // 4
    run = lm_data.train_batches(stream, 0, **kw)
    batches = [next(run) for _ in range(2 * per_epoch + 3)]
    for step in (0, 5, per_epoch - 1, per_epoch, 2 * per_epoch + 2):
        np.testing.assert_array_equal(lm_data.train_batch(stream, step, **kw), batches[step])
        resumed = lm_data.train_batches(stream, step, **kw)
        np.testing.assert_array_equal(next(resumed), batches[step])
    b = batches[0]
    assert b.shape == (4, 11) and b.dtype == np.int32
    np.testing.assert_array_equal(np.diff(b, axis=1), 1)  # contiguous windows of the stream
    epoch0 = np.concatenate(batches[:per_epoch])[:, 0]
    assert len(set(epoch0.tolist())) == len(epoch0)  # no window twice in an epoch
    assert not np.array_equal(lm_data.train_batch(stream, 0, seed=4, batch_size=4, seq_len=10), b)


def test_eval_windows_spread_over_the_stream():
    stream = np.arange(1000, dtype=np.uint16)
    windows = lm_data.eval_windows(stream, 10, max_windows=5)
    assert windows.shape == (5, 11) and windows[0, 0] == 0 and windows[-1, 0] > 900
    assert len(lm_data.eval_windows(stream, 10)) == lm_data.windows_per_epoch(1000, 10)
