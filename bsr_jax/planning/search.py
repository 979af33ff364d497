"""Fit a training step into a memory budget at the least modelled time: ``plan``.

``plan(model, loss_fn, *example_batch, optimizer=..., budget=..., target="h100")`` chooses, for
each repeated block of a linen model (``MixerBlock_0..11``, ``encoderblock_i``, a ``nn.scan``'s
layer), one of ``OPTIONS`` (keep, lean neighbours, remat of the block under JAX's policies, host
offload; opted in: int8/int4 storage, int4 with approximate dx, top-k), and one for the rest of
the model (keep, lean; opted in: int4), the combination with the least modelled step time
(``CompiledStep.modelled_seconds``) whose compiled peak fits ``budget``; it compiles what it
returns. Everything it measures is a full step: loss, gradient, optimizer update, parameters and
optimizer state donated, compiled deviceless for ``target`` (``bsr_jax.compiled_memory``).

How it searches, in compiles (each cached by its choices):

1. the dense step (the budget's reference and the baseline): where it fits, it is the plan; where
   the step's arguments alone (parameters, optimizer state, batch) exceed the budget, nothing fits;
2. remat on every block (the least any option keeps): where it does not fit and the rest and the
   loss have no other choice, nothing does, and the search stops there;
3. the cost model (``bsr_jax.planning.cost``): the compiled steps' buffers live at the peak and
   kernels, told apart by the module path in their op names, give each block's bytes and time
   under each option; "probes", steps whose blocks take the other options in turn (one step for
   up to as many options as there are blocks), measure the rest, with each choice for the rest and
   the loss. ``CostModel.solve`` finds the assignment (any option on any block) of least predicted
   time whose predicted peak fits; it is compiled, the model recalibrated with it and solved
   again, until ``verify`` candidates fit, the model's best was compiled already, or it is
   predicted to lose to one compiled (``bsr_jax.planning.verify``). The fastest compiled candidate within budget
   is returned.

Peaks are not additive (XLA reschedules, remat's recompute is transient), so nothing is trusted
uncompiled: a plan's peak and time are those of its own compiled step. Only exact options are
searched unless asked for: approximate ones (``int8``/``int4`` dW, ``int4-dx8`` dx, ``topk``, a rest
of ``int4``) change gradients within the bounds documented in docs/memory.md and docs/RESULTS.md
(``Option.approximation``), and join with ``approximate=True`` or by name in ``options=``.

Linen models' blocks and candidates are ``bsr_jax.planning.linen``'s; ``flax.nnx`` models
(``bsr_jax.planning.nnx``) take the same search over blocks found in their
module graph (an ``nnx.List`` of blocks, ``block_0, block_1``), each candidate built on a clone:
per block keep, int8/int4/topk (compression only, no lean neighbours) and the remat options; for
the rest keep or int4. ``lean``/``int4-dx8`` per block and a lean rest are linen's (rules by
path), and blocks stacked for ``nnx.scan`` are not supported.
"""

from __future__ import annotations

import contextvars
import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import optax
from flax import nnx

from bsr_jax.measure.compiled import DEVICELESS_TARGETS, check_target
from bsr_jax.ops.head_loss import check_chunk, chunked_head_loss
from bsr_jax.planning import nnx as planner_nnx
from bsr_jax.planning import placement
from bsr_jax.planning.candidates import Candidates, Family, traced_on
from bsr_jax.planning.cost import CostModel, probes, shares
from bsr_jax.planning.linen import Linen, assemble, find_blocks
from bsr_jax.planning.microbatch import AUTO, check_microbatches, fastest_count
from bsr_jax.planning.options import EXACT, LOSS, OPTIONS, REST, REST_OPTIONS, Option, abstract, parse_budget
from bsr_jax.planning.result import Measured, NoFit, Plan
from bsr_jax.planning.verify import compile_predicted
from bsr_jax.rewrite.rules import LayerTable, layer_table


# microbatches="auto": the modelled time of the fastest plan found at another count, which a plan
# at this count must be predicted to beat for a candidate to be compiled (``compile_predicted``'s ``beat``).
_TO_BEAT: contextvars.ContextVar[float] = contextvars.ContextVar("bsr_jax_plan_to_beat", default=math.inf)


def _check_loss(loss_fn: Callable[..., jax.Array], family: type, batch: Sequence[Any]) -> None:
    """A ``TypeError`` showing the form ``plan`` calls ``loss_fn`` in, where its signature cannot
    take that call (``loss(params, x, y)``, JAX's usual form, failed deep inside the trace)."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return  # no signature to read (some C callables): the call itself will say what is wrong
    try:
        signature.bind(*family.loss_args, *batch)
    except TypeError as error:
        call = f"loss_fn({', '.join(family.loss_args)}, *batch)"
        raise TypeError(f"plan calls {call} with each candidate ({len(batch)} batch argument(s) here), but loss_fn{signature} "
                        f"cannot take that ({error}); write it as, e.g., {family.loss_example}") from None  # fmt: skip


def _not_refused_by(family: Family, options: Sequence[str], named: bool) -> tuple[str, ...]:
    """``options`` less those this model cannot take (``family.unavailable``: the instance's, beyond
    its kind's); a ``ValueError`` where they were ``named``."""
    refused = [o for o in options if o in family.unavailable]
    if refused and named:
        raise ValueError(f"options {refused} not available for this model: " + "; ".join(f"{o}: {family.unavailable[o]}" for o in refused))
    return tuple(o for o in options if o not in refused)


def _available(argument: str, given: Sequence[str] | None, known: Sequence[str], family: type, approximate: bool) -> tuple[str, ...]:
    """``given`` checked against ``known`` and what ``family`` cannot take; ``None``: all it can
    that are exact, or with ``approximate`` all it can (opt-in ones only by name)."""
    unavailable = family.unavailable if argument == "options" else family.rest_unavailable
    if given is None:
        return tuple(o for o in known if o not in unavailable and not OPTIONS[o].opt_in and (approximate or OPTIONS[o].exact))
    unknown = [o for o in given if o not in known]
    if unknown:
        raise ValueError(f"{argument} {unknown} unknown; choose from {tuple(known)}")
    refused = [o for o in given if o in unavailable]
    if refused:
        raise ValueError(f"{argument} {refused} not available for {family.name} models: " + "; ".join(f"{o}: {unavailable[o]}" for o in refused))
    return tuple(given)


def plan(model: nn.Module | nnx.Module, loss_fn: Callable[..., jax.Array], *example_batch: Any, optimizer: optax.GradientTransformation,
         budget: float | str, target: str = "h100", options: Sequence[str] | None = None,
         rest_options: Sequence[str] | None = None, approximate: bool = False, verify: int = 3,
         variables: Any = None, init_args: Sequence[Any] | None = None, progress: bool = True,
         cache: dict | None = None, loss_chunk: int | None = None, microbatches: int | str = 1,
         value_and_grad: Callable[..., Any] | None = None) -> Plan:  # fmt: skip
    """The fastest plan (least modelled step time) whose compiled step fits ``budget`` on ``target``.

    Args:
      model: an unbound ``flax.linen.Module`` with repeated blocks (see ``find_blocks``), or a
        ``flax.nnx.Module`` with a list of blocks (``bsr_jax.planning.nnx.find_blocks``), not mutated.
      loss_fn: linen: ``loss_fn(module, variables, *batch) -> scalar``, called with each candidate
        module (it applies ``module``; mutable collections such as ``batch_stats`` are the caller's to
        handle). NNX: ``loss_fn(model, *batch) -> scalar``, called with each candidate model holding
        the step's state (as ``nnx.value_and_grad(loss_fn)(model, *batch)``); gradients are taken
        with respect to its ``nnx.Param``s. A signature that cannot take that call, or a loss that
        applies a module of its own, is an error before anything compiles.
      example_batch: arrays or ``jax.ShapeDtypeStruct``s of one training batch. Over a mesh:
        placed with ``NamedSharding``s (as are ``variables``, or an NNX model's arrays), on any
        mesh (real devices, host devices, a ``jax.sharding.AbstractMesh``; Auto or Explicit axes)
        of at most the target's 8 devices: the plan is then of XLA's per-device SPMD program on a
        mesh of the same axes over the target's devices (``bsr_jax.planning.placement``; the
        optimizer's state sharded as its parameters, anything unplaced replicated), and
        ``budget``, every peak and ``Plan.peak`` are one device's.
      optimizer: the optax transformation of the step (its state counts toward the peak).
      budget: bytes per device (an int, or a string with a unit: ``"12GiB"``, ``"800MB"``) or a fraction in
        (0, 1] of the dense step's compiled peak on ``target`` (a float, or a string without a
        unit: ``0.5``, ``"0.5"``); ``"2.0"`` or ``"100"`` is an error (``parse_budget``).
      target: ``"h100"`` or ``"tpu-v5p"``, any case (deviceless, with the ``aot`` extra: see
        ``bsr_jax.compiled_memory``).
      options: names from ``OPTIONS`` the blocks may take; ``"keep"`` is always included. Default:
        the exact ones (``EXACT``) the model's kind can take (NNX: not ``"lean"``, which needs
        linen's rules by path; naming it is a ``ValueError``). Naming approximate ones here opts in
        to them, as naming MaxText's named policies (``remat-minimal``, ``remat-save-qkv``, ...)
        does: searched only when named.
      rest_options: what everything outside the blocks may take (``REST_OPTIONS``; NNX: not
        ``"lean"``); ``"keep"`` is always included. Default: the exact ones (``int4`` is not).
      approximate: with the default ``options``/``rest_options``, also search the approximate ones
        (int8/int4 storage, top-k, approximate dx: gradients change within docs/memory.md's bounds).
      verify: how many of the cost model's candidates that fit the budget are compiled at most
        (each compile recalibrates the model; at most twice as many tried; it stops sooner where
        the model's fastest was compiled already). 0: only the dense step, remat on every block
        and the probes are candidates.
      variables: (linen) the model's variables (arrays or ``ShapeDtypeStruct``s); default: the
        abstract ``model.init(key, *init_args)``, ``init_args`` defaulting to ``example_batch[:1]``
        (a model whose ``__call__`` needs more, such as ``train=``, needs ``variables``).
        An NNX model carries its own state (arrays, or ``ShapeDtypeStruct``s from ``nnx.eval_shape``).
      progress: one line on stderr per compile.
      cache: a dict of compiled candidates to read and fill, shared between calls with the same
        model, loss and optimizer (e.g. several budgets); entries are kept apart by target, block
        paths and the shapes of the variables and batch. By default each call compiles anew.
      loss_chunk: also consider the loss through ``bsr_jax.chunked_head_loss(loss_fn,
        chunk=loss_chunk)`` (exact; a head projection followed by optax's softmax cross-entropy
        never holds its logits): chosen where it makes the step faster within the budget or is
        needed to fit; then ``plan.loss_fn`` is that loss, for the user's step. Default: the loss
        as given.
      microbatches: (linen) every candidate step, dense included (so a fractional ``budget`` is of
        the dense step at this count), takes its gradient as the mean over this many equal slices
        of the batch, one at a time (``bsr_jax.accumulated_value_and_grad``: exact up to float
        summation order); it must divide the batch. ``Plan.microbatches`` says it for the user's
        step. Default 1: the batch at once. ``"auto"``: the fastest of the plan at 1 and, where the
        dense step does not fit there, plans of keep or remat per block at 2, 4, 8 micro-batches
        (dividing the batch) up to the fewest count where one fits, then the dense step alone at
        more, up to the first count where it fits or is no faster than the best found
        (docs/planner.md); a fractional budget is of the
        whole batch's dense step, and the plan's ``dense`` stays that step.
      value_and_grad: (linen, one micro-batch) how the step takes its gradient, as the user's step
        does: ``value_and_grad(loss) -> (params, *batch) -> (loss value, grads)``, with ``loss(params,
        *batch) -> scalar``; default ``jax.value_and_grad``. For a step that is not plain autodiff
        under ``jax.jit``, e.g. FSDP written with ``jax.shard_map`` (train.lm's, which gathers each
        scanned layer's parameters as it runs): traced under ``jax.set_mesh`` of the target's mesh,
        so it may read it with ``jax.sharding.get_abstract_mesh()``. A model's own ``nn.remat``
        around a block takes the plan's policy for that block as well (it keeps what both keep).

    Returns:
      a ``Plan`` (its ``str`` is a table). Its ``model`` is used in the user's step as it is
      (NNX: a new model holding a copy of ``model``'s state). Where the dense step fits the budget
      it is the plan, after one compile (every option trades time for memory).

    Raises:
      ValueError: bad ``budget``/``target``/``options``, a model with no repeated blocks (or, NNX,
        blocks stacked for ``nnx.scan``), a ``loss_fn`` that never applies the module it is given,
        or no candidate within budget: ``NoFit``, a ``ValueError`` whose message names the smallest
        compiled peak and its choices (``microbatches="auto"``: the least of every count searched,
        and that count), as does its ``smallest``; where remat on every block, the least any option
        keeps, does not fit, or the step's arguments alone exceed the budget, the search stops there.
      TypeError: a ``loss_fn`` whose signature cannot take the call above, or (linen) a default
        ``model.init`` that fails (pass ``variables=``).
    """
    kind, amount = parse_budget(budget)
    target = check_target(target, DEVICELESS_TARGETS)
    if not isinstance(verify, int) or verify < 0:
        raise ValueError(f"verify must be an int >= 0, got {verify!r}")
    if not isinstance(model, (nn.Module, nnx.Module)):
        raise ValueError(f"model must be a flax.linen or flax.nnx Module, got {type(model).__name__}")
    family_type = Linen if isinstance(model, nn.Module) else planner_nnx.Nnx
    defaults = options is None and not approximate  # approximate=True would add options (named ones are searched as named)
    named = options is not None
    options = _available("options", options, tuple(OPTIONS), family_type, approximate)
    rest_options = _available("rest_options", rest_options, REST_OPTIONS, family_type, approximate)
    if loss_chunk is not None:
        check_chunk(loss_chunk, "loss_chunk")
    batch = abstract(example_batch)
    if microbatches == AUTO:
        if family_type is not Linen:
            raise ValueError("microbatches='auto' needs a flax.linen model (NNX: not yet)")
        # Options as given (None: each count's search takes its defaults, less what this model cannot take).
        same = dict(optimizer=optimizer, target=target, options=options if named else None, approximate=approximate, rest_options=rest_options,
                    verify=verify, variables=variables, init_args=init_args, progress=progress, cache={} if cache is None else cache,
                    loss_chunk=loss_chunk)  # fmt: skip

        def at_count(beat: float = math.inf, **kw: Any) -> Plan:
            token = _TO_BEAT.set(beat)
            try:
                return plan(model, loss_fn, *example_batch, **(same | kw))
            finally:
                _TO_BEAT.reset(token)

        return fastest_count(at_count, budget, batch, options)
    microbatches = check_microbatches(microbatches, batch, auto=True)
    if microbatches != 1 and family_type is not Linen:
        raise ValueError("microbatches > 1 needs a flax.linen model (NNX: not yet)")
    if value_and_grad is not None and (family_type is not Linen or microbatches != 1 or not callable(value_and_grad)):
        raise ValueError("value_and_grad must be a callable, for a flax.linen model at microbatches=1 (NNX and micro-batches: not yet)"
                         f", got {value_and_grad!r} for a {family_type.name} model at microbatches={microbatches}")  # fmt: skip
    _check_loss(loss_fn, family_type, batch)
    loss_fns = {"plain": loss_fn} | ({"chunked": chunked_head_loss(loss_fn, chunk=loss_chunk)} if loss_chunk else {})
    family: Family = family_type(model, loss_fn, batch, variables, init_args)
    options = _not_refused_by(family, options, named)
    mesh = placement.target_mesh((family.state, batch), target)
    if mesh is not None:  # the user's shardings, on the target's devices
        family.state, family.params, batch = placement.on_mesh((family.state, family.params, batch), mesh)
    search = Candidates(family, loss_fns, batch, optimizer, target, progress, cache, microbatches, mesh, value_and_grad)
    blocks = family.blocks
    n = len(blocks)
    if progress:
        left_out = [o for o in OPTIONS if defaults and not OPTIONS[o].exact and not OPTIONS[o].opt_in and o not in family_type.unavailable]
        print(f"[plan] {n} block(s): {blocks[0]}{' .. ' + blocks[-1] if n > 1 else ''}; options {list(options)}"
              + (f" (approximate ones left out: approximate=True adds {left_out})" if left_out else ""), file=sys.stderr)  # fmt: skip
    # Remat on every block always changes the step's program: unless the loss ignores its module. Checked
    # once per step (microbatches="auto" compiles the dense step at one micro-batch first), not per count.
    checked = any((search.at_count(k), ("keep",) * n, "keep", "plain") in search.shared for k in (1, microbatches))
    if not checked and search.program(["keep"] * n, "keep") == search.program(["remat"] * n, "keep"):
        raise ValueError(f"plan: loss_fn never applies the module it is given (remat on every block lowered to the dense step's "
                         f"program): apply its first argument, e.g. {family.loss_example}")  # fmt: skip
    names = list(dict.fromkeys(["keep", *options]))
    variants = [(rest, loss) for rest in dict.fromkeys(["keep", *rest_options]) for loss in loss_fns]
    try:
        return _search(family, search, loss_fns, names, variants, kind, amount, target, verify)
    finally:
        search.close()


def _search(family: Family, search: Candidates, loss_fns: Mapping[str, Callable[..., jax.Array]], names: Sequence[str],
            variants: Sequence[tuple[str, str]], kind: str, amount: float, target: str, verify: int) -> Plan:  # fmt: skip
    """``plan``'s search once its arguments are checked (its docstring and the module's say how)."""
    blocks = family.blocks
    n = len(blocks)
    # Remat on every block and the probes are what the cost model needs where the dense step does
    # not fit: lowered while it compiles (lowering is Python, compiling is XLA's threads), compiled
    # only once it does not fit.
    only_dense = len(names) == 1 and len(variants) == 1  # options=["keep"], rest kept, no chunked loss
    measuring = [] if only_dense else [(("remat",) * n, "keep", "plain"), *probes(blocks, names, [v for v in variants if v != ("keep", "plain")])]
    cold = bool(search.lower([(("keep",) * n, "keep", "plain")]))  # the dense step is not compiled yet
    search.prefetch([(("keep",) * n, "keep", "plain")], breakdown=True)
    if cold:  # nothing to overlap with where it is: lowered when needed (where the dense step fits, never)
        search.lower(measuring)
    dense = search.measure(["keep"] * n, "keep", breakdown=True)  # the cost model's reference where it does not fit
    if not dense.compiled and kind == "fraction":
        raise ValueError(f"plan: the dense step does not compile on {target} (XLA needs at least {dense.peak / 2**20:,.0f} MiB, more than "
                         f"the device holds), so a budget of {amount} of its peak has nothing to be a fraction of: give bytes, e.g. "
                         f"budget=\"{dense.peak / 2 / 2**30:.0f}GiB\"")  # fmt: skip
    limit = amount * dense.peak if kind == "fraction" else amount

    def infeasible(best: Measured, why: str = "") -> NoFit:
        of_dense = f"{best.peak / dense.peak:.2f} of dense's" if dense.compiled else "dense does not compile"
        return NoFit(f"plan: no candidate fits the budget of {limit / 2**20:,.0f} MiB on {target}; the smallest compiled peak "
                     f"was {best.peak / 2**20:,.0f} MiB ({of_dense}), with {best.label}{why}", best, search.microbatches)  # fmt: skip

    if dense.compiled and dense.peak <= limit:
        return _plan(family, search, loss_fns, (("keep",) * n, "keep", "plain"), limit, target, dense, None)
    if search.argument_bytes > limit:
        raise infeasible(dense, f"; the step's arguments alone (parameters, optimizer state, batch) take {search.argument_bytes / 2**20:,.0f} MiB")
    if only_dense:
        raise infeasible(dense, ": the options allow nothing else")
    # Where remat on every block may end the search (below), the probes wait for it.
    search.prefetch(measuring[:1] if len(variants) == 1 else measuring, breakdown=True)
    # Remat on every block keeps only the blocks' inputs, the least of any option (no option
    # had a smaller peak on any model or target of docs/RESULTS.md 10.1): where it does not fit
    # with the rest kept, only the rest's or the loss's other choices can make a step fit.
    remat = search.measure(["remat"] * n, "keep", breakdown=True)
    if remat.peak > limit and len(variants) == 1:
        raise infeasible(search.smallest(), ": remat on every block keeps the least of any option, so the search stopped there")
    search.prefetch(measuring[1:], breakdown=True)
    dense, remat = search.current(dense), search.current(remat)  # rescaled where XLA's model timed only a later step
    model = CostModel(blocks) if dense.compiled else None
    if model:
        model.observe((("keep",) * n, "keep", "plain"), dense.peak, dense.seconds, shares(search.compiled(dense), blocks, dense.seconds))
    key = _modelled_search(search, model, measuring, names, variants, limit, verify, infeasible)
    return _plan(family, search, loss_fns, key, limit, target, dense, remat)


def _modelled_search(search: Candidates, model: CostModel | None, keys: Sequence[tuple], names: Sequence[str],
                     variants: Sequence[tuple[str, str]], limit: float, verify: int, infeasible: Callable[..., ValueError]) -> tuple:  # fmt: skip
    """The fastest compiled candidate within ``limit``, searched with the cost model
    (``bsr_jax.planning.cost``): remat on every block and the probes measure every option and
    variant, ``CostModel.solve`` predicts the fastest assignment that fits, which is compiled, and
    the model, calibrated by every step compiled so far, is solved again, until ``verify``
    candidates fit, ``2 * verify`` were compiled, or the model's best is one already compiled
    (``compile_predicted``). Where one of them (or ``model``'s reference, the dense step: ``model`` None)
    needs more than the device holds, XLA compiles nothing to learn from: the fastest of those
    that compiled."""
    blocks = search.family.blocks
    measured = [search.measure(*key, breakdown=True) for key in keys]
    measured = [search.current(m) for m in measured]
    if model is None or not all(m.compiled for m in measured):
        return _fastest_fitting(search, names, variants, limit, infeasible)
    for key, m in zip(keys, measured):
        model.observe(key, m.peak, m.seconds, shares(search.compiled(m), blocks, m.seconds))
    n, remat = len(blocks), measured[0]
    # What the rest's and the loss's choices add is the part the model sees whole (REST): exact enough
    # to say, with remat on every block compiled, whether anything can fit.
    if remat.peak + min(model.predict((("remat",) * n, *v))[0] - model.predict((("remat",) * n, "keep", "plain"))[0] for v in variants) > limit:
        raise infeasible(search.smallest(), ": remat on every block keeps the least of any option, so nothing more was compiled")
    search.adopt_shared()
    for key, (m, _) in search.cache.items():  # what earlier calls sharing the cache compiled
        if key not in model.steps and m.compiled:
            model.observe(key, m.peak, m.seconds)
    compile_predicted(search, model, names, variants, limit, verify, _TO_BEAT.get())
    return _fastest_fitting(search, names, variants, limit, infeasible)


def _fastest_fitting(search: Candidates, names: Sequence[str], variants: Sequence[tuple[str, str]], limit: float,
                     infeasible: Callable[..., ValueError]) -> tuple:  # fmt: skip
    """The fastest candidate compiled within ``limit`` whose choices are allowed, this call's and
    those earlier calls sharing the cache compiled."""
    search.adopt_shared()
    allowed = lambda key: set(key[0]) <= set(names) and (key[1], key[2]) in variants  # noqa: E731
    fitting = [(m.seconds, key) for key, (m, _) in search.cache.items() if m.compiled and m.peak <= limit and allowed(key)]
    if not fitting:
        raise infeasible(search.smallest(allowed))
    return min(fitting)[1]


def _plan(family: Family, search: Candidates, loss_fns: Mapping[str, Callable[..., jax.Array]], key: tuple, limit: float, target: str,
          dense: Measured, remat: Measured | None) -> Plan:  # fmt: skip
    (chosen, compiled), (choices, rest, loss) = search.cache[key], key
    dense, remat = search.current(dense), remat and search.current(remat)
    model = family.assemble(choices, rest)
    step = family.step(model, search.optimizer, loss_fns[loss], search.microbatches, search.value_and_grad)
    # The plan keeps these, not the search (which holds every candidate's lowered program).
    arguments, mesh = (family.state, search.opt_state, *search.batch), search.mesh

    def layers() -> LayerTable:
        # What each layer of the chosen step keeps: its step traced (jax.eval_shape), nothing compiled.
        with traced_on(mesh):
            return layer_table(step, *arguments)

    return Plan(model=model, loss_fn=loss_fns[loss], choices=chosen.choices, peak=chosen.peak, modelled_seconds=chosen.seconds, budget=int(limit),
                target=target, dense=dense, remat=remat, tried=tuple(m for m, _ in search.cache.values()), compiled=compiled, layers=layers,
                microbatches=search.microbatches, mesh=dict(mesh.shape) if mesh else None)  # fmt: skip


__all__ = ["EXACT", "LOSS", "OPTIONS", "REST", "REST_OPTIONS", "NoFit", "Option", "Plan", "assemble", "find_blocks", "parse_budget", "plan"]
