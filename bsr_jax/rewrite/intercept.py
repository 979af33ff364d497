"""Products on parameters inside custom linen layers, routed through ``pruned_dot_general``.

Model libraries often build projections from their own small modules (transformers' Flax GPT-2
``FlaxConv1D`` calls ``lax.dot_general(x, kernel.T, ...)``; others write ``x @ w`` or
``jnp.einsum("btd,df->btf", x, w)``). Inside ``product_interception()`` (entered by
``compress_model``'s ``apply``), ``jax.lax.dot_general``, ``jax.numpy.einsum``/``matmul``/``dot``
and the ``@`` operator are replaced, for the duration of the context, by functions that look at
their operands: where one operand is a *parameter* (a leaf of the ``params`` collection passed to
``apply``, or an array computed from parameters alone: ``kernel.T``, ``kernel.astype(...)``,
weight-normalised ``g * v / |v|``) and the other is not, the product runs inside a linen module
whose path a rule matches with a ``Pruning``, and it is a linear map on the parameter (no batch
axes, one float dtype, no other ``preferred_element_type``, no ``out_sharding``), it goes through
``pruned_dot_general``: forward and dx exact, dW from the kept blocks. Contracted axes that are not
x's trailing and w's leading ones are transposed into that form first (then the product runs on
the transposed operands: the same sums, possibly in another order). A product on a parameter that
cannot be routed is reported once per layer (``UserWarning`` naming the path and why) and runs as
is. Products with no parameter operand (attention's ``q @ k``) are left alone, unreported. Every
product on a parameter of a layer, routed or not, names its activation operand and its result
(``bsr_jax.core.names``: ``"<layer path>:input"``, ``":output"``) for ``jax.checkpoint`` policies.

Which arrays are parameters is tracked at ``jax.core.Primitive.bind``: while a context is active,
every primitive whose array inputs are all parameter-derived (Python or concrete scalars aside)
marks its outputs parameter-derived. This runs where JAX traces (under ``grad``, ``jit``,
``eval_shape``); an op-by-op forward of concrete arrays with no transformation does not trace
and is left dense (it has no backward pass to compress).

Modules this module does not route: ``nn.Dense``/``nn.DenseGeneral``/``nn.Conv`` and the bsr_jax
layers (``bsr_jax.rewrite.compress`` routes them through their own product hooks), and NNX modules.
The replaced functions are process-wide while any thread is inside a context; other threads see
only their own (empty) state and get the original products.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jax_core

from bsr_jax.core import layer_choice, names
from bsr_jax.core.jax_private import tensor_contractions
from bsr_jax.ops.linear import linear_dims, merge_contracted, pruned_dot_general
from bsr_jax.core.patching import ProcessWidePatch

_ORIGINAL = {"bind": jax_core.Primitive.bind, "dot_general": lax.dot_general, "einsum": jnp.einsum, "matmul": jnp.matmul, "dot": jnp.dot}


@dataclasses.dataclass
class _State:
    """One thread's interception state (the innermost context's)."""

    frames: list[tuple[Any, bool]] = dataclasses.field(default_factory=list)  # (module, may route its products)
    derived: dict[int, Any] = dataclasses.field(default_factory=dict)  # id -> the array, kept alive so ids stay unique
    reported: set[str] = dataclasses.field(default_factory=set)
    routing: bool = False  # inside a routed product: its own products are plain


_local = threading.local()


def _state() -> _State | None:
    return getattr(_local, "state", None)


def _derived(state: _State, a: Any) -> bool:
    return id(a) in state.derived and state.derived[id(a)] is a


def _neutral(a: Any) -> bool:
    """A constant that leaves an op's result parameter-derived: a Python or concrete scalar."""
    return not isinstance(a, jax.core.Tracer) and np.ndim(a) == 0


def _tracking_bind(self, *args, **params):
    out = _ORIGINAL["bind"](self, *args, **params)
    state = _state()
    if state is not None and state.derived and any(_derived(state, a) for a in args):
        if all(_derived(state, a) or _neutral(a) for a in args):
            for o in out if self.multiple_results else (out,):
                state.derived[id(o)] = o
    return out


def mark_parameters(tree: Any) -> None:
    """Mark the array leaves of ``tree`` (an ``apply``'s ``params`` collection) as parameters."""
    state = _state()
    if state is not None:
        state.derived.update((id(leaf), leaf) for leaf in jax.tree.leaves(tree))


@contextlib.contextmanager
def module_call(module: Any, routes_products: bool) -> Iterator[None]:
    """Within a linen module's method call: products on parameters belong to ``module`` (routed
    only where ``routes_products``; modules with their own product hooks pass ``False``)."""
    state = _state()
    if state is None:
        yield
        return
    layer_choice.enter_module(module, next((m for m, _ in reversed(state.frames)), None))
    state.frames.append((module, routes_products))
    try:
        yield
    finally:
        state.frames.pop()
    # A module holding a matrix is a layer its rule names, routed or not (so a rule naming only
    # custom layers is matched at init too, where nothing traces and no product is seen).
    own = module.variables.get("params", {}) if module.scope is not None else {}
    if routes_products and any(getattr(v, "ndim", 0) >= 2 for v in own.values()):
        layer_choice.lookup(module)


def pruning_key(compression: Any, module: Any) -> jax.Array | None:
    """A ``"pruning"`` key for a layer that needs one: from ``module``, or, inside a nested
    ``submodule.apply`` that was given no rngs, from the innermost enclosing module that has them."""
    if not compression.needs_key:
        return None
    state = _state()
    candidates = [module] + ([m for m, _ in reversed(state.frames)] if state is not None else [])
    for m in candidates:
        if m.has_rng("pruning"):
            return m.make_rng("pruning")
    return None


def _report_once(state: _State, path: str, reason: str) -> None:
    if path not in state.reported:
        state.reported.add(path)
        layer_choice.report_dense(path, reason)


def _routed(lhs, rhs, dims, precision, extra: dict[str, Any]):
    """The routed product of ``lax.dot_general(lhs, rhs, dims, ...)``, or ``None`` (run it as is)."""
    state = _state()
    if state is None or state.routing or not state.frames:
        return None
    lhs_param, rhs_param = _derived(state, lhs), _derived(state, rhs)
    module, routes = state.frames[-1]
    if lhs_param == rhs_param or not routes:
        return None
    compression = layer_choice.lookup(module)
    if compression is layer_choice.NO_MATCH or compression is None:
        return None
    path = layer_choice.module_path(module)
    (contract_l, contract_r), batch = dims
    x, w, x_axes, w_axes = (lhs, rhs, contract_l, contract_r) if rhs_param else (rhs, lhs, contract_r, contract_l)
    x_axes, w_axes = tuple(int(a) for a in x_axes), tuple(int(a) for a in w_axes)
    # A Pooling rule resolves to dense for these modules (rules.resolve: they are not nn.Convs).
    if batch != ((), ()) and any(batch):
        reason = f"dot_general {dims} has batch axes (not a linear map on the parameter)"
    elif extra.get("out_sharding") is not None or extra.get("preferred_element_type") not in (None, x.dtype):
        reason = f"the product sets {extra}"
    elif not (jnp.issubdtype(x.dtype, jnp.floating) and x.dtype == w.dtype):
        reason = f"operands {x.dtype} and {w.dtype} are not one float dtype"
    elif not x_axes or jnp.ndim(x) < 2:
        reason = "the product contracts no axis of a matrix input"
    else:
        reason = None
    if reason is not None:
        _report_once(state, path, f"a product on a parameter is not routed: {reason}")
        return None
    x = checkpoint_name(x, names.tensor_name(path, names.INPUT))
    x_free = [a for a in range(x.ndim) if a not in x_axes]
    w_free = [a for a in range(w.ndim) if a not in w_axes]
    x_perm, w_perm = (*x_free, *x_axes), (*w_axes, *w_free)
    xt = x if x_perm == tuple(range(x.ndim)) else lax.transpose(x, x_perm)
    wt = w if w_perm == tuple(range(w.ndim)) else lax.transpose(w, w_perm)
    key = pruning_key(compression, module)
    layer_choice.record(path, compression, merge_contracted(xt, len(x_axes)))
    state.routing = True
    try:
        y = pruned_dot_general(xt, wt, linear_dims(xt.ndim, len(x_axes)), pruning=compression, key=key, precision=precision)
    finally:
        state.routing = False
    if lhs_param:  # dot_general's output lists lhs's free axes (here w's) first
        y = lax.transpose(y, (*range(len(x_free), y.ndim), *range(len(x_free))))
    return checkpoint_name(y, names.tensor_name(path, names.OUTPUT))


def _named(product, a, b, *args, **kwargs):
    """``product(a, b, ...)`` not routed: where it is a product on a parameter of a layer, its
    activation operand and result named as a routed product's (``names.tagged``), for policies."""
    state = _state()
    if state is None or state.routing or not state.frames or not state.frames[-1][1] or _derived(state, a) == _derived(state, b):
        return product(a, b, *args, **kwargs)
    path = layer_choice.module_path(state.frames[-1][0])
    if _derived(state, a):
        return names.tagged(lambda x, w, *rest, **kw: product(w, x, *rest, **kw), path)(b, a, *args, **kwargs)
    return names.tagged(product, path)(a, b, *args, **kwargs)


def _dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    extra = {"preferred_element_type": preferred_element_type, **kwargs}
    y = _routed(lhs, rhs, dimension_numbers, precision, extra)
    if y is None:
        return _named(_ORIGINAL["dot_general"], lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type, **kwargs)
    return y


def _with_parameter(*operands) -> bool:
    state = _state()
    return state is not None and not state.routing and bool(state.frames) and any(_derived(state, a) for a in operands)


def _einsum(subscripts, *operands, **kwargs):
    if not _with_parameter(*operands) or "_dot_general" in kwargs:
        return _ORIGINAL["einsum"](subscripts, *operands, **kwargs)
    # Unjitted, so the pairwise products it forms from the operands (and their parameter marks)
    # reach the routing dot_general.
    with jax.disable_jit():
        return _ORIGINAL["einsum"](subscripts, *operands, _dot_general=_dot_general, **kwargs)


def _matrix_product(name: str):
    original = _ORIGINAL[name]

    def product(a, b, *, precision=None, preferred_element_type=None, **kwargs):
        # A 2-D parameter on the right (``x @ w``): x's last axis against w's first, as jnp does.
        if _with_parameter(a, b) and jnp.ndim(b) == 2 and jnp.ndim(a) >= 1:
            extra = {"preferred_element_type": preferred_element_type, **kwargs}
            y = _routed(a, b, (((jnp.ndim(a) - 1,), (0,)), ((), ())), precision, extra)
            if y is not None:
                return y
        return _named(original, a, b, precision=precision, preferred_element_type=preferred_element_type, **kwargs)

    product.__name__ = product.__qualname__ = name
    product.__doc__ = original.__doc__
    return product


_REPLACEMENTS: tuple[tuple[Any, str, Any], ...] = (
    (jax_core.Primitive, "bind", _tracking_bind),
    (jax.lax, "dot_general", _dot_general),
    (jnp, "einsum", _einsum),
    (jnp, "matmul", _matrix_product("matmul")),
    (tensor_contractions, "matmul", _matrix_product("matmul")),  # what ``a @ b`` calls
    (jnp, "dot", _matrix_product("dot")),
)
_PATCH = ProcessWidePatch(lambda: _REPLACEMENTS)


@contextlib.contextmanager
def product_interception() -> Iterator[None]:
    """Route products on parameters inside rule-matched linen modules (see the module docstring)."""
    outer = _state()
    with _PATCH.applied():
        # Nested contexts (a compressed model applied inside another) share the outer's marks and frames.
        _local.state = outer if outer is not None else _State()
        try:
            yield
        finally:
            _local.state = outer
