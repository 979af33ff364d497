"""train.settings through train.lm's configuration (train.cifar's: tests/train/test_cli.py): --resume's
rule, JSON round trips, and the checks every settings class gets."""

import dataclasses
import json

import pytest

from train import lm_config
from train.lm_config import LMConfig
from train.settings import InvalidSetting, UsageError


def _saved_run(workdir, **fields) -> LMConfig:
    saved = LMConfig(**fields)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps({"config": saved.to_json(), "run": {}}))
    return saved


def test_a_resumed_lm_run_takes_its_config_json_and_only_the_overrides(tmp_path, capsys):
    workdir = tmp_path / "run"
    saved = _saved_run(workdir, model="cpu", steps=200, storage_dtype="int4", layer_sparsity=(("layer_*/mlp/*", 0.5),))
    parse = lambda *flags: lm_config.parse("train.lm", "doc", ["--workdir", str(workdir), "--resume", *flags])  # noqa: E731
    assert parse() == (dataclasses.replace(saved, resume=True), str(workdir), [])
    assert parse("--storage-dtype", "int4", "--layer-sparsity", "layer_*/mlp/*=0.50")[0] == dataclasses.replace(saved, resume=True)
    config, _, notes = parse("--stop-at", "50", "--log-every", "5")
    assert (config.stop_at, config.log_every, config.steps) == (50, 5, 200)
    assert notes == ["--stop-at None -> 50", "--log-every 20 -> 5"]
    with pytest.raises(SystemExit) as exit_info:
        parse("--steps", "300", "--no-lean", "--layer-sparsity", "layer_0/*=0.9")
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"train.lm: {workdir} was trained with other settings; to resume it, drop ")
    assert ("--lean off (the run has on); --layer-sparsity layer_0/*=0.9 (the run has "
            "layer_*/mlp/*=0.5); --steps 300 (the run has 200). To train") in lines[0]  # fmt: skip


def test_lm_settings_round_trip_through_json_and_name_unknown_fields():
    config = LMConfig(dx="int8", layer_sparsity=(("layer_1/attn/*", 0.3),), memory_budget=None, stop_at=7)
    assert LMConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    with pytest.raises(UsageError, match=r"unknown settings \['epochs'\] \(written by another version of train.lm\?\)"):
        LMConfig.from_json({**config.to_json(), "epochs": 3})


@pytest.mark.parametrize("field", ["lr", "min_lr", "weight_decay", "clip_norm", "val_fraction", "sparsity"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_every_float_setting_must_be_finite(field, value):
    with pytest.raises(InvalidSetting, match=f"{field} must be a finite number") as error:
        LMConfig(**{field: value})
    assert error.value.field == field


def test_a_choice_flag_is_read_in_any_case(tmp_path):
    config, _, _ = lm_config.parse("train.lm", "doc", ["--workdir", str(tmp_path / "run"), "--target", "H100", "--storage-dtype", "INT4"])
    assert (config.target, config.storage_dtype) == ("h100", "int4")


def test_block_is_a_side_or_rows_by_columns_in_flags_json_and_resume(tmp_path, capsys):
    parse = lambda *flags: lm_config.parse("train.lm", "doc", ["--workdir", str(tmp_path / "run"), *flags])[0]  # noqa: E731
    assert parse("--block", "32").block == 32
    assert parse("--block", "1X128").block == (1, 128)
    config = LMConfig(block=(1, 128))
    assert json.loads(json.dumps(config.to_json()))["block"] == [1, 128]
    assert LMConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    with pytest.raises(UsageError, match=r"setting block holds \[1, 2, 3\]"):
        LMConfig.from_json({**config.to_json(), "block": [1, 2, 3]})
    with pytest.raises(InvalidSetting, match=r"block must be a side >= 1 or ROWSxCOLUMNS with both >= 1, got \(1, 0\)"):
        LMConfig(block=(1, 0))
    for bad in ("1x2x3", "x128", "16.0"):
        with pytest.raises(SystemExit):
            parse("--block", bad)
        assert "expected a side N or ROWSxCOLUMNS (e.g. 16 or 1x128)" in capsys.readouterr().err
    workdir = tmp_path / "saved"
    _saved_run(workdir, block=(1, 128))
    resume = lambda *flags: lm_config.parse("train.lm", "doc", ["--workdir", str(workdir), "--resume", *flags])  # noqa: E731
    assert resume("--block", "1x128")[0].block == (1, 128)
    with pytest.raises(SystemExit):
        resume("--block", "16")
    assert "--block 16 (the run has 1x128)" in capsys.readouterr().err
