"""Choosing an implementation by the platform a function is lowered for, not the host's.

``by_lowering_platform`` is ``lax.platform_dependent``: one jitted function compiles for any target
from any host (e.g. ahead of time for a TPU on a CPU machine), inside ``jax.shard_map`` too, where
each branch's results are made to vary over the same manual mesh axes (those its operands vary
over), as ``platform_dependent`` requires of its branches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from bsr_jax.core import sharding


def _varying_axes(tree: Any) -> frozenset[str]:
    return frozenset(a for leaf in jax.tree.leaves(tree) for a in jax.typeof(leaf).manual_axis_type.varying)


def _varying_over(axes: frozenset[str], fn: Callable[..., Any]) -> Callable[..., Any]:
    def branch(*operands):
        # A branch's result varies over no axis its operands do not (nothing here reads axis_index).
        return jax.tree.map(lambda a: sharding.vary_over(a, axes), fn(*operands))

    return branch


def by_lowering_platform(default: Callable[..., Any], branches: dict[str, Callable[..., Any]], *operands: Any) -> Any:
    """``branches[platform](*operands)`` for the platform lowered for (``default`` for platforms not
    named). Platform names are jax's lowering names: ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``."""
    axes = _varying_axes(operands)
    if axes:
        default, branches = _varying_over(axes, default), {k: _varying_over(axes, f) for k, f in branches.items()}
    return lax.platform_dependent(*operands, default=default, **branches)


# XLA:TPU tiles an array's two minor dimensions to (8, 128): an array 16 values wide takes 8x its
# bytes. Blocks whose rows are whole 128-lane tiles are laid out without padding as they are.
TPU_LANES = 128


def tpu_lane_dense(block: tuple[int, int]) -> bool:
    """Whether ``(bm, bk)`` blocks are a whole number of XLA:TPU lane tiles wide."""
    return block[1] % TPU_LANES == 0
