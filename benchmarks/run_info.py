"""What every benchmark records next to its numbers (command, commit, machine, CPU model and vector
flags, the CPU kernel's instruction-set path, device, date), and the one way benchmarks time steps
against each other (alternating, on a shared machine)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jax


def run_metadata() -> dict[str, str]:
    """Call it when the run starts: the commit is the code that was imported, with ``+dirty`` when
    tracked files had uncommitted changes."""
    git = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()  # noqa: E731
    commit = git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    return dict(
        command=" ".join(["python"] + sys.argv),
        commit=commit,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=f"{platform.node()} {platform.processor() or platform.machine()} ({os.cpu_count()} cores)",
        **cpu_info(),
        jax=jax.__version__,
        backend=jax.default_backend(),
        device=jax.devices()[0].device_kind,
    )


# The flags that decide which kernel paths and which of XLA's code a CPU can run.
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile")


def cpu_info() -> dict[str, str]:
    """``cpu``: model name with family/model numbers (VMs often hide the name: AMD family 25 model
    17 is Zen 4), ``cpu_flags``: which of ``VECTOR_FLAGS`` it has, ``cpu_kernel_isa``: the path the
    ``cpu`` backend's kernel runs (``cpu_kernels.resolve_isa()``, so ``$BSR_JAX_CPU_ISA`` counts)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:  # not Linux: the platform module's answer, flags unknown
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    flags = set(fields.get("flags", "").split())
    try:
        import cpu_kernels

        isa = cpu_kernels.resolve_isa()
    except (RuntimeError, ValueError) as error:  # kernel not built, or a bad $BSR_JAX_CPU_ISA
        isa = f"unavailable: {error}"
    return dict(cpu=name, cpu_flags=" ".join(f for f in VECTOR_FLAGS if f in flags) or "unknown", cpu_kernel_isa=isa)


def footer(meta: dict[str, str]) -> str:
    """The line under a results table: how and where it was measured."""
    return (
        f"<sub>`{meta['command']}` at commit `{meta['commit']}`, {meta['date']}, {meta['machine']}, CPU {meta['cpu']} "
        f"[{meta['cpu_flags']}], kernel path {meta['cpu_kernel_isa']}, jax {meta['jax']}, device `{meta['device']}`</sub>"
    )


def write_json(path: str, meta: dict[str, str], payload: dict) -> None:
    """``{"meta": meta, **payload}`` to ``path`` (directories created), announced on stderr."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, **payload), f, indent=1)
    print(f"wrote {path}", file=sys.stderr)


def alternating_time_ratios(steps: dict[str, Callable[[], Any]], reps: int, baseline: str) -> dict[str, dict[str, float]]:
    """Times every step ``reps`` times, alternating between them so that load on a shared machine
    hits each alike (each timed call follows an untimed warm one); returns per step the median
    seconds and the median of its per-round ratio to ``baseline``'s."""
    times: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(reps):
        for label, step in steps.items():
            jax.block_until_ready(step())
            start = time.perf_counter()
            jax.block_until_ready(step())
            times[label].append(time.perf_counter() - start)
    return {
        label: dict(
            seconds=statistics.median(ts), ratio=statistics.median(t / b for t, b in zip(ts, times[baseline]))
        )
        for label, ts in times.items()
    }
