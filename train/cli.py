"""What ``python -m train.cifar`` and ``python -m train.imagenet`` share: flags -> config -> train."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from train.config import TrainConfig, UsageError, parse


def main(prog: str, description: str, defaults: TrainConfig, datasets: Sequence[str], argv: Sequence[str] | None) -> int:
    """Run one training; returns the process exit code.

    0 when the run finished, 2 (with the message on stderr, no traceback) when the data cannot be
    found or a flag is invalid, 128 + signal number when SIGINT/SIGTERM stopped it (after a
    checkpoint; ``--resume`` continues it).
    """
    config, workdir = parse(prog, description, defaults, datasets, argv)
    # Imported after parsing, so --help and flag errors do not wait for JAX to start.
    from train.data import DataNotFoundError
    from train.loop import train_and_evaluate

    try:
        result = train_and_evaluate(config, workdir)
    except (DataNotFoundError, UsageError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    return 0 if result["stopped_by"] is None else 128 + result["stopped_by"]
