"""What every benchmark records next to its numbers (command, commit, machine, device, date), and
the one way benchmarks time steps against each other (alternating, on a shared machine)."""

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
        jax=jax.__version__,
        backend=jax.default_backend(),
        device=jax.devices()[0].device_kind,
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
