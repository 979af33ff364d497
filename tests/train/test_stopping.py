"""train/stopping.py: a stop signal that arrives while stdout is being written still stops cleanly; a
second signal quits at once."""

import io
import os
import signal
import subprocess
import sys
import time

from train import metrics, stopping

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _SignalDuringWrite(io.FileIO):
    """A file whose first write runs ``hook`` inside it, as a signal arriving mid-flush would."""

    hook = None

    def write(self, data):
        hook, self.hook = self.hook, None
        if hook:
            hook()
        return super().write(data)


def test_signal_arriving_during_a_stdout_write_is_reported_not_raised(monkeypatch):
    read_fd, write_fd = os.pipe()
    raw = _SignalDuringWrite(write_fd, "w")
    stdout = io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", stdout)
    request = stopping.StopRequest()
    raw.hook = lambda: request(signal.SIGINT, None)  # a buffered print here raised "reentrant call"
    metrics.say("kind=train step=3")
    stdout.close()
    with os.fdopen(read_fd) as f:
        lines = f.read().splitlines()
    assert request.signal == signal.SIGINT
    assert lines[0].startswith("SIGINT: stopping after the step in flight, then saving a checkpoint"), lines
    assert lines[1] == "kind=train step=3"


def test_a_second_signal_quits_at_once_without_a_checkpoint(cifar_image_folder, tmp_path):
    workdir = tmp_path / "run"
    flags = ["--data-dir", str(cifar_image_folder), "--cache-dir", str(cifar_image_folder / "cache"), "--workdir", str(workdir),
             "--batch-size", "8", "--dim", "16", "--depth", "1", "--log-every", "1"]  # 500 steps: far longer than the test
    env = {**os.environ, "HOME": str(tmp_path / "home"), "TFDS_DATA_DIR": str(tmp_path / "tfds"), "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen([sys.executable, "-m", "train.cifar", *flags], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines = []
    while sum("kind=train" in line for line in lines) < 3:  # training is under way
        lines.append(process.stdout.readline())
        assert lines[-1], "".join(lines) + process.stderr.read()
    # Python runs its handler once for signals that arrive while a step runs in XLA; the pause only
    # keeps the kernel from merging the two into one pending signal.
    process.send_signal(signal.SIGINT)
    time.sleep(0.05)
    sent = time.perf_counter()
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGINT, stdout + stderr
    assert "SIGINT again: quitting at once, without a checkpoint" in stdout
    assert "run summary" not in stdout and "Traceback" not in stderr, stdout + stderr
    assert time.perf_counter() - sent < 5
