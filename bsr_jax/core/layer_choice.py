"""Which compression a layer's backward keeps: asked at trace time by the layers (``bsr_jax.Dense``,
``bsr_jax.Conv``, routed Flax layers), answered by the active rewrite.

The layers sit below the rewriting that decides for them, so they do not import it: a rewrite
(``bsr_jax.rewrite.rules.use_rules``) installs a ``Resolver`` for the duration of a trace with
``resolving``, and the layers call ``lookup`` and ``record`` here. Without one, ``lookup`` answers
``NO_MATCH`` and a layer keeps its own options. What the layers resolved, compressed and left dense
is collected, where asked (``collecting``), into a ``LayerTable``.

Paths: a linen module's path is its Flax path, '/'-joined (``"Encoder/block0/MlpBlock_0/Dense_1"``),
under a nested ``submodule.apply(...)`` prefixed by the path of the module that made the call;
an NNX module's is its attribute path (``"layers/0/mlp"``).
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

from flax import nnx

from bsr_jax.core.layer_table import Collector

NO_MATCH = object()  # lookup's answer when no rewrite is active or none of its rules matches


class Resolver(Protocol):
    """What an active rewrite answers for each layer call (``bsr_jax.rewrite.rules`` implements it)."""

    # Nested roots' path prefixes, by ``id`` of the root: (root, prefix).
    prefixes: dict[int, tuple[Any, tuple[str, ...]]]

    def resolve(self, module: Any, path: str) -> Any:
        """The compression for the bound linen ``module`` at ``path`` (``None``: dense), or ``NO_MATCH``."""


_ACTIVE: contextvars.ContextVar[Resolver | None] = contextvars.ContextVar("bsr_jax_resolver", default=None)
# Apart from the resolver: a table is collected whoever resolves (rules, a table, a layer's own options).
_COLLECTORS: contextvars.ContextVar[tuple[Collector, ...]] = contextvars.ContextVar("bsr_jax_collectors", default=())


def active() -> Resolver | None:
    """The resolver installed by the innermost ``resolving`` context, if any."""
    return _ACTIVE.get()


@contextlib.contextmanager
def resolving(resolver: Resolver) -> Iterator[None]:
    """Layers traced within the context ask ``resolver`` what to keep."""
    token = _ACTIVE.set(resolver)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def collecting() -> Iterator[Collector]:
    """Collect what the layers traced within the context resolve: ``collector.table()`` after it."""
    collector = Collector()
    token = _COLLECTORS.set((*_COLLECTORS.get(), collector))
    try:
        yield collector
    finally:
        _COLLECTORS.reset(token)


def module_path(module: Any) -> str:
    """The path of a bound linen module: its Flax path, under a nested ``apply`` prefixed by the
    path of the module that made that call and the nested root's name (or class name)."""
    resolver = _ACTIVE.get()
    entry = resolver.prefixes.get(id(module.scope.root)) if resolver is not None else None
    prefix = entry[1] if entry is not None and entry[0] is module.scope.root else ()
    return "/".join((*prefix, *module.path))


def nnx_module_paths(model: nnx.Module) -> Iterator[tuple[str, nnx.Module]]:
    """Each module of an NNX model (``model`` itself: ``""``) with its path, the '/'-joined
    attribute path (``"layers/0/mlp"``): what ``compress_model`` matches and ``residual_report`` shows."""
    for path, module in nnx.iter_modules(model):
        yield "/".join(str(p) for p in path), module


def enter_module(module: Any, caller: Any | None) -> None:
    """Called for each linen module call under an active resolver, with the innermost module whose
    call is running (``caller``): a nested root (``submodule.apply(...)`` inside ``caller``) gets its prefix."""
    resolver = _ACTIVE.get()
    if resolver is None or caller is None or module.path or module.scope.root is caller.scope.root:
        return
    root = module.scope.root
    if id(root) not in resolver.prefixes or resolver.prefixes[id(root)][0] is not root:
        parent = tuple(p for p in module_path(caller).split("/") if p)
        resolver.prefixes[id(root)] = (root, (*parent, module.name or type(module).__name__))


def lookup(module: Any) -> Any:
    """The active resolver's compression for ``module`` (a bound Flax module), or ``NO_MATCH``."""
    resolver, path = _ACTIVE.get(), module_path(module)
    resolved(path, type(module).__name__)
    return NO_MATCH if resolver is None else resolver.resolve(module, path)


def resolved(path: str, layer: str, reason: str | None = None) -> None:
    """Note the layer at ``path`` (of class ``layer``) in the collected tables, in call order
    (``reason``: why it stays dense, where known before it is called: NNX resolves at once)."""
    for collector in _COLLECTORS.get():
        collector.resolved(path, layer, reason)


def record(path: str, compression: Any, x: Any) -> None:
    """Called by every compressing layer with the compression its input ``x`` is kept with."""
    for collector in _COLLECTORS.get():
        collector.record(path, compression, x)


def report_dense(path: str, reason: str) -> None:
    """Report that the layer at ``path`` stays dense although a rule asked for a compression."""
    warnings.warn(f"bsr_jax: {path or 'the root module'} stays dense: {reason}", UserWarning, stacklevel=3)
    for collector in _COLLECTORS.get():
        collector.dense(path, reason)
