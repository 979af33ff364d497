"""A run directory damaged outside the run (a cut-off copy, a full disk, a bad block): a fresh run
replaces a damaged config.json; --resume skips a damaged newest checkpoint for the newest intact
one, saying so in one line, and refuses in one line (exit 2) when none is intact; no absl or
TensorStore noise on the terminal. The data layer is replaced by small generated arrays, as in
test_loop; the CLI runs in this process (its exit code and output as a user sees them)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil

import numpy as np
import pytest

from train import cli, data, loop
from train.checkpoint import NoIntactCheckpoint
from train.config import CIFAR_DEFAULTS, DATASETS, TrainConfig

# One xdist worker runs this module (--dist loadgroup, pyproject.toml): the module fixture
# `stopped_run` (a four-step run) runs once, not once per worker.
pytestmark = pytest.mark.xdist_group("test_damaged_run_dir")

# 4 steps per epoch; checkpoints every 2 steps.
TINY = TrainConfig(dim=16, depth=1, image_size=8, patch_size=4, batch_size=16, eval_batch_size=16, epochs=2,
                   warmup_epochs=0.0, log_every=2, checkpoint_every=2)  # fmt: skip


def _splits() -> dict[str, data.ArrayDataset]:
    rng = np.random.default_rng(0)
    split = lambda n: data.ArrayDataset(rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8), np.arange(n, dtype=np.int32) % 4, num_classes=4)  # noqa: E731
    return {"train": split(64), "test": split(16)}


@pytest.fixture
def generated_data(monkeypatch):
    splits = _splits()
    monkeypatch.setattr(data, "load_split", lambda dataset, split, **kw: splits[split])


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run stopped at step 4 with checkpoints 2 and 4 (copy it before damaging it)."""
    workdir = tmp_path_factory.mktemp("stopped") / "run"
    splits = _splits()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(data, "load_split", lambda dataset, split, **kw: splits[split])
        loop.train_and_evaluate(dataclasses.replace(TINY, steps=4), str(workdir))
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
    return workdir


def truncate_an_array(step_dir) -> str:
    """Cut the largest array file of the checkpoint to 100 bytes (a copy cut off); the reason as a
    pattern (which arrays share that file varies from run to run)."""
    files = [os.path.join(d, n) for d, _, names in os.walk(step_dir / "default" / "ocdbt.process_0" / "d") for n in names]
    os.truncate(max(files, key=os.path.getsize), 100)
    return r"its array [\w.]+ cannot be read: Requested byte range \[\d+, \d+\) is not valid for value of size 100"


def garbage_metadata(step_dir) -> str:
    (step_dir / "_CHECKPOINT_METADATA").write_text("garbage{{")
    return re.escape("its _CHECKPOINT_METADATA is not Orbax's JSON")


def resume(workdir, *flags: str) -> int:
    """``python -m train.cifar --resume --workdir WORKDIR FLAGS`` in this process; its exit code."""
    return cli.main("train.cifar", "doc", CIFAR_DEFAULTS, DATASETS, ["--resume", "--workdir", str(workdir), *flags])


def no_noise(capfd, caplog) -> str:
    """stdout, after checking that stderr is empty and that neither absl (Orbax's logger, on stderr
    outside pytest) nor anything else logged a warning."""
    out, err = capfd.readouterr()
    assert err == "", err
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    return out


@pytest.mark.parametrize("damage", [truncate_an_array, garbage_metadata])
def test_resume_skips_a_damaged_newest_checkpoint_and_says_so_in_one_line(stopped_run, generated_data, tmp_path, capfd, caplog, damage):
    workdir = tmp_path / "run"
    shutil.copytree(stopped_run, workdir)
    why = damage(workdir / "checkpoints" / "4")
    caplog.set_level(logging.INFO)
    assert resume(workdir, "--steps", "6") == 0
    out = no_noise(capfd, caplog)
    aside = workdir / "damaged_checkpoints"
    notes = [line for line in out.splitlines() if line.startswith("checkpoint ")]
    assert len(notes) == 1 and re.fullmatch(f"checkpoint 4 is damaged \\({why}\\): moved to {re.escape(str(aside))}; resuming from step 2", notes[0]), out
    assert os.listdir(aside) == ["4"] and sorted(os.listdir(workdir / "checkpoints")) == ["4", "6"]  # step 4 trained again
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "memory"] == [0, 2]  # the resumed run started at step 2
    assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4, 6]


def test_resume_without_an_intact_checkpoint_is_one_line_and_exit_2(stopped_run, generated_data, tmp_path, capfd, caplog):
    workdir = tmp_path / "run"
    shutil.copytree(stopped_run, workdir)
    why4, why2 = truncate_an_array(workdir / "checkpoints" / "4"), garbage_metadata(workdir / "checkpoints" / "2")
    caplog.set_level(logging.INFO)
    assert resume(workdir, "--steps", "6") == 2
    out, err = capfd.readouterr()
    assert re.fullmatch(f"train.cifar: no intact checkpoint in {re.escape(str(workdir / 'checkpoints'))} to resume from: "
                        f"checkpoint 4 is damaged \\({why4}\\); checkpoint 2 is damaged \\({why2}\\); pass another --workdir "
                        "to train afresh\n", err), err  # fmt: skip
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"] and not (workdir / "damaged_checkpoints").exists()
    assert issubclass(NoIntactCheckpoint, cli.UsageError)


def test_a_fresh_run_replaces_a_damaged_config_json(generated_data, tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text('{"config": {"lr": 0.')  # cut off; no checkpoints: nothing to resume
    assert loop.train_and_evaluate(dataclasses.replace(TINY, steps=1), str(workdir))["step"] == 1
    assert json.loads((workdir / "config.json").read_text())["config"]["steps"] == 1
