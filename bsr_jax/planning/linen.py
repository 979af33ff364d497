"""``bsr_jax.plan`` for ``flax.linen`` models: the repeated blocks from the traced loss (name
stacks), each candidate ``compress_model`` with rules, lean modes, dx and remat by path."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import optax
from jax.extend import core as jax_core

from bsr_jax.rewrite.compress import compress_model
from bsr_jax.planning.microbatch import accumulated_value_and_grad
from bsr_jax.planning.options import OPTIONS, abstract, natural
from bsr_jax.measure.report import module_path
from bsr_jax.rewrite.rules import Rule


def _walk(jaxpr: Any, root: str, scale: int = 1, outer: str = "") -> Any:
    """``(equation, its jaxpr's trip count, its module path)`` for every equation, nested ones too.
    An equation inside another's jaxpr whose path does not lie under the enclosing one's takes the
    enclosing one's: a ``custom_vjp``'s body traces with a fresh name stack (``jax.nn.dot_product_attention``'s
    empty, Pallas splash attention's its kernel's ``jax.named_scope``, which reads as a module)."""
    for eqn in jaxpr.eqns:
        path = module_path(eqn.source_info.name_stack, frozenset({root}))
        if outer and not (path == outer or path.startswith(outer + "/")):
            path = outer
        yield eqn, scale, path
        inner = scale * eqn.params["length"] if eqn.primitive is jax.lax.scan_p else scale
        for sub in jax_core.jaxprs_in_params(eqn.params):
            yield from _walk(sub, root, inner, path)


def find_blocks(jaxpr: Any, root: str) -> tuple[tuple[str, ...], bool]:
    """The repeated blocks of a traced model: ``(paths, scanned)``. Siblings whose names differ
    only in a trailing number (``MixerBlock_3``, ``h/7``) and that have submodules form a group;
    the group whose equations
    count most (times the trip count of the loops they run in) wins; a ``nn.scan``'s layer (the
    common module of its body's equations) counts as one block run ``length`` times."""
    weight: dict[str, int] = {}
    scans: dict[str, int] = {}
    for eqn, scale, path in _walk(jaxpr, root):
        parts = path.split("/")
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            weight[prefix] = weight.get(prefix, 0) + scale
        if eqn.primitive is jax.lax.scan_p:
            body = [p.split("/")[0] for _, _, p in _walk(eqn.params["jaxpr"].jaxpr, root, outer=path)]
            if body and all(p == body[0] and p for p in body):
                scans[body[0]] = eqn.params["length"]
    groups: dict[tuple[str, str], list[str]] = {}
    for path in weight:
        if not path:
            continue
        parent, _, name = path.rpartition("/")
        stem = re.sub(r"_?\d+$", "", name)
        if stem != name:
            groups.setdefault((parent, stem), []).append(path)
    # A block has submodules of its own: a row of single layers (Dense_0, Dense_1) is not a block.
    composite = {path.rpartition("/")[0] for path in weight}
    candidates = [(sum(weight[p] for p in paths), tuple(sorted(paths, key=natural)), False)
                  for paths in groups.values() if len(paths) > 1 and all(p in composite for p in paths)]  # fmt: skip
    candidates += [(weight.get(path, 0), (path,), True) for path in scans]
    if not candidates:
        raise ValueError("plan: found no repeated blocks (siblings named name_0, name_1, ... or a nn.scan's layer) in the model")
    _, paths, scanned = max(candidates, key=lambda c: c[0])
    return paths, scanned

def assemble(model: nn.Module, blocks: Sequence[str], choices: Sequence[str], rest: str = "keep", outside: bool = True) -> nn.Module:
    """``model`` with block ``blocks[i]`` treated as ``OPTIONS[choices[i]]`` and everything else as
    ``OPTIONS[rest]`` (``compress_model`` with rules, lean modes, dx and remat by path); ``model``
    itself where everything is kept. ``outside``: whether any parameter lies outside the blocks
    (without one, the rest's compression has nothing to compress)."""
    if set(choices) <= {"keep"} and rest == "keep":
        return model
    rules, lean, dx, remat = [], [], [], []
    for block, name in zip(blocks, choices):
        option = OPTIONS[name]
        inside = (block, f"{block}/*")
        # Every block gets its own rule, exact ones too: the rest's rule ("*") is for what lies
        # outside the blocks (a kept or remat block under a rest of int4 stays exact).
        rules += [Rule(f"{block}/{glob}", None) for glob in option.exact_layers]  # before the block's: the first match wins
        rules.append(Rule(f"{block}/*", option.compression))
        if option.remat:
            remat.append((block, option.policy))
            continue
        lean += [(p, option.lean) for p in inside]
        dx += [(p, option.dx) for p in inside]
    rest_option = OPTIONS[rest]
    # compress_model raises on a rule that matches no layer; layers no rule matches stay exact anyway.
    if rest_option.compression is not None and outside:
        rules.append(Rule("*", rest_option.compression))
    lean.append(("*", rest_option.lean))
    dx.append(("*", None))
    any_dx = any(fmt for _, fmt in dx)
    return compress_model(model, rules, lean=lean, dx=dx if any_dx else None, remat=remat)


class Linen:
    """A linen model: blocks from its traced loss, candidates from ``assemble``, its variables as the state."""

    name = "flax.linen"
    unavailable: Mapping[str, str] = {}
    rest_unavailable: Mapping[str, str] = {}
    loss_args = ("module", "variables")
    loss_example = "def loss_fn(module, variables, x, y): return optax.softmax_cross_entropy_with_integer_labels(module.apply(variables, x), y).mean()"

    def __init__(self, model: nn.Module, loss_fn: Callable[..., jax.Array], batch: Sequence[Any], variables: Any,
                 init_args: Sequence[Any] | None):  # fmt: skip
        if variables is None:
            args = abstract(tuple(init_args) if init_args is not None else batch[:1])
            zeros = jax.tree.map(lambda a: jax.numpy.zeros(a.shape, a.dtype), args)
            try:
                variables = jax.eval_shape(lambda: model.init(jax.random.key(0), *zeros))
            except TypeError as error:  # a __call__ that needs more than the batch's first array (train=)
                raise TypeError(f"plan: the default {type(model).__name__}.init(key, {'*init_args' if init_args is not None else 'example_batch[0]'}) "
                                f"failed ({error}); pass variables= (your model's initialised variables, arrays or "
                                "jax.eval_shape(lambda: model.init(key, x, train=False)) shapes)") from error  # fmt: skip
        self.model, self.loss_fn, self.state = model, loss_fn, abstract(variables)
        self.params = self.state["params"]
        traced = jax.make_jaxpr(lambda v, *b: loss_fn(model, v, *b))(self.state, *batch)
        self.blocks = find_blocks(traced.jaxpr, type(model).__name__)[0]
        modules = {"/".join(str(getattr(k, "key", k)) for k in path[:-1]) for path, _ in jax.tree_util.tree_leaves_with_path(self.params)}
        self.outside = any(not any(m == b or m.startswith(b + "/") for b in self.blocks) for m in modules)
        # An option that leaves layers exact needs such a layer in every block: any block may take it, and
        # compress_model refuses a rule that matches no layer.
        self.unavailable = {**Linen.unavailable, **{
            name: f"not every block has a layer matching {list(option.exact_layers)}" for name, option in OPTIONS.items()
            if option.exact_layers and not all(any(fnmatch.fnmatchcase(m, f"{b}/{glob}") for m in modules for glob in option.exact_layers)
                                               for b in self.blocks)}}  # fmt: skip

    def assemble(self, choices: Sequence[str], rest: str) -> nn.Module:
        return assemble(self.model, self.blocks, choices, rest, self.outside)

    def step(self, module: nn.Module, optimizer: optax.GradientTransformation, loss_fn: Callable[..., jax.Array],
             microbatches: int = 1, value_and_grad: Callable[..., Any] | None = None) -> Callable[..., Any]:  # fmt: skip
        def step(variables, opt_state, *batch):
            others = {k: v for k, v in variables.items() if k != "params"}
            loss = lambda p, *piece: loss_fn(module, others | {"params": p}, *piece)  # noqa: E731
            grad = value_and_grad(loss) if value_and_grad else accumulated_value_and_grad(loss, microbatches)
            value, grads = grad(variables["params"], *batch)
            updates, opt_state = optimizer.update(grads, opt_state, variables["params"])
            return others | {"params": optax.apply_updates(variables["params"], updates)}, opt_state, value

        return step
