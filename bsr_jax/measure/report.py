"""Where the backward pass keeps its bytes: a table of residuals by module path and kind.

``residual_report(loss, params, *args)`` traces ``jax.vjp`` of the loss (nothing runs), takes the
residuals its VJP closure holds (each distinct array once, as ``bsr_jax.residual_bytes`` counts
them), and, for each one, finds the forward equation that produced it and the backward equations
that read it. Module paths come from the name stack Flax (linen's named scopes) records in each
equation's source info, with JAX's transform wrappers (``jvp(...)``, ``transpose(...)``) and the
linen root's class name removed, so they are the paths rules and ``pruning_plan`` use (a nested
``submodule.apply`` included: ``lm_head``); arrays produced outside any submodule, by the loss
function or by the root module's own code, have the path ``""`` (printed as ``(top level)``).
NNX modules record no name stack: while the report traces, each NNX module called under the
outermost one (the root) gets its attribute path as name stack (``layers/0/mlp``:
``layer_choice.nnx_module_paths``, the paths ``compress_model``'s rules match). Module copies an NNX
transform makes (``nnx.remat``, ``nnx.scan``; lean NNX norms run under ``nnx.remat``) are not the
root's and take the path of the module calling the transform.

Kinds, in order of precedence:

* ``parameter``: computed from the parameters (first argument) alone and of a parameter's size,
  e.g. a kernel or a reshaped LayerNorm scale; the same bytes at any batch size;
* ``input``: another argument (e.g. the batch) or an array the loss closes over (a batch bound in
  ``loss = lambda p: ...``), or a view of one (reshape, transpose, dtype cast);
* ``shared``: an activation the backward pass reads in several modules (one kept array serving,
  e.g., the q, k and v projections), compressed or not;
* ``compressed``: an array of a bsr_jax block-sparse residual (named ``RESIDUAL_NAME``);
* ``dense``: any other activation.

``layers``: the per-layer table the traced call resolved (``bsr_jax.LayerTable``: what each layer's
backward keeps and how, dense layers with why), printed after the residuals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.extend as jex
from flax import nnx
from jax.extend import source_info_util

from bsr_jax.core.names import RESIDUAL_NAME
from bsr_jax.measure.memory import MIB, _aval_bytes
from bsr_jax.core.layer_choice import collecting, nnx_module_paths
from bsr_jax.core.layer_table import LayerTable

KINDS = ("parameter", "input", "shared", "compressed", "dense")
# How format() prints the path "": computed (or read) outside any submodule, by the loss function
# itself or by the root module's own code (e.g. an activation called in its __call__).
TOP_LEVEL = "(top level)"
# Primitives that only relabel, reshape or repack their input: a compressed array stays compressed
# through them (e.g. a view of the kept blocks, or compress_model's stop_gradient on them).
_VIEWS = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "convert_element_type", "copy", "copy_p", "stop_gradient", "optimization_barrier"})


@dataclasses.dataclass(frozen=True)
class ReportRow:
    """One distinct array kept for the backward pass.

    path: module path of the equation that produced it (``"Mixer/MixerBlock_0/LayerNorm_0"``), or
      for an argument kept as is its tree path (``"0/params/Dense_0/kernel"``: argument 0);
    kind: one of ``KINDS``; readers: module paths of the backward equations that read it.
    """

    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    readers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ResidualReport:
    """The residuals of a loss's VJP, in program order, with totals by kind; ``layers``: the
    per-layer table of what the traced call's layers resolved."""

    rows: tuple[ReportRow, ...]
    layers: LayerTable = LayerTable(())

    @property
    def total(self) -> int:
        return sum(r.nbytes for r in self.rows)

    def totals(self) -> dict[str, int]:
        """Bytes by kind (every kind of ``KINDS`` present, zeros included) and ``"total"``."""
        by_kind = {kind: sum(r.nbytes for r in self.rows if r.kind == kind) for kind in KINDS}
        return {**by_kind, "total": self.total}

    def by_path(self) -> dict[tuple[str, str], int]:
        """Bytes by (module path, kind), in order of first appearance."""
        grouped: dict[tuple[str, str], int] = {}
        for r in self.rows:
            grouped[(r.path, r.kind)] = grouped.get((r.path, r.kind), 0) + r.nbytes
        return grouped

    def format(self, *, group: bool = True) -> str:
        """A text table; ``group=True``: one line per (module path, kind), else one per array. Path
        ``""`` (outside any submodule) prints as ``TOP_LEVEL``, with a line saying what that is."""
        width = max([len(r.path or TOP_LEVEL) for r in self.rows] + [len("module path")])
        lines = [f"{'module path':<{width}} {'kind':<10} {'arrays':>6} {'KiB':>10}  shapes -> read by"]
        groups: dict[tuple[str, str], list[ReportRow]] = {}
        for r in self.rows:
            groups.setdefault((r.path, r.kind) if group else (r.path, r.kind, id(r)), []).append(r)
        for (path, kind, *_), rows in groups.items():
            shapes: dict[str, int] = {}
            for r in rows:
                text = f"{r.dtype}[{','.join(map(str, r.shape))}]"
                shapes[text] = shapes.get(text, 0) + 1
            shape_text = ", ".join(f"{n}x {s}" if n > 1 else s for s, n in shapes.items())
            readers = sorted({reader or TOP_LEVEL for r in rows for reader in r.readers})
            nbytes = sum(r.nbytes for r in rows)
            lines.append(f"{path or TOP_LEVEL:<{width}} {kind:<10} {len(rows):>6} {nbytes / 1024:>10.1f}  {shape_text} -> {', '.join(readers) or '-'}")
        if any(r.path == "" or "" in r.readers for r in self.rows):
            lines.append(f"{TOP_LEVEL}: made or read outside every submodule: by the loss function itself or the root module's own code")
        totals = self.totals()
        lines.append(", ".join(f"{kind} {totals[kind] / MIB:.3f}" for kind in KINDS) + f"; total {self.total / MIB:.3f} MiB")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format() + (f"\n\n{self.layers}" if self.layers else "")


_TRANSFORM = re.compile(r"^\w+\((.*)\)$")


def module_path(name_stack: Any, roots: frozenset[str] = frozenset()) -> str:
    """A module path from an equation's name stack: ``"transpose(jvp(Net))/Dense_0/transpose()"``
    -> ``"Net/Dense_0"``. A method scope (``"wte.attend"``) counts as its module (``"wte"``);
    repeated scopes that lifted transforms (``nn.checkpoint``) add and scopes that name no module
    (einsum specs) are dropped. A first part in ``roots`` (the class name of a linen root module)
    is dropped too, so the path is the one rules match (``"Dense_0"``)."""
    parts = []
    for part in str(name_stack).split("/"):
        while (match := _TRANSFORM.match(part)) is not None:
            part = match.group(1)
        part = part.split(".")[0]
        if part and "->" not in part and (not parts or parts[-1] != part):
            parts.append(part)
    if parts and parts[0] in parts[1:]:  # a nested jaxpr's stack restarts at the root
        last_root = len(parts) - 1 - parts[::-1].index(parts[0])
        parts = parts[:1] + [p for p in parts[last_root + 1 :] if p not in parts[:1]]
    if parts and parts[0] in roots:
        parts = parts[1:]
    return "/".join(parts)


def _parameter_derived(jaxpr, n_params: int) -> set:
    """Variables of ``jaxpr`` computed from its first ``n_params`` inputs alone (scalar constants
    aside). Closed-over arrays count as data, not parameters: a loss closing over its batch has
    activations computed from parameters and that constant."""
    derived = set(jaxpr.invars[:n_params])
    neutral = {v for v in jaxpr.constvars if v.aval.size <= 1}
    for eqn in jaxpr.eqns:
        sources = {v for v in eqn.invars if isinstance(v, jex.core.Var)} - neutral
        if sources and sources <= derived:
            derived.update(eqn.outvars)
        elif not sources:
            neutral.update(eqn.outvars)
    return derived


@contextlib.contextmanager
def _recording_roots(roots: set[str]) -> Iterator[None]:
    """Collect the scope names of outermost linen root modules called inside (their class names),
    which name stacks start with and rule paths do not."""
    depth = [0]

    def interceptor(next_fun, args, kwargs, context):
        if context.module.scope is None:  # an unbound module's own method (a subclass's apply)
            return next_fun(*args, **kwargs)
        if depth[0] == 0 and not context.module.path:
            roots.add(context.module.name or type(context.module).__name__)
        depth[0] += 1
        try:
            return next_fun(*args, **kwargs)
        finally:
            depth[0] -= 1

    with nn.intercept_methods(interceptor):
        yield


@contextlib.contextmanager
def _naming_nnx_modules() -> Iterator[None]:
    """Give NNX module calls the name stacks linen's named scopes give linen ones: while tracing in
    this thread, the ``__call__`` of every ``nnx.Module`` subclass defined so far runs, below the
    outermost module called (the root), with the name stack set to the module's rule path
    (``nnx_module_paths`` of the root). Set, not extended: a module called from outside its
    parent (a shared one) still gets its own path, the one its rule matched."""
    owner, stacks = threading.get_ident(), {}  # module id -> its name stack, while the root's call runs

    def name_stack(path: str) -> source_info_util.NameStack:
        # One scope per part, as nested named scopes give: transform wrappers (``transpose(...)``)
        # then wrap a part, which ``module_path`` removes.
        return functools.reduce(source_info_util.NameStack.extend, filter(None, path.split("/")), source_info_util.new_name_stack())

    def named(call):
        @functools.wraps(call)
        def wrapper(module, *args, **kwargs):
            if threading.get_ident() != owner:
                return call(module, *args, **kwargs)
            if not stacks:
                stacks.update((id(m), name_stack(path)) for path, m in nnx_module_paths(module))
                try:
                    return call(module, *args, **kwargs)
                finally:
                    stacks.clear()
            stack = stacks.get(id(module))
            if not stack:  # the root again (a subclass calling its base) or a module outside its graph
                return call(module, *args, **kwargs)
            with source_info_util.set_name_stack(stack):
                return call(module, *args, **kwargs)

        return wrapper

    calls, pending = {}, [nnx.Module]
    while pending:  # every nnx.Module subclass defined so far with a __call__ of its own
        cls = pending.pop()
        pending += cls.__subclasses__()
        if "__call__" in vars(cls):
            calls[cls] = vars(cls)["__call__"]
    for cls, call in calls.items():
        cls.__call__ = named(call)
    try:
        yield
    finally:
        for cls, call in calls.items():
            cls.__call__ = call


def _through_views(var, producers: dict) -> tuple[Any, bool]:
    """The variable ``var`` is a view of (following ``_VIEWS`` and ``checkpoint_name``), and whether
    the chain passes a bsr_jax residual name."""
    compressed = False
    while (eqn := producers.get(var)) is not None:
        if eqn.primitive.name == "name":
            compressed = compressed or eqn.params.get("name") == RESIDUAL_NAME
        elif eqn.primitive.name not in _VIEWS:
            break
        var = eqn.invars[0]
    return var, compressed


def _reader_stacks(eqn, index: int, outer: str) -> set[str]:
    """Name stacks of the equations that read ``eqn``'s input ``index``: the equation's own, or, for
    a call whose inner equations have their own (the backward of a ``jax.checkpoint``, e.g.
    ``bsr_jax.rewrite.lean_graph``'s per-module ones), those of the inner equations reading it."""
    stack = "/".join(filter(None, (outer, str(eqn.source_info.name_stack))))
    inner = eqn.params.get("jaxpr")
    inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr (pjit) or a Jaxpr (remat)
    if not isinstance(inner, jex.core.Jaxpr) or len(inner.invars) != len(eqn.invars):
        return {stack}
    var = inner.invars[index]
    found = {s for e in inner.eqns for i, v in enumerate(e.invars) if v is var for s in _reader_stacks(e, i, stack)}
    return found or {stack}


def residual_report(fn: Callable[..., Any], params: Any, *args: Any) -> ResidualReport:
    """What ``jax.vjp(fn, params, *args)`` keeps for the backward pass, by module path and kind.

    Nothing runs (``params``/``args`` may be ``jax.ShapeDtypeStruct``s). The rows sum to
    ``bsr_jax.residual_bytes(fn, params, *args).total``; see the module docstring for the kinds.
    """
    vjp_structure = {}

    def forward(params, *args):
        out, vjp_fn = jax.vjp(fn, params, *args)
        residuals, vjp_structure["treedef"] = jax.tree.flatten(vjp_fn)
        vjp_structure["out"] = jax.ShapeDtypeStruct(out.shape, out.dtype)
        return residuals

    found_roots: set[str] = set()
    with _recording_roots(found_roots), _naming_nnx_modules(), collecting() as layers:
        closed = jax.make_jaxpr(forward)(params, *args)
    roots = frozenset(found_roots)
    fwd = closed.jaxpr
    kept = [v for v in fwd.outvars if isinstance(v, jex.core.Var)]
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in fwd.outvars]
    backward = jax.make_jaxpr(lambda residuals, ct: jax.tree.unflatten(vjp_structure["treedef"], residuals)(ct))(avals, vjp_structure["out"])

    readers: dict[Any, set[str]] = {v: set() for v in kept}
    forward_of = dict(zip(backward.jaxpr.invars, fwd.outvars))
    for eqn in backward.jaxpr.eqns:
        for i, v in enumerate(eqn.invars):
            if isinstance(v, jex.core.Var) and isinstance(forward_of.get(v), jex.core.Var):
                readers[forward_of[v]].update(module_path(stack, roots) for stack in _reader_stacks(eqn, i, ""))

    producers = {v: eqn for eqn in fwd.eqns for v in eqn.outvars}
    n_params = len(jax.tree.leaves(params))
    param_sizes = {leaf.size for leaf in jax.tree.leaves(params)}
    from_params = {v for v in _parameter_derived(fwd, n_params) if v.aval.size in param_sizes}
    inputs = set(fwd.invars[n_params:]) | {v for v in fwd.constvars if v.aval.size > 1}
    argument_paths = [jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in jax.tree_util.tree_flatten_with_path((params, *args))[0]]
    argument_path = dict(zip(fwd.invars, argument_paths))
    rows = []
    for v in dict.fromkeys(kept):  # each distinct array once, in the order the closure holds them
        eqn = producers.get(v)
        source, compressed = _through_views(v, producers)
        if v in from_params:
            kind = "parameter"
        elif source in inputs:
            kind = "input"
        elif len(readers[v]) > 1:
            kind = "shared"
        else:
            kind = "compressed" if compressed else "dense"
        path = module_path(eqn.source_info.name_stack, roots) if eqn is not None else argument_path.get(v, "")
        rows.append(ReportRow(path, kind, tuple(v.aval.shape), str(v.aval.dtype), _aval_bytes(v), tuple(sorted(readers[v]))))
    for v in fwd.outvars:
        if isinstance(v, jex.core.Literal):  # a constant the closure holds, e.g. a scalar
            rows.append(ReportRow("", "dense", tuple(v.aval.shape), str(v.aval.dtype), _aval_bytes(v), ()))
    return ResidualReport(tuple(rows), layers.table())
