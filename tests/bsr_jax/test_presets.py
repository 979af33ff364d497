"""bsr_jax.presets: the recommended setting follows the measured front and its errors name the budget."""

import json
import pathlib

import pytest

from bsr_jax import Pruning, presets

PARETO = pathlib.Path(__file__).resolve().parents[2] / "docs" / "results" / "pareto.json"


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


def test_recommended_is_the_most_accurate_setting_within_the_budget():
    for budget in (0.3, 0.45, 0.5, 0.7, 1.0):
        within = [m for m in presets.MEASURED if m.memory_ratio <= budget]
        if not within:
            continue
        chosen = presets.recommended(budget)
        best = min(m.gap_points for m in within)
        match = [m for m in within if m.pruning == chosen]
        assert match and match[0].gap_points == best
    # A larger budget never recommends a less accurate setting.
    gap = {m.pruning: m.gap_points for m in presets.MEASURED}
    budgets = sorted(m.memory_ratio for m in presets.MEASURED)
    gaps = [gap[presets.recommended(b)] for b in budgets]
    assert gaps == sorted(gaps, reverse=True)
    assert isinstance(presets.recommended(), Pruning)


@pytest.mark.parametrize("budget", [0.0, -0.1, 1.5, "half"])
def test_budget_out_of_range_names_the_argument(budget):
    with pytest.raises(ValueError, match=r"budget must be .* in \(0, 1\]"):
        presets.recommended(budget)


def test_budget_below_every_measured_setting_names_the_smallest():
    smallest = min(presets.MEASURED, key=lambda m: m.memory_ratio)
    with pytest.raises(ValueError, match=smallest.config):
        presets.recommended(smallest.memory_ratio / 2)
