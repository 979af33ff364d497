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
import dataclasses
import fnmatch
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import flax.linen as nn
import jax
import jax.numpy as jnp

from bsr_jax.core import layer_choice
from bsr_jax.storage.compression import Compression
from bsr_jax.storage.pooling import Pooling


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


def as_rules(rules: Rule | Sequence[Rule], argument: str = "rules") -> tuple[Rule, ...]:
    """``rules`` as a tuple: one ``Rule`` or a sequence of them (the one check every entry point uses)."""
    if isinstance(rules, Rule):
        return (rules,)
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise TypeError(f"{argument} must be a bsr_jax.Rule or a list of them, got {type(rules).__name__}")
    for rule in rules:
        if not isinstance(rule, Rule):
            raise ValueError(f"{argument} must be bsr_jax.Rule objects, got {rule!r}")
    return tuple(rules)


def first_match(patterns: Sequence[str], path: str) -> int | None:
    """Index of the first ``fnmatch`` glob in ``patterns`` matching ``path``: the one matching rule."""
    return next((i for i, pattern in enumerate(patterns) if fnmatch.fnmatchcase(path, pattern)), None)


@dataclasses.dataclass
class _Active:
    """The ``layer_choice.Resolver`` of a ``use_rules`` context: the first matching rule's compression."""

    rules: tuple[Rule, ...]
    matched: set[int]
    plan: list[LayerPlan] | None = None
    # Path of the module calling a nested ``submodule.apply(...)``, by the nested root's scope:
    # modules under it are named from there (``lm_head``, not the nested root's ``''``).
    prefixes: dict[int, tuple[Any, tuple[str, ...]]] = dataclasses.field(default_factory=dict)

    def resolve(self, module: Any, path: str) -> Any:
        """A ``Pooling`` rule resolves to ``None`` (dense, reported) for modules that are not
        ``nn.Conv``s: pooling is defined for convolution inputs only."""
        i = first_match([rule.pattern for rule in self.rules], path)
        if i is None:
            return layer_choice.NO_MATCH
        self.matched.add(i)
        compression = self.rules[i].compression
        if isinstance(compression, Pooling) and not isinstance(module, nn.Conv):
            if not module.is_initializing():
                layer_choice.report_dense(path, f"{type(module).__name__} is not a convolution, and Pooling compresses convolution inputs only")
            return None
        return compression

    def record(self, path: str, compression: Compression, x: Any) -> None:
        if self.plan is not None:
            self.plan.append(LayerPlan(path, compression, jax.ShapeDtypeStruct(x.shape, x.dtype)))


@contextlib.contextmanager
def use_rules(rules: Rule | Sequence[Rule]) -> Iterator[None]:
    """Within the context, bsr_jax layers (and layers routed by ``compress_model``) take their
    compression from ``rules`` (one ``Rule`` or a list). Raises ``ValueError`` on exit when a rule
    matched no layer."""
    rules = as_rules(rules)
    outer = layer_choice.active()
    # An inner context (a compressed model's apply inside pruning_plan) records into the outer plan;
    # with the same rules it also counts the outer's matches (pruning_plan given the model's rules).
    matched = outer.matched if outer is not None and outer.rules == rules else set()
    active = _Active(rules, matched, outer.plan if outer else None, outer.prefixes if outer else {})
    with layer_choice.resolving(active):
        yield
    unmatched = [rules[i].pattern for i in range(len(rules)) if i not in active.matched]
    if unmatched:
        raise ValueError(f"rule pattern(s) {unmatched} matched no layer; check the module paths (bsr_jax.pruning_plan lists them)")


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One compressed call: the module path, its resolved compression and the input's shape/dtype."""

    path: str
    compression: Compression
    input: jax.ShapeDtypeStruct


@dataclasses.dataclass(frozen=True)
class PruningPlan(Sequence[LayerPlan]):
    """What ``pruning_plan`` found: the compressing calls in call order (indexable and iterable like
    the list earlier versions returned); ``str()`` is a table with each input's bytes, dense and as
    kept for the backward pass."""

    layers: tuple[LayerPlan, ...]

    @overload
    def __getitem__(self, i: int) -> LayerPlan: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[LayerPlan, ...]: ...
    def __getitem__(self, i):
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def __str__(self) -> str:
        rows = [("module path", "compression", "input", "dense KiB", "kept KiB")]
        for layer in self.layers:
            shape = f"{layer.input.dtype}[{','.join(map(str, layer.input.shape))}]"
            dense = math.prod(layer.input.shape) * jnp.dtype(layer.input.dtype).itemsize
            rows.append((layer.path or "-", _describe(layer.compression), shape, f"{dense / 1024:.1f}", f"{_kept_bytes(layer) / 1024:.1f}"))
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
        return "\n".join([*lines, f"{len(self.layers)} compressed call(s)"])


def _describe(compression: Compression) -> str:
    """The compression's fields that differ from their defaults: ``Pruning(0.7, block=(8, 8))``."""
    fields = dataclasses.fields(compression)
    first, rest = getattr(compression, fields[0].name), fields[1:]
    defaults = type(compression)(first)
    changed = [f"{f.name}={getattr(compression, f.name)!r}" for f in rest if getattr(compression, f.name) != getattr(defaults, f.name)]
    return f"{type(compression).__name__}({', '.join([repr(first), *changed])})"


def _kept_bytes(layer: LayerPlan) -> int:
    """Bytes of ``compression.compress(input)`` (shapes only; a stochastic one drawn with a dummy key)."""
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype) if layer.compression.needs_key else None
    kept = jax.eval_shape(layer.compression.compress, layer.input, key)
    return kept.nbytes


def pruning_plan(apply_fn: Callable[..., Any], *args: Any, rules: Rule | Sequence[Rule] = (), **kwargs: Any) -> PruningPlan:
    """What each compressing layer of ``apply_fn(*args, **kwargs)`` resolves, in call order
    (traced with ``jax.eval_shape``; nothing runs). Layers that stay dense are left out. ``rules``:
    applied around the call (a ``compress_model`` model's ``apply`` brings its own; passing the same
    rules again is fine)."""
    outer = layer_choice.active()
    rules = as_rules(rules, "rules") or (outer.rules if outer else ())
    with use_rules(rules):
        active = layer_choice.active()
        active.plan = []
        jax.eval_shape(apply_fn, *args, **kwargs)
        plan = active.plan
    return PruningPlan(tuple(layer for layer in plan if layer.compression.saves_memory(layer.input)))
