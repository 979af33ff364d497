"""Mistakes a new user makes: each run exits with code 2 and a short stderr whose first line gives
the cause and names the flag (or file) and the value to change; no traceback.

Flag errors (refused before JAX is imported), --help and signals run as subprocesses; mistakes found
in the data run in this process as ``python -m`` would run them (``run_here``), which spares each
one the 2-3 s of an interpreter importing JAX and its plugins."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from cli_stderr import ours
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli_env(home) -> dict[str, str]:
    """A CLI subprocess's environment: HOME and tfds' data under ``home``, CPU only, no BSR_JAX_CACHE."""
    env = {**os.environ, "HOME": str(home / "home"), "TFDS_DATA_DIR": str(home / "tfds"), "JAX_PLATFORMS": "cpu"}
    env.pop("BSR_JAX_CACHE", None)
    return env


def run_cli(module: str, *args: str, home) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], env=cli_env(home), cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip


@pytest.fixture
def run_here(tmp_path, monkeypatch):
    """``run_cli(module, *args, home=tmp_path)`` in this process (``cli_env``'s changes made with
    ``monkeypatch``): the module's ``__main__`` block under ``runpy``, its exit code from
    ``SystemExit``, its output captured; an exception it does not handle fails the test, as a
    traceback would."""

    def run(module: str, *args: str) -> subprocess.CompletedProcess:
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
        monkeypatch.delenv("BSR_JAX_CACHE", raising=False)
        monkeypatch.chdir(ROOT)
        monkeypatch.setattr(sys, "argv", [module, *args])
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exit_:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = exit_.value.code
        code = 0 if code is None else code if isinstance(code, int) else 1  # as the interpreter exits
        return subprocess.CompletedProcess([module, *args], code, stdout.getvalue(), stderr.getvalue())

    return run


def refused(done: subprocess.CompletedProcess, lines: int = 1) -> str:
    """The first stderr line of a run that exited with 2 and at most ``lines`` lines, no traceback."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert 1 <= len(ours(done.stderr)) <= lines and "Traceback" not in done.stderr, done.stderr
    return ours(done.stderr)[0]


def small_run(data_dir, tmp_path, *extra: str) -> list[str]:
    return ["--data-dir", str(data_dir), "--cache-dir", str(data_dir / "cache"), "--workdir", str(tmp_path / "run"),
            "--eval-batch-size", "4", "--dim", "16", "--depth", "1", *extra]  # fmt: skip


@pytest.mark.parametrize("module", ["train.cifar", "train.imagenet"])
def test_a_batch_larger_than_the_data_names_the_flag_range_and_data_size(module, cifar_image_folder, tmp_path, run_here):
    # train.imagenet's default batch is 1024: more than any small folder holds.
    flags = ["--batch-size", "100000"] if module == "train.cifar" else ["--dataset", "imagefolder", "--model", "tiny"]
    folder = cifar_image_folder if module == "train.cifar" else cifar_image_folder / "cifar10"
    batch = 100000 if module == "train.cifar" else 1024
    line = refused(run_here(module, *small_run(folder, tmp_path, *flags)))
    assert line == f"{module}: --batch-size {batch} is more than the 40 training images: it must be in [1, 40]"
    assert not (tmp_path / "run").exists()


def test_a_layer_sparsity_pattern_matching_no_layer_is_refused_before_the_data(tmp_path, run_here):
    flags = ["--data-dir", str(tmp_path / "no-data"), "--workdir", str(tmp_path / "run"), "--depth", "2",
             "--sparsity", "0.7", "--layer-sparsity", "block*/fc1=0.5", "--layer-sparsity", "blocks*/fc2=0.9"]  # fmt: skip
    line = refused(run_here("train.cifar", *flags))
    assert line == (
        "train.cifar: --layer-sparsity blocks*/fc2=0.9: 'blocks*/fc2' matches no layer of the tiny model, whose layer "
        "paths are stem, block{0..1}/affine1, block{0..1}/token_mixing, block{0..1}/layerscale1, block{0..1}/affine2, "
        "block{0..1}/fc1, block{0..1}/fc2, block{0..1}/layerscale2, final_affine, head"
    )


def test_resume_with_nothing_to_resume_names_the_workdir(tmp_path):
    workdir = tmp_path / "rnu"  # a typo of an earlier run's workdir
    line = refused(run_cli("train.cifar", "--resume", "--workdir", str(workdir), home=tmp_path))
    assert line == (f"train.cifar: argument --resume: nothing to resume in {workdir}: it has no config.json; "
                    "pass the --workdir of an earlier run, or drop --resume (see --help)")  # fmt: skip
    assert not workdir.exists() and not (tmp_path / "home").exists()  # nothing downloaded or created


def test_a_patch_size_that_does_not_divide_the_image_names_both_flags(tmp_path):
    line = refused(run_cli("train.cifar", "--patch-size", "5", home=tmp_path))
    assert line == "train.cifar: argument --patch-size: patch_size must be >= 1 and divide --image-size 32, got 5 (see --help)"


def test_images_of_different_sizes_are_refused_with_advice_that_works(tmp_path, run_here):
    rng = np.random.default_rng(0)
    folder = tmp_path / "mixed"
    for split, count in (("train", 8), ("test", 4)):
        for i in range(count):
            (folder / split / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
            side = 32 if i % 2 else 40
            Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(folder / split / f"c{i % 2}" / f"{i}.png")
    flags = small_run(folder, tmp_path, "--dataset", "imagefolder", "--batch-size", "4", "--steps", "1")
    line = refused(run_here("train.cifar", *flags))
    assert line.startswith(f"train.cifar: images have different sizes 32x32 and 40x40 in {folder}, which --augment cifar ")
    assert line.endswith("to resize them all to N x N, pass --dataset imagefolder --augment imagenet (or none) --image-size N")
    done = run_here("train.cifar", *flags, "--augment", "none", "--image-size", "32")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("flags, advice", [
    (["--image-size", "40"], "--image-size 40 does not match the 32x32 cifar10 images, which --augment cifar keeps as stored: "
                             "pass --image-size 32"),
    (["--augment", "imagenet", "--image-size", "40"], "--image-size 40 is larger than the 32x32 cifar10 images that --augment "
                                                      "imagenet crops from: pass --image-size 32 or less, or --dataset imagefolder"),
])  # fmt: skip
def test_an_image_size_the_stored_images_cannot_give_is_refused(flags, advice, cifar_image_folder, tmp_path, run_here):
    line = refused(run_here("train.cifar", *small_run(cifar_image_folder, tmp_path, "--batch-size", "8", *flags)))
    assert line.startswith(f"train.cifar: {advice}")


# A missing directory is refused as the README's archive name is: -m slow.
@pytest.mark.parametrize("name", ["empty", "missing", "cifar-10-python.tar.gz"])
def test_data_not_found_says_the_cause_first_in_a_short_line(tmp_path, name, run_here):
    data_dir = tmp_path / name
    download = "; without --data-dir it is downloaded."
    if name == "empty":
        data_dir.mkdir()
        cause = f"No cifar10 'train' data found in --data-dir {data_dir}{download}"
    else:  # a missing path; the README's first command without the archive gives a file name, not a directory
        cause = f"No cifar10 'train' data: --data-dir {data_dir} does not exist{download}"
    done = run_here("train.cifar", "--data-dir", str(data_dir), "--workdir", str(tmp_path / "run"))
    line = refused(done, lines=3)
    assert line == f"train.cifar: {cause}"
    lines = ours(done.stderr)
    assert len(lines) == 3 and all(len(n.replace(str(data_dir), "")) <= 120 for n in lines), lines  # short, but for paths
    assert lines[1].startswith(f"  Looked in {data_dir}") and lines[2].startswith("  Pass --data-dir cifar-10-python.tar.gz ")
    if name != "empty":  # a missing path is not searched as a directory
        assert lines[1] == f"  Looked in {data_dir} (does not exist)."


def test_a_corrupt_image_names_the_file(tmp_path, run_here):
    folder = tmp_path / "imgs"
    for split, count in (("train", 8), ("test", 4)):
        for i in range(count):
            (folder / split / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(folder / split / f"c{i % 2}" / f"{i}.jpg")
    bad = folder / "train" / "c1" / "3.jpg"
    bad.write_bytes(bad.read_bytes()[:100])  # truncated
    line = refused(run_here("train.cifar", *small_run(folder, tmp_path, "--dataset", "imagefolder")))
    assert line.startswith(f"train.cifar: cannot read image {bad}: ")
    assert line.endswith(" (a truncated or corrupt image? replace or delete it)")


def test_a_folder_with_two_classes_is_not_cifar10(tmp_path, run_here):
    folder = tmp_path / "cats_and_dogs"
    for split, count in (("train", 8), ("test", 4)):
        for i in range(count):
            (folder / split / ("cat", "dog")[i % 2]).mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((32, 32, 3), i, np.uint8)).save(folder / split / ("cat", "dog")[i % 2] / f"{i}.png")
    line = refused(run_here("train.cifar", *small_run(folder, tmp_path)))
    assert line == (f"train.cifar: {folder} has 2 classes, but cifar10 has 10: pass --dataset imagefolder to train on it "
                    "as it is, or point --data-dir at the dataset")  # fmt: skip
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, line", [
    (["--dim", "0"], "argument --dim: dim must be >= 1, got 0"),
    (["--dim", "-5", "--model", "resnet18"], "argument --dim: dim must be >= 1, got -5"),
    (["--depth", "0"], "argument --depth: depth must be >= 1, got 0"),
    (["--patch-size", "0"], "argument --patch-size: patch_size must be >= 1 and divide --image-size 32, got 0"),
    (["--weight-decay", "-1"], "argument --weight-decay: weight_decay must be >= 0, got -1.0"),
    (["--min-lr", "0.01"], "argument --min-lr: min_lr must be in [0, --lr 0.001], got 0.01"),
    (["--min-lr=-1e-6"], "argument --min-lr: min_lr must be in [0, --lr 0.001], got -1e-06"),
    (["--lr", "inf"], "argument --lr: lr must be a finite number, got inf"),
    (["--warmup-epochs", "nan"], "argument --warmup-epochs: warmup_epochs must be a finite number, got nan"),
])  # fmt: skip
def test_model_size_and_optimizer_flags_are_checked_before_anything_starts(flags, line, tmp_path):
    workdir = tmp_path / "run"
    done = run_cli("train.cifar", *flags, "--data-dir", str(tmp_path / "no-data"), "--workdir", str(workdir), home=tmp_path)
    assert refused(done) == f"train.cifar: {line} (see --help)"
    assert not workdir.exists()


@pytest.mark.parametrize("module", ["train.cifar", "train.imagenet", "train.plot"])
def test_help_keeps_the_descriptions_lines(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    doc = __import__(module, fromlist=["_"]).__doc__
    lines = done.stdout.splitlines()
    for expected in doc.strip().splitlines():  # each line as written, e.g. one example command per line
        assert expected in lines, expected


@pytest.mark.parametrize("module", ["train.cifar", "train.imagenet", "train.lm"])
def test_help_ends_its_description_with_the_exit_codes_all_trainers_share(module):
    from train.cli import EXIT_CODES

    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    description = done.stdout[: done.stdout.index("\noptions:")]
    assert description.endswith("\n" + EXIT_CODES), description


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_data_is_read_stops_with_one_line(signum, cifar_image_folder, tmp_path):
    # One "image" is a FIFO: the reader blocks in it until the test has sent the signal, so the
    # signal lands while the data is being read, every time, without a large archive.
    folder = tmp_path / "data"
    shutil.copytree(cifar_image_folder / "cifar10", folder / "cifar10")
    fifo = folder / "cifar10" / "train" / "class9" / "9999.png"
    os.mkfifo(fifo)
    process = subprocess.Popen([sys.executable, "-m", "train.cifar", *small_run(folder, tmp_path)], env=cli_env(tmp_path), cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while True:  # opening the FIFO for writing succeeds once the reader has it open
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
    try:
        process.send_signal(signum)
        # The FIFO may be read by a decoding thread that the main thread waits for, and the signal
        # may land in that thread: then the main thread sees it only once that read ends. End it
        # as a real file's read would end, with a whole image, after the signal was sent.
        time.sleep(1)
        image = next(p for p in sorted((folder / "cifar10" / "train" / "class9").glob("*.png")) if p != fifo)
        with contextlib.suppress(BrokenPipeError):  # usually the reader has stopped already
            os.write(writer, image.read_bytes())
    finally:
        os.close(writer)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signum and "Traceback" not in stderr, stderr
    assert ours(stderr) == [f"train.cifar: stopped by {signal.Signals(signum).name}; no checkpoint to resume from: run it again"]
    assert stdout == "" and not (tmp_path / "run").exists()
    cache = folder / "cache"
    assert not cache.exists() or [n for n in os.listdir(cache) if n.startswith(".tmp")] == []  # no half-written entry
