"""The CLIs as a user runs them: --help, flag errors, missing data, a smoke run end to end, plots."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from train import config as config_lib
from train import plot
from train.config import CIFAR_DEFAULTS, IMAGENET_DEFAULTS, TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(module: str, *args: str, home) -> subprocess.CompletedProcess:
    """``python -m module args`` from the repository root, with HOME and tfds' dir under ``home``."""
    env = {
        **os.environ,
        "HOME": str(home / "home"),
        "TFDS_DATA_DIR": str(home / "tfds"),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("BSR_JAX_CACHE", None)
    return subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("defaults", [CIFAR_DEFAULTS, IMAGENET_DEFAULTS])
def test_help_documents_every_flag_with_its_default(defaults):
    text = config_lib.build_parser("train.x", "doc", defaults).format_help()
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        assert flag in text, flag
    # One "(default: ...)" per flag (help itself has none); argparse may wrap inside the parentheses.
    flat = " ".join(text.split())
    assert flat.count("(default:") == len(dataclasses.fields(TrainConfig)) + 1  # + --workdir
    assert f"(default: {defaults.model})" in flat and f"(default: {defaults.batch_size})" in flat


def test_flags_become_the_frozen_config():
    config, workdir = config_lib.parse(
        "train.cifar", "doc", CIFAR_DEFAULTS, config_lib.DATASETS,
        ["--sparsity", "0.7", "--block", "8", "--model", "s12", "--dataset", "cifar100", "--steps", "5",
         "--sparse-head", "--dtype", "bfloat16", "--workdir", "w"],
    )  # fmt: skip
    assert config == dataclasses.replace(
        CIFAR_DEFAULTS, sparsity=0.7, block=8, model="s12", dataset="cifar100", steps=5, sparse_head=True, dtype="bfloat16"
    )
    assert workdir == "w"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sparsity = 0.5


def test_pruning_extension_flags():
    config, _ = config_lib.parse(
        "train.cifar", "doc", CIFAR_DEFAULTS, config_lib.DATASETS,
        ["--sparsity", "0.7", "--storage-dtype", "int8", "--stochastic", "--sparsity-warmup-epochs", "2",
         "--layer-sparsity", "block0/*=0", "--layer-sparsity", "*/fc2=0.9", "--prune-scale-shift"],
    )  # fmt: skip
    assert config.storage_dtype == "int8" and config.stochastic and config.sparsity_warmup_epochs == 2.0
    assert config.layer_sparsity == (("block0/*", 0.0), ("*/fc2", 0.9)) and config.prune_scale_shift


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--layer-sparsity", "fc2"], "expected PATTERN=VALUE"),
        (["--layer-sparsity", "*/fc2=x"], "expected PATTERN=VALUE"),
        (["--layer-sparsity", "*/fc2=1.0"], "layer_sparsity must be PATTERN=VALUE rules with VALUE in [0, 1)"),
        (["--storage-dtype", "int4"], "argument --storage-dtype: invalid choice: 'int4'"),
    ],
)
def test_bad_pruning_extension_flags(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        config_lib.parse("train.cifar", "doc", CIFAR_DEFAULTS, config_lib.DATASETS, flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_flag_values_exit_with_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        config_lib.parse("train.cifar", "doc", CIFAR_DEFAULTS, config_lib.DATASETS, ["--sparsity", "1.5"])
    assert exit_info.value.code == 2
    assert "sparsity must be in [0, 1), got 1.5" in capsys.readouterr().err


def test_missing_data_is_one_clear_message(tmp_path):
    empty = tmp_path / "nothing_here"
    empty.mkdir()
    done = run_cli("train.cifar", "--data-dir", str(empty), "--workdir", str(tmp_path / "run"), home=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    message = [line for line in done.stderr.splitlines() if line.startswith("train.cifar: ")]
    assert len(message) == 1 and str(empty) in message[0] and "--data-dir" in message[0]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """``python -m train.cifar --steps 3`` on a generated CIFAR-10-style image folder."""
    tmp = tmp_path_factory.mktemp("smoke")
    rng = np.random.default_rng(0)
    for split, count in (("train", 40), ("test", 12)):
        for i in range(count):
            folder = tmp / "data" / "cifar10" / split / f"class{i % 10}"
            folder.mkdir(parents=True, exist_ok=True)
            from PIL import Image

            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i:04d}.png")
    workdir = tmp / "run"
    done = run_cli(
        "train.cifar", "--data-dir", str(tmp / "data"), "--cache-dir", str(tmp / "cache"), "--workdir", str(workdir),
        "--steps", "3", "--batch-size", "8", "--eval-batch-size", "4", "--dim", "16", "--depth", "1",
        "--sparsity", "0.7", "--block", "16", "--log-every", "1", home=tmp,
    )  # fmt: skip
    return done, workdir


def test_smoke_run_writes_metrics_config_and_checkpoint(smoke_run):
    done, workdir = smoke_run
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds == ["memory", "train", "train", "train", "eval"]
    assert all(np.isfinite(r["loss"]) for r in records if r["kind"] == "train")
    assert 0.0 <= records[-1]["test_accuracy"] <= 1.0 and records[-1]["step"] == 3
    assert "images_per_s" in records[2] and records[0]["kept_block_fraction"] < 0.35
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["config"]["sparsity"] == 0.7 and saved["run"]["train_examples"] == 40
    assert os.listdir(workdir / "checkpoints") == ["3"]
    assert "test_accuracy=" in done.stdout


def test_plot_draws_several_runs(smoke_run, tmp_path):
    _, workdir = smoke_run
    other = tmp_path / "other"
    other.mkdir()
    records = [{"kind": "train", "step": s, "epoch": s / 4, "loss": 2.0 / s} for s in range(1, 9)]
    records += [{"kind": "eval", "step": s, "epoch": s / 4, "test_loss": 1.0, "test_accuracy": s / 10} for s in (4, 8)]
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "curves.png"
    assert plot.main([str(workdir), str(other), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert plot.main([str(tmp_path / "missing"), "--out", str(out)]) == 2
