"""Choosing an implementation by the platform a function is lowered for, not the host's.

``by_lowering_platform`` is ``lax.platform_dependent`` (one jitted function compiles for any target
from any host, e.g. ahead of time for a TPU on a CPU machine), except inside ``jax.shard_map``:
there the branches' results vary over different mesh axes, which ``platform_dependent``'s branches
may not, so the choice is by the host's platform (``jax.default_backend()``), and compiling for
another platform needs an explicit choice (e.g. ``backend=``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def by_lowering_platform(probe: jax.Array, default: Callable[..., Any], branches: dict[str, Callable[..., Any]], *operands: Any) -> Any:
    """``branches[platform](*operands)`` for the platform lowered for (``default`` for platforms not
    named); by the host's platform when ``probe`` varies over manual mesh axes (inside shard_map).
    Platform names are jax's lowering names: ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``."""
    if jax.typeof(probe).manual_axis_type.varying:
        host = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())  # jax calls CUDA/ROCm "gpu"
        return branches.get(host, default)(*operands)
    return jax.lax.platform_dependent(*operands, default=default, **branches)


# XLA:TPU tiles an array's two minor dimensions to (8, 128): an array 16 values wide takes 8x its
# bytes. Blocks whose rows are whole 128-lane tiles are laid out without padding as they are.
TPU_LANES = 128


def tpu_lane_dense(block: tuple[int, int]) -> bool:
    """Whether ``(bm, bk)`` blocks are a whole number of XLA:TPU lane tiles wide."""
    return block[1] % TPU_LANES == 0
