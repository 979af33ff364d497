"""Issue 14's accuracy study: CIFAR-10 ResNet-18 dense vs pool2 vs BSR 0.7/16 at equal epochs.

One resumable command trains the three ``benchmarks/accuracy/cifar_grid.py`` configurations in ``STUDY``
(``RESNET_STUDY``; one after the other, each in ``ROOT/<config>-seed<S>``; finished runs are skipped,
interrupted ones resume from their last checkpoint) for ``EPOCHS`` epochs, then prints the accuracy table:
per configuration the residual memory against dense (each run's memory record), the test accuracy
after every epoch, the final accuracy, and the epochs until the test accuracy first reaches 90% of
the dense run's final accuracy ("-": not reached; unfinished runs show the epochs they have).

    python -m benchmarks.accuracy.resnet_study --data-dir /work/shared/data/cifar10-jpg.tar.gz
    python -m benchmarks.accuracy.resnet_study --table-only          # the table of what has run so far

Both also write the table's rows to ``--out`` (``benchmarks/results/resnet_study.json``).

Its width (``--dim 16`` in CONFIGS) and ``EPOCHS`` come from ``benchmarks/speed/resnet_step_time.py``.

Writes docs/RESULTS.md section 8 (ResNet-18 on CIFAR-10 at equal epochs).
"""

from __future__ import annotations

import argparse
import os

from benchmarks.accuracy import cifar_grid
from benchmarks.accuracy import grid_report
from benchmarks.run_info import run_metadata, write_json

STUDY = cifar_grid.RESNET_STUDY  # CONFIGS names; the first is the dense reference
# ResNet-18 at --dim 16 took 0.7-1.2 s per step of 128 (benchmarks/results/resnet_step_time.json;
# an earlier run of it 1.2-1.6 s; 2 cores shared with another training run and tests): 5-10 minutes
# per epoch, so 5 epochs fit the issue's ~60 minutes per configuration even at the slowest figure.
# Full width (--dim 64) took 11.7-16.2 s per step (< 1 epoch an hour), --dim 32 2.9-5.5 s. The study
# itself then ran at 0.46-0.55 s per step (17-20 minutes per configuration, a niced ResMLP study
# beside it): a longer schedule would fit the hour; ``--epochs N --root <new dir>`` runs one.
EPOCHS = 5


def read_run(workdir: str) -> dict:
    """``{"evals": [(epoch, test accuracy), ...], "memory": the memory record or {}, "finished":
    evaluated after its last configured epoch}`` of one run."""
    run = grid_report.load_run(workdir)
    return {
        "evals": [(r["epoch"], r["test_accuracy"]) for r in run["eval"]],
        "memory": run["memory"][0] if run["memory"] else {},
        "finished": grid_report.is_finished(workdir, run),
    }


def accuracy_table(root: str, configs: tuple[str, ...] = STUDY, seed: int = 0) -> tuple[list[dict], str]:
    """Rows (one per configuration that has a run under ``root``) and the markdown table.

    ``configs[0]`` is the dense reference: epochs to 90% are counted against its final accuracy
    (none until it has finished). Memory is each run's residual bytes over the dense model's
    (``dense_residual_activation_mib`` of its memory record). An unfinished run is marked
    "(unfinished)" and its last evaluation stands in the "final acc" column.
    """
    runs = {}
    for name in configs:
        workdir = os.path.join(root, f"{name}-seed{seed}")
        if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
            runs[name] = read_run(workdir)
    dense = runs.get(configs[0])
    target = 0.9 * dense["evals"][-1][1] if dense and dense["finished"] else None
    rows = []
    for name, run in runs.items():
        memory = run["memory"]
        ratio = memory["residual_activation_mib"] / memory["dense_residual_activation_mib"] if memory else None
        reached = None if target is None else next((e for e, acc in run["evals"] if acc >= target), None)
        rows.append(dict(config=name, residual_vs_dense=ratio, evals=run["evals"], epochs_to_90pct_dense=reached,
                         final_accuracy=run["evals"][-1][1] if run["evals"] else None, finished=run["finished"]))  # fmt: skip
    epochs = sorted({round(e, 6) for row in rows for e, _ in row["evals"]})
    fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
    header = ["config", "residual memory vs dense", *(f"acc @ epoch {e:g}" for e in epochs), "final acc", "epochs to 90% of dense"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        by_epoch = {round(e, 6): acc for e, acc in row["evals"]}
        cells = [row["config"] + ("" if row["finished"] else " (unfinished)"), fmt(row["residual_vs_dense"], "{:.2f}"), *(fmt(by_epoch.get(e), "{:.2%}") for e in epochs),
                 fmt(row["final_accuracy"], "{:.2%}"), fmt(row["epochs_to_90pct_dense"], "{:g}")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return rows, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="runs/resnet18_study", help="one workdir per run below this (default: %(default)s)")
    parser.add_argument("--data-dir", help="passed to train.cifar --data-dir")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help="epochs per run, equal for all (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--table-only", action="store_true", help="only print the table of the runs that exist")
    parser.add_argument("--out", default="benchmarks/results/resnet_study.json", help="the table's rows as JSON")
    parser.add_argument("extra", nargs="*", help="further train.cifar flags, after --")
    args = parser.parse_args(argv)
    if not args.table_only:
        # A checkpoint every epoch (390 steps of 128), so an interrupted session loses at most one.
        extra = args.extra if "--checkpoint-every" in args.extra else ["--checkpoint-every", "390", *args.extra]
        grid = argparse.Namespace(root=args.root, data_dir=args.data_dir, model="resnet18", epochs=args.epochs,
                                  seeds=[args.seed], configs=list(STUDY), extra=extra)  # fmt: skip
        cifar_grid.run_grid(grid)
    rows, table = accuracy_table(args.root, STUDY, args.seed)
    print(table)
    write_json(args.out, run_metadata(), dict(root=args.root, seed=args.seed, rows=rows))


if __name__ == "__main__":
    main()
