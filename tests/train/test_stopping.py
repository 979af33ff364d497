"""train/stopping.py: a stop signal that arrives while stdout is being written still stops cleanly."""

import io
import os
import signal
import sys

from train import metrics, stopping


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
