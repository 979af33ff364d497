"""What a run's workdir holds, read without JAX (the CLI checks it before JAX starts).

* ``config.json``: ``{"config": TrainConfig fields, "run": facts such as steps_per_epoch}``,
  written by ``train.loop`` when a run starts;
* ``checkpoints/<step>/``: Orbax checkpoints, one directory per step, named by the step number;
* ``damaged_checkpoints/<step>/``: checkpoints ``--resume`` found damaged and set aside (``train.checkpoint``);
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


class DamagedConfig(ValueError):
    """``config.json`` is not what a run writes (cut off, overwritten, edited into invalid JSON); the
    message names the file, what is wrong and what to do. Nothing is guessed in its place."""


def read_saved(workdir: str) -> dict[str, Any] | None:
    """``config.json`` as written by the run (``{"config": ..., "run": ...}``), or None when there is
    none; ``DamagedConfig`` when it cannot be read as one."""
    path = config_path(workdir)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        text = f.read()
    try:
        saved = json.loads(text.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise DamagedConfig(_damaged(path, f"not UTF-8 text (byte {error.start})")) from None
    except json.JSONDecodeError as error:
        what = "empty" if not text.strip() else f"not valid JSON ({error.msg} at line {error.lineno} column {error.colno})"
        raise DamagedConfig(_damaged(path, what)) from None
    missing = [key for key in ("config", "run") if not isinstance(saved, dict) or not isinstance(saved.get(key), dict)]
    if missing:
        raise DamagedConfig(_damaged(path, f"not a run's config.json (no {' or '.join(repr(k) for k in missing)} object)"))
    return saved


def _damaged(path: str, what: str) -> str:
    return f"{path} is {what}: repair it, or pass another --workdir to train afresh"


def latest_checkpoint_step(workdir: str) -> int | None:
    """The newest finished checkpoint's step (Orbax writes into a temporary name, then renames)."""
    directory = checkpoint_dir(workdir)
    steps = [int(n) for n in os.listdir(directory) if n.isdigit()] if os.path.isdir(directory) else []
    return max(steps, default=None)


class DamagedRecords(ValueError):
    """A line of ``metrics.jsonl`` other than the last is not a JSON record; the message names the
    file and the line (something other than a cut-off write damaged it: it is not dropped silently)."""


def metrics_path(workdir: str) -> str:
    return os.path.join(workdir, "metrics.jsonl")


def read_records_and_damage(workdir: str) -> tuple[list[dict[str, Any]], str | None]:
    """The records of ``workdir/metrics.jsonl`` and a note on a partial last line, or None.

    A run cut off while appending a record (a crash, a full disk, a kill) leaves a partial last
    line; it is skipped (a resumed run rewrites the file without it) and the note says so, once,
    for the caller to print. A damaged line before the last raises ``DamagedRecords``;
    ``FileNotFoundError`` names a missing file.
    """
    path = metrics_path(workdir)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics in {workdir}: {path} does not exist")
    with open(path, "rb") as f:  # bytes: a cut-off write may end inside a UTF-8 character
        lines = [(number, line) for number, line in enumerate(f.read().split(b"\n"), 1) if line.strip()]
    records = []
    for i, (number, line) in enumerate(lines):
        try:
            record = json.loads(line.decode("utf-8", errors="replace"))
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif i < len(lines) - 1:
            raise DamagedRecords(f"{path}: line {number} is not a JSON record "
                                 f"({_excerpt(line)}); delete or repair that line")  # fmt: skip
        else:
            return records, (f"{path}: skipped its last line, a record cut off when it was written "
                             f"({_excerpt(line)}; {len(line)} bytes)")  # fmt: skip
    return records, None


def read_records(workdir: str) -> list[dict[str, Any]]:
    """``read_records_and_damage`` without the note (a partial last line is skipped silently)."""
    return read_records_and_damage(workdir)[0]


def _excerpt(line: bytes) -> str:
    text = line.decode("utf-8", errors="replace").replace("\0", "\\0")
    return repr(text if len(text) <= 40 else text[:37] + "...")


def stop_step(steps: int | None, epochs: int, steps_per_epoch: int) -> int:
    """The step a run ends at: ``steps`` if given, capped at ``epochs`` whole epochs."""
    total = epochs * steps_per_epoch
    return min(steps or total, total)


def finished_at(workdir: str, steps: int | None, epochs: int) -> int | None:
    """The step a finished run in ``workdir`` ended at (its checkpoint and final evaluation are
    written), or None when there is something left to do (or no run)."""
    saved = read_saved(workdir)
    return None if saved is None else finished_at_step(workdir, stop_step(steps, epochs, saved["run"]["steps_per_epoch"]))


def finished_at_step(workdir: str, stop_step: int) -> int | None:
    """``finished_at`` for a run that ends at ``stop_step``: its last checkpoint, if at or past
    ``stop_step`` and evaluated, else None."""
    step = latest_checkpoint_step(workdir)
    if step is None or step < stop_step:
        return None
    return step if step in evaluated_steps(workdir) else None


def evaluated_steps(workdir: str) -> set[int]:
    """The steps with an eval record in ``workdir``'s metrics (none where it has no metrics yet)."""
    try:
        return {r["step"] for r in read_records(workdir) if r.get("kind") == "eval"}
    except FileNotFoundError:
        return set()
