"""Rules: which layer gets which compression, by module path. The one resolver of the library.

    rules = [Rule("*/MlpBlock_*/Dense_1", Pruning(0.9)), Rule("*/head", None), Rule("*", Pruning(0.7))]
    with use_rules(rules):
        model.apply(variables, x)          # at trace time, inside jit

A path is the '/'-joined names of a Flax module (``"Encoder/block0/MlpBlock_0/Dense_1"``), matched
with ``fnmatch`` globs; the first matching rule wins; a rule whose compression is ``None`` leaves
the layer dense; a layer no rule matches keeps its own options (``bsr_jax.Dense(...,
sparsity=0.7)``) or, routed by ``compress_model``, stays dense. A rule that matches no layer of a
traced call is an error naming it, so a typo never silently leaves a model dense.

Compressions: ``Pruning`` (any linear layer or convolution) and ``Pooling`` (convolutions only).
A layer a rule matches but cannot honour (a ``Pooling`` rule on a Dense layer, a conv
configuration the compressed convolution does not cover) stays dense and is reported with a
``UserWarning`` naming its path and why (``report_dense``), never silently.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax

from bsr_jax.format import PRUNING_OPTIONS, Pruning
from bsr_jax.pooling import Pooling

Compression = Pruning | Pooling
SHORTHAND_FIELDS = PRUNING_OPTIONS
NO_MATCH = object()  # lookup's answer when no rule is active or none matches


@dataclasses.dataclass(frozen=True)
class Rule:
    """``pattern``: an ``fnmatch`` glob over module paths; ``compression``: what matching layers
    keep for the backward pass (``None``: dense)."""

    pattern: str
    compression: Compression | None

    def __post_init__(self):
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"Rule pattern must be a non-empty string glob, got {self.pattern!r}")
        if self.compression is not None and not isinstance(self.compression, Compression):
            raise ValueError(f"Rule compression must be a bsr_jax.Pruning, a bsr_jax.Pooling or None, got {self.compression!r}")


def first_match(patterns: Sequence[str], path: str) -> int | None:
    """Index of the first ``fnmatch`` glob in ``patterns`` matching ``path``: the one matching rule."""
    return next((i for i, pattern in enumerate(patterns) if fnmatch.fnmatchcase(path, pattern)), None)


@dataclasses.dataclass
class _Active:
    rules: tuple[Rule, ...]
    matched: set[int]
    plan: list[LayerPlan] | None = None


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("bsr_jax_rules", default=None)


def module_path(module: Any) -> str:
    return "/".join(module.path)


@contextlib.contextmanager
def use_rules(rules: Sequence[Rule]) -> Iterator[None]:
    """Within the context, bsr_jax layers (and layers routed by ``compress_model``) take their
    compression from ``rules``. Raises ``ValueError`` on exit when a rule matched no layer."""
    rules = tuple(rules)
    for rule in rules:
        if not isinstance(rule, Rule):
            raise ValueError(f"rules must be bsr_jax.Rule objects, got {rule!r}")
    outer = _ACTIVE.get()
    # An inner context (a compressed model's apply inside pruning_plan) records into the outer plan.
    active = _Active(rules, set(), outer.plan if outer else None)
    token = _ACTIVE.set(active)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
    unmatched = [rules[i].pattern for i in range(len(rules)) if i not in active.matched]
    if unmatched:
        raise ValueError(f"rule pattern(s) {unmatched} matched no layer; check the module paths (bsr_jax.pruning_plan lists them)")


def report_dense(path: str, reason: str) -> None:
    """Report that the layer at ``path`` stays dense although a rule asked for a compression."""
    warnings.warn(f"bsr_jax: {path or 'the root module'} stays dense: {reason}", UserWarning, stacklevel=3)


def lookup(module: Any) -> Any:
    """The active rules' compression for ``module`` (a bound Flax module), or ``NO_MATCH``.

    A ``Pooling`` rule resolves to ``None`` (dense, reported) for modules that are not
    ``nn.Conv``s: pooling is defined for convolution inputs only.
    """
    active = _ACTIVE.get()
    if active is None:
        return NO_MATCH
    i = first_match([rule.pattern for rule in active.rules], module_path(module))
    if i is None:
        return NO_MATCH
    active.matched.add(i)
    compression = active.rules[i].compression
    if isinstance(compression, Pooling) and not isinstance(module, nn.Conv):
        if not module.is_initializing():
            report_dense(module_path(module), f"{type(module).__name__} is not a convolution, and Pooling compresses convolution inputs only")
        return None
    return compression


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One compressed call: the module path, its resolved compression and the input's shape/dtype."""

    path: str
    compression: Compression
    input: jax.ShapeDtypeStruct


def record(path: str, compression: Compression, x: Any) -> None:
    """Called by every compressing layer with what it resolved; collected by ``pruning_plan``."""
    active = _ACTIVE.get()
    if active is not None and active.plan is not None:
        active.plan.append(LayerPlan(path, compression, jax.ShapeDtypeStruct(x.shape, x.dtype)))


def pruning_plan(apply_fn: Callable[..., Any], *args: Any, rules: Sequence[Rule] = (), **kwargs: Any) -> list[LayerPlan]:
    """What each compressing layer of ``apply_fn(*args, **kwargs)`` resolves, in call order
    (traced with ``jax.eval_shape``; nothing runs). Layers that stay dense are left out."""
    outer = _ACTIVE.get()
    rules = tuple(rules) or (outer.rules if outer else ())
    with use_rules(rules):
        active = _ACTIVE.get()
        active.plan = []
        jax.eval_shape(apply_fn, *args, **kwargs)
        plan = active.plan
    return [layer for layer in plan if layer.compression.saves_memory(layer.input)]
