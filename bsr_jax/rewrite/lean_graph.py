"""Lean neighbours recognised by what the program computes, not by which function or module it calls.

``bsr_jax.rewrite.lean`` replaces known functions and modules (``nn.LayerNorm``, ``nn.gelu``,
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
   saved values. ``jax.nn.relu`` and other calls (``custom_jvp``, ``jit``, nested checkpoints)
   count as what they call. A segment with nothing to recompute (a convolution alone, a Dense and
   its bias, reading what the step computed: ``lean_policy.recomputes_nothing_read``) runs without
   a checkpoint, whose optimization barrier would only keep its weights live beside XLA's copies;
4. a module's own computation that reads a cheap output of one of its submodules (a parent adding
   its children's BatchNorm outputs and applying ReLU) recomputes that output inside its
   checkpoint from what the submodule keeps anyway, rather than keeping it as a checkpoint input;
   and a submodule that is the only reader of a cheap output of its parent's own computation (the
   second Dense of an MLP reading the GELU between them) recomputes that computation (products
   excluded) from its inputs, which the activation's backward keeps anyway: each checkpoint keeps
   its inputs, and XLA, which recomputes such outputs in a dense step, cannot look across a
   checkpoint's boundary;
5. a ``scan`` (layers stacked with ``nn.scan``) is bound again with its body evaluated the same
   way, segment by segment (``_lean_scan``), so each layer keeps what it keeps in a Python loop of
   layers; other control flow (``while``, ``cond``) runs as traced, inside its segment;
6. ``Treatment.modes`` (``compress_model``'s ``lean`` rules and ``remat``) change this by module
   path: a module left as traced (no checkpoint: XLA keeps what it keeps), or a module and all its
   submodules run under one ``jax.checkpoint`` with a JAX policy, as ``nn.remat`` would (inside a
   ``scan``'s body, per layer). This is how ``bsr_jax.plan`` gives each block its own treatment
   without editing the model.

So each module keeps only what its exact backward needs from its inputs and its linear layers'
outputs: a hand-written RMSNorm its input; ``silu(gate) * up`` the gate and up projections; einsum
attention q, k and v (probabilities recomputed, as flash attention does, and as ``bsr_jax.rewrite.lean``
does for ``nn.dot_product_attention``); dropout its key. No linear layer's product is recomputed,
and segments follow the forward's module order, so the backward recomputes one module's
intermediates right before that module's backward, not all of them at once.

Forward values are the traced equations evaluated again (bit-identical); gradients are plain
autodiff's of the same equations, recomputed (equal up to float reassociation). Inputs that are
not traced (an op-by-op forward of concrete arrays, which has no backward pass) run ``fn`` as is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jax_core
from jax.extend import source_info_util

from bsr_jax.core.call_arrays import split_arrays
from bsr_jax.measure.report import module_path
from bsr_jax.ops import head_loss
from bsr_jax.ops.dx import stored_compressed
from bsr_jax.rewrite.lean_policy import both, policy, recomputed, recomputes_nothing_read

# A bsr_jax.ops.dx format for every module, or (pattern, format or None) rules by module path.
DxRules = str | Sequence[tuple[str, str | None]] | None


@dataclasses.dataclass(frozen=True)
class Remat:
    """A module evaluated as ``nn.remat`` would: all of its computation (its submodules' too)
    under one ``jax.checkpoint(policy=policy)``; ``None`` keeps nothing (JAX's default)."""

    policy: Callable[..., bool] | None = None


# How a module's computation is evaluated, ``(pattern, mode)`` rules by module path (the path
# rules match: the root's class name dropped), first match: ``True`` lean (a checkpoint per
# segment, ``policy``), ``False`` as traced (XLA keeps what it keeps), ``Remat``. A ``Remat`` rule
# applies to the module its pattern names and everything below it; no match: lean.
ModeRules = Sequence[tuple[str, "bool | Remat"]]


@dataclasses.dataclass(frozen=True)
class Treatment:
    """What ``evaluate`` does with each module: ``dx`` rules, ``modes``, and ``roots`` (the root
    module's class name, dropped from paths before ``modes`` match them)."""

    dx: DxRules = None
    modes: ModeRules = ()
    roots: frozenset[str] = frozenset()

    def _parts(self, path: str) -> list[str]:
        parts = path.split("/") if path else []
        return parts[1:] if parts and parts[0] in self.roots else parts

    def dx_format(self, path: str) -> str | None:
        """The ``bsr_jax.ops.dx`` format for the module at ``path``: ``dx`` itself, or its first rule
        ``(pattern, format)`` whose pattern matches the path."""
        if self.dx is None or isinstance(self.dx, str):
            return self.dx
        path = "/".join(self._parts(path))
        return next((fmt for pattern, fmt in self.dx if fnmatch.fnmatchcase(path, pattern)), None)

    def mode(self, path: str) -> tuple[str | None, bool | Remat]:
        """``(block, Remat)`` for a path at or below a module a ``Remat`` rule names (``block``: that
        module's path, the shortest such), else ``(None, lean or not)``."""
        if not self.modes:
            return None, True
        parts = self._parts(path)
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            mode = next((m for pattern, m in self.modes if fnmatch.fnmatchcase(prefix, pattern)), True)
            if isinstance(mode, Remat):
                return prefix, mode
        mode = next((m for pattern, m in self.modes if fnmatch.fnmatchcase("/".join(parts), pattern)), True)
        return None, bool(mode)

    def lean_exact(self, path: str) -> bool:
        """Whether the module at ``path`` is lean (a checkpoint per segment) with no ``dx`` format:
        where recomputing its neighbours' cheap values, not storing them compressed, applies."""
        return self.mode(path) == (None, True) and self.dx_format(path) is None

def _segments(eqns: list[Any]) -> tuple[list[list[Any]], list[str]]:
    """Maximal runs of consecutive equations with one module path (einsum specs and transform
    wrappers in the name stack do not count: ``module_path`` drops them), and each run's path."""
    segments: list[list[Any]] = []
    paths: list[str] = []
    for eqn in eqns:
        path = module_path(eqn.source_info.name_stack)
        if segments and path == paths[-1]:
            segments[-1].append(eqn)
        else:
            segments.append([eqn])
            paths.append(path)
    return segments, paths


def _below(path: str, parent: str) -> bool:
    """Whether module ``path`` is a submodule (at any depth) of module ``parent``."""
    return path.startswith(parent + "/") if parent else bool(path)


def _has_product(eqn: Any) -> bool:
    """Whether ``eqn`` is, or calls, a ``dot_general`` (attention's batched products among them)."""
    return eqn.primitive.name == "dot_general" or any(_has_product(e) for j in jax_core.jaxprs_in_params(eqn.params) for e in j.eqns)


def _pulled(segment: list[Any], path: str, producers: dict[Any, tuple[Any, int, str]], readers: dict[Any, set[int]],
            index: int, pullable: Callable[[int], bool]) -> list[Any]:  # fmt: skip
    """The equations of other modules that ``segment`` (module ``path``'s own, unit ``index``)
    recomputes rather than keeping their outputs:

    * down: the recomputed producers of its inputs that lie below ``path``, and theirs in turn as
      long as each lies in its reader's segment or below its reader's module (a parent's ReLU reads
      a child's BatchNorm output, which reads the grandchild convolution's output);
    * up: where the segment is a submodule reading a cheap output of its parent's own computation
      that nothing else reads (a Dense reading its MLP's GELU), that computation within the
      parent's segment, products excluded (attention's ``p v`` stays kept); not where the parent's
      unit is not ``pullable`` (a ``dx`` format stores its inputs).

    The chain stops at what is kept anyway (products, convolutions, named residuals, the parent's
    segment's inputs), and never follows a value across sibling modules (a residual stream from
    block to block). Without it, a module reading a cheap output of a neighbour (transformers'
    ResNet adds its children's BatchNorm outputs and applies ReLU; a Dense reads a GELU's output)
    keeps that output as an input of its ``jax.checkpoint``, beside the neighbour's input, kept for
    the neighbour's backward: two arrays where XLA, with no checkpoint boundary between them,
    keeps one and recomputes the other (a dense ViT-B/16 on TPU v5p keeps the GELU's input only)."""
    defined = {v for eqn in segment for v in eqn.outvars}
    pulled: dict[int, Any] = {}
    for v in dict.fromkeys(v for eqn in segment for v in eqn.invars if isinstance(v, jax_core.Var) and v not in defined):
        chain: dict[int, Any] = {}
        todo = [(v, path, None, False)]  # (input, reader's path, reader's segment, whether pulled up)
        while todo:
            u, reader_path, reader_segment, up = todo.pop()
            if not isinstance(u, jax_core.Var) or u not in producers:
                continue
            eqn, producer, eqn_path = producers[u]
            if id(eqn) in chain or id(eqn) in pulled:
                continue
            if up:  # within the parent's segment only; its inputs are kept
                if producer == reader_segment and recomputed(eqn) and not _has_product(eqn):
                    chain[id(eqn)] = eqn
                    todo.extend((w, eqn_path, producer, True) for w in eqn.invars)
                continue
            if not recomputed(eqn):
                if producer == reader_segment:
                    # Kept only as computed inside the submodule (a Dense's product before its
                    # bias): nothing kept anyway to recompute from, so the output stays an input.
                    chain = {}
                    break
                continue
            if producer == reader_segment or _below(eqn_path, reader_path):
                chain[id(eqn)] = eqn
                todo.extend((w, eqn_path, producer, False) for w in eqn.invars)
            elif (reader_segment is None and _below(path, eqn_path) and readers[u] == {index} and pullable(producer)
                  and not _has_product(eqn)):  # fmt: skip
                chain[id(eqn)] = eqn
                todo.extend((w, eqn_path, producer, True) for w in eqn.invars)
        pulled.update(chain)
    return list(pulled.values())


def _read(env: dict[Any, Any], v: Any) -> Any:
    return v.val if isinstance(v, jax_core.Literal) else env[v]


def _lean_scan(eqn: Any, values: list[Any], treatment: Treatment, computed: list[bool]) -> list[Any]:
    """``eqn``, a ``scan``, with its body evaluated by ``evaluate`` (each of the body's segments
    under its own ``jax.checkpoint``), otherwise as bound.

    Layers stacked with ``nn.scan`` are one ``scan`` equation whose body is one layer. Bound as
    traced, the only checkpoint is the segment's around the whole ``scan``, and its backward
    recomputes what the policy does not save for all iterations at once, stacked, before the
    backward ``scan`` reads it: ``(layers, B, heads, T, T)`` of attention probabilities (gpt2-small
    with int4 residuals kept 0.96 of dense's compiled peak on H100 this way, 0.41 with a loop of
    layers). With a checkpoint per segment inside the body, each iteration's backward recomputes
    its own layer's values, and each module keeps what it keeps in a loop of layers, stacked.

    The ``scan``'s operands are its body's inputs in order: ``num_consts`` loop invariants,
    ``num_carry`` carries, then the scanned slices; its outputs the carries, then the stacked
    per-iteration outputs. ``jax.lax.scan`` traces the body anew (its consts become the new
    ``scan``'s loop invariants) and checks that carries keep their types. ``computed``: which
    operands the step computed (``evaluate``'s dx formats store only those); carries count as
    computed, since every iteration after the first reads the previous one's output."""
    params = eqn.params
    body, num_consts, num_carry = params["jaxpr"], params["num_consts"], params["num_carry"]
    consts, init, xs = values[:num_consts], values[num_consts : num_consts + num_carry], values[num_consts + num_carry :]

    body_computed = [*computed[:num_consts], *[True] * num_carry, *computed[num_consts + num_carry :]]

    def step(carry, x):
        out = evaluate(body.jaxpr, body.consts, [*consts, *carry, *x], treatment, body_computed)
        return out[:num_carry], out[num_carry:]

    carry, ys = jax.lax.scan(step, list(init), list(xs), length=params["length"], reverse=params["reverse"],
                             unroll=params["unroll"], _split_transpose=params.get("_split_transpose", False))  # fmt: skip
    return [*carry, *ys]


def _remat_inside(eqn: Any, treatment: Treatment | None) -> Remat | None:
    """The ``Remat`` mode of a module whose computation a model's own checkpoint (``eqn``, an
    ``nn.remat`` around a scanned layer, traced without a module path of its own) holds, if any."""
    if treatment is None:
        return None
    modes = (treatment.mode(module_path(e.source_info.name_stack))[1] for e in eqn.params["jaxpr"].eqns)
    return next((m for m in modes if isinstance(m, Remat)), None)


def _run_segment(segment: list[Any], ins: list[Any], outs: list[Any], treatment: Treatment | None,
                 arguments: frozenset[Any] = frozenset(), within: Remat | None = None) -> Callable[..., list[Any]]:  # fmt: skip
    """The segment's equations as a function of ``ins`` returning ``outs``; a ``scan`` among them
    evaluates its body as ``evaluate`` does (``_lean_scan``; ``arguments``: the variables that are
    the step's arguments, not computed), or as bound where ``treatment`` is None (inside a
    ``Remat`` module, whose checkpoint decides for all of it: ``within``, whose policy the
    module's own checkpoints take as well, ``lean_policy.both``)."""

    def run(*values):
        env = dict(zip(ins, values))
        for eqn in segment:
            # As jax.core.eval_jaxpr: the equation keeps its name stack, so module paths (rules,
            # residual_report) stay what they were when traced.
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            invals = [_read(env, v) for v in eqn.invars]
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
                if eqn.primitive is jax.lax.scan_p and treatment is not None:
                    computed = [isinstance(v, jax_core.Var) and v not in arguments for v in eqn.invars]
                    out = _lean_scan(eqn, invals, treatment, computed)
                else:
                    params = eqn.params
                    remat = (within or _remat_inside(eqn, treatment)) if eqn.primitive.name == "remat2" else None
                    if remat is not None:
                        params = {**params, "policy": both(remat.policy, params["policy"])}
                    out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
            env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
        return [env[v] for v in outs]

    return run


def _backward_reads(fn: Callable[..., Any], args: list[Any]) -> list[bool]:
    """Which of ``args`` the backward pass of ``fn`` keeps (the residuals of its vjp, traced only)."""
    closed = jax.make_jaxpr(lambda *a: jax.tree.leaves(jax.vjp(fn, *a)[1]))(*args)
    kept = {v for v in closed.jaxpr.outvars if isinstance(v, jax_core.Var)}
    return [v in kept for v in closed.jaxpr.invars]


def _units(segments: list[list[Any]], paths: list[str], treatment: Treatment) -> list[tuple[list[Any], str, bool | Remat]]:
    """The segments grouped as ``evaluate`` runs them, ``(equations, path, mode)``: consecutive
    segments at or below one ``Remat`` module merged into one unit (its path the module's), every
    other segment its own unit, lean or not."""
    units: list[tuple[list[Any], str, bool | Remat]] = []
    previous = None
    for segment, path in zip(segments, paths):
        block, mode = treatment.mode(path)
        if block is not None and block == previous:
            units[-1][0].extend(segment)
        else:
            units.append((list(segment), block if block is not None else path, mode))
        previous = block
    return units


def evaluate(jaxpr: Any, consts: list[Any], args: list[Any], treatment: Treatment = Treatment(),
             computed: Sequence[bool] | None = None) -> list[Any]:  # fmt: skip
    """``jaxpr``'s outputs, each segment (module) evaluated under ``jax.checkpoint(policy=policy)``,
    with the cheap outputs of its submodules that it reads recomputed inside (``_pulled``), unless
    ``treatment.modes`` say otherwise: as traced, or a whole module under one checkpoint (``Remat``).

    With ``treatment.dx`` (a ``bsr_jax.ops.dx`` format, or ``(pattern, format or None)`` rules by module
    path, first match): a lean segment that keeps nothing of its own (every equation recomputed: a
    norm, an activation, attention's softmax) keeps the inputs its backward reads in that format
    instead (``bsr_jax.ops.dx.stored_compressed``): those the step computed, not its arguments
    (parameters, the model's inputs). ``computed``: which of ``args`` the step computed (a
    ``scan`` body's carries; by default none: ``args`` are the step's arguments)."""
    segments, paths = _segments(jaxpr.eqns)
    units = _units(segments, paths, treatment)
    order = {id(eqn): i for i, eqn in enumerate(jaxpr.eqns)}
    producers = {v: (eqn, i, path) for i, (unit, path, _) in enumerate(units) for eqn in unit for v in eqn.outvars}
    readers: dict[Any, set[int]] = {v: {-1} for v in jaxpr.outvars if isinstance(v, jax_core.Var)}
    for i, (unit, _, _) in enumerate(units):
        for v in (v for eqn in unit for v in eqn.invars if isinstance(v, jax_core.Var)):
            readers.setdefault(v, set()).add(i)
    pullable = lambda i: treatment.lean_exact(units[i][1])  # noqa: E731
    # Each unit's equations to run: for a lean one the pulled producers (in program order), then its own.
    runs = [(sorted(_pulled(unit, path, producers, readers, i, pullable), key=lambda e: order[id(e)]) if mode is True else []) + unit
            for i, (unit, path, mode) in enumerate(units)]  # fmt: skip
    # Variables read after each unit (by later units or as outputs): what it must return.
    needed_after: list[set[Any]] = []
    live = {v for v in jaxpr.outvars if isinstance(v, jax_core.Var)}
    for run in reversed(runs):
        needed_after.append(set(live))
        live.update(v for eqn in run for v in eqn.invars if isinstance(v, jax_core.Var))
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    computed = computed or [False] * len(args)
    arguments = frozenset(jaxpr.constvars) | {v for v, c in zip(jaxpr.invars, computed) if not c}
    for (unit, path, mode), run, after in zip(units, runs, reversed(needed_after)):
        defined = {v for eqn in run for v in eqn.outvars}
        ins = list(dict.fromkeys(v for eqn in run for v in eqn.invars if isinstance(v, jax_core.Var) and v not in defined))
        outs = [v for eqn in unit for v in eqn.outvars if v in after]
        values = [env[v] for v in ins]
        if isinstance(mode, Remat):
            segment_fn = jax.checkpoint(_run_segment(run, ins, outs, None, arguments, within=mode), policy=mode.policy)
        elif mode is False or recomputes_nothing_read(run, arguments):
            segment_fn = _run_segment(run, ins, outs, treatment, arguments)
        else:
            segment_fn = jax.checkpoint(_run_segment(run, ins, outs, treatment, arguments), policy=policy)
            fmt = treatment.dx_format(path)
            if fmt is not None and all(recomputed(eqn) for eqn in run):
                produced = [v not in arguments for v in ins]
                read = _backward_reads(segment_fn, values)
                segment_fn = stored_compressed(segment_fn, fmt, only=[p and r for p, r in zip(produced, read)], unread=[not r for r in read])
        with jax.named_scope(path) if path else contextlib.nullcontext():
            env.update(zip(outs, segment_fn(*values)))
    return [_read(env, v) for v in jaxpr.outvars]


_COMPUTED = object()  # marks the result leaves the jaxpr computes


def lean_call(fn: Callable[..., Any], *args: Any, treatment: Treatment = Treatment(), **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, keeping for the backward pass only what each module's computation
    needs (see the module docstring), in ``treatment.dx``'s format where given, each module as
    ``treatment.modes`` say (``evaluate``). Array leaves of
    the arguments are traced; other leaves (``train=True``, ``mutable=[...]``) and non-array leaves
    of the result stay Python values."""
    arrays, rebuild = split_arrays(args, kwargs)
    if not any(isinstance(a, jax.core.Tracer) for a in arrays):
        return fn(*args, **kwargs)  # nothing is differentiated
    result: dict[str, Any] = {}

    def traced(*arrays):
        call_args, call_kwargs = rebuild(arrays)
        out_leaves, result["tree"] = jax.tree.flatten(fn(*call_args, **call_kwargs))
        result["static"] = [_COMPUTED if isinstance(o, jax.Array) else o for o in out_leaves]
        outs = [o for o in out_leaves if isinstance(o, jax.Array)]
        # A head whose logits the caller's loss may chunk (bsr_jax.ops.head_loss) reads arrays inside:
        # returned too, so the evaluated logits can be recorded with the evaluated head's operands.
        result["heads"], head_arrays = head_loss.carried(outs)
        return outs + head_arrays

    closed = jax.make_jaxpr(traced)(*arrays)
    values = evaluate(closed.jaxpr, closed.consts, arrays, treatment)
    count = sum(s is _COMPUTED for s in result["static"])
    head_loss.recarry(values[:count], result["heads"], values[count:])
    computed = iter(values[:count])
    return jax.tree.unflatten(result["tree"], [next(computed) if s is _COMPUTED else s for s in result["static"]])
