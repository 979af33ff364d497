"""One rule for every progress bar (train.progress): drawn where stderr is a terminal, nothing
written elsewhere (a log file, a pipe), so a log holds the same lines whichever bar was running."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest

from train import data, data_sources, progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def small_bars_shown(monkeypatch):
    """The data bars' size thresholds at 0, so that the tiny test data would show them."""
    monkeypatch.setattr(data_sources, "_PROGRESS_BYTES", 0)
    monkeypatch.setattr(data_sources, "_PROGRESS_FILES", 0)


def _load_both(isolated_env, fake_data, name: str) -> None:
    rng = np.random.default_rng(0)
    split = fake_data.random_split(rng, 10, 10, size=32)
    archive = fake_data.write_cifar_python(str(isolated_env / name), "cifar10", split, split, archive=True)
    data.load_split("cifar10", "train", data_dir=archive, cache_dir=str(isolated_env / name / "c"))
    folder = isolated_env / name / "folder"
    fake_data.write_image_folder(str(folder), {"train": [("a", split.images[0])], "test": [("a", split.images[1])]})
    data.load_split("imagefolder", "train", data_dir=str(folder), cache_dir=str(isolated_env / name / "c"))


def test_data_bars_write_nothing_off_a_terminal_and_draw_on_one(isolated_env, fake_data, small_bars_shown, monkeypatch, capsys):
    (isolated_env / "off").mkdir()
    _load_both(isolated_env, fake_data, "off")
    assert capsys.readouterr().err == ""  # captured stderr is not a terminal
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    (isolated_env / "on").mkdir()
    _load_both(isolated_env, fake_data, "on")
    drawn = terminal.getvalue()
    assert "reading cifar-10-python.tar.gz" in drawn and "decoding " in drawn and "\r" in drawn


def test_the_rule(monkeypatch):
    for stream, hidden, shown in ((io.StringIO(), False, False), (Terminal(), False, True), (Terminal(), True, False)):
        monkeypatch.setattr(sys, "stderr", stream)
        with progress.bar(total=3, desc="training", hidden=hidden, mininterval=0) as bar:
            bar.update(3)
        assert ("training" in stream.getvalue()) == shown, (stream, hidden)
