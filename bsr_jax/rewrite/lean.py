"""Lean neighbours: norms, activations and attention that keep less for the backward pass, exactly.

Around the linear layers of a typical Flax model, most residual bytes are kept by their neighbours:
a ``LayerNorm`` keeps about three input-sized arrays, a GELU five arrays of the 4x-wide hidden, and
dot-product attention three ``(B, H, T, T)`` arrays per layer. Inside ``lean_neighbours()`` those
computations run so that the backward pass keeps only what their derivatives need and recomputes
the rest (no matmul of a linear layer is recomputed):

* linen ``LayerNorm``, ``RMSNorm``, ``GroupNorm``, ``BatchNorm`` (also in training mode, which
  updates ``batch_stats``) and their NNX twins run under a lifted ``checkpoint`` (``nn.checkpoint``,
  ``nnx.remat``): they keep their input and parameters; the statistics are recomputed.
* ``gelu`` and ``silu``/``swish`` run under ``jax.checkpoint``: they keep their input.
* ``relu`` keeps a 1-bit mask of ``x > 0`` (packed into uint8, 1/32 of an f32 input).
* these activations also where a linen module holds them as attributes (``act=nn.relu``).
* ``flax.linen.dot_product_attention`` (called directly, or as the default ``attention_fn`` of
  ``nn.MultiHeadDotProductAttention`` and its subclasses) runs as ``bsr_jax.ops.attention``'s: it
  keeps q, k, v, the mask/bias, the dropout key and its output (not where the module's ``out``
  layer is compressed), and the backward recomputes the probabilities and takes flash attention's
  softmax derivative; dropout recomputes the same mask from the same key.

Forward outputs are bit-identical to the unmodified computation (the same Flax/JAX code runs, or
for attention the same operations in the same order), and every gradient is the one plain autodiff
gives, up to float reassociation (attention's: up to float rounding, its softmax derivative formed
in f32 as flash attention's; ``bsr_jax.ops.attention``). ``init`` is not changed.

How it intercepts: linen modules through ``nn.intercept_methods``; functions called as module
attributes (``nn.gelu(x)``, ``jax.nn.relu(x)``, ``nnx.silu(x)``, ``nn.dot_product_attention(...)``)
by replacing those attributes of ``jax.nn``, ``flax.linen``, ``flax.nnx`` and their activation
modules for the duration of the context (the idea of qwix's interception, done by attribute only);
NNX norms by replacing their classes' ``__call__``. Everything is restored on exit, also on
exceptions. Not covered: functions imported by name before the context (``from jax.nn import
gelu``), ``nnx.MultiHeadAttention`` (its attention runs as is), attention that sows its weights
(``sow_weights=True`` asks for them to be kept). The replaced attributes are process-wide while any
thread is inside the context; other threads then also get the lean (equally exact) functions.

``compress_model`` (linen) also runs ``bsr_jax.rewrite.lean_graph``, which recognises hand-written norms,
activations and attention by what they compute; the functions here still matter under NNX and for
the 1-bit ReLU mask (named ``LEAN_NAME`` so that its policy keeps the mask rather than x).

Tracing is what matters: enter the context where the loss is traced (inside a jitted function, not
around a call that hits jit's cache of a program traced without it). The lean ``relu`` defines a
JVP, so forward-mode differentiation works too.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import activation as linen_activation
from flax.linen import attention as linen_attention
from flax.nnx.nn import activations as nnx_activations
from jax.ad_checkpoint import checkpoint_name

from bsr_jax.core import layer_choice
from bsr_jax.core.names import LEAN_NAME
from bsr_jax.core.patching import ProcessWidePatch
from bsr_jax.ops import attention as attention_ops

LINEN_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm)
NNX_NORMS = (nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm, nnx.BatchNorm)
# Namespaces whose attributes user code reads at call time (``nn.gelu(x)``); every attribute that
# is one of the original functions below is replaced while the context is active.
NAMESPACES = (jax.nn, nn, linen_activation, linen_attention, nnx, nnx_activations)

_dot_product_attention = linen_attention.dot_product_attention


def _split_arrays(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """The array leaves of ``tree`` and a function that rebuilds ``tree`` from new ones (the other
    leaves, e.g. ``use_running_average=False``, stay Python values: transforms must not trace them)."""
    leaves, treedef = jax.tree.flatten(tree)
    is_array = [isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves]

    def rebuild(arrays: list[Any]) -> Any:
        it = iter(arrays)
        return jax.tree.unflatten(treedef, [next(it) if a else leaf for leaf, a in zip(leaves, is_array)])

    return [leaf for leaf, a in zip(leaves, is_array) if a], rebuild


# ---- activations ----


def _checkpointed(original: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``original`` under ``jax.checkpoint``: the backward pass keeps only its array input."""

    @functools.wraps(original)
    def lean(x, *args, **kwargs):
        return jax.checkpoint(lambda x: original(x, *args, **kwargs))(x)

    return lean


_BITS = 8  # rows packed into one byte


def _as_rows(x: jax.Array) -> jax.Array:
    """``x`` as ``(rows, columns)``, columns its last axis, rows padded to a multiple of 8."""
    rows = x.reshape(-1, x.shape[-1] if x.ndim else 1)
    return jnp.pad(rows, ((0, -rows.shape[0] % _BITS), (0, 0)))


def _pack_by_rows(rows: jax.Array) -> jax.Array:
    groups = rows.reshape(-1, _BITS, rows.shape[-1])
    return jnp.sum(groups << jnp.arange(_BITS, dtype=jnp.uint8)[:, None], axis=1, dtype=jnp.uint8)


def _unpack_by_rows(packed: jax.Array) -> jax.Array:
    bits = (packed[:, None, :] >> jnp.arange(_BITS, dtype=jnp.uint8)[:, None]) & 1
    return bits.reshape(-1, packed.shape[-1])


def _pack_along_rows(rows: jax.Array) -> jax.Array:
    return jnp.packbits(rows.reshape(-1)).reshape(-1, rows.shape[-1])


def _unpack_along_rows(packed: jax.Array) -> jax.Array:
    return jnp.unpackbits(packed.reshape(-1)).reshape(-1, packed.shape[-1])


def _pack_mask(mask: jax.Array) -> jax.Array:
    """A bool array as 1 bit per element: ``(ceil(rows / 8), columns)`` uint8 (rows: every axis but
    the last; ``columns``: the last).

    How bits are grouped into bytes depends on the platform: on TPU, 8 rows of one column (the last
    axis stays the minor one, tiled 128 lanes wide, so packing and unpacking add no relayout: the
    12 x 768 LM's lean step 106 -> 89 ms modelled); elsewhere 8 neighbours along a row, as
    ``jnp.packbits`` does (XLA:GPU fuses that reduction over 8 neighbours with the kernel computing
    the mask's input, which it does not do for the rows' form: +0.4 ms on the same LM)."""
    return jax.lax.platform_dependent(_as_rows(mask).astype(jnp.uint8), tpu=_pack_by_rows, default=_pack_along_rows)


def _masked_tangent(packed: jax.Array, t: jax.Array) -> jax.Array:
    bits = jax.lax.platform_dependent(packed, tpu=_unpack_by_rows, default=_unpack_along_rows)
    mask = bits[: t.size // bits.shape[-1]].reshape(t.shape).astype(bool)
    return jnp.where(mask, t, jnp.zeros_like(t))


def _bitmask_relu(original: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    """``original`` (``jax.nn.relu``) whose derivative keeps ``x > 0`` as 1 bit per element.

    Same forward; the tangent is ``t`` where ``x > 0`` and 0 elsewhere (0 at ``x == 0`` and for NaN,
    as ``jax.nn.relu``'s own derivative). The unpacking runs under ``jax.checkpoint`` so the
    linearised program keeps the packed mask, not an unpacked byte mask.
    """

    @jax.custom_jvp
    def relu(x):
        return original(x)

    @relu.defjvp
    def relu_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        # Named so that bsr_jax.rewrite.lean_graph's policy keeps the packed mask, not x to recompute it.
        return original(x), jax.checkpoint(_masked_tangent)(checkpoint_name(_pack_mask(x > 0), LEAN_NAME), t)

    @functools.wraps(original)
    def lean(x):
        return relu(x)

    return lean


LEAN_RELU = _bitmask_relu(jax.nn.relu)
_LEAN_ACTIVATIONS: tuple[tuple[Callable[..., jax.Array], Callable[..., jax.Array]], ...] = (
    (jax.nn.gelu, _checkpointed(jax.nn.gelu)),
    (jax.nn.silu, _checkpointed(jax.nn.silu)),  # jax.nn.swish is the same function
    (jax.nn.relu, LEAN_RELU),
)


# ---- attention ----

_ATTENTION_SIGNATURE = inspect.signature(_dot_product_attention)
# Arguments that, given, leave the call as Flax runs it: sown weights, the caller's own products.
_ATTENTION_OWN_PRODUCTS = ("module", "einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum")


def _lean_attention(keep_output: bool) -> Callable[..., jax.Array]:
    @functools.wraps(_dot_product_attention)  # Flax's signature: MultiHeadDotProductAttention filters its arguments by it
    def attention(*args, **kwargs):
        bound = _ATTENTION_SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        named = dict(bound.arguments)
        if [name for name in _ATTENTION_OWN_PRODUCTS if named.pop(name) is not None]:
            return _dot_product_attention(*args, **kwargs)
        return attention_ops.dot_product_attention(**named, keep_output=keep_output)

    return attention


lean_dot_product_attention = _lean_attention(keep_output=True)
lean_dot_product_attention.__doc__ = """``flax.linen.dot_product_attention`` keeping q, k, v, bias, mask, the dropout key and the
output for the backward pass, which recomputes the probabilities and takes flash attention's
softmax derivative (``bsr_jax.ops.attention``: same arguments, bit-identical output). With
``module`` given (``sow_weights=True``) the weights are meant to be kept, and with custom einsums or
a ``dot_general`` the products are the caller's: the call then runs unchanged. Inside
``nn.MultiHeadDotProductAttention`` whose ``out`` layer a rule compresses, the output is not kept
(``keep_output=False`` there).

Arrays: query (..., Tq, H, D), key/value (..., Tk, H, D), bias/mask broadcastable to
(..., H, Tq, Tk).
"""


# ---- norms ----

# The rule of an active lean_attention context (which attention modules are lean), else None: all.
_ATTENTION_WHERE: contextvars.ContextVar[Callable[[str], bool] | None] = contextvars.ContextVar("bsr_jax_lean_attention", default=None)
_local = threading.local()  # .inside: a lean norm's own call is running; .depth: nesting of contexts


@contextlib.contextmanager
def _inside_lean_norm() -> Iterator[None]:
    previous = getattr(_local, "inside", False)
    _local.inside = True
    try:
        yield
    finally:
        _local.inside = previous


@contextlib.contextmanager
def swapped_fields(module: nn.Module, lean_of: dict[int, Callable[..., Any]]) -> Iterator[None]:
    """Activations held as module attributes (``act: Callable = nn.relu``, as flax's ResNet
    examples do) were bound when the dataclass was defined, so replacing ``nn.relu`` does not reach
    them: those ``lean_of`` maps (by the original's id) are swapped for this call (children built
    from them, e.g. ``Block(act=self.act)``, get the replacements)."""
    originals = {f.name: vars(module).get(f.name) for f in dataclasses.fields(module)}
    originals = {name: value for name, value in originals.items() if id(value) in lean_of}
    for name, value in originals.items():
        object.__setattr__(module, name, lean_of[id(value)])
    try:
        yield
    finally:
        for name, value in originals.items():
            object.__setattr__(module, name, value)


def _output_kept_as_is(attention: nn.MultiHeadDotProductAttention) -> bool:
    """Whether the attention's output projection (its ``out`` layer) keeps its input as it is: then
    the attention keeps the same array for its backward at no cost; where a rule compresses that
    layer, keeping it would add its bytes to the peak (``bsr_jax.ops.attention``'s ``keep_output``)."""
    resolver = layer_choice.active()
    if resolver is None:
        return True
    compression = resolver.resolve(attention, f"{layer_choice.module_path(attention)}/out")
    return compression is None or compression is layer_choice.NO_MATCH


def _linen_interceptor(next_fun, args, kwargs, context):
    if context.method_name != "__call__" or getattr(_local, "inside", False):
        return next_fun(*args, **kwargs)
    with swapped_fields(context.module, {id(original): lean for original, lean in _LEAN_ACTIVATIONS}):
        return _lean_module_call(next_fun, args, kwargs, context.module)


def _default_attention(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiHeadDotProductAttention) and module.attention_fn is _dot_product_attention


def _with_lean_attention(next_fun, args, kwargs, module: nn.MultiHeadDotProductAttention):
    # The default attention_fn was bound when the dataclass was defined, so replacing the
    # module attribute ``nn.dot_product_attention`` does not reach it: swap it for this call.
    object.__setattr__(module, "attention_fn", _lean_attention(keep_output=_output_kept_as_is(module)))
    try:
        return next_fun(*args, **kwargs)
    finally:
        object.__setattr__(module, "attention_fn", _dot_product_attention)


def _lean_module_call(next_fun, args, kwargs, module: nn.Module):
    if _default_attention(module) and _ATTENTION_WHERE.get() is None:  # else lean_attention's rule decides
        return _with_lean_attention(next_fun, args, kwargs, module)
    if isinstance(module, LINEN_NORMS) and not module.is_initializing():
        arrays, rebuild = _split_arrays((args, kwargs))

        def normalise(lifted_module, *arrays):
            call_args, call_kwargs = rebuild(list(arrays))
            with _inside_lean_norm():  # the lifted call reaches this interceptor again
                return lifted_module(*call_args, **call_kwargs)

        # nn.checkpoint passes the variables explicitly and applies batch_stats updates outside the
        # transform, so no tracer leaks.
        return nn.checkpoint(normalise)(module, *arrays)
    return next_fun(*args, **kwargs)


def _nnx_lean_call(original_call: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    @functools.wraps(original_call)
    def call(self, *args, **kwargs):
        arrays, rebuild = _split_arrays((args, kwargs))

        def normalise(module, *arrays):
            call_args, call_kwargs = rebuild(list(arrays))
            return original_call(module, *call_args, **call_kwargs)

        # nnx.remat carries the module's state in and its updates (BatchNorm statistics) out.
        return nnx.remat(normalise)(self, *arrays)

    return call


# ---- the context ----

def namespace_replacements(lean_of: dict[int, Any]) -> list[tuple[Any, str, Any]]:
    """(namespace, attribute, replacement) for every public attribute of ``NAMESPACES`` that
    ``lean_of`` maps (by the original's id)."""
    return [
        (namespace, name, lean_of[id(value)])
        for namespace in NAMESPACES
        for name, value in vars(namespace).items()
        if id(value) in lean_of and not name.startswith("_")
    ]


def _replacements() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, lean value) for every attribute this context replaces."""
    lean_of = {id(original): lean for original, lean in _LEAN_ACTIVATIONS}
    lean_of[id(_dot_product_attention)] = lean_dot_product_attention
    return namespace_replacements(lean_of) + [(cls, "__call__", _nnx_lean_call(cls.__call__)) for cls in NNX_NORMS]


_PATCH = ProcessWidePatch(_replacements)  # found when the first context opens


@contextlib.contextmanager
def lean_attention(where: Callable[[str], bool]) -> Iterator[None]:
    """Only ``lean_neighbours``' attention, for the ``nn.MultiHeadDotProductAttention`` modules (with
    Flax's default ``attention_fn``) whose path (``layer_choice.module_path``) ``where`` accepts:
    how ``compress_model``'s lean rules by path give their lean modules' attention
    ``bsr_jax.ops.attention``'s backward, where ``bsr_jax.rewrite.lean_graph`` makes the rest lean.
    Inside ``lean_neighbours`` too it decides which attention is lean (``compress_model``'s ``dx``
    formats keep q, k and v through ``lean_graph``'s recomputation instead)."""

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name == "__call__" and _default_attention(module) and where(layer_choice.module_path(module)):
            return _with_lean_attention(next_fun, args, kwargs, module)
        return next_fun(*args, **kwargs)

    token = _ATTENTION_WHERE.set(where)
    try:
        with nn.intercept_methods(interceptor):
            yield
    finally:
        _ATTENTION_WHERE.reset(token)


def active() -> bool:
    """Whether this thread is inside ``lean_neighbours``."""
    return bool(getattr(_local, "depth", 0))


@contextlib.contextmanager
def lean_neighbours(enabled: bool = True) -> Iterator[None]:
    """Run norms, activations and attention traced inside this context the lean way (see the
    module docstring); ``enabled=False`` is a no-op, the off switch. Nested contexts are no-ops.

    Usage: ``with bsr_jax.rewrite.lean.lean_neighbours(): y = model.apply(variables, x)`` inside the loss.
    """
    if not enabled or getattr(_local, "depth", 0):
        yield
        return
    with _PATCH.applied():
        _local.depth = 1
        try:
            with nn.intercept_methods(_linen_interceptor):
                yield
        finally:
            _local.depth = 0
