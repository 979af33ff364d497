"""What ``python -m train.cifar`` and ``python -m train.imagenet`` share: flags -> config -> train."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from train import run_dir
from train.config import TrainConfig, UsageError, parse, parse_processes


def main(prog: str, description: str, defaults: TrainConfig, datasets: Sequence[str], argv: Sequence[str] | None) -> int:
    """Run one training; returns the process exit code.

    0 when the run finished (or had finished before ``--resume``), 2 with a one-line message on
    stderr (no traceback) when a flag is invalid or the data cannot be found, read or downloaded,
    128 + signal number when SIGINT/SIGTERM stopped it (after a checkpoint; ``--resume``
    continues it).
    """
    config, workdir, overrides = parse(prog, description, defaults, datasets, argv)
    processes = parse_processes(prog, argv)
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
    except (DataError, UsageError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    return 0 if result["stopped_by"] is None else 128 + result["stopped_by"]
