"""Stopping a run on SIGINT/SIGTERM after the step in flight, at the same step on every process.

``stop_on_signals()`` installs the handlers for the duration of a run and yields a ``StopRequest``;
the loop asks ``request.agreed()`` after each step (and each evaluation batch) and, once it answers
a signal, saves a checkpoint and stops. With several processes the answer is the same on all of
them (any process's signal stops every one): each process must take the same path through the
collectives of the steps, evaluations and checkpoints, or the others wait forever.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from train import metrics


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Set by the first SIGINT/SIGTERM (a second one quits the process: ``stop_on_signals``)."""

    def __init__(self):
        self.signal: int | None = None  # this process's, as received

    def agreed(self) -> int | None:
        """The signal that stops the run, or None, agreed by all processes: call it at the same
        points on every process (with several, it is a small all-gather)."""
        if jax.process_count() == 1:
            return self.signal
        # Only the gathered values decide, so a signal arriving during the gather is seen by every
        # process at the next call, not by this one alone now.
        return int(np.max(multihost_utils.process_allgather(np.int32(self.signal or 0)))) or None

    def __call__(self, signum, frame):
        if self.signal is not None:  # the watcher of stop_on_signals quits on this one
            return
        self.signal = signum
        metrics.say_from_signal_handler(f"{signal.Signals(signum).name}: stopping after the step in flight, then saving a checkpoint "
                    "(an evaluation under way is dropped and redone by --resume; a second signal quits at once, "
                    "without a checkpoint)")  # fmt: skip


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Handlers for the duration of a run, and a watcher thread that quits the process at once
    (exit 128 + signal, no checkpoint) on a second signal."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield request
        return
    previous = {s: signal.signal(s, request) for s in STOP_SIGNALS}
    # Python runs a handler only between bytecodes, so two signals arriving while a step runs in
    # XLA make one call of it; the wakeup fd receives one byte per signal, as it arrives.
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_quit_on_second_signal, args=(read_fd,), daemon=True, name="second-signal")
    watcher.start()
    try:
        yield request
    finally:
        signal.set_wakeup_fd(previous_wakeup)
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.close(write_fd)  # the watcher reads end-of-file and returns
        watcher.join()
        os.close(read_fd)


def _quit_on_second_signal(read_fd: int) -> None:
    received = 0
    while byte := os.read(read_fd, 1):
        if byte[0] in STOP_SIGNALS:
            received += 1
        if received == 2:
            name = signal.Signals(byte[0]).name
            metrics.say_from_signal_handler(f"{name} again: quitting at once, without a checkpoint")
            os._exit(128 + byte[0])
