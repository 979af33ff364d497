"""Damaged or empty run files: a metrics.jsonl cut off in its last line (a crash, a full disk) is
read without that line and the reader says so once; an empty one is nothing to plot (an error
naming the file); other damage is an error naming the line. train.plot as a subprocess, as a user
runs it: exit code and the exact stderr lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cli_stderr import ours

from train import plot, run_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDS = [{"kind": "memory", "step": 0, "residual_activation_mib": 1.5}]
RECORDS += [{"kind": "train", "step": s, "epoch": s / 4, "loss": 2.0 / s} for s in range(1, 9)]
RECORDS += [{"kind": "eval", "step": s, "epoch": s / 4, "test_loss": 1.0, "test_accuracy": s / 10} for s in (4, 8)]


def write_run(workdir, text: str | bytes):
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "metrics.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def lines_of(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def plot_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train.plot", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


@pytest.mark.parametrize("cut", [1, 20, -1])
def test_a_partial_last_line_is_skipped_with_a_note(tmp_path, cut):
    last = json.dumps(RECORDS[-1])
    path = write_run(tmp_path / "run", lines_of(RECORDS[:-1]) + last[:cut])  # no newline: the write was cut off
    records, note = run_dir.read_records_and_damage(str(tmp_path / "run"))
    assert records == RECORDS[:-1]
    assert note.startswith(f"{path}: skipped its last line, a record cut off when it was written (")
    assert note.endswith(f"; {len(last[:cut])} bytes)") and "\n" not in note
    assert run_dir.read_records(str(tmp_path / "run")) == RECORDS[:-1]


def test_a_cut_inside_a_utf8_character_or_a_zero_filled_tail_is_a_partial_line_too(tmp_path):
    for tail in ('{"kind": "note", "text": "caf\xc3'.encode("latin-1"), b"\0" * 300):
        write_run(tmp_path / "run", lines_of(RECORDS).encode() + tail)
        records, note = run_dir.read_records_and_damage(str(tmp_path / "run"))
        assert records == RECORDS and note is not None


def test_complete_files_have_no_note_and_blank_lines_are_ignored(tmp_path):
    write_run(tmp_path / "run", lines_of(RECORDS[:3]) + "\n" + lines_of(RECORDS[3:]))
    assert run_dir.read_records_and_damage(str(tmp_path / "run")) == (RECORDS, None)


def test_damage_before_the_last_line_is_an_error_naming_the_line(tmp_path):
    path = write_run(tmp_path / "run", lines_of(RECORDS[:2]) + '{"kind": "tr' + lines_of(RECORDS[2:]))
    with pytest.raises(run_dir.DamagedRecords, match=f"^{path}: line 3 is not a JSON record "):
        run_dir.read_records(str(tmp_path / "run"))


def test_plot_reads_a_run_cut_off_in_its_last_line_and_says_so_once(tmp_path):
    path = write_run(tmp_path / "run", lines_of(RECORDS[:-1]) + json.dumps(RECORDS[-1])[:25])
    done = plot_cli(str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"wrote {tmp_path / 'run' / 'curves.png'}\n"
    note = ours(done.stderr)
    assert len(note) == 1 and note[0].startswith(f"train.plot: {path}: skipped its last line"), done.stderr
    assert (tmp_path / "run" / "curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("content, what", [
    ("", "is empty"),
    (json.dumps(RECORDS[0]) + "\n", "has no train or eval records yet"),  # the memory record of a run's start
])  # fmt: skip
def test_plot_of_a_run_with_nothing_to_plot_is_an_error_naming_the_file(tmp_path, content, what):
    write_run(tmp_path / "good", lines_of(RECORDS))
    path = write_run(tmp_path / "empty", content)
    done = plot_cli(str(tmp_path / "good"), str(tmp_path / "empty"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert ours(done.stderr) == [f"train.plot: {path} {what}: nothing to plot (has the run logged a step?)"]
    assert not (tmp_path / "good" / "curves.png").exists()  # no PNG of blank axes


def test_plot_of_a_damaged_line_is_an_error_naming_it(tmp_path):
    path = write_run(tmp_path / "run", '{"kind": "tr' + lines_of(RECORDS))
    done = plot_cli(str(tmp_path / "run"))
    assert done.returncode == 2 and len(ours(done.stderr)) == 1 and "Traceback" not in done.stderr, done.stderr
    assert ours(done.stderr)[0].startswith(f"train.plot: {path}: line 1 is not a JSON record ")


def test_resume_of_a_run_damaged_before_its_last_line_is_an_error_naming_it(tmp_path):
    from train.config import CIFAR_DEFAULTS

    workdir = tmp_path / "run"
    path = write_run(workdir, lines_of(RECORDS[:2]) + "garbage\n" + lines_of(RECORDS[2:]))
    (workdir / "config.json").write_text(json.dumps({"config": CIFAR_DEFAULTS.to_json(), "run": {"steps_per_epoch": 5}}))
    (workdir / "checkpoints" / "8").mkdir(parents=True)
    env = {**os.environ, "HOME": str(tmp_path / "home"), "TFDS_DATA_DIR": str(tmp_path / "tfds"), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "train.cifar", "--resume", "--workdir", str(workdir)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert ours(done.stderr) == [f"train.cifar: {path}: line 3 is not a JSON record ('garbage'); delete or repair that line"]


def _resume(cli: str, workdir) -> int:
    """``python -m train.cifar|train.lm --resume --workdir WORKDIR`` in this process (the config is
    read before JAX starts); returns the exit code."""
    from train import cli as image_cli
    from train import lm
    from train.config import CIFAR_DEFAULTS, DATASETS

    argv = ["--resume", "--workdir", str(workdir)]
    try:
        return lm.main(argv) if cli == "train.lm" else image_cli.main(cli, "doc", CIFAR_DEFAULTS, DATASETS, argv)
    except SystemExit as exit:
        return exit.code


@pytest.mark.parametrize("cli", ["train.cifar", "train.lm"])
@pytest.mark.parametrize("content, what", [
    (b'{"config": {"lr": 0.1, "sparsity"', "is not valid JSON (Expecting ':' delimiter at line 1 column 34)"),
    (b"", "is empty"),
    (b"\x00\x00\x00\x00", "is not valid JSON (Expecting value at line 1 column 1)"),  # a crash's zero-filled block
    (b"\xff\xfe{}", "is not UTF-8 text (byte 0)"),
    (b'{"config": {}}', "is not a run's config.json (no 'run' object)"),
    (b"[1, 2]", "is not a run's config.json (no 'config' or 'run' object)"),
])  # fmt: skip
def test_resume_with_a_damaged_config_json_is_one_line_naming_the_file(tmp_path, capsys, cli, content, what):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_bytes(content)
    assert _resume(cli, workdir) == 2
    err = capsys.readouterr().err
    assert err == f"{cli}: {workdir / 'config.json'} {what}: repair it, or pass another --workdir to train afresh\n"


@pytest.mark.parametrize("cli", ["train.cifar", "train.lm"])
def test_resume_with_a_setting_of_the_wrong_type_names_the_setting(tmp_path, capsys, cli):
    from train.config import CIFAR_DEFAULTS
    from train.lm_config import LMConfig

    workdir = tmp_path / "run"
    workdir.mkdir()
    fields = {**(LMConfig() if cli == "train.lm" else CIFAR_DEFAULTS).to_json(), "sparsity": "0.7"}  # edited by hand
    (workdir / "config.json").write_text(json.dumps({"config": fields, "run": {"steps_per_epoch": 5}}))
    assert _resume(cli, workdir) == 2
    assert capsys.readouterr().err == (f"{cli}: {workdir / 'config.json'}: setting sparsity holds '0.7', not a float: "
                                       "repair it, or pass another --workdir\n")  # fmt: skip


# Records as train.lm writes them (train.lm_loop; train records from train.metrics.train_record):
# no accuracy in training, validation loss in evaluations, which have no epoch.
LM_RECORDS = [{"kind": "memory", "step": 0, "per_device_batch": 8, "residual_activation_mib": 0.5}]
LM_RECORDS += [{"kind": "train", "step": s, "epoch": s / 400, "loss": 5.0 / s, "grad_norm": 1.0, "lr": 1e-3,
                "step_time_s": 0.1, "tokens_per_s": 1000.0} for s in (10, 20, 30, 40)]  # fmt: skip
LM_RECORDS += [{"kind": "eval", "step": s, "val_loss": 3.0 / s, "val_perplexity": 2.0, "val_bits_per_byte": 1.5} for s in (20, 40)]


def test_plot_draws_train_lm_runs_against_steps(tmp_path):
    write_run(tmp_path / "lm-dense", lines_of(LM_RECORDS))
    write_run(tmp_path / "lm-int4", lines_of(LM_RECORDS[:3]))  # stopped before its first evaluation
    done = plot_cli(str(tmp_path / "lm-dense"), str(tmp_path / "lm-int4"))
    assert done.returncode == 0 and ours(done.stderr) == [], done.stderr
    assert done.stdout == f"wrote {tmp_path / 'lm-dense' / 'curves.png'}\n"
    assert (tmp_path / "lm-dense" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert plot.run_kind(LM_RECORDS) == plot.run_kind(LM_RECORDS[:3]) == "lm" and plot.run_kind(RECORDS) == "image"


def test_plot_refuses_image_and_lm_runs_in_one_figure_in_one_line(tmp_path, capsys):
    write_run(tmp_path / "lm", lines_of(LM_RECORDS))
    write_run(tmp_path / "cifar", lines_of(RECORDS))
    assert plot.main([str(tmp_path / "cifar"), str(tmp_path / "lm")]) == 2
    assert capsys.readouterr().err == (f"train.plot: {tmp_path / 'lm'} is a train.lm run (plotted against steps) and "
                                       f"{tmp_path / 'cifar'} an image run (against epochs): plot them separately, "
                                       "each with its own --out\n")  # fmt: skip
    assert not (tmp_path / "cifar" / "curves.png").exists()


@pytest.mark.parametrize("records, what", [
    (RECORDS[:2] + [{"kind": "eval", "step": 4, "epoch": 1.0, "score": 0.5}],
     ": its eval records hold neither test_accuracy (train.cifar, train.imagenet) nor val_loss (train.lm): not a run this can plot"),
    (RECORDS[:2] + [{"kind": "eval", "step": 4, "epoch": 1.0, "test_accuracy": 0.5}],
     ": the eval record of step 4 has no number 'test_loss': not written by train.cifar, train.imagenet or train.lm?"),
    (LM_RECORDS[:2] + [{"kind": "eval", "val_loss": 2.0}],
     ": the eval record of step ? has no number 'step': not written by train.cifar, train.imagenet or train.lm?"),
])  # fmt: skip
def test_plot_of_records_it_cannot_draw_is_one_line_naming_the_file(tmp_path, capsys, records, what):
    path = write_run(tmp_path / "run", lines_of(records))
    assert plot.main([str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == f"train.plot: {path}{what}\n"
