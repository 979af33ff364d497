"""Sparsity schedules and per-layer sparsity for any Flax model built from bsr_jax layers.

Capacities are static shapes, so every distinct sparsity compiles its own program. Schedules here
therefore return a few discrete levels, and per-layer rules are hashable tuples that can be a
static argument of a jitted step.

    rules = (("*/fc2", 0.9), ("block0/*", 0.0), ("*", 0.7))     # first match wins
    with layer_sparsity(rules):
        logits = model.apply(params, images)                     # inside jit, at trace time
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence

import flax.linen as nn
import jax

from bsr_jax.storage.format import check_sparsity
from bsr_jax.ops.layers import PrunedModule
from bsr_jax.core.layer_choice import module_path
from bsr_jax.rewrite.rules import first_match

SparsityRules = tuple[tuple[str, float], ...]


def warmup_fraction(step: int, *, warmup_steps: int, levels: int = 4) -> float:
    """Fraction of the target sparsity at ``step``: 0 until ``warmup_steps / levels``, then
    ``levels`` equal stairs up to 1, reached at ``warmup_steps`` and kept after."""
    if warmup_steps < 0 or levels < 1:
        raise ValueError(f"warmup_steps must be >= 0 and levels >= 1, got {warmup_steps} and {levels}")
    if step >= warmup_steps:
        return 1.0
    return math.floor(levels * step / warmup_steps) / levels


def warmup_sparsity(step: int, *, target: float, warmup_steps: int, levels: int = 4) -> float:
    """Sparsity at ``step``: ``target`` times ``warmup_fraction``; ``levels + 1`` distinct values."""
    check_sparsity(target)
    return round(target * warmup_fraction(step, warmup_steps=warmup_steps, levels=levels), 6)


def scale_rules(rules: SparsityRules, fraction: float) -> SparsityRules:
    """Every rule's sparsity times ``fraction`` (e.g. a warmup ramp of per-layer targets)."""
    return tuple((pattern, round(sparsity * fraction, 6)) for pattern, sparsity in rules)


def layer_sparsity(rules: SparsityRules | Sequence[tuple[str, float]]) -> contextlib.AbstractContextManager[None]:
    """Within the context, each bsr_jax layer whose module path ('/'-joined, e.g.
    ``"block3/fc1"``) matches a pattern (``fnmatch``) runs at that pattern's sparsity; the first
    matching rule wins and unmatched layers keep their own setting. Applies at trace time, so use
    it inside the jitted function (with the rules as a static value).

    Raises ``ValueError`` here, when the context is made, for a rule that is not a
    ``(pattern, sparsity)`` pair or a sparsity outside [0, 1).
    """
    return _layer_sparsity(_check_rules(rules))


def _check_rules(rules: Iterable[tuple[str, float]]) -> SparsityRules:
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
        raise ValueError(f"layer_sparsity rules must be a sequence of (pattern, sparsity) pairs, got {rules!r}")
    checked = []
    for rule in rules:
        if isinstance(rule, (str, bytes)) or not isinstance(rule, Sequence) or len(rule) != 2:
            raise ValueError(f"layer_sparsity rule {rule!r} must be a (pattern, sparsity) pair, e.g. ('*/fc2', 0.9)")
        pattern, sparsity = rule
        try:
            checked.append((str(pattern), check_sparsity(sparsity)))
        except ValueError:
            raise ValueError(
                f"layer_sparsity rule {tuple(rule)!r}: the sparsity must be a Python float in [0, 1), got {sparsity!r}"
            ) from None
    return tuple(checked)


@contextlib.contextmanager
def _layer_sparsity(rules: SparsityRules) -> Iterator[None]:
    def override(next_fun, args, kwargs, context):
        if isinstance(context.module, PrunedModule) and context.method_name == "__call__":
            i = first_match([pattern for pattern, _ in rules], module_path(context.module))
            if i is not None:
                kwargs = {**kwargs, "sparsity": rules[i][1]}
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(override):
        yield


def prunable_layer_paths(apply_fn, *args, **kwargs) -> list[str]:
    """Paths of the bsr_jax layers that ``apply_fn(*args, **kwargs)`` calls, in call order (traced only)."""
    paths: list[str] = []

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, PrunedModule) and context.method_name == "__call__":
            paths.append(module_path(context.module))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(apply_fn, *args, **kwargs)
    return list(dict.fromkeys(paths))
