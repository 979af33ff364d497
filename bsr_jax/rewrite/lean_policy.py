"""What a lean segment keeps (``policy``: products and what is not cheap to recompute), and
``both``: a policy keeping what two keep, for a model's own checkpoint inside a block the plan remats."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jax_core
from jax.extend.core.primitives import name_p

from bsr_jax.core import jax_private
from bsr_jax.core.names import LEAN_NAME, RESIDUAL_NAME

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


# Primitives whose backward reads none of their operands (linear in each): recomputing them in a
# checkpoint's backward recomputes nothing the backward reads.
LINEAR = frozenset(
    "add sub neg reshape broadcast_in_dim transpose squeeze expand_dims slice concatenate pad rev copy copy_p reduce_sum name".split()
)

# Primitives that only call a jaxpr (``jax.nn.relu`` is a ``custom_jvp`` around a ``jit``): kept or
# recomputed as what they call.
CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call"})


# Reductions kept where each output sums at least this many inputs: a norm's statistics, a softmax's
# maximum and sum. Keeping them costs 1/this of their operand or less, and their recomputation
# is a pass over it (ResNet-50, H100: BatchNorm's batch statistics recomputed in 16 lean blocks'
# backward took 1.07 of lean's 2.48 ms; docs/RESULTS.md 12.13).
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
REDUCED_BY = 16


def policy(prim, *avals, **params) -> bool:
    """A ``jax.checkpoint`` policy: True where the output is kept rather than recomputed. With the
    operands' avals (as ``jax.checkpoint`` calls it), a reduction of ``REDUCED_BY`` or more inputs
    per output is kept; without them (``recomputed``), by the primitive alone."""
    if prim.name in REDUCTIONS and avals:
        return math.prod(avals[0].shape[a] for a in params["axes"]) >= REDUCED_BY
    if prim is name_p:
        return params["name"] in (RESIDUAL_NAME, LEAN_NAME)
    if prim.name == "dot_general":  # batch axes: attention-like, two activations; else a linear layer
        (_, _), (lhs_batch, rhs_batch) = params["dimension_numbers"]
        return not (lhs_batch or rhs_batch)
    if prim.name in CALLS:
        return not all(recomputed(e) for jaxpr in jax_core.jaxprs_in_params(params) for e in jaxpr.eqns)
    return prim.name not in CHEAP


def recomputed(eqn: Any) -> bool:
    """Whether ``policy`` recomputes ``eqn``'s outputs rather than keeping them, by its primitive:
    a reduction counts as recomputed (where it is pulled into a reader's checkpoint, that
    checkpoint's ``policy`` keeps its output)."""
    return not policy(eqn.primitive, **eqn.params)


def recomputes_nothing_read(eqns: list[Any], arguments: frozenset[Any] = frozenset()) -> bool:
    """Whether ``jax.checkpoint(policy=policy)`` around ``eqns`` would recompute nothing its backward
    reads and can go: linear layers (products on parameters, convolutions: kept) reading the
    segment's inputs (through ``checkpoint_name`` at most), at least one computed by the step (not
    among ``arguments``), and ``LINEAR`` equations besides (a Dense's bias): a convolution alone.
    Such a checkpoint keeps what plain autodiff keeps; its one effect is the optimization barrier
    in front of its backward, which kept the layer's weights live in their own layout beside the
    transposed copy XLA made for the forward (transformers' ResNet-50 on H100: every 3x3 kernel
    twice at the backward's start, lean 1.07x of dense's peak). Kept for a product reading an
    equation's output (pulled in, a transpose or a cast: plain autodiff would keep that output, the
    checkpoint keeps its input), and where XLA without the barrier kept more (deviceless H100,
    ViT-B/16): a product over several axes (attention's out projection over the heads: its input
    twice, 443 MiB) and one reading arguments only (the patch embedding: a layout copy of the
    images beside them, 37 MiB)."""
    computed = {v for e in eqns for v in e.outvars}
    source = {}  # checkpoint_name's output -> what it names
    for e in eqns:
        name = e.primitive.name
        if name == "name" and not isinstance(e.invars[0], jax_core.Literal):
            source[e.outvars[0]] = source.get(e.invars[0], e.invars[0])
        elif name in ("dot_general", "conv_general_dilated") and not recomputed(e):
            operands = [source.get(v, v) for v in e.invars if not isinstance(v, jax_core.Literal)]  # literals: unhashable
            if any(v in computed for v in operands) or all(v in arguments for v in operands):
                return False
            if name == "dot_general" and len(e.params["dimension_numbers"][0][0]) > 1:
                return False
        elif name not in LINEAR:
            return False
    return True


def both(outer: Callable[..., Any] | None, inner: Callable[..., Any] | None) -> Callable[..., Any]:
    """A ``jax.checkpoint`` policy keeping what both keep (``None``: nothing), where ``outer``
    keeps it (on the device or offloaded). JAX lets a checkpoint's own policy decide what is kept of
    its computation even inside another checkpoint, so a model's own ``nn.remat`` (train.lm's, which
    keeps all but the parameters it gathers) inside a ``Remat`` module would keep what the Remat's
    policy recomputes; composed, the module keeps no more than both allow."""
    outer, inner = outer or jax.checkpoint_policies.nothing_saveable, inner or jax.checkpoint_policies.nothing_saveable

    def keeps(prim, *avals, **params):
        kept = jax_private.ensure_enum(outer(prim, *avals, **params))
        if isinstance(kept, jax_private.RecomputeType) or isinstance(jax_private.ensure_enum(inner(prim, *avals, **params)), jax_private.RecomputeType):
            return False
        return kept

    return keeps
