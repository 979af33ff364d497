"""Rules: which layer gets which compression, by module path. The one resolver of the library.

    rules = [Rule("*/MlpBlock_*/Dense_1", Pruning(0.9)), Rule("*/head", None), Rule("*", Pruning(0.7))]
    with use_rules(rules):
        model.apply(variables, x)          # at trace time, inside jit

A path is the '/'-joined names of a Flax module (``"Encoder/block0/MlpBlock_0/Dense_1"``), matched
with ``fnmatch`` globs; the first matching rule wins; a rule whose compression is ``None`` leaves
the layer dense; a layer no rule matches keeps its own options (``bsr_jax.Dense(...,
sparsity=0.7)``) or, routed by ``compress_model``, stays dense. A rule (a table row) that matches
no layer of a traced call is an error naming it, so a typo never silently leaves a model dense.

Compressions: ``Pruning`` (any linear layer or convolution) and ``Pooling`` (convolutions only).
A layer a rule matches but cannot honour (a ``Pooling`` rule on a Dense layer, a conv
configuration the compressed convolution does not cover) stays dense and is reported with a
``UserWarning`` naming its path and why (``report_dense``), never silently.

Resolved once: ``resolve`` is the one function turning rules (or a ``LayerTable``'s rows, by exact
path) into what a layer keeps, for linen at trace time (``use_rules``, once per path and trace)
and for NNX when ``compress_model`` routes; what each layer resolved is collected into a
``LayerTable`` (``layer_table``), which ``compress_model`` applies as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax

from bsr_jax.core import layer_choice
from bsr_jax.core.layer_table import LayerRow, LayerTable
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


Rules = tuple[Rule, ...] | LayerTable  # what resolves: rules by glob, or a table's rows by exact path


def as_rules(rules: Rule | Sequence[Rule] | LayerTable, argument: str = "rules") -> Rules:
    """``rules`` as a tuple: one ``Rule`` or a sequence of them (the one check every entry point
    uses); a ``LayerTable`` as it is."""
    if isinstance(rules, LayerTable):
        return rules
    if isinstance(rules, Rule):
        return (rules,)
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise TypeError(f"{argument} must be a bsr_jax.Rule or a list of them (or a bsr_jax.LayerTable), got {type(rules).__name__}")
    for rule in rules:
        if not isinstance(rule, Rule):
            raise ValueError(f"{argument} must be bsr_jax.Rule objects, got {rule!r}")
    return tuple(rules)


def first_match(patterns: Sequence[str], path: str) -> int | None:
    """Index of the first ``fnmatch`` glob in ``patterns`` matching ``path``: the one matching rule."""
    return next((i for i, pattern in enumerate(patterns) if fnmatch.fnmatchcase(path, pattern)), None)


def resolve(rules: Rules, path: str, module: Any, conv: bool) -> tuple[int | None, Any, str | None]:
    """What the layer ``module`` at ``path`` keeps under ``rules``: ``(i, compression, reason)``,
    ``i`` the first matching rule, or for a table its row of exactly ``path`` (``None`` and
    ``NO_MATCH`` where none matches); ``reason``, where a compression asked for cannot be kept
    (``compression`` is then ``None``): a ``Pooling`` on a layer that is not a convolution
    (``conv``), pooling being defined for convolution inputs only, or a table row's own (so an
    applied table resolves to itself)."""
    if isinstance(rules, LayerTable):
        i = rules.find(path)
        if i is not None and rules[i].reason is not None:
            return i, None, rules[i].reason
    else:
        i = first_match([rule.pattern for rule in rules], path)
    if i is None:
        return None, layer_choice.NO_MATCH, None
    compression = rules[i].compression
    if isinstance(compression, Pooling) and not conv:
        return i, None, f"{type(module).__name__} is not a convolution, and Pooling compresses convolution inputs only"
    return i, compression, None


def compresses_below(rules: Rules, path: str) -> bool:
    """Whether ``rules`` compress a layer below the module at ``path`` (a rule's first match for a
    child of it; a table's rows under it)."""
    if isinstance(rules, LayerTable):
        return any(row.path.startswith(f"{path}/") and row.compression is not None for row in rules)
    compression = resolve(rules, f"{path}/*", None, conv=False)[1]
    return compression is not None and compression is not layer_choice.NO_MATCH


def unmatched_error(rules: Rules, matched: set[int], layers: str = "layer") -> ValueError | None:
    """The error naming the rules (a table's paths) that matched no layer, or ``None``: a typo
    never silently leaves a model dense, nor a table row a layer it does not have."""
    if isinstance(rules, LayerTable):
        unmatched = list(dict.fromkeys(row.path for row in rules if rules.find(row.path) not in matched))
        return ValueError(f"table row(s) for {unmatched} match no {layers} of the model (a table applies to the model it was made for)") if unmatched else None
    unmatched = [rules[i].pattern for i in range(len(rules)) if i not in matched]
    return ValueError(f"rule pattern(s) {unmatched} matched no {layers}; check the module paths (bsr_jax.layer_table lists them)") if unmatched else None


@dataclasses.dataclass
class _Active:
    """The ``layer_choice.Resolver`` of a ``use_rules`` context: ``resolve`` of each path, once."""

    rules: Rules
    matched: set[int]
    # Path of the module calling a nested ``submodule.apply(...)``, by the nested root's scope:
    # modules under it are named from there (``lm_head``, not the nested root's ``''``).
    prefixes: dict[int, tuple[Any, tuple[str, ...]]] = dataclasses.field(default_factory=dict)
    resolved: dict[str, Any] = dataclasses.field(default_factory=dict)  # path -> its compression, this trace

    def resolve(self, module: Any, path: str) -> Any:
        if path not in self.resolved:
            i, compression, reason = resolve(self.rules, path, module, isinstance(module, nn.Conv))
            if i is not None:
                self.matched.add(i)
            if reason is not None and not module.is_initializing():
                layer_choice.report_dense(path, reason)
            self.resolved[path] = compression
        return self.resolved[path]


@contextlib.contextmanager
def use_rules(rules: Rule | Sequence[Rule] | LayerTable) -> Iterator[None]:
    """Within the context, bsr_jax layers (and layers routed by ``compress_model``) take their
    compression from ``rules`` (one ``Rule``, a list, or a ``LayerTable`` applied by exact path).
    Raises ``ValueError`` on exit when a rule (a table row) matched no layer."""
    rules = as_rules(rules)
    outer = layer_choice.active()
    # An inner context with the same rules (a compressed model's apply inside layer_table given the
    # model's rules) also counts the outer's matches, and nested roots keep their prefixes.
    matched = outer.matched if outer is not None and outer.rules == rules else set()
    active = _Active(rules, matched, outer.prefixes if outer else {})
    with layer_choice.resolving(active):
        yield
    error = unmatched_error(rules, active.matched)
    if error is not None:
        raise error


def layer_table(apply_fn: Callable[..., Any], *args: Any, rules: Rule | Sequence[Rule] | LayerTable = (), **kwargs: Any) -> LayerTable:
    """What each layer of ``apply_fn(*args, **kwargs)`` resolves, in call order (traced with
    ``jax.eval_shape``; nothing runs): every layer a rule can name (``compress_model``'s routed
    layers, bsr_jax layers, custom layers with products on parameters), compressed or dense, with
    the reason where a rule asked for a compression it cannot keep. ``rules``: applied around the
    call (a ``compress_model`` model's ``apply`` brings its own; passing the same rules again is
    fine). ``compress_model(model, table)`` applies the table as it is."""
    rules = as_rules(rules)
    with layer_choice.collecting() as collector, use_rules(rules) if rules else contextlib.nullcontext():
        jax.eval_shape(apply_fn, *args, **kwargs)
    return collector.table()


LayerPlan = LayerRow  # pruning_plan's rows: the table's (``path``, ``compression``, ``input``)


class PruningPlan(LayerTable):
    """What ``pruning_plan`` found: the compressing calls of a ``LayerTable``, in call order
    (indexable and iterable like the list earlier versions returned; ``layers``: the rows)."""

    @property
    def layers(self) -> tuple[LayerRow, ...]:
        return self.rows


def pruning_plan(apply_fn: Callable[..., Any], *args: Any, rules: Rule | Sequence[Rule] = (), **kwargs: Any) -> PruningPlan:
    """``layer_table(apply_fn, *args, rules=rules, **kwargs)``'s compressing calls: the layers that
    stay dense (or keep their input: a compression that would not save bytes) are left out."""
    return PruningPlan(tuple(row for row in layer_table(apply_fn, *args, rules=rules, **kwargs) if row.compresses))
