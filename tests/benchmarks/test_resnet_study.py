"""The ResNet accuracy study's table (benchmarks/accuracy/resnet_study.py) on fake run directories."""

import json

from benchmarks.accuracy import cifar_grid
from benchmarks.accuracy import resnet_study


def _write_run(root, name, memory, evals, epochs=3):
    workdir = root / f"{name}-seed0"
    workdir.mkdir()
    (workdir / "config.json").write_text(json.dumps({"config": {"epochs": epochs}, "run": {}}))
    records = [{"kind": "memory", "step": 0, **memory}] if memory else []
    for epoch, accuracy in evals:
        records.append({"kind": "train", "step": int(epoch * 10), "loss": 1.0})
        records.append({"kind": "eval", "step": int(epoch * 10), "epoch": epoch, "test_accuracy": accuracy, "test_loss": 1.0})
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_accuracy_table_from_fake_runs(tmp_path):
    dense, pool2, bsr = resnet_study.STUDY
    memory = lambda mib: {"residual_activation_mib": mib, "dense_residual_activation_mib": 200.0}
    _write_run(tmp_path, dense, memory(200.0), [(1.0, 0.40), (2.0, 0.55), (3.0, 0.60)])
    # 90% of dense's final 0.60 is 0.54: pool2 reaches it at epoch 3, BSR (stopped after 2) not yet.
    _write_run(tmp_path, pool2, memory(64.0), [(1.0, 0.35), (2.0, 0.50), (3.0, 0.56)])
    _write_run(tmp_path, bsr, memory(70.0), [(1.0, 0.30), (2.0, 0.45)])
    rows, table = resnet_study.accuracy_table(str(tmp_path))
    by_config = {row["config"]: row for row in rows}
    assert [by_config[c]["epochs_to_90pct_dense"] for c in resnet_study.STUDY] == [2.0, 3.0, None]
    assert [by_config[c]["final_accuracy"] for c in resnet_study.STUDY] == [0.60, 0.56, 0.45]
    assert by_config[pool2]["residual_vs_dense"] == 0.32
    lines = table.splitlines()
    assert lines[0] == ("| config | residual memory vs dense | acc @ epoch 1 | acc @ epoch 2 | acc @ epoch 3 | final acc | "
                        "epochs to 90% of dense |")  # fmt: skip
    assert lines[3] == f"| {pool2} | 0.32 | 35.00% | 50.00% | 56.00% | 56.00% | 3 |"
    assert lines[4] == f"| {bsr} (unfinished) | 0.35 | 30.00% | 45.00% | - | 45.00% | - |"


def test_accuracy_table_without_a_finished_dense_run_counts_no_epochs(tmp_path):
    dense, pool2, _ = resnet_study.STUDY
    _write_run(tmp_path, dense, {}, [(1.0, 0.5)])  # stopped after epoch 1 of 3: no final accuracy yet
    _write_run(tmp_path, pool2, {}, [(1.0, 0.9)])
    rows, _ = resnet_study.accuracy_table(str(tmp_path))
    assert [(row["epochs_to_90pct_dense"], row["residual_vs_dense"], row["finished"]) for row in rows] == [(None, None, False)] * 2


def test_study_configs_are_resnet18_runs_of_the_grid():
    for name in resnet_study.STUDY:
        flags = cifar_grid.CONFIGS[name]
        assert flags[flags.index("--model") + 1] == "resnet18"


def test_table_only_writes_the_rows_as_json(tmp_path, capsys):
    dense, pool2, _ = resnet_study.STUDY
    memory = {"residual_activation_mib": 64.0, "dense_residual_activation_mib": 200.0}
    _write_run(tmp_path, dense, {**memory, "residual_activation_mib": 200.0}, [(1.0, 0.5), (2.0, 0.6), (3.0, 0.7)])
    _write_run(tmp_path, pool2, memory, [(1.0, 0.4), (2.0, 0.64), (3.0, 0.65)])  # 90% of 0.7: 0.63
    out = tmp_path / "study.json"
    resnet_study.main(["--table-only", "--root", str(tmp_path), "--out", str(out)])
    written = json.loads(out.read_text())
    assert [row["config"] for row in written["rows"]] == [dense, pool2]
    assert written["rows"][1]["epochs_to_90pct_dense"] == 2.0 and written["rows"][1]["residual_vs_dense"] == 0.32
    assert f"| {pool2} | 0.32 | 40.00% | 64.00% | 65.00% | 65.00% | 2 |" in capsys.readouterr().out
