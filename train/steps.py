"""The step loop both trainers run (``train.loop`` for images, ``train.lm_loop`` for text): training
steps with the sparsity warm-up, a progress bar, metric records, checkpoints, evaluations, and a
clean stop on SIGINT/SIGTERM (``train.stopping``) that a resumed run continues bit for bit."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

import jax

from bsr_jax.rewrite.schedules import warmup_fraction
from train import metrics, progress, stopping
from train.checkpoint import Checkpoints


def run_steps(
    state: Any,
    batches: Iterator[Any],
    *,
    start_step: int,
    stop_step: int,
    steps_per_epoch: int,
    items_per_step: int,
    items: str,
    train_steps: dict[float, Callable],
    compile_step: Callable[[float], Callable],
    warmup_steps: int,
    log_every: int,
    checkpoint_every: int,
    eval_due: Callable[[int], bool],
    evaluate: Callable[[int, Any, stopping.StopRequest], dict | None],
    evaluated: set[int],
    checkpoints: Checkpoints,
    log: Callable[[dict], None],
) -> tuple[Any, dict[str, Any]]:
    """Steps ``start_step`` -> ``stop_step`` of ``state`` on ``batches`` (closed at the end).

    ``train_steps`` maps a warm-up level (``bsr_jax.rewrite.schedules.warmup_fraction`` of the step over
    ``warmup_steps``) to a compiled step ``(state, batch) -> (state, metrics)``; a missing level is
    compiled by ``compile_step``. A train record (``metrics.train_record``, throughput as
    ``{items}_per_s`` of ``items_per_step``) is logged every ``log_every`` steps, at evaluations
    and at a stop; a checkpoint is saved every ``checkpoint_every`` steps, at ``stop_step`` and at
    a stop; ``evaluate(step, state, stop)`` returns the eval record to log, or None when a stop
    abandoned it, where ``eval_due(step)``, and at ``start_step`` when a stop had cut that
    evaluation off (it is not in ``evaluated``). Returns ``(state, result)``: ``result`` holds the
    last ``"train"`` and ``"eval"`` records, the ``"step"`` reached and ``"stopped_by"`` (the
    signal that stopped the run, agreed by every process, or None).
    """
    result: dict[str, Any] = {}
    interval: list[dict] = []  # metrics of the steps since the last record
    timer = metrics.StepTimer()
    rate = f"{items}_per_s"

    def run_eval(step: int, stop: stopping.StopRequest) -> bool:
        """Evaluate and log; True when a stop was requested (the evaluation may have been dropped)."""
        record = evaluate(step, state, stop)
        if record is not None:
            result["eval"] = record
            log(record)
        return stop.agreed() is not None

    step = start_step
    quiet = jax.process_index() != 0  # bars on process 0 only (and there, as every bar, on a terminal only)
    with stopping.stop_on_signals() as stop, contextlib.closing(batches), \
            progress.bar(total=stop_step, initial=start_step, unit="step", desc="training", hidden=quiet) as bar:  # fmt: skip
        signalled = False
        if start_step > 0 and eval_due(start_step) and start_step not in evaluated:  # stopped during that evaluation
            signalled = run_eval(start_step, stop)
        while step < stop_step and not signalled:
            level = warmup_fraction(step, warmup_steps=warmup_steps)
            if level not in train_steps:
                train_steps[level] = compile_step(level)
            state, step_metrics = train_steps[level](state, next(batches))
            # Waiting for each step keeps one step in flight: a signal stops the run within one
            # step's time, and the bar counts finished steps (the batches are prefetched meanwhile).
            interval.append(jax.device_get(step_metrics))
            step += 1
            if step == start_step + 1:  # the first step compiles and warms up: not timed
                timer.restart()
            else:
                timer.steps += 1
            shown = {"loss": f"{interval[-1]['loss']:.3f}"}
            if timer.steps:
                shown[rate] = f"{timer.per_s(items_per_step):.0f}"
            bar.set_postfix(shown, refresh=False)
            bar.update(1)
            signalled = stop.agreed() is not None
            if step % log_every == 0 or eval_due(step) or signalled:
                result["train"] = metrics.train_record(interval, timer, step, steps_per_epoch, items_per_step, items)
                log(result["train"])
                interval = []
            if step % checkpoint_every == 0 or step == stop_step or signalled:
                checkpoints.save(step, state)
            if eval_due(step) and not signalled:
                signalled = run_eval(step, stop)
            if not interval:  # a record was written: time from here, without logging/saving/eval
                timer.restart()
    checkpoints.save(step, state)
    checkpoints.close()
    stopped_by = stop.agreed()
    if stopped_by is not None:
        metrics.say(f"stopped by {signal.Signals(stopped_by).name} at step {step}; continue with --resume")
    result.update(step=step, stopped_by=stopped_by)
    return state, result
