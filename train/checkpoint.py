"""Orbax checkpoints of the train state: a plain dict ``{"step", "params", "opt_state"}``.

The step is all a resumed run needs besides the arrays: the epoch and the batch within it follow
from it, and the data order is a function of (seed, epoch, batch), so a resumed run replays
exactly the batches the interrupted one would have seen.

A checkpoint damaged after it was written (a cut-off copy, a full disk, a bad block) is found
before Orbax reads it (``checkpoint_damage``): ``Checkpoints.restore_newest_intact`` resumes from
the newest intact one and moves the damaged newer ones to ``damaged_checkpoints/`` beside the
checkpoint directory, so the resumed run can write those steps again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
import tensorstore as ts

from train import sharding
from train.settings import UsageError

# Orbax's names: the commit metadata of a checkpoint, and the directory of the one item we save.
_METADATA = "_CHECKPOINT_METADATA"
_ITEM = "default"


class NoIntactCheckpoint(UsageError):
    """Every checkpoint ``--resume`` could start from is damaged; the message names each and why."""


class Checkpoints:
    """Checkpoints under ``directory`` (one sub-directory per step), the newest ``keep`` kept.

    Saves are synchronous: the next train step donates (overwrites) the state's buffers, so a save
    must not read them in the background. ``directory`` is created by the first save, so a run that
    fails before one leaves no empty checkpoint directory behind.
    """

    def __init__(self, directory: str, keep: int = 2):
        self._directory = os.path.abspath(directory)
        self._aside = os.path.join(os.path.dirname(self._directory), "damaged_checkpoints")
        self._keep = keep
        self._orbax: ocp.CheckpointManager | None = None

    @property
    def _manager(self) -> ocp.CheckpointManager:
        # Started on first use: Orbax reads every checkpoint's metadata when it starts, and logs
        # (absl, on stderr) about a damaged one that restore_newest_intact is about to set aside.
        if self._orbax is None:
            options = ocp.CheckpointManagerOptions(max_to_keep=self._keep, create=False, enable_async_checkpointing=False)
            self._orbax = ocp.CheckpointManager(self._directory, options=options)
        return self._orbax

    def steps(self) -> list[int]:
        """The saved steps, oldest first (Orbax writes into a temporary name, then renames)."""
        names = os.listdir(self._directory) if os.path.isdir(self._directory) else []
        return sorted(int(n) for n in names if n.isdigit())

    def latest_step(self) -> int | None:
        return max(self.steps(), default=None)

    def save(self, step: int, state: Any) -> None:
        """Write ``state`` as checkpoint ``step`` (a no-op if that step is already saved)."""
        if step not in self.steps():
            os.makedirs(self._directory, exist_ok=True)
            self._manager.save(step, args=ocp.args.StandardSave(state), force=True)

    def restore(self, like: Any, step: int | None = None) -> Any:
        """Checkpoint ``step`` (default: the latest) with the structure, dtypes and shardings of ``like``.

        ``like`` may hold arrays or ``jax.ShapeDtypeStruct`` with a ``sharding``.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self._directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def restore_newest_intact(self, like: Any, note: Callable[[str], None]) -> Any:
        """``restore(like)`` of the newest checkpoint ``checkpoint_damage`` and Orbax accept.

        Damaged newer checkpoints are moved to ``damaged_checkpoints/<step>`` beside the checkpoint
        directory and ``note`` gets one line: which steps, why, and the step resumed from. Raises
        ``NoIntactCheckpoint`` (moving nothing more) when no checkpoint is intact.
        """
        skipped: list[tuple[int, str]] = []
        moved: dict[int, str] = {}
        for step in reversed(self.steps()):
            why = checkpoint_damage(os.path.join(self._directory, str(step)))
            if why is None:
                moved.update(self._set_aside([s for s, _ in skipped if s not in moved]))
                try:
                    state = self.restore(like, step)
                except (ValueError, OSError) as error:  # what Orbax raises for a file checkpoint_damage does not read
                    why = f"Orbax cannot restore it: {_detail(error)}"
                else:
                    if skipped:
                        note(f"{_listed(skipped)}: moved to {self._aside}; resuming from step {step}")
                    return state
            skipped.append((step, why))
        aside = f" (moved to {self._aside})" if moved else ""
        raise NoIntactCheckpoint(f"no intact checkpoint in {self._directory} to resume from: {_listed(skipped)}{aside}; "
                                 "pass another --workdir to train afresh")  # fmt: skip

    def _set_aside(self, steps: list[int]) -> dict[int, str]:
        """Move ``steps`` out of the checkpoint directory (process 0; every process waits for it)."""
        moved = {}
        for step in steps:
            target, n = os.path.join(self._aside, str(step)), 1
            while os.path.exists(target):  # damaged again after an earlier resume: keep both
                n += 1
                target = os.path.join(self._aside, f"{step}-{n}")
            if jax.process_index() == 0:
                os.makedirs(self._aside, exist_ok=True)
                os.rename(os.path.join(self._directory, str(step)), target)
            moved[step] = target
        sharding.sync_processes("damaged checkpoints set aside")
        if moved and self._orbax is not None:
            self._orbax.reload()
        return moved

    def close(self) -> None:
        if self._orbax is not None:
            self._orbax.close()


def checkpoint_damage(path: str) -> str | None:
    """Why the checkpoint directory ``path`` cannot be trusted, or None.

    Orbax's commit metadata must be a JSON object, and every array must read back whole, one at a
    time (TensorStore checks each stored value's size and its compression's frames; a flipped bit
    inside a value goes unnoticed). Read one by one, a damaged array fails alone, where Orbax's
    concurrent reads would leave others in flight that print tracebacks after the error.
    """
    try:
        with open(os.path.join(path, _METADATA), "rb") as f:
            metadata = json.loads(f.read())
    except FileNotFoundError:
        return f"its {_METADATA} is missing"
    except ValueError:  # not JSON, or not UTF-8
        metadata = None
    if not isinstance(metadata, dict):
        return f"its {_METADATA} is not Orbax's JSON"
    store = {"driver": "ocdbt", "base": f"file://{os.path.join(path, _ITEM)}/"}
    try:
        keys = ts.KvStore.open(store).result().list().result()
    except ValueError as error:
        return f"its array database cannot be read: {_detail(error)}"
    names = sorted(key[: -len(b"/.zarray")].decode() for key in keys if key.endswith(b"/.zarray"))
    if not names:
        return "it holds no arrays"
    for name in names:
        try:
            ts.open({"driver": "zarr", "kvstore": {**store, "path": f"{name}/"}}, open=True, read=True).result().read().result()
        except ValueError as error:
            return f"its array {name} cannot be read: {_detail(error)}"
    return None


def _detail(error: Exception) -> str:
    """The last clause of a TensorStore or Orbax error (what is wrong, after the paths), short."""
    line = (str(error).splitlines() or [type(error).__name__])[0]
    line = line.rsplit('": ', 1)[-1]
    return line if len(line) <= 120 else line[:117] + "..."


def _listed(skipped: list[tuple[int, str]]) -> str:
    return "; ".join(f"checkpoint {step} is damaged ({why})" for step, why in skipped)
