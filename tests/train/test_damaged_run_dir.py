"""A run directory damaged outside the run (a cut-off copy, a full disk, a bad block): a fresh run
replaces a damaged config.json; --resume skips a damaged newest checkpoint for the newest intact
one, saying so in one line, and refuses in one line when none is intact; no absl or TensorStore
noise on the terminal. The data layer is replaced by small generated arrays, as in test_loop."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from train import data, loop
from train.config import TrainConfig

TINY = TrainConfig(dim=16, depth=1, image_size=8, patch_size=4, batch_size=16, eval_batch_size=16, epochs=2,
                   warmup_epochs=0.0, log_every=2, checkpoint_every=2)  # fmt: skip


@pytest.fixture
def generated_data(monkeypatch):
    """64 train and 16 test 8x8 images of 4 classes (4 steps per epoch)."""
    rng = np.random.default_rng(0)
    split = lambda n: data.ArrayDataset(rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8), np.arange(n, dtype=np.int32) % 4, num_classes=4)  # noqa: E731
    splits = {"train": split(64), "test": split(16)}
    monkeypatch.setattr(data, "load_split", lambda dataset, split, **kw: splits[split])


def test_a_fresh_run_replaces_a_damaged_config_json(generated_data, tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text('{"config": {"lr": 0.')  # cut off; no checkpoints: nothing to resume
    assert loop.train_and_evaluate(dataclasses.replace(TINY, steps=1), str(workdir))["step"] == 1
    assert json.loads((workdir / "config.json").read_text())["config"]["steps"] == 1
