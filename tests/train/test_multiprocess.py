"""``python -m train.cifar`` over 2 processes x 2 host devices (``jax.distributed`` on localhost)
computes what 1 process x 4 devices does; process 0 alone prints and writes the logs.

The tolerances are benchmarks/speed/multiprocess.py's: the two layouts prune the same per-device shards,
and only the order in which the gradient all-reduce sums the devices' parts differs (float32).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import chex
import pytest

from benchmarks.speed.multiprocess import LOSS_TOLERANCE, STATE_TOLERANCE, TINY_RUN, final_state, free_port, launch, step_records
from tests import host_devices
from train import config as config_lib
from train.config import CIFAR_DEFAULTS, Processes


def test_process_flags_are_not_training_settings():
    flags = ["--coordinator", "node0:1234", "--num-processes", "2", "--process-id", "1", "--sparsity", "0.5"]
    config, _, _ = config_lib.parse("train.cifar", "doc", CIFAR_DEFAULTS, config_lib.DATASETS, flags)
    assert config == dataclasses.replace(CIFAR_DEFAULTS, sparsity=0.5)
    assert config_lib.parse_processes("train.cifar", flags) == Processes(coordinator="node0:1234", num_processes=2, process_id=1)
    assert config_lib.parse_processes("train.cifar", ["--sparsity", "0.5"]) == Processes()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-processes", "0"], "argument --num-processes: num_processes must be >= 1, got 0"),
        (["--num-processes", "2", "--coordinator", "node0:1234", "--process-id", "2"],
         "argument --process-id: process_id must be in [0, num_processes = 2), got 2"),
        (["--num-processes", "2"], "argument --coordinator: coordinator must be HOST:PORT, given exactly when num_processes > 1, got None"),
        (["--num-processes", "2", "--coordinator", "node0"],
         "argument --coordinator: coordinator must be HOST:PORT, given exactly when num_processes > 1, got 'node0'"),
        (["--coordinator", "node0:1234"],
         "argument --coordinator: coordinator must be HOST:PORT, given exactly when num_processes > 1, got 'node0:1234'"),
    ],
)  # fmt: skip
def test_bad_process_flags_exit_with_one_line_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        config_lib.parse_processes("train.cifar", flags)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"train.cifar: {message} (see --help)\n"


def run_both_layouts(cifar_image_folder, tmp_path, *extra: str):
    """The same run as 1 process x 4 devices and 2 processes x 2 devices, side by side."""
    env = {**os.environ, "HOME": str(tmp_path / "home"), "TFDS_DATA_DIR": str(tmp_path / "tfds")}
    env.pop("BSR_JAX_CACHE", None)

    def run(layout: str):
        processes, devices = map(int, layout.split("x"))
        flags = ["--data-dir", str(cifar_image_folder), "--cache-dir", str(cifar_image_folder / "cache"),
                 "--workdir", str(tmp_path / layout), *TINY_RUN, *extra]  # fmt: skip
        return launch(["-m", "train.cifar", *flags], processes, devices, env=env, timeout_s=240)

    with ThreadPoolExecutor(2) as pool:
        single, multi = pool.map(run, ("1x4", "2x2"))
    for done in (*single, *multi):
        assert done.returncode == 0, done.stdout + done.stderr
    return single, multi, tmp_path / "1x4", tmp_path / "2x2"


@pytest.mark.slow  # 25 s; with the other multi-process runs
def test_data_parallel_step_across_two_processes():
    script = os.path.join(os.path.dirname(__file__), "multiprocess_check.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    processes = launch([script], num_processes=2, devices_per_process=2, env=env, timeout_s=240)
    for index, done in enumerate(processes):
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"process {index}: all checks passed" in done.stdout


@pytest.mark.slow  # 3 CLI processes side by side: 39-52 s on 2 busy cores
def test_two_processes_match_one_process_with_the_same_devices(cifar_image_folder, tmp_path):
    (single,), (first, second), single_dir, multi_dir = run_both_layouts(cifar_image_folder, tmp_path, "--steps", "5")

    records = [step_records(str(w)) for w in (single_dir, multi_dir)]
    assert [(r["kind"], r["step"]) for r in records[1]] == [(r["kind"], r["step"]) for r in records[0]]
    assert [r["step"] for r in records[1]] == [1, 2, 3, 4, 5, 5]  # every step logged, then the evaluation
    numbers = [[{k: v for k, v in r.items() if k != "kind"} for r in rs] for rs in records]
    chex.assert_trees_all_close(numbers[1], numbers[0], **LOSS_TOLERANCE)
    chex.assert_trees_all_close(final_state(str(multi_dir)), final_state(str(single_dir)), **STATE_TOLERANCE)

    # One config.json (process 0's), which counts the 4 devices of both processes.
    assert (multi_dir / "config.json").read_text() == (single_dir / "config.json").read_text()
    assert json.loads((multi_dir / "config.json").read_text())["run"]["devices"] == 4
    assert os.listdir(multi_dir / "checkpoints") == ["5"]  # written once, collectively
    # Process 0 prints the records and the summary; process 1 prints none of them.
    assert "kind=eval" in first.stdout and f"run summary ({multi_dir})" in first.stdout
    assert "kind=" not in second.stdout and "run summary" not in second.stdout, second.stdout


@pytest.mark.slow  # 3 runs of 2 processes: 80 s on 2 busy cores
def test_resume_over_two_processes_continues_bit_for_bit(cifar_image_folder, tmp_path):
    env = {**os.environ, "HOME": str(tmp_path / "home"), "TFDS_DATA_DIR": str(tmp_path / "tfds")}
    flags = ["-m", "train.cifar", "--data-dir", str(cifar_image_folder), "--cache-dir", str(cifar_image_folder / "cache"), *TINY_RUN]

    def run(workdir: str, *extra: str) -> None:
        for done in launch([*flags, "--workdir", str(tmp_path / workdir), *extra], 2, 2, env=env, timeout_s=240):
            assert done.returncode == 0, done.stdout + done.stderr

    run("whole", "--steps", "5")
    run("resumed", "--steps", "3")
    run("resumed", "--steps", "5", "--resume")
    whole, resumed = (final_state(str(tmp_path / w)) for w in ("whole", "resumed"))
    chex.assert_trees_all_equal(resumed, whole)
    records = [[r for r in step_records(str(tmp_path / w)) if r["kind"] == "train"] for w in ("whole", "resumed")]
    assert records[1] == records[0]


@pytest.mark.slow  # 27 s on 2 busy cores
def test_a_signal_to_one_process_stops_both_at_the_same_step(cifar_image_folder, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": host_devices.xla_flags(2)}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    workdir = tmp_path / "run"
    flags = ["--data-dir", str(cifar_image_folder), "--cache-dir", str(cifar_image_folder / "cache"), "--workdir", str(workdir),
             *TINY_RUN, "--steps", "400", "--coordinator", f"localhost:{free_port()}", "--num-processes", "2"]  # fmt: skip
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    processes = []
    for i, log in enumerate(logs):
        with open(log, "w") as out:
            processes.append(subprocess.Popen([sys.executable, "-m", "train.cifar", *flags, "--process-id", str(i)],
                                              env=env, cwd=root, stdout=out, stderr=subprocess.STDOUT))  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while "kind=train step=2 " not in logs[0].read_text():
            assert time.monotonic() < deadline and processes[0].poll() is None, logs[0].read_text()
            time.sleep(0.2)
        processes[1].send_signal(signal.SIGTERM)  # process 1 only
        codes = [p.wait(timeout=120) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    assert codes == [128 + signal.SIGTERM] * 2, [log.read_text() for log in logs]
    (stopped_at,) = os.listdir(workdir / "checkpoints")  # one checkpoint, saved by both together
    assert 2 <= int(stopped_at) < 400
    last = step_records(str(workdir))[-1]
    assert (last["kind"], last["step"]) == ("train", int(stopped_at))
    assert f"stopped by SIGTERM at step {stopped_at}" in logs[0].read_text()
