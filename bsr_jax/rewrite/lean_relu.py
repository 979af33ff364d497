"""ReLU's 1-bit mask by module path: where ``compress_model``'s lean rules by path leave it to
``bsr_jax.rewrite.lean_graph`` alone.

``lean_graph`` keeps, for ReLU's derivative, the array ReLU reads (the first Dense's output of an
MLP), which a lean block keeps anyway where the second Dense keeps its input as it is (its input is
recomputed from it). Where the second Dense keeps its input compressed, that array is kept for the
mask alone: 90 MiB a block on the 12 x 768 LM (docs/RESULTS.md 14.7). Inside ``lean_relu(where)``,
``jax.nn.relu`` (and the same function as a linen module's attribute, ``act=nn.relu``) called by a
module whose path ``where`` accepts keeps ``bsr_jax.rewrite.lean``'s 1-bit mask instead, exactly as
inside ``lean_neighbours``; elsewhere it runs as is.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import flax.linen as nn
import jax
from flax.linen import module as linen_module

from bsr_jax.core import layer_choice
from bsr_jax.core.patching import ProcessWidePatch
from bsr_jax.rewrite import lean

_WHERE: contextvars.ContextVar[Callable[[str], bool] | None] = contextvars.ContextVar("bsr_jax_lean_relu", default=None)
_ORIGINAL = jax.nn.relu


def _caller_path() -> str | None:
    stack = linen_module._context.module_stack
    module = stack[-1] if stack else None
    return None if module is None or module.scope is None else layer_choice.module_path(module)


def relu(x):
    """``jax.nn.relu``; with ``bsr_jax.rewrite.lean``'s 1-bit mask inside ``lean_neighbours`` or
    where the innermost ``lean_relu`` accepts the calling module's path."""
    where = _WHERE.get()
    if lean.active() or (where is not None and (path := _caller_path()) is not None and where(path)):
        return lean.LEAN_RELU(x)
    return _ORIGINAL(x)


_PATCH = ProcessWidePatch(lambda: lean.namespace_replacements({id(_ORIGINAL): relu}))


def _relu_fields(next_fun, args, kwargs, context):
    with lean.swapped_fields(context.module, {id(_ORIGINAL): relu}):
        return next_fun(*args, **kwargs)


@contextlib.contextmanager
def lean_relu(where: Callable[[str], bool]) -> Iterator[None]:
    """ReLU keeps its 1-bit mask in the modules whose path (``layer_choice.module_path``) ``where``
    accepts; exact either way (the same forward, plain autodiff's gradient)."""
    token = _WHERE.set(where)
    try:
        with _PATCH.applied(), nn.intercept_methods(_relu_fields):
            yield
    finally:
        _WHERE.reset(token)
