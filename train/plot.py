"""Loss and test-accuracy curves of several runs in one PNG.

    python -m train.plot runs/tiny_dense runs/tiny_s0.7      # writes runs/tiny_dense/curves.png

Reads each WORKDIR/metrics.jsonl (written by ``train.loop``; a last line cut off by a crash is
skipped, with a note); a run is labelled by its directory name. Curves are drawn against epochs, so runs with different batch sizes line up. The PNG goes to
the first WORKDIR unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt

from train.run_dir import DamagedRecords, metrics_path, read_records_and_damage


class NothingToPlot(ValueError):
    """A run's metrics.jsonl holds no train or eval record; the message names the file."""


def plot_runs(workdirs: Sequence[str], out: str, note: Callable[[str], None] = print) -> None:
    """Train loss (left), test loss (middle) and test accuracy (right) of each run, in ``out``.

    Raises ``NothingToPlot`` (before drawing anything) for a run without train or eval records;
    a partial last line of a run cut off while writing it is skipped, and ``note`` is told.
    """
    runs = []
    for workdir in workdirs:
        records, damage = read_records_and_damage(workdir)
        if damage is not None:
            note(damage)
        if not any(r.get("kind") in ("train", "eval") for r in records):
            what = "is empty" if not records else "has no train or eval records yet"
            raise NothingToPlot(f"{metrics_path(workdir)} {what}: nothing to plot (has the run logged a step?)")
        runs.append((workdir, records))
    fig, (ax_loss, ax_test_loss, ax_acc) = plt.subplots(1, 3, figsize=(15, 4.5))
    for workdir, records in runs:
        label = os.path.basename(os.path.normpath(workdir))
        train = [r for r in records if r.get("kind") == "train"]
        evals = [r for r in records if r.get("kind") == "eval"]
        ax_loss.plot([r["epoch"] for r in train], [r["loss"] for r in train], label=label)
        ax_test_loss.plot([r["epoch"] for r in evals], [r["test_loss"] for r in evals], marker="o", label=label)
        ax_acc.plot([r["epoch"] for r in evals], [r["test_accuracy"] for r in evals], marker="o", label=label)
    for ax, title in ((ax_loss, "train loss"), (ax_test_loss, "test loss"), (ax_acc, "test accuracy")):
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


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
    except (FileNotFoundError, DamagedRecords, NothingToPlot) as error:
        print(f"train.plot: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
