"""Per-layer sensitivity: how far each layer's parameter gradient moves at each sparsity."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from bsr_jax.rewrite.schedules import layer_sparsity


# The parameter whose gradient pruning approximates, per bsr_jax layer (Dense, Affine, LayerScale);
# biases and shifts have exact gradients and would only dilute the error.
PRUNED_PARAMS = ("kernel", "alpha", "scale")


def layer_params(params: Any, path: str) -> Any:
    """The parameters of the layer at ``path`` ('/'-joined module names) in ``params``."""
    for name in path.split("/"):
        params = params[name]
    return params


def pruned_param(params: Any, path: str) -> jax.Array:
    """The ``kernel``, ``alpha`` or ``scale`` leaf of the layer at ``path`` in ``params``."""
    layer = layer_params(params, path)
    return next(layer[name] for name in PRUNED_PARAMS if name in layer)


def relative_error(got: Any, want: Any, path: str) -> float:
    """``||got - want|| / ||want||`` of the pruned parameter's gradient of layer ``path``."""
    g, w = pruned_param(got, path).astype(jnp.float32), pruned_param(want, path).astype(jnp.float32)
    return float(jnp.linalg.norm(g - w) / jnp.maximum(jnp.linalg.norm(w), 1e-30))


def gradient_sensitivity(
    loss_fn: Callable[..., jax.Array],
    params: Any,
    *args: Any,
    paths: Sequence[str],
    sparsities: Sequence[float],
) -> dict[str, dict[float, float]]:
    """Relative error ``||g_s - g_0|| / ||g_0||`` of each layer's pruned-parameter gradient.

    The parameter is the one pruning approximates: a Dense ``kernel``, an Affine ``alpha``, a
    LayerScale ``scale`` (biases and shifts are exact).

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

    reference = grads_at(0.0)
    report: dict[str, dict[float, float]] = {path: {} for path in paths}
    for sparsity in sparsities:
        grads = grads_at(sparsity)
        for path in paths:
            report[path][sparsity] = relative_error(grads, reference, path)
    return report
