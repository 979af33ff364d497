"""The CLIs as a user runs them: --help, flag errors, resume, no network, a smoke run end to end,
SIGINT, plots. Subprocess tests assert exit codes and the exact stderr lines."""

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from checkpoint_scores import checkpoint_scores
from cli_stderr import ours

from train import config as config_lib
from train import plot
from train.config import CIFAR_DEFAULTS, IMAGENET_DEFAULTS, TrainConfig

# One xdist worker runs this module (--dist loadgroup, pyproject.toml): the module fixture
# `smoke_run` (a train.cifar subprocess) runs once, not once per worker.
pytestmark = pytest.mark.xdist_group("test_cli")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli_env(home, **extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: HOME and tfds' dir under ``home``, CPU only."""
    env = {**os.environ, "HOME": str(home / "home"), "TFDS_DATA_DIR": str(home / "tfds"), "JAX_PLATFORMS": "cpu", **extra}
    env.pop("BSR_JAX_CACHE", None)
    return env


def run_cli(module: str, *args: str, home, **env: str) -> subprocess.CompletedProcess:
    """``python -m module args`` from the repository root (see ``cli_env``)."""
    return subprocess.run([sys.executable, "-m", module, *args], env=cli_env(home, **env), cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


def test_option_lists_match_the_library_and_the_models():
    from bsr_jax.backends import dispatch as backends
    from bsr_jax.ops import dx
    from bsr_jax.storage import format as bsr_format
    from train import resnet
    from train.models import PRESETS

    assert config_lib.MODELS == (*PRESETS, *resnet.PRESETS)
    assert config_lib.RESNET_MODELS == tuple(resnet.PRESETS)
    assert set(config_lib.STORAGE_DTYPES) == set(bsr_format.STORAGE_DTYPES)
    assert config_lib.DX_FORMATS == dx.DX_FORMATS
    assert set(config_lib.CRITERIA) == set(bsr_format.CRITERIA)
    assert set(config_lib.SELECTIONS) == set(bsr_format.SELECTIONS)
    assert set(config_lib.ROUNDINGS) == set(bsr_format.ROUNDINGS)
    assert set(config_lib.STOCHASTIC_ROUNDING_DTYPES) == set(bsr_format.STOCHASTIC_ROUNDING_DTYPES)
    assert set(config_lib.BACKENDS) == set(backends.BACKENDS)


def test_the_cli_modules_do_not_import_jax():
    # --help and flag errors are answered before train.cli imports the training code.
    code = "import sys, train.cifar, train.imagenet, train.cli; print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'flax', 'bsr_jax'}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("defaults", [CIFAR_DEFAULTS, IMAGENET_DEFAULTS])
def test_help_documents_every_flag_with_its_default(defaults):
    text = config_lib.build_parser("train.x", "doc", defaults).format_help()
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        assert flag in text, flag
    # One "(default: ...)" per flag (help itself has none); argparse may wrap inside the parentheses.
    flat = " ".join(text.split())
    # + --workdir and the flags of the processes of a run (--coordinator --num-processes --process-id)
    assert flat.count("(default:") == len(dataclasses.fields(TrainConfig)) + 1 + len(dataclasses.fields(config_lib.Processes))
    assert f"(default: {defaults.model})" in flat and f"(default: {defaults.batch_size})" in flat


def test_help_keeps_the_pruning_flags_together_and_lists_every_storage_dtype():
    text = " ".join(config_lib.build_parser("train.x", "doc", CIFAR_DEFAULTS).format_help().split())
    options = text[text.index("options:"):]
    order = [options.index(f) for f in ("--no-stochastic ", "--sparsity-warmup-epochs ", "--layer-sparsity ", "--optimizer ")]
    assert order == sorted(order)
    assert f"lower precision ({', '.join(config_lib.STORAGE_DTYPES)})" in text and "int4" in config_lib.STORAGE_DTYPES


def test_flags_become_the_frozen_config():
    config, workdir, notes = config_lib.parse(
        "train.cifar", "doc", CIFAR_DEFAULTS, config_lib.DATASETS,
        ["--sparsity", "0.7", "--block", "8", "--model", "s12", "--dataset", "cifar100", "--steps", "5",
         "--sparse-head", "--dtype", "bfloat16", "--workdir", "w"],
    )  # fmt: skip
    assert config == dataclasses.replace(
        CIFAR_DEFAULTS, sparsity=0.7, block=8, model="s12", dataset="cifar100", steps=5, sparse_head=True, dtype="bfloat16"
    )
    assert workdir == "w" and notes == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sparsity = 0.5


def test_pruning_extension_flags():
    config, _, _ = config_lib.parse(
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
        (["--storage-dtype", "int3"], "argument --storage-dtype: invalid choice: 'int3'"),
        (["--compression", "pool3"], "argument --compression: invalid choice: 'pool3'"),
        (["--compression", "pool2"], "argument --compression: compression must be None or one of ('pool2', 'pool4'), "
         "with a ResNet model ('resnet18', 'resnet50') and without --sparsity/--stochastic, got 'pool2'"),
        (["--model", "resnet18", "--compression", "pool2", "--sparsity", "0.5"], "without --sparsity/--stochastic"),
        (["--model", "resnet50", "--depth", "3"], "argument --depth: depth applies to ResMLP models only, got 3 with model resnet50"),
        (["--model", "resnet18", "--layer-sparsity", "*=0.5"], "argument --layer-sparsity: layer_sparsity applies to ResMLP"),
        (["--model", "resnet18", "--remat"], "argument --remat: remat applies to ResMLP models only, got on with model resnet18"),
        (["--remat", "--memory-budget", "0.5"], "argument --memory-budget: memory_budget must be None, or without "
         "--sparsity/--storage-dtype/--dx/--stochastic/--layer-sparsity/--compression/--remat (the plan chooses them)"),
    ],
)
def test_bad_pruning_extension_flags(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        config_lib.parse("train.cifar", "doc", CIFAR_DEFAULTS, config_lib.DATASETS, flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_flag_values_exit_with_one_line_naming_the_flag(capsys):
    for flags, message in (
        (["--sparsity", "1.5"], "train.cifar: argument --sparsity: sparsity must be in [0, 1), got 1.5 (see --help)"),
        (["--block", "0"], "train.cifar: argument --block: block must be a side >= 1 or ROWSxCOLUMNS with both >= 1, got 0 (see --help)"),
        (["--backend", "fused", "--storage-dtype", "int4"], "train.cifar: argument --backend: backend must be None or one of "
         "('auto', 'cpu', 'xla', 'pallas', 'reference', 'fused'); 'fused' needs --block 1x128 --sparsity 0 --storage-dtype int8 or int4 "
         "and --rounding nearest, got 'fused' (see --help)"),
        (["--backend", "gpu"], "train.cifar: argument --backend: invalid choice: 'gpu' (choose from 'auto', 'cpu', "
                               "'xla', 'pallas', 'reference', 'fused') (see --help)"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            config_lib.parse("train.cifar", "doc", CIFAR_DEFAULTS, config_lib.DATASETS, flags)
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.splitlines() == [message]


def test_remat_flag_reaches_the_blocks_with_the_policy_that_keeps_compressed_residuals():
    import bsr_jax
    from train.models import create_model, dense_counterpart

    parse = lambda *flags: config_lib.parse("train.cifar", "doc", CIFAR_DEFAULTS, config_lib.DATASETS, list(flags))[0]  # noqa: E731
    assert parse().remat is False and parse("--remat").remat is True
    plain, compressed = create_model(parse("--remat"), 10), create_model(parse("--remat", "--storage-dtype", "int4"), 10)
    assert (plain.remat, plain.remat_policy) == (True, None)  # a block keeps its input alone
    # Compressed residuals are kept, not recomputed (the policy is a new closure each call: compare what it saves).
    assert compressed.remat and compressed.remat_policy is not None
    assert compressed.remat_policy.__code__ is bsr_jax.remat_policy().__code__
    assert create_model(parse(), 10).remat is False and dense_counterpart(parse("--remat")).remat is False


def test_the_fused_backend_takes_its_format_and_reaches_the_layers():
    from train.models import create_model, dense_counterpart

    flags = ["--backend", "fused", "--block", "1x128", "--sparsity", "0", "--storage-dtype", "int4"]
    config = config_lib.parse("train.cifar", "doc", CIFAR_DEFAULTS, config_lib.DATASETS, flags)[0]
    assert (config.backend, config.block) == ("fused", (1, 128))
    assert dense_counterpart(config).backend is None  # the baseline compresses nothing, so no fused format
    model = create_model(config, 10)
    assert model.dense.keywords["backend"] == "fused" and model.dense.keywords["pruning"].block == (1, 128)


@pytest.mark.parametrize("change", [{}, {"storage_dtype": "int8"}, {"rounding": "stochastic"}, {"block": 16}, {"block": (1, 64)},
                                    {"sparsity": 0.5}, {"storage_dtype": "bfloat16"}])  # fmt: skip
def test_the_trainers_fused_check_is_the_backends_rule(change):
    """The settings check fused's format without importing JAX; it must say what the backend says."""
    from bsr_jax.backends import fused
    from train.models import config_pruning

    config = dataclasses.replace(CIFAR_DEFAULTS, **({"block": (1, 128), "sparsity": 0.0, "storage_dtype": "int4"} | change))
    assert config._fused_format() == (fused._format_error(config_pruning(config)) is None)


def _saved_run(workdir, **fields) -> TrainConfig:
    """A config.json as a run writes it (settings and run facts; 5 steps per epoch)."""
    saved = dataclasses.replace(CIFAR_DEFAULTS, **fields)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps({"config": saved.to_json(), "run": {"steps_per_epoch": 5}}))
    return saved


def test_resume_uses_the_runs_config_json(tmp_path, capsys):
    workdir = tmp_path / "run"
    saved = _saved_run(workdir, sparsity=0.7, model="tiny", epochs=10, data_dir="../data.tar.gz", layer_sparsity=(("*/fc2", 0.9),))
    parse = lambda *flags: config_lib.parse("train.cifar", "doc", CIFAR_DEFAULTS, config_lib.DATASETS, ["--workdir", str(workdir), "--resume", *flags])  # noqa: E731
    # No flags repeated: the run's settings, not the defaults.
    assert parse() == (dataclasses.replace(saved, resume=True), str(workdir), [])
    # Flags equal to config.json (as benchmarks/accuracy/cifar_grid.py passes them) are fine.
    same = ["--model", "tiny", "--epochs", "10", "--seed", "0", "--sparsity", "0.70", "--data-dir", "../data.tar.gz",
            "--layer-sparsity", "*/fc2=0.9"]  # fmt: skip
    assert parse(*same)[0] == dataclasses.replace(saved, resume=True)
    # The documented overrides apply and are reported.
    config, _, notes = parse("--steps", "130", "--epochs", "20")
    assert (config.steps, config.epochs, config.sparsity) == (130, 20, 0.7)
    assert notes == ["--steps None -> 130", "--epochs 10 -> 20"]
    # Anything else that differs is an error naming each flag, on one line.
    with pytest.raises(SystemExit) as exit_info:
        parse("--sparsity", "0.5", "--model", "s12", "--no-stochastic")
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"train.cifar: {workdir} was trained with other settings; to resume it, drop ")
    assert "--model s12 (the run has tiny); --sparsity 0.5 (the run has 0.7)" in lines[0] and "stochastic" not in lines[0]


def test_download_failure_is_one_line_and_leaves_no_checkpoints(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        mirror = f"http://127.0.0.1:{s.getsockname()[1]}/"  # closed once the socket is: connection refused
    done = run_cli("train.cifar", "--sparsity", "0.7", "--workdir", str(tmp_path / "run"), home=tmp_path, BSR_JAX_CIFAR_MIRROR=mirror)
    assert done.returncode == 2, done.stderr
    lines = ours(done.stderr)
    assert len(lines) == 3, done.stderr  # the cause, where it looked, what to do offline
    assert lines[0].startswith(f"train.cifar: could not download CIFAR-10 from {mirror}cifar-10-python.tar.gz: ")
    assert lines[1] == (f"  Looked in {tmp_path / 'tfds' / 'downloads' / 'manual'} (does not exist), "
                        f"{tmp_path / 'home' / '.cache' / 'bsr_jax' / 'downloads'} (does not exist) first.")  # fmt: skip
    assert "--data-dir cifar-10-python.tar.gz" in lines[2] and "image folder" in lines[2]
    assert not (tmp_path / "run").exists()  # a failed run leaves no empty workdir or checkpoints/


def smoke_flags(data_dir, workdir, *extra: str) -> list[str]:
    return ["--data-dir", str(data_dir), "--cache-dir", str(data_dir / "cache"), "--workdir", str(workdir),
            "--batch-size", "8", "--eval-batch-size", "4", "--dim", "16", "--depth", "1",
            "--sparsity", "0.7", "--block", "16", "--log-every", "1", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def smoke_run(cifar_image_folder, tmp_path_factory):
    """``python -m train.cifar --steps 3`` on the generated image folder, evaluating the 12 test
    images in batches of 5 so that the last one is padded."""
    workdir = tmp_path_factory.mktemp("smoke") / "run"
    done = run_cli("train.cifar", *smoke_flags(cifar_image_folder, workdir, "--steps", "3", "--eval-batch-size", "5"), home=cifar_image_folder)
    return done, workdir


def test_smoke_run_writes_metrics_config_checkpoint_and_a_summary(smoke_run):
    done, workdir = smoke_run
    assert done.returncode == 0, done.stdout + done.stderr
    assert ours(done.stderr) == [], done.stderr  # progress bars are off without a terminal
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds == ["memory", "train", "train", "train", "eval"]
    assert all(np.isfinite(r["loss"]) for r in records if r["kind"] == "train")
    assert records[-1]["step"] == 3
    # The reported scores are those of the saved params over exactly the 12 test images; the
    # tolerance covers float32 summation order only (one wrong example moves accuracy by 1/12).
    recomputed = checkpoint_scores(str(workdir), 3)
    assert recomputed["test_examples"] == 12
    assert records[-1]["test_accuracy"] == pytest.approx(recomputed["test_accuracy"], rel=1e-6, abs=1e-7)
    assert records[-1]["test_loss"] == pytest.approx(recomputed["test_loss"], rel=1e-5)
    assert "images_per_s" in records[2] and records[0]["kept_block_fraction"] < 0.35
    assert records[0]["residual_activation_mib"] < records[0]["dense_residual_activation_mib"]
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["config"]["sparsity"] == 0.7 and saved["run"]["train_examples"] == 40
    assert os.listdir(workdir / "checkpoints") == ["3"]
    summary = done.stdout[done.stdout.index(f"run summary ({workdir})"):].splitlines()
    accuracy = f"{records[-1]['test_accuracy']:.4f}"
    residual, ratio = records[0]["residual_activation_mib"], records[0]["residual_activation_mib"] / records[0]["dense_residual_activation_mib"]
    assert summary[1:] == [
        "  steps            3 of 3",
        summary[2],  # wall time
        f"  test accuracy    {accuracy} final, {accuracy} best (epoch 0.6)",
        # The device's figure first; the residuals' share of dense's is labelled as what it is.
        f"  compiled peak    {records[0]['compiled_peak_mib']:.2f} MiB per device: XLA's memory plan of the train step (cpu)",
        f"  residuals        {residual:.2f} MiB per device kept for the backward, {ratio:.0%} of dense's (counted in the jaxpr, "
        "not device memory)",
        f"  checkpoint       {workdir}/checkpoints/3",
        f"  plot             python -m train.plot {workdir}  (writes {workdir}/curves.png)",
    ]


def _snapshot(workdir) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(workdir.rglob("*"))}


def test_resume_keeps_settings_refuses_changes_and_knows_when_it_is_done(smoke_run, cifar_image_folder, tmp_path):
    _, finished = smoke_run
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    before = _snapshot(workdir)
    changed = run_cli("train.cifar", "--workdir", str(workdir), "--resume", "--sparsity", "0.5", home=cifar_image_folder)
    assert changed.returncode == 2 and len(ours(changed.stderr)) == 1, changed.stderr
    assert "--sparsity 0.5 (the run has 0.7)" in changed.stderr
    done = run_cli("train.cifar", "--workdir", str(workdir), "--resume", home=cifar_image_folder)
    assert done.returncode == 0 and ours(done.stderr) == [], done.stderr
    assert done.stdout == f"train.cifar: the run in {workdir} already finished at step 3; nothing to do (raise --epochs or --steps to train further)\n"
    assert _snapshot(workdir) == before  # neither touched anything
    # Only --resume and --steps: the run's sparsity 0.7 continues, not the default 0.
    more = run_cli("train.cifar", "--workdir", str(workdir), "--resume", "--steps", "5", home=cifar_image_folder)
    assert more.returncode == 0, more.stdout + more.stderr
    assert f"train.cifar: resuming {workdir} with its config.json, changing --steps 3 -> 5" in more.stdout
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    assert records[-1]["kind"] == "eval" and records[-1]["step"] == 5
    assert records[-2]["kind"] == "train" and [r for r in records if r["kind"] == "memory"][-1]["kept_block_fraction"] < 0.35
    saved = json.loads((workdir / "config.json").read_text())["config"]
    assert (saved["sparsity"], saved["steps"]) == (0.7, 5)


@pytest.mark.slow  # 9 s; a damaged metrics file's line-skipping holds by default in test_run_files
def test_resume_skips_a_metrics_line_cut_off_by_a_crash_and_says_so(smoke_run, cifar_image_folder, tmp_path):
    _, finished = smoke_run
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    metrics = workdir / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:-1]) + lines[-1][:30])  # the final eval record, cut off
    done = run_cli("train.cifar", "--workdir", str(workdir), "--resume", "--steps", "4", home=cifar_image_folder)
    assert done.returncode == 0 and ours(done.stderr) == [], done.stdout + done.stderr
    notes = [line for line in done.stdout.splitlines() if "metrics.jsonl" in line]
    assert notes == [f"{metrics}: skipped its last line, a record cut off when it was written ({lines[-1][:30]!r}; 30 bytes)"]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]  # whole again
    # (step 3's evaluation was due only as the end of --steps 3)
    assert [(r["kind"], r["step"]) for r in records if r["kind"] != "memory"] == [
        ("train", 1), ("train", 2), ("train", 3), ("train", 4), ("eval", 4)]


def test_sigint_stops_within_a_step_with_a_checkpoint(cifar_image_folder, tmp_path):
    workdir = tmp_path / "run"
    flags = smoke_flags(cifar_image_folder, workdir)  # 100 epochs of 5 steps: far longer than the test
    process = subprocess.Popen([sys.executable, "-m", "train.cifar", *flags], env=cli_env(cifar_image_folder), cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines = []
    while sum("kind=train" in line for line in lines) < 3:  # training is under way
        lines.append(process.stdout.readline())
        assert lines[-1], "".join(lines) + process.stderr.read()
    sent = time.perf_counter()
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    elapsed = time.perf_counter() - sent
    assert process.returncode == 128 + signal.SIGINT, stdout + stderr
    assert ours(stderr) == [], stderr
    assert "SIGINT: stopping after the step in flight, then saving a checkpoint" in stdout
    stopped = int(stdout.split("stopped by SIGINT at step ")[1].split(";")[0])
    assert os.listdir(workdir / "checkpoints") == [str(stopped)]
    assert "stopped by SIGINT: continue with --resume" in stdout and "run summary" in stdout
    assert elapsed < 15, elapsed  # steps of this model take milliseconds; the rest is the checkpoint


def test_plot_draws_several_runs_into_the_first_workdir(smoke_run, tmp_path):
    _, workdir = smoke_run
    other = tmp_path / "other"
    other.mkdir()
    records = [{"kind": "train", "step": s, "epoch": s / 4, "loss": 2.0 / s} for s in range(1, 9)]
    records += [{"kind": "eval", "step": s, "epoch": s / 4, "test_loss": 1.0, "test_accuracy": s / 10} for s in (4, 8)]
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    first = tmp_path / "first"
    shutil.copytree(workdir, first)
    assert plot.main([str(first), str(other)]) == 0
    out = first / "curves.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert plot.main([str(tmp_path / "missing"), "--out", str(tmp_path / "x.png")]) == 2


@pytest.mark.slow  # 9 s; --remat's gradients and smaller residuals hold by default in test_models
def test_remat_smoke_run_trains_a_step_keeping_less_than_dense(cifar_image_folder, tmp_path):
    workdir = tmp_path / "run"
    flags = ["--data-dir", str(cifar_image_folder), "--cache-dir", str(cifar_image_folder / "cache"), "--workdir", str(workdir),
             "--batch-size", "8", "--eval-batch-size", "12", "--dim", "16", "--depth", "2", "--remat", "--steps", "1"]  # fmt: skip
    done = run_cli("train.cifar", *flags, home=cifar_image_folder)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((workdir / "config.json").read_text())["config"]["remat"] is True
    memory, train, evaluation = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert train["step"] == 1 and np.isfinite(train["loss"]) and evaluation["kind"] == "eval"
    # Two blocks keep their inputs alone: far less than the plain model's activations.
    assert memory["residual_activation_mib"] < 0.5 * memory["dense_residual_activation_mib"]


def test_resnet_compression_flags():
    config, _, _ = config_lib.parse(
        "train.imagenet", "doc", IMAGENET_DEFAULTS, config_lib.DATASETS,
        ["--model", "resnet50", "--compression", "pool4", "--storage-dtype", "int8"],
    )  # fmt: skip
    assert (config.model, config.compression, config.storage_dtype) == ("resnet50", "pool4", "int8")


@pytest.mark.slow  # 31 s; pooled ResNet training holds in test_resnet and test_compress, the CLI in the other smokes
def test_resnet18_pool2_smoke_run_carries_batch_stats(cifar_image_folder, tmp_path):
    """``--model resnet18 --compression pool2 --steps 2`` end to end (8 filters, batch 4): the
    checkpoint holds batch_stats, which training changed and evaluation used (resuming restores the
    state with the same ``Checkpoints.restore`` as below; resume itself is tested on ResMLP)."""
    workdir = tmp_path / "run"
    flags = ["--data-dir", str(cifar_image_folder), "--cache-dir", str(cifar_image_folder / "cache"), "--workdir", str(workdir),
             "--model", "resnet18", "--compression", "pool2", "--dim", "8", "--batch-size", "4",
             "--eval-batch-size", "6", "--log-every", "1"]  # fmt: skip
    done = run_cli("train.cifar", *flags, "--steps", "2", home=cifar_image_folder)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["memory", "train", "train", "eval"]
    assert all(np.isfinite(r["loss"]) for r in records if r["kind"] == "train")
    assert "kept_block_fraction" not in records[0]  # pooled convolutions keep no blocks
    # Pooled conv inputs keep less than the dense ResNet (BatchNorm and ReLU keep the rest).
    assert records[0]["residual_activation_mib"] < 0.9 * records[0]["dense_residual_activation_mib"]
    recomputed = checkpoint_scores(str(workdir), 2)  # evaluation mode on the saved running averages
    assert records[-1]["test_accuracy"] == pytest.approx(recomputed["test_accuracy"], abs=1e-7)
    assert records[-1]["test_loss"] == pytest.approx(recomputed["test_loss"], rel=1e-5)

    import jax

    from train import loop, sharding
    from train.checkpoint import Checkpoints

    config = TrainConfig.from_json(json.loads((workdir / "config.json").read_text())["config"])
    assert config.compression == "pool2" and config.model == "resnet18"
    model = loop.create_model(config, 10)
    tx = loop.create_optimizer(config, loop.learning_rate_schedule(config, steps_per_epoch=1))
    initial = loop.create_state(model, tx, (1, 32, 32, 3), config.seed, sharding.make_mesh(jax.devices()[:1]))
    checkpoints = Checkpoints(str(workdir / "checkpoints"))
    saved = checkpoints.restore(initial, 2)
    checkpoints.close()
    # Two training steps moved the running averages away from their initial values.
    assert not np.allclose(saved["batch_stats"]["bn_init"]["mean"], initial["batch_stats"]["bn_init"]["mean"])
