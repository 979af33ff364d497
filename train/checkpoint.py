"""Orbax checkpoints of the train state: a plain dict ``{"step", "params", "opt_state"}``.

The step is all a resumed run needs besides the arrays: the epoch and the batch within it follow
from it, and the data order is a function of (seed, epoch, batch), so a resumed run replays
exactly the batches the interrupted one would have seen.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpoints:
    """Checkpoints under ``directory`` (one sub-directory per step), the newest ``keep`` kept.

    Saves are synchronous: the next train step donates (overwrites) the state's buffers, so a save
    must not read them in the background. ``directory`` is created by the first save, so a run that
    fails before one leaves no empty checkpoint directory behind.
    """

    def __init__(self, directory: str, keep: int = 2):
        self._directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=False, enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self._directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any) -> None:
        """Write ``state`` as checkpoint ``step`` (a no-op if that step is already saved)."""
        if step not in self._manager.all_steps():
            os.makedirs(self._directory, exist_ok=True)
            self._manager.save(step, args=ocp.args.StandardSave(state), force=True)

    def restore(self, like: Any, step: int | None = None) -> Any:
        """Checkpoint ``step`` (default: the latest) with the structure, dtypes and shardings of ``like``.

        ``like`` may hold arrays or ``jax.ShapeDtypeStruct`` with a ``sharding``.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self._manager.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        self._manager.close()
