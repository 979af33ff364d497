"""What a run reports: memory figures (once), train records, and the JSON-lines log.

Memory figures are per device and computed from shapes, before the first step:
``residual_activation_mib`` is ``bsr_jax.residual_bytes`` of the loss at the per-device batch
(activations and the input batch the backward pass keeps: the figure block-sparse residuals
shrink); ``compiled_peak_mib``/``compiled_temp_mib`` come from XLA's ``memory_analysis`` of the
compiled step (on CPU a secondary figure, see docs/memory.md); ``kept_block_fraction`` is the
fraction of activation blocks the pruned layers really keep (capacities round up, at least one
block; absent where layers are compressed without blocks, as pooled convolutions are);
``dense_residual_activation_mib`` is the residual figure with nothing pruned.
On GPU/TPU, train records add ``device_peak_mib`` from the device's memory stats.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import bsr_jax
from bsr_jax.rewrite.schedules import layer_sparsity
from train import run_dir
from train.models import predict

MIB = 2**20


def kept_block_fraction(
    model: nn.Module, params: Any, images: jax.ShapeDtypeStruct, rules: Any = (), batch_stats: Any = None
) -> float | None:
    """Kept / total blocks over all block-pruned layers' inputs at this batch shape, under the
    per-layer sparsity ``rules`` the loss uses: 1.0 when nothing is compressed (every block kept),
    None when layers are compressed without blocks (pooled convolutions). ``batch_stats``: a
    BatchNorm model's statistics (traced in evaluation mode)."""
    kept, total = 0, 0
    variables = {"params": params} if batch_stats is None else {"params": params, "batch_stats": batch_stats}
    with layer_sparsity(rules):
        plan = bsr_jax.pruning_plan(lambda v, x: predict(model, v, x), variables, images)
    pruned = [layer for layer in plan if isinstance(layer.compression, bsr_jax.Pruning)]
    if not pruned:
        return None if plan else 1.0
    for layer in pruned:
        stored = layer.compression.stored_shape(layer.input)
        kept += stored.capacity
        total += math.prod(stored.grid)
    return kept / total


def memory_report(
    model, loss_fn, compiled_step, state: dict[str, Any], batch_shape: tuple[int, ...], mesh, rules: Any = (),
    *, dense_loss_fn,
) -> dict[str, Any]:
    """Per-device memory figures of one training step (computed from shapes; nothing runs).

    ``dense_loss_fn``: the same loss with nothing pruned, for ``dense_residual_activation_mib``.
    """
    per_device = (batch_shape[0] // mesh.devices.size, *batch_shape[1:])
    images = jax.ShapeDtypeStruct(per_device, jnp.float32)
    labels = jax.ShapeDtypeStruct(per_device[:1], jnp.int32)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state["params"])
    batch_stats = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.get("batch_stats"))
    extra = () if batch_stats is None else (batch_stats,)
    rng = jax.random.key(0)  # for stochastic pruning; the residuals' shapes do not depend on it

    def residual_mib(loss) -> float:
        fn = lambda p, x, y, *stats: loss(p, {"image": x, "label": y}, rng, *stats)[0]
        kept = bsr_jax.residual_bytes(fn, params, images, labels, *extra)
        return (kept.activations + kept.inputs) / MIB

    compiled = bsr_jax.CompiledMemory.of(compiled_step)
    report = {
        "kind": "memory",
        "per_device_batch": per_device[0],
        "residual_activation_mib": residual_mib(loss_fn),
        "dense_residual_activation_mib": residual_mib(dense_loss_fn),
        "compiled_peak_mib": compiled.peak / MIB,
        "compiled_temp_mib": compiled.temp / MIB,
    }
    kept = kept_block_fraction(model, params, images, rules, batch_stats)
    return report if kept is None else {**report, "kept_block_fraction": kept}


def device_peak_mib() -> float | None:
    """Peak bytes in use on the first local device, where the backend reports it (GPU, TPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return stats["peak_bytes_in_use"] / MIB if stats and "peak_bytes_in_use" in stats else None


class MetricsLog:
    """Prints metric records and appends them to ``metrics.jsonl`` (process 0 only)."""

    def __init__(self, workdir: str, keep_until_step: int | None):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.enabled = jax.process_index() == 0
        if self.enabled:
            # A resumed run rewrites what the interrupted one logged after its last checkpoint.
            kept = []
            if keep_until_step is not None and os.path.exists(self.path):
                records, damage = run_dir.read_records_and_damage(workdir)
                if damage is not None:  # a partial last line: not rewritten, so the log is whole again
                    say(damage)
                kept = [json.dumps(r) + "\n" for r in records if r.get("step", 0) <= keep_until_step]
            with open(self.path, "w") as f:
                f.writelines(kept)

    def __call__(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        say(" ".join(f"{k}={_fmt(v)}" for k, v in record.items()))


def say(text: str) -> None:
    """Print a line above the progress bar, flushed at once (logs redirected to files stay current);
    process 0 only, in a run over several processes."""
    if jax.process_index() != 0:
        return
    tqdm.write(text)
    sys.stdout.flush()


def say_from_signal_handler(text: str) -> None:
    """``say`` for a signal handler: one unbuffered write to stdout's file descriptor. The handler
    can run in the middle of a write to ``sys.stdout``, whose buffer then refuses a second
    (reentrant) write with RuntimeError; on a terminal the line starts below the progress bar."""
    if jax.process_index() != 0:
        return
    os.write(sys.stdout.fileno(), (("\n" if sys.stdout.isatty() else "") + text + "\n").encode())


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class StepTimer:
    """Wall time of the ``steps`` counted since ``restart``."""

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self.start, self.steps = time.perf_counter(), 0

    def per_s(self, items_per_step: int) -> float:
        """Throughput (items a second) of the timed steps (0 before any), assuming they have finished."""
        return items_per_step * self.steps / (time.perf_counter() - self.start) if self.steps else 0.0


def train_record(interval: list[dict], timer: StepTimer, step: int, steps_per_epoch: int, items_per_step: int, items: str) -> dict:
    """Mean metrics of the steps since the last record, with the throughput as ``{items}_per_s``;
    raises on a non-finite loss."""
    values = jax.device_get(interval)
    elapsed = time.perf_counter() - timer.start  # after device_get: every step has finished
    losses = np.array([v["loss"] for v in values])
    if not np.all(np.isfinite(losses)):
        bad = step - len(values) + int(np.argmin(np.isfinite(losses))) + 1
        raise FloatingPointError(f"loss became {losses[~np.isfinite(losses)][0]} at step {bad}")
    record = {"kind": "train", "step": step, "epoch": step / steps_per_epoch}
    record.update({k: float(np.mean([v[k] for v in values])) for k in values[0]})
    if timer.steps:
        record.update({"step_time_s": elapsed / timer.steps, f"{items}_per_s": items_per_step * timer.steps / elapsed})
    peak = device_peak_mib()
    if peak is not None:
        record["device_peak_mib"] = peak
    return record


def memory_summary(memory: dict[str, Any]) -> list[str]:
    """The run summary's memory lines, from the memory record: the compiled step's peak, the memory
    figure of a device (as XLA plans the step on this backend), then the residual bytes the backward
    keeps, a count of the jaxpr that a device's memory need not follow (a compressed step's peak
    can stay near dense's while its residuals halve), so it is labelled as such."""
    residual, dense = memory["residual_activation_mib"], memory["dense_residual_activation_mib"]
    return [
        f"  compiled peak    {memory['compiled_peak_mib']:.2f} MiB per device: XLA's memory plan of the train step ({jax.default_backend()})",
        f"  residuals        {residual:.2f} MiB per device kept for the backward, {residual / dense:.0%} of dense's "
        "(counted in the jaxpr, not device memory)",
    ]


def run_summary(
    workdir: str,
    records: list[dict[str, Any]],
    *,
    step: int,
    stop_step: int,
    stopped_by: int | None,
    wall_time_s: float,
    checkpoint: str,
) -> dict[str, Any]:
    """What a finished or stopped run achieved, from its ``metrics.jsonl`` records; printed as a block.

    Returns ``{"step", "stop_step", "stopped_by", "wall_time_s", "final_test_accuracy",
    "best_test_accuracy", "best_epoch", "compiled_peak_mib", "residual_activation_mib",
    "dense_residual_activation_mib", "checkpoint", "plot_command"}``; the accuracies are None when no
    evaluation ran. The printed block shows the memory as ``memory_summary`` says.
    """
    evals = [r for r in records if r.get("kind") == "eval"]
    memory = [r for r in records if r.get("kind") == "memory"][-1]
    best = max(evals, key=lambda r: r["test_accuracy"], default=None)
    summary = {
        "step": step,
        "stop_step": stop_step,
        "stopped_by": stopped_by,
        "wall_time_s": wall_time_s,
        "final_test_accuracy": evals[-1]["test_accuracy"] if evals else None,
        "best_test_accuracy": best["test_accuracy"] if best else None,
        "best_epoch": best["epoch"] if best else None,
        "compiled_peak_mib": memory["compiled_peak_mib"],
        "residual_activation_mib": memory["residual_activation_mib"],
        "dense_residual_activation_mib": memory["dense_residual_activation_mib"],
        "checkpoint": checkpoint,
        "plot_command": f"python -m train.plot {workdir}",
    }
    status = f"{step} of {stop_step}"
    if stopped_by is not None:
        status += f", stopped by {signal.Signals(stopped_by).name}: continue with --resume"
    accuracy = "not evaluated yet"
    if evals:
        accuracy = (f"{summary['final_test_accuracy']:.4f} final, {summary['best_test_accuracy']:.4f} best "
                    f"(epoch {best['epoch']:.3g})")  # fmt: skip
    say("\n".join([
        f"run summary ({workdir})",
        f"  steps            {status}",
        f"  wall time        {wall_time_s:.0f} s (this session, data loading and compilation included)",
        f"  test accuracy    {accuracy}",
        *memory_summary(memory),
        f"  checkpoint       {checkpoint}",
        f"  plot             {summary['plot_command']}  (writes {os.path.join(workdir, 'curves.png')})",
    ]))  # fmt: skip
    return summary
