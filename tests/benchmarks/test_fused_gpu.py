"""benchmarks/kernels/fused_gpu.py, which a GPU session runs in one call: its rows off a GPU (the
kernels interpreted), so that the script is known to run before device time is spent on it."""

import json

import pytest

from benchmarks.kernels import fused_gpu


def test_every_kernel_variant_is_timed_against_xla_and_modelled(tmp_path):
    out = tmp_path / "fused_gpu.json"
    fused_gpu.main(["--shapes", "tiny", "--reps", "1", "--burst", "2", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["kernel"] for r in rows] == [
        "forward", "forward rows=128 warps=4", "forward rows=128 warps=8", "forward columns=256 warps=8",
        "dW splits=1", "dW splits=auto", "dW splits=auto rows=128 warps=4", "dW splits=auto rows=128 warps=8",
        "dW splits=auto columns=256 warps=8", "dW splits=auto rows=128 columns=256 warps=8", "dW bf16 products",
    ]  # fmt: skip
    for row in rows:
        assert row["us"] > 0 and row["xla_us"] > 0 and row["modelled_us"] > 0
        assert row["ratio"] == row["us"] / row["xla_us"]


def test_a_timing_needs_at_least_one_call(tmp_path):
    with pytest.raises(SystemExit):
        fused_gpu.main(["--shapes", "tiny", "--burst", "0", "--json", str(tmp_path / "x.json")])
