"""Lean neighbours recognised by what the program computes, not by which function or module it calls.

``bsr_jax.lean`` replaces known functions and modules (``nn.LayerNorm``, ``nn.gelu``,
``nn.dot_product_attention``). Model libraries write the same computations by hand: an RMSNorm as
``x * rsqrt(mean(x**2))``, SwiGLU as ``silu(gate) * up`` with ``silu`` taken from a dict bound at
import, attention as einsums. ``lean_call(fn, *args)`` makes all of them keep less without
recognising any name:

1. it traces ``fn`` once to a jaxpr (``jax.make_jaxpr``; the model's Python, and so every
   interception of ``compress_model``, runs once, here);
2. it cuts the jaxpr into *segments*: maximal runs of consecutive equations with the same module
   path (the linen name stack that ``residual_report`` reads), i.e. one module's own computation
   between its sub-module calls: a norm, an activation, attention's softmax and einsums;
3. it evaluates each segment under ``jax.checkpoint`` with ``policy``: the outputs of products on
   parameters (``dot_general`` without batch axes, i.e. linear layers), of convolutions, of
   bsr_jax's compressed residuals (``RESIDUAL_NAME``), of values named ``LEAN_NAME`` (ReLU's 1-bit
   mask) and of anything not known to be cheap are saved; everything cheap (elementwise math,
   reductions, reshapes, gathers, random bits, and products with batch axes such as attention's
   ``q k^T`` and ``p v``) is recomputed in the backward pass from the segment's inputs and the
   saved values.

So each module keeps only what its exact backward needs from its inputs and its linear layers'
outputs: a hand-written RMSNorm its input; ``silu(gate) * up`` the gate and up projections; einsum
attention q, k and v (probabilities recomputed, as flash attention does, and as ``bsr_jax.lean``
does for ``nn.dot_product_attention``); dropout its key. No linear layer's product is recomputed,
and segments follow the forward's module order, so the backward recomputes one module's
intermediates right before that module's backward, not all of them at once.

Forward values are the traced equations evaluated again (bit-identical); gradients are plain
autodiff's of the same equations, recomputed (equal up to float reassociation). Inputs that are
not traced (an op-by-op forward of concrete arrays, which has no backward pass) run ``fn`` as is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src import core as jax_core
from jax._src import source_info_util
from jax._src.ad_checkpoint import name_p

from bsr_jax.format import RESIDUAL_NAME
from bsr_jax.lean import LEAN_NAME
from bsr_jax.report import module_path

# Primitives whose outputs are recomputed rather than kept: elementwise math, comparisons and
# selects, layout changes, reductions and scans over an axis, gathers (embedding lookups), random
# bits (dropout masks recompute from their key). Anything else (sort, FFT, custom calls, ...) is kept.
CHEAP = frozenset(
    """
    add sub mul div rem neg max min abs sign exp exp2 log log1p expm1 tanh logistic erf erfc erf_inv
    rsqrt sqrt cbrt pow integer_pow square sin cos tan atan2 floor ceil round is_finite nextafter clamp
    select_n eq ne lt le gt ge and or not xor shift_left shift_right_logical shift_right_arithmetic
    population_count convert_element_type reduce_precision reshape broadcast_in_dim transpose squeeze
    expand_dims slice dynamic_slice dynamic_update_slice concatenate pad rev iota copy copy_p split
    gather reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin cumsum
    cumlogsumexp cummax cummin stop_gradient random_bits random_wrap random_unwrap random_seed
    threefry2x32
    """.split()
)


def policy(prim, *avals, **params) -> bool:
    """A ``jax.checkpoint`` policy: True where the output is kept rather than recomputed."""
    del avals
    if prim is name_p:
        return params["name"] in (RESIDUAL_NAME, LEAN_NAME)
    if prim.name == "dot_general":  # batch axes: attention-like, two activations; else a linear layer
        (_, _), (lhs_batch, rhs_batch) = params["dimension_numbers"]
        return not (lhs_batch or rhs_batch)
    return prim.name not in CHEAP


def _segments(eqns: list[Any]) -> list[list[Any]]:
    """Maximal runs of consecutive equations with one module path (einsum specs and transform
    wrappers in the name stack do not count: ``module_path`` drops them)."""
    segments: list[list[Any]] = []
    last = None
    for eqn in eqns:
        path = module_path(eqn.source_info.name_stack)
        if segments and path == last:
            segments[-1].append(eqn)
        else:
            segments.append([eqn])
        last = path
    return segments


def _read(env: dict[Any, Any], v: Any) -> Any:
    return v.val if isinstance(v, jax_core.Literal) else env[v]


def _run_segment(segment: list[Any], ins: list[Any], outs: list[Any]) -> Callable[..., list[Any]]:
    def run(*values):
        env = dict(zip(ins, values))
        for eqn in segment:
            # As jax.core.eval_jaxpr: the equation keeps its name stack, so module paths (rules,
            # residual_report) stay what they were when traced.
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
                out = eqn.primitive.bind(*(_read(env, v) for v in eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
            env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
        return [env[v] for v in outs]

    return run


def evaluate(jaxpr: Any, consts: list[Any], args: list[Any]) -> list[Any]:
    """``jaxpr``'s outputs, each segment (module) evaluated under ``jax.checkpoint(policy=policy)``."""
    segments = _segments(jaxpr.eqns)
    # Variables read after each segment (by later segments or as outputs): what it must return.
    needed_after: list[set[Any]] = []
    live = {v for v in jaxpr.outvars if isinstance(v, jax_core.Var)}
    for segment in reversed(segments):
        needed_after.append(set(live))
        live.update(v for eqn in segment for v in eqn.invars if isinstance(v, jax_core.Var))
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for segment, after in zip(segments, reversed(needed_after)):
        defined = {v for eqn in segment for v in eqn.outvars}
        ins = list(dict.fromkeys(v for eqn in segment for v in eqn.invars if isinstance(v, jax_core.Var) and v not in defined))
        outs = [v for eqn in segment for v in eqn.outvars if v in after]
        values = jax.checkpoint(_run_segment(segment, ins, outs), policy=policy)(*(env[v] for v in ins))
        env.update(zip(outs, values))
    return [_read(env, v) for v in jaxpr.outvars]


_COMPUTED = object()  # marks the result leaves the jaxpr computes


def lean_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, keeping for the backward pass only what each module's computation
    needs (see the module docstring). Array leaves of the arguments are traced; other leaves
    (``train=True``, ``mutable=[...]``) and non-array leaves of the result stay Python values."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    is_array = [isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves]
    arrays = [leaf for leaf, a in zip(leaves, is_array) if a]
    if not any(isinstance(a, jax_core.Tracer) for a in arrays):
        return fn(*args, **kwargs)  # nothing is differentiated
    result: dict[str, Any] = {}

    def traced(*arrays):
        it = iter(arrays)
        call_args, call_kwargs = jax.tree.unflatten(treedef, [next(it) if a else leaf for leaf, a in zip(leaves, is_array)])
        out_leaves, result["tree"] = jax.tree.flatten(fn(*call_args, **call_kwargs))
        result["static"] = [_COMPUTED if isinstance(o, jax.Array) else o for o in out_leaves]
        return [o for o in out_leaves if isinstance(o, jax.Array)]

    closed = jax.make_jaxpr(traced)(*arrays)
    computed = iter(evaluate(closed.jaxpr, closed.consts, arrays))
    return jax.tree.unflatten(result["tree"], [next(computed) if s is _COMPUTED else s for s in result["static"]])
