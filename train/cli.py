"""What ``python -m train.cifar`` and ``python -m train.imagenet`` share: flags -> config -> train."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Sequence

from train import run_dir
from train.config import TrainConfig, UsageError, parse, parse_processes

# The end of every training CLI's --help (train.cifar, train.imagenet, train.lm): they exit alike.
EXIT_CODES = """\
Exit codes: 0 done (or nothing left to do); 2 the run cannot start or go on as asked: a bad flag,
data that cannot be found or read, a damaged file in the workdir (a short message on stderr, no
traceback); 128 + signal number when SIGINT/SIGTERM stopped it: in training after a checkpoint
(--resume continues it bit for bit), before (JAX starting, the data being prepared) with one line
on stderr; 1 anything else, with its traceback (a NaN or infinite loss names its step).
"""


def with_exit_codes(description: str) -> str:
    """``description`` (a CLI's module docstring) followed by ``EXIT_CODES``, for its --help."""
    return f"{description.rstrip()}\n{EXIT_CODES}"


def main(prog: str, description: str, defaults: TrainConfig, datasets: Sequence[str], argv: Sequence[str] | None) -> int:
    """Run one training; returns the process exit code.

    ``EXIT_CODES`` says which (and ends ``description`` in --help).
    """
    config, workdir, overrides = parse(prog, with_exit_codes(description), defaults, datasets, argv)
    processes = parse_processes(prog, argv)
    return run_interruptible(prog, workdir, lambda: _run(prog, config, workdir, overrides, processes))


def run_interruptible(prog: str, workdir: str, run: Callable[[], int]) -> int:
    """``run()``'s exit code, or 128 + signal number with one line on stderr when SIGINT/SIGTERM
    arrives outside the training loop's own handlers (``train.stopping``): while JAX starts or the
    data is read and prepared. SIGTERM is handled as Ctrl-C, rather than dying silently."""
    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in (signal.SIGINT, signal.SIGTERM)}
    _received.clear()
    try:
        return run()
    except (KeyboardInterrupt, _Interrupted) as interrupt:
        signum = interrupt.signum if isinstance(interrupt, _Interrupted) else signal.SIGINT
        saved = run_dir.latest_checkpoint_step(workdir)
        after = ("no checkpoint to resume from: run it again" if saved is None
                 else f"its last checkpoint is step {saved}: continue with --resume")  # fmt: skip
        print(f"{prog}: stopped by {signal.Signals(signum).name}; {after}", file=sys.stderr)
        return 128 + signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def refused(prog: str, error: Exception) -> int:
    """Exit code 2 with ``error`` as one line on stderr: the run cannot go on as configured (a flag,
    the data, damaged records). A signal whose exception was swallowed meanwhile stops the run instead."""
    if _received:  # raised inside a callback that swallowed it (jax's gc callback): it stops the run
        raise _Interrupted(_received[0]) from None
    print(f"{prog}: {error}", file=sys.stderr)
    return 2


def _run(prog: str, config, workdir: str, overrides: list[str], processes) -> int:
    if config.resume:
        done = run_dir.finished_at(workdir, config.steps, config.epochs)
        if done is not None:
            print(f"{prog}: the run in {workdir} already finished at step {done}; nothing to do "
                  f"(raise --epochs or --steps to train further)")  # fmt: skip
            return 0
        if overrides:
            print(f"{prog}: resuming {workdir} with its config.json, changing {', '.join(overrides)}")
    # Imported after parsing, so --help and flag errors do not wait for JAX to start.
    from train.data import DataError
    from train.loop import train_and_evaluate
    from train.sharding import join_processes

    join_processes(processes)  # before anything starts JAX's backends
    try:
        result = train_and_evaluate(config, workdir)
    except (DataError, UsageError, run_dir.DamagedRecords, run_dir.DamagedConfig) as error:
        return refused(prog, error)
    return 0 if result["stopped_by"] is None else 128 + result["stopped_by"]


# Signals received outside the training loop. Python runs a signal's handler wherever the main
# thread is, also inside a callback (jax's gc callback) that swallows what it raises: the record
# lets the run stop at its next error or exit instead of carrying on as if nothing arrived.
_received: list[int] = []


class _Interrupted(BaseException):
    """SIGINT or SIGTERM outside the training loop (raised as Ctrl-C raises KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum, frame):
    _received.append(signum)
    raise _Interrupted(signum)
