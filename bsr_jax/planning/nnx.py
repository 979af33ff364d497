"""``bsr_jax.plan`` for ``flax.nnx`` models: the blocks from the module graph, each candidate built
on a clone of the user's model (``compress_model`` routes NNX layers in place), the step on
``nnx.split``/``nnx.merge``; the search is ``bsr_jax.planning.search``'s.

What an NNX block can take: ``keep``; ``int8``/``int4``/``topk``, its ``nnx.Linear`` /
``nnx.LinearGeneral`` / ``nnx.Conv`` inputs compressed for their weight gradient (without linen's
lean neighbours: NNX's lean is the whole model or nothing); the ``remat`` options, its
``__call__`` under ``nnx.remat(policy=...)``. The rest: ``keep`` or ``int4``. Not ``lean`` or
``int4-dx8`` per block, nor a ``lean`` rest: they need ``compress_model``'s lean and dx rules by
module path, which are linen's. Blocks stacked by ``nnx.vmap`` and run by ``nnx.scan`` are not
supported (one module holds every layer: no block to treat on its own).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax
from flax import nnx

from bsr_jax.rewrite.compress import REPORTED_NNX, ROUTED_NNX, ROUTED_NNX_CONV, compress_model
from bsr_jax.planning.options import OPTIONS, abstract, natural
from bsr_jax.core.layer_choice import nnx_module_paths
from bsr_jax.rewrite.rules import Rule

_BY_PATH = "needs compress_model's lean and dx rules by module path, which are linen's"
LINEN_ONLY: Mapping[str, str] = {"lean": f"per-block lean {_BY_PATH}", "int4-dx8": f"per-block approximate dx {_BY_PATH}",
                                 "int4-outdense": f"the lean attention that keeps its output {_BY_PATH}"}
REST_LINEN_ONLY: Mapping[str, str] = {"lean": f"a lean rest {_BY_PATH}"}
_MATCHED = (*ROUTED_NNX, ROUTED_NNX_CONV, REPORTED_NNX)  # the layers compress_model's rules match


def find_blocks(model: nnx.Module) -> tuple[str, ...]:
    """The repeated blocks of an NNX model by path (``"blocks/0"``, ``"block_3"``): sibling modules
    in its graph whose names differ only in a trailing number (an ``nnx.List``'s items, attributes
    ``block_0, block_1``) and that have submodules of their own; of several such groups, the one
    holding the most parameters (not, as for linen, the most traced operations)."""
    modules = dict(nnx_module_paths(model))
    _check_unstacked(modules)
    composite = {path.rpartition("/")[0] for path in modules if path}
    groups: dict[tuple[str, str], list[str]] = {}
    for path in modules:
        parent, _, name = path.rpartition("/")
        stem = re.sub(r"_?\d+$", "", name)
        if path and stem != name and path in composite:
            groups.setdefault((parent, stem), []).append(path)
    candidates = [paths for paths in groups.values() if len(paths) > 1]
    if not candidates:
        raise ValueError("plan: found no repeated blocks in the NNX model (sibling modules with submodules: "
                         "an nnx.List of blocks, or attributes block_0, block_1, ...)")  # fmt: skip
    best = max(candidates, key=lambda paths: sum(_size(modules[p]) for p in paths))
    return tuple(sorted(best, key=natural))


def _size(module: nnx.Module) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nnx.state(module, nnx.Param)))


def _check_unstacked(modules: Mapping[str, nnx.Module]) -> None:
    """Blocks made under ``nnx.vmap`` (to run under ``nnx.scan``) show as layers whose kernels
    have one leading axis (the layers') more than the layer's own."""
    for path, module in modules.items():
        if isinstance(module, nnx.Linear):
            expected = 2
        elif isinstance(module, nnx.Conv):
            expected = len(module.kernel_size) + 2
        else:
            continue
        shape = module.kernel.get_value().shape
        if len(shape) != expected:
            raise ValueError(f"plan: {path} ({type(module).__name__}) has a kernel of shape {tuple(shape)}, with a leading "
                             "axis of stacked layers: blocks stacked by nnx.vmap and run by nnx.scan are not supported for "
                             "NNX models; keep the blocks as a list, nnx.List([Block(...) for _ in range(n)])")  # fmt: skip


def _swap_call(block: nnx.Module, call: Callable[..., Any]) -> None:
    """``block``, in place, with its class swapped for a subclass whose ``__call__`` is ``call``
    (the state is unchanged; ``nnx.split``/``merge``/``clone`` keep the subclass)."""
    base = type(block)
    block.__class__ = type(base.__name__, (base,), {"__call__": call, "__module__": base.__module__})


def _remat(block: nnx.Module, policy: Callable[..., bool] | None) -> None:
    """``block``, in place, recomputing its forward in the backward pass: its ``__call__`` runs
    under ``nnx.remat(policy=policy)``."""
    base = type(block)

    def __call__(self, *args, **kwargs):
        # Positional arrays are the checkpoint's inputs; other positional arguments (a train flag)
        # stay Python values, as the block's code expects; keyword arguments are closed over
        # (nnx.remat takes none).
        static = tuple(i + 1 for i, arg in enumerate(args) if not isinstance(arg, jax.Array))  # + 1: self

        def call(module, *args):
            return base.__call__(module, *args, **kwargs)

        return nnx.remat(call, policy=policy, static_argnums=static)(self, *args)

    _swap_call(block, __call__)


def _scoped(block: nnx.Module, path: str) -> None:
    """``block``, in place, running in ``jax.named_scope(path)``: NNX modules push no name scope
    of their own, and the cost model (``bsr_jax.planning.cost.shares``) tells a compiled step's
    buffers and kernels apart by the module path in their op names. Values are unchanged."""
    base = type(block)

    def __call__(self, *args, **kwargs):
        with jax.named_scope(path):
            return base.__call__(self, *args, **kwargs)

    _swap_call(block, __call__)


class Nnx:
    """An NNX model for ``plan`` (a ``bsr_jax.planning.candidates.Family``); its state is ``nnx.state(model)``."""

    name = "flax.nnx"
    unavailable = LINEN_ONLY
    rest_unavailable = REST_LINEN_ONLY
    loss_args = ("model",)
    loss_example = "def loss_fn(model, x, y): return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()"

    def __init__(self, model: nnx.Module, loss_fn: Callable[..., jax.Array], batch: Sequence[Any], variables: Any,
                 init_args: Sequence[Any] | None):  # fmt: skip
        del batch, loss_fn  # the blocks come from the module graph, not from a trace
        if variables is not None or init_args is not None:
            raise ValueError("variables and init_args are for linen models: an NNX model carries its own state")
        self.model = model
        self.blocks = find_blocks(model)
        self.state, self.params = abstract(nnx.state(model)), abstract(nnx.state(model, nnx.Param))
        # compress_model raises on a rule that matches no layer: rules go only where layers are.
        layers = [path for path, module in nnx_module_paths(model) if isinstance(module, _MATCHED)]
        self.with_layers = {block for block in self.blocks if any(p.startswith(block + "/") for p in layers)}
        self.outside = any(not any(p.startswith(block + "/") for block in self.blocks) for p in layers)

    def assemble(self, choices: Sequence[str], rest: str) -> nnx.Module:
        """A clone of the model treated as ``choices`` and ``rest`` say (the model is left as it is)."""
        module = nnx.clone(self.model)
        modules = dict(nnx_module_paths(module))
        rules = []
        for block, name in zip(self.blocks, choices):
            option = OPTIONS[name]
            if option.remat:
                _remat(modules[block], option.policy)
            _scoped(modules[block], block)
            # Every block its own rule, exact ones too: the rest's rule is for what lies outside.
            if block in self.with_layers:
                rules.append(Rule(f"{block}/*", option.compression))
        if OPTIONS[rest].compression is not None and self.outside:
            rules.append(Rule("*", OPTIONS[rest].compression))
        return compress_model(module, rules, lean=False) if rules else module

    def step(self, module: nnx.Module, optimizer: optax.GradientTransformation, loss_fn: Callable[..., jax.Array],
             microbatches: int = 1, value_and_grad: Callable[..., Any] | None = None) -> Callable[..., Any]:  # fmt: skip
        if microbatches != 1 or value_and_grad is not None:  # plan refuses them first; the forward's state updates would need threading
            raise ValueError("microbatches > 1 and value_and_grad need a flax.linen model (NNX: not yet)")
        graphdef = nnx.graphdef(module)

        def step(state, opt_state, *batch):
            # NNX's own step: the gradient with respect to the nnx.Params, and whatever else the
            # forward updates (batch statistics, rng counts) written back into the model.
            model = nnx.merge(graphdef, state)
            value, grads = nnx.value_and_grad(loss_fn)(model, *batch)
            params = nnx.state(model, nnx.Param)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            nnx.update(model, optax.apply_updates(params, updates))
            return nnx.state(model), opt_state, value

        return step


__all__ = ["LINEN_ONLY", "REST_LINEN_ONLY", "Nnx", "find_blocks"]
