"""A call's array arguments apart from the rest, for tracing it with ``jax.make_jaxpr``: array
leaves become the trace's inputs, other leaves (``train=True``, ``mutable=[...]``, modules) stay
the Python values they were. ``rewrite.lean_graph.lean_call`` and ``ops.head_loss``'s look at a
loss function both trace calls so."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np


def split_arrays(args: tuple, kwargs: dict) -> tuple[list[Any], Callable[[Sequence[Any]], tuple[tuple, dict]]]:
    """``(arrays, rebuild)``: the array leaves of ``(args, kwargs)`` in order, and ``rebuild(arrays)
    -> (args, kwargs)`` with those (e.g. tracers) in their places and every other leaf as it was."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    is_array = [isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves]

    def rebuild(arrays: Sequence[Any]) -> tuple[tuple, dict]:
        it = iter(arrays)
        return jax.tree.unflatten(treedef, [next(it) if a else leaf for leaf, a in zip(leaves, is_array)])

    return [leaf for leaf, a in zip(leaves, is_array) if a], rebuild
