"""``compress_model(model, rules)``: block-pruned residuals for any Flax model, unmodified.

``rules`` are resolved once per layer (``bsr_jax.rewrite.rules.resolve``): linen layers when traced,
NNX layers here, into the per-layer table ``bsr_jax.layer_table`` returns; given such a
``LayerTable`` instead, ``compress_model`` applies its rows as they are, by exact path.

Linen: the returned module is the same model (same class behaviour, attributes, ``init``/``apply``
arguments and parameter tree) whose ``apply`` runs with the rules active. Each ``nn.Dense`` /
``nn.DenseGeneral`` (and subclasses, e.g. ones overriding ``param``) whose path a rule matches gets
its product from ``pruned_dot_general``: the module still creates, transforms and promotes its own
parameters, and only the ``dot_general`` it calls is replaced, so the forward is bit-identical.
Each ``nn.Conv`` (and subclasses, e.g. weight-standardised convs overriding ``param``) a rule
matches with ``Pooling`` or ``Pruning`` gets its ``lax.conv_general_dilated`` call replaced the same
way, by ``bsr_jax.compressed_conv`` on the kernel the module produced: forward bit-identical, dx and
db exact, dW from the compressed input. bsr_jax layers inside the model (``Dense``, ``Conv``, ...)
follow the same rules. Layers that read the same array with the same compression (q, k and v from
one LayerNorm output) compress it once and keep one residual (linear layers; convolutions keep one
each). With ``lean=True`` (the default) the neighbours keep less too, all exact: known norms,
activations and attention by name (``bsr_jax.rewrite.lean``), and hand-written ones by what they compute
(``bsr_jax.rewrite.lean_graph``: each module's own equations under ``jax.checkpoint``, cheap ops recomputed).

Every ``nn.Dense`` / ``nn.DenseGeneral`` / ``nn.Conv`` without a product hook of its own (and, NNX,
every ``nnx.Linear`` / ``nnx.LinearGeneral`` / ``nnx.Conv``) is routed, compressed or not, so its
product's operand and result carry ``checkpoint_name``s (``bsr_jax.core.names``): ``"<path>:input"``,
``"<path>:output"``, identities outside ``jax.checkpoint``, for policies by name.

Left dense and reported (``UserWarning`` naming the path and the reason, ``layer_choice.report_dense``):
modules with their own ``dot_general``/``dot_general_cls`` or ``conv_general_dilated(_cls)``,
DenseGeneral with batch dims, non-float inputs, products that are not a plain linear map,
``nn.ConvLocal``/``nn.ConvTranspose``/``nn.Einsum``, and ``Pooling`` rules on layers that are not convolutions.

NNX: the matching ``nnx.Linear`` / ``nnx.LinearGeneral`` modules of the (in place) returned model
get a compressing ``dot_general``, the matching ``nnx.Conv`` modules (and subclasses) a
compressing ``conv_general_dilated`` (the same stand-in as linen's: forward bit-identical, dx and db
exact); the root's class becomes a subclass whose ``__call__`` shows the resolved table to
``bsr_jax.layer_table`` and, with ``lean``, runs inside ``lean_neighbours``; parameters and
``nnx.split``/``merge``/``jit``/``grad`` are unchanged. Reported and left dense: convs with their
own ``conv_general_dilated``, ``nnx.ConvTranspose``, ``Pooling`` rules on linear layers, calls with
an ``out_sharding``. Shared-input residuals and stochastic options need the linen path (no rng
stream there).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from bsr_jax.storage import barriers
from bsr_jax.ops import head_loss
from bsr_jax.rewrite import intercept, lean_graph, lean_relu
from bsr_jax.ops.dx import check_dx
from bsr_jax.rewrite import lean as lean_ops
from bsr_jax.rewrite import rules as rules_lib
from bsr_jax.core import layer_choice, names, sharding
from bsr_jax.ops.conv import Conv, channels_last_dimension_numbers, compressed_conv
from bsr_jax.storage.format import BlockSparse
from bsr_jax.storage.pruning import Pruning
from bsr_jax.ops.layers import PrunedModule
from bsr_jax.ops.linear import is_linear_dims, merge_contracted, pruned_dot_general, writes_own_codes
from bsr_jax.rewrite.rules import Rule
from bsr_jax.core.layer_choice import NO_MATCH
from bsr_jax.core.layer_table import LayerRow, LayerTable
from bsr_jax.storage.compression import Compression

ROUTED_LINEN = (nn.Dense, nn.DenseGeneral)
ROUTED_LINEN_CONV = nn.Conv  # and subclasses; bsr_jax.Conv resolves its rule itself
# A matching compression is reported, not applied: no product hook to replace (nn.Einsum calls
# jnp.einsum directly) or a product other than the plain one (local / transposed convolutions).
REPORTED_LINEN = (nn.ConvLocal, nn.ConvTranspose, nn.Einsum)
ROUTED_NNX = (nnx.Linear, nnx.LinearGeneral)
ROUTED_NNX_CONV = nnx.Conv  # and subclasses
REPORTED_NNX = nnx.ConvTranspose  # a transposed product: no compressed op for it


@dataclasses.dataclass
class _SharedBlocks:
    """Compressed inputs of one traced call, by (input array, compression): kept once however many
    layers read them. Holds the arrays themselves so their ids stay unique while cached."""

    cache: dict[tuple[int, str, Pruning], tuple[Any, BlockSparse]] = dataclasses.field(default_factory=dict)
    # Inputs one layer has read with its own codes written by its GEMM (the fused kernels): shared
    # from the second reader on, so a layer that is its input's only reader needs no pass over it.
    first: dict[tuple[int, str, Pruning], Any] = dataclasses.field(default_factory=dict)

    @staticmethod
    def _key(source: Any, x: jax.Array, pruning: Pruning) -> tuple[int, str, Pruning]:
        return id(source), str(x.dtype), pruning

    def first_reader(self, source: Any, x: jax.Array, pruning: Pruning) -> bool:
        """True the first time ``source`` is read under ``pruning`` (recorded)."""
        cache_key = self._key(source, x, pruning)
        if self.first.get(cache_key) is source:
            return False
        self.first[cache_key] = source
        return True

    def blocks(self, source: Any, x: jax.Array, pruning: Pruning, key: jax.Array | None) -> BlockSparse:
        """Blocks of ``x``, the product's operand made from the module input ``source`` (the same
        object for every layer reading it; ``x`` may be a fresh dtype-promoted copy)."""
        cache_key = self._key(source, x, pruning)
        entry = self.cache.get(cache_key)
        if entry is None or entry[0] is not source:
            flat = jax.lax.stop_gradient(x.reshape(-1, x.shape[-1]))
            # Under a mesh, per shard of the rows (as each op compresses its own): the blocks stay
            # on the devices owning the rows, and pruned_dot_general takes them shard by shard.
            # Named (for remat policies) but not behind a per-layer barrier: each layer's barrier
            # would give it a copy of its own.
            kept = barriers.named(sharding.compress_rows(pruning.compress, flat, key))
            entry = self.cache[cache_key] = (source, kept)
        return entry[1]


def _compressing_dot_general(pruning: Pruning, key, shared: _SharedBlocks | None, path: str, source: Any = None):
    def dot_general(x, w, dims, precision=None, **kwargs):
        # preferred_element_type / out_sharding change the product itself: left to lax (dense).
        if not is_linear_dims(dims, x.ndim) or any(v is not None for v in kwargs.values()):
            layer_choice.report_dense(path, f"dot_general {dims} {kwargs} is not a plain linear map")
            return jax.lax.dot_general(x, w, dims, precision=precision, **kwargs)
        x2 = merge_contracted(x, len(dims[0][0]))
        layer_choice.record(path, pruning, x2)
        blocks = None
        # Shared blocks are computed in the forward pass, so they need the key there; a stochastic
        # layer without one keeps its own (which raises if it is differentiated).
        if shared is not None and source is not None and len(dims[0][0]) == 1 and pruning.saves_memory(x2) and (key is not None or not pruning.needs_key):
            # Where the layer's GEMM writes x's codes itself (fused kernels, on GPU and TPU), its
            # first reader keeps its own; the others share one compression of x (q/k/v: two copies
            # of the codes, no pass over x for a layer that reads its input alone, as fc2 does).
            own = writes_own_codes(x, w, dims, pruning) and shared.first_reader(source, x, pruning)
            blocks = None if own else shared.blocks(source, x, pruning, key)
        return pruned_dot_general(x, w, dims, pruning=pruning, key=key, blocks=blocks, precision=precision)

    return dot_general


def _compressing_conv(compression: Compression, key: jax.Array | None, path: str):
    """A ``lax.conv_general_dilated`` stand-in for one ``nn.Conv`` call: ``compressed_conv``
    where the call is a plain channels-last convolution of floats, else the call itself (reported)."""

    def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                             dimension_numbers=None, feature_group_count=1, batch_group_count=1, precision=None,
                             preferred_element_type=None, out_sharding=None):  # fmt: skip
        call = dict(lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
                    feature_group_count=feature_group_count, batch_group_count=batch_group_count, precision=precision,
                    preferred_element_type=preferred_element_type, out_sharding=out_sharding)  # fmt: skip
        dims = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
        floats = all(jnp.issubdtype(a.dtype, jnp.floating) for a in (lhs, rhs)) and lhs.dtype == rhs.dtype
        # nnx.Conv always passes out_sharding (None unless the caller asks for an output sharding).
        plain = batch_group_count == 1 and preferred_element_type is None and out_sharding is None
        if dims != channels_last_dimension_numbers(lhs.ndim) or not plain or not floats:
            layer_choice.report_dense(path, f"conv_general_dilated on {lhs.dtype}/{rhs.dtype} with {call} is not a plain "
                                   "channels-last convolution of one float dtype")  # fmt: skip
            return lax.conv_general_dilated(lhs, rhs, window_strides, padding, **call)
        layer_choice.record(path, compression, lhs)
        return compressed_conv(lhs, rhs, compression=compression, strides=window_strides, padding=padding,
                               lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation, feature_group_count=feature_group_count,
                               precision=precision, key=key)  # fmt: skip

    return conv_general_dilated


def _replaced(module: nn.Module, attribute: str, value: Any, call):
    """``call()`` with the module's ``attribute`` (its product hook) set to ``value``: the module
    keeps computing its own parameters; only the product it calls is replaced."""
    object.__setattr__(module, attribute, value)
    try:
        return call()
    finally:
        object.__setattr__(module, attribute, None)


def _route_linen(shared: _SharedBlocks):
    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        routed = isinstance(module, (*ROUTED_LINEN, ROUTED_LINEN_CONV, *REPORTED_LINEN))
        own_hooks = routed or isinstance(module, (PrunedModule, Conv))
        with intercept.module_call(module, routes_products=not own_hooks):
            return route(next_fun, args, kwargs, context, routed)

    def route(next_fun, args, kwargs, context, routed):
        module = context.module
        if context.method_name != "__call__" or not routed or isinstance(module, (PrunedModule, Conv)):
            return next_fun(*args, **kwargs)
        compression = layer_choice.lookup(module)
        if module.is_initializing():
            return next_fun(*args, **kwargs)
        path = layer_choice.module_path(module)
        call = lambda: next_fun(*args, **kwargs)
        # Layers no rule compresses are routed too, for their tensors' names (names.tagged).
        dense = compression is NO_MATCH or compression is None
        if isinstance(module, REPORTED_LINEN):
            if not dense:
                layer_choice.report_dense(path, f"{type(module).__name__} is not routed (nn.Dense, nn.DenseGeneral, nn.Conv and subclasses are)")
            return call()
        key = None if dense else intercept.pruning_key(compression, module)
        if isinstance(module, ROUTED_LINEN_CONV):
            if module.conv_general_dilated is not None or module.conv_general_dilated_cls is not None:
                if not dense:
                    layer_choice.report_dense(path, "the module has its own conv_general_dilated")
                return call()
            conv = lax.conv_general_dilated if dense else _compressing_conv(compression, key, path)
            return _replaced(module, "conv_general_dilated", names.tagged(conv, path), call)
        if module.dot_general is not None or module.dot_general_cls is not None or getattr(module, "batch_dims", ()):
            if not dense:
                layer_choice.report_dense(path, "the module has its own dot_general or batch dims")
            return call()
        dot_general = lax.dot_general if dense else _compressing_dot_general(compression, key, shared, path, source=args[0] if args else None)
        return _replaced(module, "dot_general", names.tagged(dot_general, path), call)

    return interceptor


@contextlib.contextmanager
def compressing(rules: rules_lib.Rules, *, lean: bool = True) -> Iterator[_SharedBlocks]:
    """The context ``compress_model``'s linen modules apply under (usable around any linen apply)."""
    shared = _SharedBlocks()
    lean_context = lean_ops.lean_neighbours() if lean else contextlib.nullcontext()
    with rules_lib.use_rules(rules), intercept.product_interception(), nn.intercept_methods(_route_linen(shared)), lean_context:
        yield shared


def _linen_compressed(model: nn.Module, rules: rules_lib.Rules, lean: bool, treatment: lean_graph.Treatment | None,
                      loss_chunk: int | None) -> nn.Module:  # fmt: skip
    """``lean``: inside ``bsr_jax.rewrite.lean``'s context; ``treatment``: evaluated by ``lean_graph``;
    ``loss_chunk``: inside ``bsr_jax.ops.head_loss``'s."""
    base = type(model)
    if treatment is not None:
        treatment = dataclasses.replace(treatment, roots=frozenset({base.__name__}))

    def apply(self, variables, *args, **kwargs):
        def run(variables, *args, **kwargs):
            intercept.mark_parameters(variables.get("params", {}))
            return base.apply(self, variables, *args, **kwargs)

        head_losses = (head_loss.recognising_head_losses(loss_chunk, scope=f"{base.__name__}.apply (compress_model(loss_chunk=...))")
                       if loss_chunk is not None else contextlib.nullcontext())  # fmt: skip
        # lean_graph's lean modules take bsr_jax.rewrite.lean's attention; not where a dx format keeps q, k, v.
        by_path = lean_ops.lean_attention(treatment.lean_exact) if treatment is not None else contextlib.nullcontext()
        # ... and ReLU's 1-bit mask where a rule compresses a layer below them (bsr_jax.rewrite.lean_relu).
        masks = lean_relu.lean_relu(lambda p: treatment.lean_exact(p) and rules_lib.compresses_below(rules, p)) if treatment and not lean else contextlib.nullcontext()
        with compressing(rules, lean=lean), head_losses, by_path, masks:
            # lean: hand-written norms, activations and attention keep less too (bsr_jax.rewrite.lean_graph).
            return lean_graph.lean_call(run, variables, *args, treatment=treatment, **kwargs) if treatment is not None else run(variables, *args, **kwargs)

    def init_with_output(self, rngs, *args, **kwargs):
        # Parameters are created by the original modules (compression only changes gradients); the
        # rules are still resolved, so a rule naming no layer fails at init already.
        with compressing(rules, lean=False):
            return base.init_with_output(self, rngs, *args, **kwargs)

    cls = type(base.__name__, (base,), {"apply": apply, "init_with_output": init_with_output, "__module__": base.__module__})
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.init and f.name not in ("parent", "name")}
    return cls(**fields)


def _nnx_table(model: nnx.Module, rules: rules_lib.Rules) -> LayerTable:
    """``rules`` resolved for each routed NNX layer, in module order (NNX layers are routed before
    any trace): the table ``_nnx_compress`` applies, dense layers (with why) included."""
    rows, matched = [], set()
    for path, module in layer_choice.nnx_module_paths(model):
        if not isinstance(module, (*ROUTED_NNX, ROUTED_NNX_CONV, REPORTED_NNX)):
            continue
        i, compression, reason = rules_lib.resolve(rules, path, module, isinstance(module, (ROUTED_NNX_CONV, REPORTED_NNX)))
        if i is not None:
            matched.add(i)
        compression = None if compression is NO_MATCH else compression
        if compression is not None and isinstance(module, REPORTED_NNX):
            reason = f"{type(module).__name__} is not routed (nnx.Linear, nnx.LinearGeneral, nnx.Conv and subclasses are)"
        elif compression is not None and isinstance(module, ROUTED_NNX_CONV) and module.conv_general_dilated is not lax.conv_general_dilated:
            reason = "the module has its own conv_general_dilated"
        if reason is not None:
            layer_choice.report_dense(path, reason)
            compression = None
        elif compression is not None and compression.needs_key:
            raise ValueError(f"{path}: stochastic pruning/rounding needs the linen path (NNX has no pruning rng here)")
        rows.append(LayerRow(path, type(module).__name__, compression, reason))
    error = rules_lib.unmatched_error(rules, matched, "nnx.Linear / nnx.LinearGeneral / nnx.Conv")
    if error is not None:
        raise error
    return LayerTable(tuple(rows))


def _nnx_compress(model: nnx.Module, rules: rules_lib.Rules, lean: bool) -> nnx.Module:
    table = _nnx_table(model, rules)
    modules = dict(layer_choice.nnx_module_paths(model))
    for row in table:
        module = modules[row.path]
        # Dense rows are routed too, for their tensors' names: their own product, named.
        if isinstance(module, ROUTED_NNX_CONV):
            conv = module.conv_general_dilated if row.compression is None else _compressing_conv(row.compression, None, row.path)
            module.conv_general_dilated = names.tagged(conv, row.path)
        elif isinstance(module, ROUTED_NNX):
            dot_general = module.dot_general if row.compression is None else _compressing_dot_general(row.compression, None, None, row.path)
            module.dot_general = names.tagged(dot_general, row.path)
    # NNX modules are called directly, outside any context of ours: the root's class becomes a
    # subclass whose __call__ shows the table to a collecting trace (layer_table, residual_report)
    # and, with lean, runs inside lean_neighbours (split/merge keep the subclass).
    base = type(model)

    def __call__(self, *args, **kwargs):
        for row in table:
            layer_choice.resolved(row.path, row.layer, row.reason)
        with lean_ops.lean_neighbours() if lean else contextlib.nullcontext():
            return base.__call__(self, *args, **kwargs)

    model.__class__ = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})
    return model


def _modes(lean: bool | Sequence[tuple[str, bool]], remat: Sequence[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
    """``lean_graph`` mode rules from ``compress_model``'s ``lean`` and ``remat``, checked."""
    modes: list[tuple[str, Any]] = []
    for rule in remat:
        if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str) and (rule[1] is None or callable(rule[1]))):
            raise ValueError(f"remat must be (pattern, jax.checkpoint policy or None) pairs, got {rule!r}")
        modes.append((rule[0], lean_graph.Remat(rule[1])))
    if lean is False and modes:
        modes.append(("*", False))  # remat only: every other module as traced
    if not isinstance(lean, bool):
        for rule in lean:
            if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str) and isinstance(rule[1], bool)):
                raise ValueError(f"lean must be True, False or (pattern, bool) pairs, got {rule!r}")
            modes.append(rule)
    return tuple(modes)


def compress_model(model: Any, rules: Rule | Sequence[Rule] | LayerTable, *, lean: bool | Sequence[tuple[str, bool]] = True,
                   dx: lean_graph.DxRules = None, remat: Sequence[tuple[str, Callable[..., bool] | None]] = (),
                   loss_chunk: int | None = None) -> Any:  # fmt: skip
    """``model`` with block-pruned residuals where ``rules`` say (first match by module path).

    Args:
      model: a ``flax.linen.Module`` (unbound) or a ``flax.nnx.Module``.
      rules: ``bsr_jax.Rule(pattern, compression)``s, or one; e.g. ``[Rule("*", Pruning(0.7, block=16))]``;
        at least one (an empty list is a ``ValueError``). Or a ``bsr_jax.LayerTable`` (from
        ``bsr_jax.layer_table`` or ``Plan.table``): each layer keeps what its row says, found by
        exact path; a row naming a layer the model does not have is a ``ValueError``.
      lean: also make norms, activations and attention keep less (exact; ``bsr_jax.rewrite.lean``); or
        ``[(pattern, bool), ...]`` by module path, first match (unmatched: lean), linen only:
        ``[("blocks_0/*", False)]`` leaves what ``blocks_0``'s submodules keep to XLA (then only
        ``bsr_jax.rewrite.lean_graph`` makes modules lean, not ``bsr_jax.rewrite.lean``'s replaced functions;
        ReLU keeps a 1-bit mask only in lean modules with a compressed layer below them, ``lean_relu``).
      remat: ``[(pattern, policy), ...]`` (linen): the module whose path a pattern matches (the
        shortest such path) and everything below it run under one ``jax.checkpoint(policy=...)``,
        as if the model had wrapped it in ``nn.remat(..., policy=policy)``; ``None``: JAX's
        default, keeping nothing. Inside ``nn.scan``, each layer (iteration) is checkpointed.
        Exact: the forward pass is unchanged, gradients are recomputed.
      dx: approximate input gradients, opt-in (linen, with ``lean``): ``"int8"`` or ``"int4"``
        stores what the backward of every recognised norm, activation and attention reads (their
        inputs, e.g. GELU's input, q/k/v) in that format (``bsr_jax.ops.dx``), or ``[(pattern,
        format or None), ...]`` by module path, first match (``[("*attention*", None), ("*",
        "int8")]``). ``None`` (the default): exact.
      loss_chunk: tokens per chunk (linen): where the model's ``__call__`` ends with its head and
        ``optax.softmax_cross_entropy_with_integer_labels(logits, labels)`` (or the one-hot form),
        the pair runs ``loss_chunk`` tokens at a time and the ``(..., V)`` logits never exist
        (``bsr_jax.ops.head_loss``: what is recognised; loss and gradients as the plain form's within
        f32 rounding). A loss outside the model needs ``bsr_jax.chunked_head_loss``. An ``apply``
        in which nothing is recognised warns. ``None`` (the default): off.

    Random options (``Pruning(stochastic=True)`` or ``rounding="stochastic"``) draw their keys from
    the ``"pruning"`` rng stream: ``model.apply(variables, x, rngs={"pruning": key})`` (linen only;
    nested ``submodule.apply`` calls inside the model use the caller's stream).

    Returns:
      linen: a module of a subclass of ``type(model)`` with the same attributes, whose ``init`` gives
      the same parameter tree and whose ``apply`` compresses; NNX: ``model`` itself, routed in place.
    """
    rules = rules_lib.as_rules(rules)
    if not rules:
        raise ValueError(
            "rules is empty: compress_model needs at least one bsr_jax.Rule, e.g. "
            "[Rule('*', bsr_jax.rewrite.presets.recommended(0.5))] (Rule(pattern, None) leaves matching layers dense)"
        )
    if dx is not None:
        for fmt in [dx] if isinstance(dx, str) else [f for _, f in dx]:
            check_dx(fmt)
        if lean is False or not isinstance(model, nn.Module):
            raise ValueError("dx needs lean=True and a flax.linen model (NNX models: not yet)")
    if loss_chunk is not None:
        head_loss.check_chunk(loss_chunk, "loss_chunk (None: off)")
        if not isinstance(model, nn.Module):
            raise ValueError("loss_chunk needs a flax.linen model (NNX models: not yet)")
    modes = _modes(lean, remat)
    if modes and not isinstance(model, nn.Module):
        raise ValueError("lean rules by path and remat= need a flax.linen model (NNX: lean=True/False only)")
    if isinstance(model, nn.Module):
        treatment = lean_graph.Treatment(dx=dx, modes=modes) if lean is not False or modes else None
        # Rules by path: lean_graph alone (bsr_jax.rewrite.lean's replacements apply everywhere or nowhere).
        return _linen_compressed(model, rules, lean is True, treatment, loss_chunk)
    if isinstance(model, nnx.Module):
        return _nnx_compress(model, rules, lean)
    raise ValueError(f"model must be a flax.linen or flax.nnx Module, got {type(model).__name__}")

