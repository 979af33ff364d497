"""benchmarks.kernels.dw_speed' per-path rows and the CPU facts every benchmark records (benchmarks.run_info)."""

import cpu_kernels
from benchmarks.kernels import dw_speed as kernels
from benchmarks import run_info


def test_layer_rows_name_the_kernel_path_that_ran(monkeypatch):
    monkeypatch.setitem(kernels.SHAPES, "tiny", (64, 48, 40))
    monkeypatch.setattr(kernels, "LAYER_DW", ((0.0, "int4"),))
    rows = kernels.measure_layer("tiny", reps=1)
    assert [(r["what"], r["backend"]) for r in rows] == [
        ("backward dx+dW", "cpu"), ("backward dx+dW", "xla"), ("dW", "cpu"), ("dW", "xla")
    ]  # fmt: skip
    assert {r["path"] for r in rows if r["backend"] == "cpu"} == {cpu_kernels.resolve_isa()}
    assert {r["path"] for r in rows if r["backend"] == "xla"} == {"-"}
    assert all(r["ratio"] > 0 for r in rows)


def test_metadata_records_cpu_model_flags_and_kernel_path(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "portable")
    meta = run_info.run_metadata()
    assert meta["cpu"] and meta["cpu_flags"] and meta["cpu_kernel_isa"] == "portable"
    assert "kernel path portable" in run_info.footer(meta) and meta["cpu"] in run_info.footer(meta)
