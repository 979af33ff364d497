"""A head projection followed by optax's softmax cross-entropy, recognised and computed chunk by chunk.

In a language model's step the largest arrays at the peak are the head's logits and their gradient,
``B x T x V`` each. ``bsr_jax.ops.losses.chunked_softmax_cross_entropy`` never holds them, but it
needs the head's input and weight, which code written the usual way never hands to its loss::

    logits = self.lm_head(x)                                                  # nn.Dense
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

While ``recognising_head_losses(chunk)`` is active (``chunked_head_loss(loss_fn)`` runs
``loss_fn`` inside it; ``compress_model(..., loss_chunk=)`` runs the model's ``apply`` inside it):

1. the output of every linen ``nn.Dense.__call__`` and ``nn.Embed.attend`` (a head tied to the
   embedding, ``w = embedding.T``) is recorded, by identity, with the operands its product read
   (after the module's dtype promotion) and its dtype;
2. ``optax.softmax_cross_entropy_with_integer_labels(logits, labels)`` and
   ``optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, V))`` (looked up on ``optax`` or
   ``optax.losses`` at call time) whose ``logits`` is such an output, or a widening cast of one
   (``logits.astype(jnp.float32)`` of bf16 logits: the same values), return
   ``chunked_softmax_cross_entropy(h, w, labels, chunk=chunk, logits_dtype=<the head's dtype>)``
   in the dtype the optax call returns. The head's own product is then unused and XLA removes it:
   no ``(tokens, V)`` array exists in the step.

Anything else runs as written, exactly: logits sliced, reshaped, scaled, narrowed or otherwise
computed on before the loss, a head with its own ``dot_general`` or a ``precision``, a
subclass of ``nn.Dense``/``nn.Embed`` (whose kernel may not be the stored one), a head whose
product a ``compress_model`` rule compresses (chunking would change its weight gradient), a head
inside ``nn.scan``/``nn.remat`` with the loss outside (its output there is another array),
``axis``/``where`` arguments, one-hot labels not made by ``jax.nn.one_hot(..., axis=-1)`` of
integers (label smoothing), and functions imported by name before the context
(``from optax import softmax_cross_entropy``). A context in which some cross-entropy call was not
recognised, or none was made, warns once when it ends (``UserWarning`` with the reason): a
requested chunking never silently does nothing.

Recognised calls equal the plain ones within f32 rounding for f32 logits; for bf16 logits the
plain optax loss computes its softmax in bf16, the chunked one in f32 on the same bf16 logits
(more accurate, and different by bf16 rounding: ~1e-2 relative per token, less on a mean). Labels
follow optax: negative ones in ``[-V, 0)`` count from the end, ones outside ``[-V, V)`` give NaN
(one-hot rows of them are zero: loss 0). The memory is ``chunk x V`` f32 per chunk instead of two
``N x V`` arrays; the price is the head's product once more in the backward pass, except where
``chunked_head_loss`` sees, in its loss function traced once more (``jax.make_jaxpr``), that only
sums over every token read the losses (``.mean()``, ``.sum()``, scaled by one number): their
gradient is then computed in the forward (``chunked_softmax_cross_entropy(summed=True)``).

The replaced functions are process-wide while any thread is inside a context (as
``bsr_jax.rewrite.intercept``'s); other threads see only their own (empty) state and get optax's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jax_core

from bsr_jax.core import layer_choice
from bsr_jax.core.call_arrays import split_arrays
from bsr_jax.core.jax_private import lax_numpy
from bsr_jax.core.names import HEAD_LOSSES_NAME
from bsr_jax.core.patching import ProcessWidePatch
from bsr_jax.ops.losses import chunked_softmax_cross_entropy

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class _Head:
    """What a head's product read: ``features (..., D)``, ``kernel (D, V)`` and ``bias (V,)`` (or
    None) in the product's dtype, and the dtype its logits were rounded to."""

    features: jax.Array
    kernel: jax.Array
    logits_dtype: jnp.dtype
    bias: jax.Array | None = None


@dataclasses.dataclass
class _State:
    """One thread's recognition state (the outermost context's)."""

    chunk: int
    scope: str  # where the context is active, for the warning
    summed: bool = False  # the losses are only summed with one weight (chunked_head_loss read it from the trace)
    report: bool = True  # warn when the context ends (not for chunked_head_loss's look at the trace)
    heads: dict[int, tuple[Any, _Head | str]] = dataclasses.field(default_factory=dict)  # id -> (array, head or why not)
    one_hots: dict[int, tuple[Any, Any, int]] = dataclasses.field(default_factory=dict)  # id -> (array, indices, classes)
    recognised: int = 0
    missed: list[str] = dataclasses.field(default_factory=list)  # why calls ran as written


_local = threading.local()


def _state() -> _State | None:
    return getattr(_local, "state", None)


def _entry(state: _State, a: Any) -> _Head | str | None:
    """The head ``a`` is the output of (or why that head is not recognised), by identity."""
    found = state.heads.get(id(a))
    return found[1] if found is not None and found[0] is a else None


# ----------------------------------------------------------------------------- heads


def _why_not(module: nn.Module, base: type, plain: dict[str, Any]) -> str | None:
    """Why ``module``'s product is not the plain one the chunked loss computes, or None."""
    path = layer_choice.module_path(module) or "the root module"
    if type(module) is not base:
        return f"the head {path} is a {type(module).__name__}, a subclass of nn.{base.__name__} (its kernel may not be the stored one)"
    for attribute, value in plain.items():
        if getattr(module, attribute) != value:
            return f"the head {path} has {attribute}={getattr(module, attribute)!r}"
    if layer_choice.lookup(module) not in (None, layer_choice.NO_MATCH):
        return f"a compress_model rule compresses the head {path}'s product (Rule({path!r}, None) before it keeps it plain)"
    return None


def _head(module: nn.Module, method: str, args: tuple, kwargs: dict) -> _Head | str | None:
    """The head a ``Dense.__call__`` / ``Embed.attend`` call computes, why it is not one, or None
    (another method or module)."""
    if isinstance(module, nn.Dense) and method == "__call__":
        reason = _why_not(module, nn.Dense, {"dot_general": None, "dot_general_cls": None, "precision": None})
        if reason is not None:
            return reason
        inputs = args[0] if args else kwargs["inputs"]
        params = {name: nn.meta.unbox(module.get_variable("params", name)) for name in ("kernel", "bias")}
        features, kernel, bias = module.promote_dtype(inputs, params["kernel"], params["bias"] if module.use_bias else None, dtype=module.dtype)
        return _Head(features, kernel, jnp.dtype(features.dtype), bias)
    if isinstance(module, nn.Embed) and method == "attend":
        reason = _why_not(module, nn.Embed, {})
        if reason is not None:
            return reason
        query = args[0] if args else kwargs["query"]
        features, embedding = module.promote_dtype(query, module.embedding, dtype=module.dtype)
        return _Head(features, embedding.T, jnp.dtype(features.dtype))
    return None


def _record_heads(next_fun, args, kwargs, context):
    """A linen method interceptor: records each head's output with what its product read."""
    out = next_fun(*args, **kwargs)
    state = _state()
    # Unbound modules (a method called outside apply, e.g. while a transform inspects the model) compute no step.
    if state is not None and context.module.scope is not None and not context.module.is_initializing():
        head = _head(context.module, context.method_name, args, kwargs)
        if head is not None:
            state.heads[id(out)] = (out, head)
    return out


def carried(outputs: list[Any]) -> tuple[list[tuple[int, _Head | str]], list[jax.Array]]:
    """For a function whose ``outputs`` another evaluation will replace (``bsr_jax.rewrite.lean_graph``
    evaluates a traced model again): the recorded heads among them, by output index, and the arrays
    those heads read, to be returned beside the outputs so their replacements can be recorded
    (``recarry``)."""
    state = _state()
    heads = [(i, e) for i, o in enumerate(outputs) if state is not None and (e := _entry(state, o)) is not None]
    arrays = [a for _, h in heads if isinstance(h, _Head) for a in (h.features, h.kernel, h.bias) if a is not None]
    return heads, arrays


def recarry(outputs: list[Any], heads: list[tuple[int, _Head | str]], arrays: list[Any]) -> None:
    """Record the re-evaluated ``outputs`` as the heads ``carried`` found, reading ``arrays``, the
    re-evaluated arrays it returned."""
    state, it = _state(), iter(arrays)
    for i, head in heads:
        if isinstance(head, _Head):
            features, kernel = next(it), next(it)
            head = _Head(features, kernel, head.logits_dtype, None if head.bias is None else next(it))
        state.heads[id(outputs[i])] = (outputs[i], head)


# ----------------------------------------------------------------------------- replaced functions

_ORIGINAL = {
    "integer": optax.losses.softmax_cross_entropy_with_integer_labels,
    "one_hot_loss": optax.losses.softmax_cross_entropy,
    "one_hot": jax.nn.one_hot,
    "astype": lax_numpy.astype,
}


def _astype(x, dtype, /, *, copy=False, device=None):
    """``astype`` that carries a head's record through a widening float cast (the same values)."""
    out = _ORIGINAL["astype"](x, dtype, copy=copy, device=device)
    state = _state()
    entry = _entry(state, x) if state is not None else None
    if entry is not None and out is not x:
        widening = jnp.issubdtype(out.dtype, jnp.floating) and jnp.promote_types(x.dtype, out.dtype) == out.dtype
        cast = f"the logits were cast from {x.dtype} to {out.dtype} (only widening casts keep the head's values)"
        state.heads[id(out)] = (out, entry if widening else cast)
    return out


def _one_hot(x, num_classes, *, dtype=None, axis=-1):
    out = _ORIGINAL["one_hot"](x, num_classes, dtype=dtype, axis=axis)
    state = _state()
    if state is not None and axis in (-1, out.ndim - 1) and jnp.issubdtype(jnp.result_type(x), jnp.integer):
        state.one_hots[id(out)] = (out, x, int(num_classes))
    return out


def _chunked(state: _State, logits: Any, labels: Any, axis: Any, where: Any, one_hot: bool) -> jax.Array | str:
    """The recognised call's per-example losses, or why it is not recognised."""
    head = _entry(state, logits)
    if head is None:
        return "the logits passed to it were not a head projection's output (sliced, reshaped or computed on first?)"
    if isinstance(head, str):
        return head
    if axis not in (-1, logits.ndim - 1) or where is not None:
        return f"it was called with axis={axis!r}, where={where!r} (recognised: axis=-1, where=None)"
    vocab = logits.shape[-1]
    if one_hot:
        found = state.one_hots.get(id(labels))
        if found is None or found[0] is not labels or found[2] != vocab or labels.shape != logits.shape:
            return "its labels were not jax.nn.one_hot(integer labels, V) of the logits' shape (label smoothing?)"
        indices = found[1]
        ids = jnp.where((indices >= 0) & (indices < vocab), indices, -1)  # one_hot gives zero rows: loss 0, no gradient
        in_range = None
        dtype = jnp.result_type(labels, logits)
    else:
        if not jnp.issubdtype(jnp.result_type(labels), jnp.integer) or jnp.shape(labels) != logits.shape[:-1]:
            return f"its labels ({jnp.result_type(labels)} {jnp.shape(labels)}) are not integers of the logits' shape without V"
        in_range = (labels >= -vocab) & (labels < vocab)  # optax counts negative labels from the end
        ids = jnp.where(in_range, jnp.where(labels < 0, labels + vocab, labels), -1)
        dtype = logits.dtype
    losses = chunked_softmax_cross_entropy(head.features, head.kernel, ids, chunk=state.chunk, logits_dtype=head.logits_dtype, bias=head.bias,
                                           summed=state.summed)  # fmt: skip
    if in_range is not None:
        losses = jnp.where(in_range, losses, jnp.nan)  # optax's out-of-range labels read NaN
    state.recognised += 1
    return checkpoint_name(losses.astype(dtype), HEAD_LOSSES_NAME)


def _loss(name: str, one_hot: bool):
    original = _ORIGINAL[name]

    @functools.wraps(original)
    def loss(logits, labels, axis=-1, where=None):
        state = _state()
        if state is None:
            return original(logits, labels, axis=axis, where=where)
        out = _chunked(state, logits, labels, axis, where, one_hot)
        if not isinstance(out, str):
            return out
        state.missed.append(f"optax.{original.__name__}: {out}")
        return original(logits, labels, axis=axis, where=where)

    return loss


_REPLACEMENTS: tuple[tuple[Any, str, Any], ...] = (
    *((owner, "softmax_cross_entropy_with_integer_labels", _loss("integer", one_hot=False)) for owner in (optax, optax.losses)),
    *((owner, "softmax_cross_entropy", _loss("one_hot_loss", one_hot=True)) for owner in (optax, optax.losses)),
    (jax.nn, "one_hot", _one_hot),
    (lax_numpy, "astype", _astype),  # what ``x.astype(...)`` calls
    (jnp, "astype", _astype),
)
_PATCH = ProcessWidePatch(lambda: _REPLACEMENTS)


def _report(state: _State) -> None:
    if state.missed:
        reasons = "; ".join(dict.fromkeys(state.missed))
        message = f"a softmax cross-entropy in {state.scope} ran as written, on the whole logits: {reasons}"
    elif state.recognised == 0:
        message = (f"no optax softmax cross-entropy was called in {state.scope}: nothing was chunked (a loss computed "
                   "outside compress_model's apply needs bsr_jax.chunked_head_loss around the loss function)")  # fmt: skip
    else:
        return
    warnings.warn(f"bsr_jax: {message}", UserWarning, stacklevel=5)


def check_chunk(chunk: Any, argument: str) -> None:
    """Raise a ``ValueError`` naming ``argument`` unless ``chunk`` is a positive int."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"{argument} must be a positive int (tokens per chunk, e.g. 1024), got {chunk!r}")


@contextlib.contextmanager
def recognising_head_losses(chunk: int, scope: str = "the traced function", summed: bool = False, report: bool = True) -> Iterator[None]:
    """Head + softmax cross-entropy pairs traced inside the context run chunked (module docstring).

    Args:
      chunk: tokens per chunk of ``chunked_softmax_cross_entropy``.
      scope: where the context is active, named in its warning.
      summed: ``chunked_softmax_cross_entropy(summed=True)``: the caller knows the losses are only
        summed with one weight (``chunked_head_loss`` reads it from the traced loss function).
      report: warn, when the context ends, where a call was not recognised or none was made.
    """
    check_chunk(chunk, "chunk")
    outer = _state()
    # Nested contexts (a compress_model(loss_chunk=) apply inside chunked_head_loss) share the
    # outer's records; the outermost one reports.
    state = outer if outer is not None else _State(chunk, scope, summed, report)
    with _PATCH.applied():
        _local.state = state
        try:
            with nn.intercept_methods(_record_heads):
                yield
        finally:
            _local.state = outer
    if outer is None and report:
        _report(state)


# What carries each token's loss to a sum unchanged in weight: layout and dtype changes, and scaling
# by one number (a Literal or a rank-0 array).
_CARRIES = frozenset({"reshape", "squeeze", "expand_dims", "convert_element_type", "copy", "copy_p", "name"})


def _summed_only(loss_fn: Callable[..., Any], chunk: int, args: tuple, kwargs: dict) -> bool:
    """Whether, in ``loss_fn(*args, **kwargs)`` traced (``jax.make_jaxpr``, array leaves abstract),
    recognised losses are read only by sums over every token, each with the same weight: then each
    token's cotangent is the same (a ``.mean()``: 1/N each). A mask, per-token weights, a slice, a
    loss returned per token or read inside a nested call: False."""
    arrays, rebuild = split_arrays(args, kwargs)

    def traced(*arrays):
        call_args, call_kwargs = rebuild(arrays)
        return loss_fn(*call_args, **call_kwargs)

    with recognising_head_losses(chunk, report=False):
        jaxpr = jax.make_jaxpr(traced)(*arrays).jaxpr
    readers: dict[Any, list[Any]] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, jax_core.Var):
                readers.setdefault(v, []).append(eqn)
    returned = {v for v in jaxpr.outvars if isinstance(v, jax_core.Var)}
    todo = [e.outvars[0] for e in jaxpr.eqns if e.primitive.name == "name" and e.params["name"] == HEAD_LOSSES_NAME]
    if not todo:
        return False
    scalar = lambda v: isinstance(v, jax_core.Literal) or not v.aval.shape  # noqa: E731
    while todo:
        v = todo.pop()
        if v in returned:
            return False
        for eqn in readers.get(v, []):
            name, others = eqn.primitive.name, [u for u in eqn.invars if u is not v]
            if name == "reduce_sum" and len(eqn.params["axes"]) == len(v.aval.shape):
                continue  # a sum over every token: what follows is scalar math
            if name in _CARRIES or (name == "mul" and all(map(scalar, others))) or (name == "div" and eqn.invars[0] is v and scalar(eqn.invars[1])):
                todo.extend(eqn.outvars)
            else:
                return False
    return True


def chunked_head_loss(loss_fn: F, *, chunk: int = 1024) -> F:
    """``loss_fn`` (same signature) whose trace runs inside ``recognising_head_losses(chunk)``.

    For a loss written outside the model::

        def loss_fn(params, x, y):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

        grads = jax.grad(bsr_jax.chunked_head_loss(loss_fn, chunk=1024))(params, x, y)

    The model's last ``nn.Dense`` or ``nn.Embed.attend`` and the loss then run
    ``chunk`` tokens at a time, never holding the ``(..., V)`` logits; what is recognised and how
    exactly is in this module's docstring. A call with nothing recognised warns.
    """
    check_chunk(chunk, "chunk")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}")

    @functools.wraps(loss_fn)
    def wrapped(*args, **kwargs):
        # Outside another context, a first trace says whether only sums over every token read the
        # losses: then their gradient is computed in the forward (no second head product).
        summed = _state() is None and _summed_only(loss_fn, chunk, args, kwargs)
        with recognising_head_losses(chunk, scope=f"{getattr(loss_fn, '__name__', 'loss_fn')} (chunked_head_loss)", summed=summed):
            return loss_fn(*args, **kwargs)

    return wrapped  # type: ignore[return-value]
