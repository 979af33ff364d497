"""What a run's workdir holds, read without JAX (the CLI checks it before JAX starts).

* ``config.json``: ``{"config": TrainConfig fields, "run": facts such as steps_per_epoch}``,
  written by ``train.loop`` when a run starts;
* ``checkpoints/<step>/``: Orbax checkpoints, one directory per step, named by the step number;
* ``metrics.jsonl``: one JSON record per line (``train.metrics``).
"""

from __future__ import annotations

import json
import os
from typing import Any


def config_path(workdir: str) -> str:
    return os.path.join(workdir, "config.json")


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(workdir, "checkpoints")


def read_saved(workdir: str) -> dict[str, Any] | None:
    """``config.json`` as written by the run (``{"config": ..., "run": ...}``), or None."""
    if not os.path.exists(config_path(workdir)):
        return None
    with open(config_path(workdir)) as f:
        return json.load(f)


def latest_checkpoint_step(workdir: str) -> int | None:
    """The newest finished checkpoint's step (Orbax writes into a temporary name, then renames)."""
    directory = checkpoint_dir(workdir)
    steps = [int(n) for n in os.listdir(directory) if n.isdigit()] if os.path.isdir(directory) else []
    return max(steps, default=None)


def read_records(workdir: str) -> list[dict[str, Any]]:
    """The records of ``workdir/metrics.jsonl``; ``FileNotFoundError`` names the missing file."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics in {workdir}: {path} does not exist")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def stop_step(steps: int | None, epochs: int, steps_per_epoch: int) -> int:
    """The step a run ends at: ``steps`` if given, capped at ``epochs`` whole epochs."""
    total = epochs * steps_per_epoch
    return min(steps or total, total)


def finished_at(workdir: str, steps: int | None, epochs: int) -> int | None:
    """The step a finished run in ``workdir`` ended at (its checkpoint and final evaluation are
    written), or None when there is something left to do (or no run)."""
    saved, step = read_saved(workdir), latest_checkpoint_step(workdir)
    if saved is None or step is None:
        return None
    if step < stop_step(steps, epochs, saved["run"]["steps_per_epoch"]):
        return None
    try:
        evaluated = {r["step"] for r in read_records(workdir) if r.get("kind") == "eval"}
    except FileNotFoundError:
        return None
    return step if step in evaluated else None
