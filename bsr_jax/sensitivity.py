"""Per-layer sensitivity: how far each layer's parameter gradient moves at each sparsity."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from bsr_jax.schedules import layer_sparsity


def _subtree(params: Any, path: str) -> Any:
    for name in path.split("/"):
        params = params[name]
    return params


def gradient_sensitivity(
    loss_fn: Callable[..., jax.Array],
    params: Any,
    *args: Any,
    paths: Sequence[str],
    sparsities: Sequence[float],
) -> dict[str, dict[float, float]]:
    """Relative error ``||g_s - g_0|| / ||g_0||`` of each layer's parameter gradient.

    Args:
      loss_fn: ``loss_fn(params, *args)`` applying a model built from bsr_jax layers.
      params: the model's variables; layer paths index ``params["params"]``.
      paths: layer paths to report (e.g. from ``schedules.prunable_layer_paths``).
      sparsities: values to measure, each applied to every layer at once.

    Because the forward pass and every input gradient are exact, a layer's gradient depends only
    on its own pruning: one backward pass per sparsity measures all layers, and the result equals
    pruning each layer alone. One compile per sparsity.
    """

    def grads_at(sparsity):
        def loss(p, *a):
            with layer_sparsity((("*", sparsity),)):
                return loss_fn(p, *a)

        return jax.jit(jax.grad(loss))(params, *args)["params"]

    def norm(tree):
        return float(jnp.sqrt(sum(jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in jax.tree.leaves(tree))))

    reference = grads_at(0.0)
    report: dict[str, dict[float, float]] = {path: {} for path in paths}
    for sparsity in sparsities:
        grads = grads_at(sparsity)
        for path in paths:
            want, got = _subtree(reference, path), _subtree(grads, path)
            report[path][sparsity] = norm(jax.tree.map(jnp.subtract, got, want)) / max(norm(want), 1e-30)
    return report
