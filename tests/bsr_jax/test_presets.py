"""bsr_jax.rewrite.presets: the recommended setting follows the measured front and its errors name the budget."""

import json
import pathlib

import pytest

from bsr_jax import Pruning
from bsr_jax.rewrite import presets

ROOT = pathlib.Path(__file__).resolve().parents[2]
PARETO = ROOT / "docs" / "results" / "pareto.json"
COMPILED = ROOT / "benchmarks" / "results" / "compiled_memory.json"


def test_measured_settings_are_the_studys_numbers():
    """Every all-residual configuration of docs/results/pareto.json is in MEASURED with its numbers,
    so the preset cannot drift from (or forget) what the study measured."""
    rows = {row["config"]: row for row in json.loads(PARETO.read_text())}
    whole_model = {name for name in rows if name == "dense" or name.startswith("all-")}
    assert whole_model == {m.config for m in presets.MEASURED}
    for m in presets.MEASURED:
        row = rows[m.config]
        assert m.memory_ratio == pytest.approx(row["s12_ratio"], abs=5e-4)
        assert m.gap_points == pytest.approx(100 * row["gap_final"], abs=5e-3)
        assert m.seeds == row["seeds"]


def test_peaks_are_the_compiled_benchmarks_numbers():
    """presets.MEASURED's compiled peaks are benchmarks/memory/compiled_memory.py's ResMLP-S12 rows."""
    rows = {(r["setting"], r["target"]): r for r in json.loads(COMPILED.read_text())["runs"] if r["model"] == "resmlp-s12"}
    for m in presets.MEASURED:
        for target in presets.TARGETS:
            dense = rows["dense", target]["peak_mib"]
            assert m.peak_ratio[target] == pytest.approx(rows[m.config, target]["peak_mib"] / dense, abs=5e-4)


@pytest.mark.parametrize("target", ["h100", "tpu-v5p"])
def test_recommended_is_the_most_accurate_setting_within_the_budget(target):
    for budget in (0.3, 0.45, 0.5, 0.7, 0.9, 1.0):
        within = [m for m in presets.MEASURED if m.peak_ratio[target] <= budget]
        if not within:
            continue
        chosen = presets.recommended(budget, target)
        best = min(m.gap_points for m in within)
        match = [m for m in within if m.pruning == chosen]
        assert match and match[0].gap_points == best
    # A larger budget never recommends a less accurate setting.
    gap = {m.pruning: m.gap_points for m in presets.MEASURED}
    budgets = sorted(m.peak_ratio[target] for m in presets.MEASURED if m.peak_ratio[target] <= 1)
    gaps = [gap[presets.recommended(b, target)] for b in budgets]
    assert gaps == sorted(gaps, reverse=True)
    assert isinstance(presets.recommended(), Pruning)


def test_unknown_target_is_named():
    with pytest.raises(ValueError, match="target must be one of"):
        presets.recommended(0.5, "a100")


@pytest.mark.parametrize("budget", [0.0, -0.1, 1.5, "half"])
def test_budget_out_of_range_names_the_argument(budget):
    with pytest.raises(ValueError, match=r"budget must be .* in \(0, 1\]"):
        presets.recommended(budget)


def test_budget_below_every_measured_setting_names_the_smallest():
    smallest = min(presets.MEASURED, key=lambda m: m.peak_ratio["h100"])
    with pytest.raises(ValueError, match=smallest.config):
        presets.recommended(smallest.peak_ratio["h100"] / 2)
