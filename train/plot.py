"""Loss and evaluation curves of several runs in one PNG.

    python -m train.plot runs/tiny_dense runs/tiny_s0.7      # writes runs/tiny_dense/curves.png
    python -m train.plot runs/lm-dense runs/lm-int4          # train.lm runs: against steps

Reads each WORKDIR/metrics.jsonl (a last line cut off by a crash is skipped, with a note); a run is
labelled by its directory name. Image runs (train.cifar, train.imagenet): train loss, test loss
and test accuracy against epochs, so runs with different batch sizes line up. train.lm runs:
train loss, validation loss and validation bits per byte against steps. Runs of the two kinds do
not share a figure. The PNG goes to the first WORKDIR unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt

from train.run_dir import DamagedRecords, metrics_path, read_records_and_damage

# What each kind of run is plotted as: its x axis, and per panel (record kind, value, title).
LAYOUTS: dict[str, tuple[str, tuple[tuple[str, str, str], ...]]] = {
    "image": ("epoch", (("train", "loss", "train loss"), ("eval", "test_loss", "test loss"),
                        ("eval", "test_accuracy", "test accuracy"))),
    "lm": ("step", (("train", "loss", "train loss"), ("eval", "val_loss", "validation loss"),
                    ("eval", "val_bits_per_byte", "validation bits per byte"))),
}  # fmt: skip


class NothingToPlot(ValueError):
    """A run's metrics.jsonl holds no train or eval record; the message names the file."""


class CannotPlot(ValueError):
    """A run's records are not what train.cifar, train.imagenet or train.lm write, or runs of both
    kinds were given together; the message names the file or the runs."""


def run_kind(records: Sequence[dict[str, Any]]) -> str | None:
    """``"image"`` or ``"lm"``: what wrote ``records`` (evaluations score test accuracy or validation
    loss; before the first one, image train records carry the batch accuracy), None when neither."""
    evals = [r for r in records if r.get("kind") == "eval"]
    if evals:
        return "image" if "test_accuracy" in evals[0] else "lm" if "val_loss" in evals[0] else None
    trains = [r for r in records if r.get("kind") == "train"]
    return None if not trains else "image" if "accuracy" in trains[0] else "lm"


def plot_runs(workdirs: Sequence[str], out: str, note: Callable[[str], None] = print) -> None:
    """The curves of ``LAYOUTS`` of each run, one panel each, in ``out``.

    Raises ``NothingToPlot`` (before drawing anything) for a run without train or eval records,
    ``CannotPlot`` for records of neither kind or runs of both; a partial last line of a run cut
    off while writing it is skipped, and ``note`` is told.
    """
    runs = []
    for workdir in workdirs:
        records, damage = read_records_and_damage(workdir)
        if damage is not None:
            note(damage)
        if not any(r.get("kind") in ("train", "eval") for r in records):
            what = "is empty" if not records else "has no train or eval records yet"
            raise NothingToPlot(f"{metrics_path(workdir)} {what}: nothing to plot (has the run logged a step?)")
        kind = run_kind(records)
        if kind is None:
            raise CannotPlot(f"{metrics_path(workdir)}: its eval records hold neither test_accuracy (train.cifar, "
                             "train.imagenet) nor val_loss (train.lm): not a run this can plot")  # fmt: skip
        runs.append((workdir, kind, records))
    kinds = {kind: workdir for workdir, kind, _ in runs}
    if len(kinds) > 1:
        raise CannotPlot(f"{kinds['lm']} is a train.lm run (plotted against steps) and {kinds['image']} an image run "
                         "(against epochs): plot them separately, each with its own --out")  # fmt: skip
    x, panels = LAYOUTS[runs[0][1]]
    curves = [(os.path.basename(os.path.normpath(workdir)), [_curve(workdir, records, x, *panel[:2]) for panel in panels])
              for workdir, _, records in runs]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.5))
    for label, points in curves:
        for ax, (record_kind, _, _), (xs, ys) in zip(axes, panels, points):
            ax.plot(xs, ys, label=label, marker="o" if record_kind == "eval" else None)
    for ax, (_, _, title) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _curve(workdir: str, records: Sequence[dict[str, Any]], x: str, kind: str, value: str) -> tuple[list, list]:
    """The ``(x, value)`` points of the ``kind`` records; ``CannotPlot`` names a record lacking one."""
    chosen = [r for r in records if r.get("kind") == kind]
    for r in chosen:
        for key in (x, value):
            if not isinstance(r.get(key), (int, float)):
                raise CannotPlot(f"{metrics_path(workdir)}: the {kind} record of step {r.get('step', '?')} has no number "
                                 f"{key!r}: not written by train.cifar, train.imagenet or train.lm?")  # fmt: skip
    return [r[x] for r in chosen], [r[value] for r in chosen]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="train.plot", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("workdirs", nargs="+", metavar="WORKDIR", help="run directories holding metrics.jsonl")
    parser.add_argument("--out", help="PNG to write (default: FIRST_WORKDIR/curves.png)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.workdirs[0], "curves.png")
    try:
        plot_runs(args.workdirs, out, note=lambda text: print(f"train.plot: {text}", file=sys.stderr))
    except (FileNotFoundError, DamagedRecords, NothingToPlot, CannotPlot) as error:
        print(f"train.plot: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
