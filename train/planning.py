"""``--memory-budget``/``--target`` of both trainers: ``bsr_jax.plan`` chooses, per block, how the
model keeps what its backward pass needs, and the run trains the plan's model.

The plan is made before training from the dense model, its loss and the run's optimizer, for the
global batch on one device of ``--target`` (compiled deviceless: a few minutes on a CPU), printed,
and recorded in ``config.json`` with the run's facts. The plan's model has the dense parameter
tree and forward values, so checkpoints, evaluation and ``--resume`` work as for any run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

import bsr_jax
from train import metrics


def check_budget(budget: str | None, usage_error: type[Exception]) -> None:
    """The budget's form, before any data is read: a one-line error naming the flag."""
    if budget is None:
        return
    try:
        bsr_jax.planning.search.parse_budget(budget)
    except ValueError as error:
        raise usage_error(f"--memory-budget: {error}") from None


def planned_model(model, loss_of: Callable[[Any], Callable[..., Any]], batch: dict, tx: optax.GradientTransformation,
                  init_input: Any, budget: str, target: str, usage_error: type[Exception], saved: dict | None = None) -> tuple[Any, dict]:  # fmt: skip
    """``(the plan's model, what to record)`` for ``model`` under ``budget`` on ``target``.

    ``loss_of(module)`` is the trainer's ``loss_fn(params, batch[, rng, batch_stats]) -> (loss, aux)``
    for ``module``; ``batch`` the global batch's arrays or shapes; ``init_input`` what ``model.init``
    takes after its key (a shape). A budget nothing fits is a usage
    error naming the smallest peak found. ``saved``: the record of the run being resumed, whose
    plan is rebuilt as it was, without compiling."""
    if saved is not None:
        choices = saved["choices"]
        blocks = [path for path in choices if path not in (bsr_jax.planning.search.REST, bsr_jax.planning.search.LOSS)]
        metrics.say(f"the plan of the resumed run: {saved['peak_bytes'] / 2**20:,.0f} MiB on {saved['target']}")
        return bsr_jax.planning.search.assemble(model, blocks, [choices[b] for b in blocks], choices[bsr_jax.planning.search.REST]), saved
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}

    def plan_loss(module, variables, batch):
        stats = (None, variables["batch_stats"]) if "batch_stats" in variables else ()  # (rng, batch_stats)
        return loss_of(module)(variables["params"], batch, *stats)[0]

    metrics.say(f"planning for --memory-budget {budget} on {target}: compiling candidates of the full step (a few minutes)")
    try:
        plan = bsr_jax.plan(model, plan_loss, abstract, optimizer=tx, budget=budget, target=target, init_args=(init_input,))
    except ValueError as error:
        raise usage_error(f"--memory-budget: {error}") from None
    metrics.say(str(plan))
    record = dict(target=target, budget_bytes=plan.budget, peak_bytes=plan.peak, modelled_seconds=plan.modelled_seconds,
                  dense_peak_bytes=plan.dense.peak, dense_seconds=plan.dense.seconds, choices=dict(plan.choices))  # fmt: skip
    return plan.model, record
