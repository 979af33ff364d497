"""The Pareto study's gaps (benchmarks/accuracy/pareto.py): same-seed differences, not differences of means."""

import pytest

from benchmarks.accuracy import pareto


def _row(config, curves, memory=1.0):
    seeds = sorted(curves)
    return dict(config=config, seeds=len(seeds), seed_ids=seeds, curves=[curves[s] for s in seeds], s12_mib=memory)


DENSE = _row("dense", {0: [(3.0, 0.56), (10.0, 0.69)], 1: [(3.0, 0.54), (10.0, 0.67)]})


def test_gap_is_against_dense_of_the_same_seed():
    # Seed 0 only: 0.69 - 0.68, not dense's two-seed mean 0.68 minus 0.68.
    one_seed = _row("int8", {0: [(3.0, 0.55), (10.0, 0.68)]})
    assert pareto.paired_gap(DENSE, one_seed, None) == pytest.approx(0.01)
    assert pareto.paired_gap(DENSE, one_seed, 3.0) == pytest.approx(0.01)
    two_seeds = _row("int4", {0: [(3.0, 0.56), (10.0, 0.70)], 1: [(3.0, 0.52), (10.0, 0.67)]})
    assert pareto.paired_gap(DENSE, two_seeds, None) == pytest.approx((-0.01 + 0.0) / 2)
    assert pareto.paired_gap(DENSE, two_seeds, 3.0) == pytest.approx((0.0 + 0.02) / 2)


def test_gap_needs_every_seed_at_an_epoch_and_a_seed_in_common():
    missing_epoch3 = _row("a", {0: [(3.0, 0.5), (10.0, 0.6)], 1: [(10.0, 0.6)]})
    assert pareto.paired_gap(DENSE, missing_epoch3, 3.0) is None
    assert pareto.paired_gap(DENSE, _row("b", {7: [(10.0, 0.6)]}), None) is None


def test_front_is_by_gap_at_no_more_memory():
    rows = [
        dict(config="dense", s12_mib=100.0, gap_final=0.0),
        dict(config="int4", s12_mib=38.0, gap_final=-0.001),
        dict(config="mixed", s12_mib=37.9, gap_final=0.016),
        dict(config="int8", s12_mib=47.0, gap_final=0.0003),  # more memory than int4, larger gap
    ]
    pareto.front(rows)
    assert {r["config"]: r["on_front"] for r in rows} == {"dense": False, "int4": True, "mixed": True, "int8": False}
