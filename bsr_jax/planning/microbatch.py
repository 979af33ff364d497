"""Micro-batching (gradient accumulation): one optimizer update from the mean gradient of ``k``
equal slices of the batch, computed one slice at a time, so a step holds one slice's activations.

``accumulated_value_and_grad(fn, k)`` is ``jax.value_and_grad(fn)`` over a batch split along its
leading axis into ``k`` slices, run by ``lax.scan``: the loss and gradients are the means over the
slices, which equal the whole batch's for a loss that is a mean over equal slices (up to float
summation order). ``plan(..., microbatches=k)`` measures steps built with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from bsr_jax.planning.cost import WORTH
from bsr_jax.planning.options import LOSS, REST, parse_budget
from bsr_jax.planning.result import Measured, NoFit, Plan


AUTO = "auto"  # plan(microbatches=AUTO): the count is searched
# plan's arguments for the dense step alone: nothing else is lowered for a search that ends there.
DENSE_ONLY = dict(options=["keep"], rest_options=["keep"], loss_chunk=None)


def check_microbatches(microbatches: Any, batch: Sequence[Any], argument: str = "microbatches", auto: bool = False) -> int:
    """``microbatches`` as an int that divides every batch array's leading axis, else a ``ValueError``
    naming ``argument`` and the allowed values (``auto``: ``"auto"`` among them, for ``plan``)."""
    sizes = {a.shape[0] for a in jax.tree.leaves(batch) if getattr(a, "ndim", 0)}
    allowed = [k for k in range(1, min(sizes, default=1) + 1) if all(n % k == 0 for n in sizes)]
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches not in allowed:
        raise ValueError(f"{argument} must be an int dividing the batch's leading axis {sorted(sizes)}: one of {allowed}"
                         f"{f' or {AUTO!r}' if auto else ''}, got {microbatches!r}")
    return microbatches


def accumulated_value_and_grad(fn: Callable[..., jax.Array], microbatches: int) -> Callable[..., tuple[jax.Array, Any]]:
    """``(params, *batch) -> (loss, grads)``: ``jax.value_and_grad(fn)`` as the mean over
    ``microbatches`` slices of every batch array's leading axis (which it must divide), one slice at
    a time. Gradients are accumulated in their own dtype (float32 parameters: float32 sums)."""
    grad_fn = jax.value_and_grad(fn)
    if microbatches == 1:
        return grad_fn

    def accumulated(params, *batch):
        slices = jax.tree.map(lambda a: a.reshape(microbatches, a.shape[0] // microbatches, *a.shape[1:]), batch)

        def one(total, piece):
            value, grads = grad_fn(params, *piece)
            return jax.tree.map(jnp.add, total, (value, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (value, grads), _ = jax.lax.scan(one, zeros, slices)
        return value / microbatches, jax.tree.map(lambda g: g / microbatches, grads)

    return accumulated


def fastest_count(plan_at: Callable[..., Plan], budget: float | str, batch: Any, options: Sequence[str]) -> Plan:
    """``plan(microbatches="auto")``: the plan at 1 against, where the dense step does not fit at 1,
    plans at 2, 4, 8 micro-batches up to the fewest where the dense step fits (more only repeat the
    same work in smaller pieces: slower): keep or remat per block (where ``options`` has it) up to
    the fewest count where such a plan fits, the dense step alone beyond. A count whose dense step
    (the fastest step at that count: every option trades time for memory) is no faster than the
    fastest plan found ends the search before anything else is compiled at it, and a count where no
    mix of keep and remat can be faster (``remat_bound``) is passed over. ``plan_at(budget=,
    microbatches=, beat=, **plan's arguments)``: ``plan`` at one count, compiling no candidate the
    cost model predicts slower than ``beat`` seconds (the fastest plan found so far)."""
    dense_plan = plan_at(budget=1.0, microbatches=1, **DENSE_ONLY)  # one compile, kept in the shared cache
    dense = dense_plan.dense
    kind, amount = parse_budget(budget)
    limit = int(amount * dense.peak) if kind == "fraction" else int(amount)
    refusals: list[NoFit] = []

    def at(k: int, allowed: list[str] | None = None) -> Plan | None:
        """The plan at ``k`` micro-batches (``allowed``: only those options, the rest kept, one
        candidate verified, none compiled that the cost model predicts slower than the fastest plan
        found), or None where nothing fits."""
        narrowed = {} if allowed is None else dict(options=allowed, rest_options=["keep"], verify=1, loss_chunk=None,
                                                   beat=min((p.modelled_seconds for p in found), default=math.inf))  # fmt: skip
        try:
            return dataclasses.replace(plan_at(budget=limit, microbatches=k, **narrowed), dense=dense)
        except NoFit as error:
            refusals.append(error)
            return None

    one = at(1)
    found = [one] if one else []
    if one is None or one.remat is not None:  # the dense step does not fit at one micro-batch
        # At k > 1 only keep or remat per block: every option at every count would multiply the search.
        narrowed = ["keep", *(["remat"] if "remat" in options else [])]
        for k in (k for k in (2, 4, 8) if divides(k, batch)):
            if found:
                # The dense step is the fastest step at k (one compile, kept in the shared cache for the search there).
                best, dense_k = min(p.modelled_seconds for p in found), dense_at(plan_at, k)
                if dense_k is not None and dense_k.seconds >= best:
                    break
                if one is not None and narrowed != ["keep"] and remat_bound(one, dense_k, k, limit) >= best * WORTH:
                    continue  # no mix of keep and remat at k can be faster: remat on every block there is not compiled
            if (p := at(k, narrowed)) is None:
                continue
            found.append(p)
            if p.remat is None:
                break  # the dense step fits at k
            narrowed = ["keep"]  # a plan fits at k: at more, only the dense step (without remat's recomputation) may be faster
    if not found:  # the least peak of every count's search, against the whole batch's dense step
        least = min(refusals, key=lambda error: error.smallest.peak)
        counts = ", ".join(str(error.microbatches) for error in refusals)
        raise NoFit(f"plan: no candidate fits the budget of {limit / 2**20:,.0f} MiB on {dense_plan.target} at {counts} micro-batch(es); the "
                    f"smallest compiled peak was {least.smallest.peak / 2**20:,.0f} MiB ({least.smallest.peak / dense.peak:.2f} of the whole "
                    f"batch's dense step), with {least.smallest.label} at {least.microbatches} micro-batch(es)", least.smallest,
                    least.microbatches) from least  # fmt: skip
    return min(found, key=lambda p: p.modelled_seconds)


def dense_at(plan_at: Callable[..., Plan], k: int) -> Measured | None:
    """The dense step at ``k`` micro-batches; None where XLA refuses to compile it (more than the
    device holds: the search goes on at ``k``)."""
    try:
        return plan_at(budget=1.0, microbatches=k, **DENSE_ONLY).dense
    except ValueError as error:
        if "does not compile" not in str(error):
            raise
        return None


def remat_bound(one: Plan, dense: Measured | None, k: int, limit: float) -> float:
    """A lower bound on the modelled time of a plan of keep or remat per block at ``k`` micro-batches
    within ``limit``, from ``one`` (the plan at one micro-batch: its dense step and remat on every
    block) and ``dense``, the dense step at ``k``: the fewest blocks under remat that bring the
    dense step within ``limit``, each saving a ``k``-th of what remat saves a block at one
    micro-batch (10% more, to be safe) and costing its recomputation there. On the 12 x 768 LM and
    ViT-B/16 (H100) a block saves at 2 what it does at 1, halved, to 1%; its recomputation costs
    4-10% more (the bound is lower for it). 0 where either step is unknown."""
    remat = one.remat
    blocks = [path for path in one.dense.choices if path not in (REST, LOSS)]
    if remat is None or dense is None or not dense.compiled or not blocks:
        return 0.0
    saved = 1.1 * (one.dense.peak - remat.peak) / len(blocks) / k
    if saved <= 0:
        return 0.0
    needed = min(max(math.ceil((dense.peak - limit) / saved), 0), len(blocks))
    return dense.seconds + needed * max(remat.seconds - one.dense.seconds, 0.0) / len(blocks)


def divides(k: int, batch: Any) -> bool:
    try:
        return check_microbatches(k, batch) == k
    except ValueError:
        return False
