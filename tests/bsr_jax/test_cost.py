"""The planner's cost model (bsr_jax.planning.cost): the solver against exhaustive search, the
probes' coverage, and shares read off a compiled step."""

import itertools

import numpy as np
import pytest

from bsr_jax.measure.compiled import CompiledStep, LiveBuffer
from bsr_jax.measure.roofline import Kernel
from bsr_jax.planning import cost
from bsr_jax.planning.options import REST


def _exhaustive(weights, costs, capacity):
    fits = [(sum(c[i] for c, i in zip(costs, pick)), list(pick)) for pick in itertools.product(*(range(len(r)) for r in weights))
            if sum(w[i] for w, i in zip(weights, pick)) <= capacity]  # fmt: skip
    return min(fits) if fits else None


@pytest.mark.parametrize("seed", range(40))
def test_the_solver_finds_what_exhaustive_search_finds(seed):
    """A 3-block model, 5 options each, integer bytes (some negative: saved against keep): the
    dynamic programme at a resolution of one byte is exact."""
    rng = np.random.default_rng(seed)
    weights = rng.integers(-40, 60, size=(3, 5)).tolist()
    costs = rng.uniform(0.5, 2.0, size=(3, 5)).tolist()
    capacity = int(rng.integers(-60, 120))
    best = _exhaustive(weights, costs, capacity)
    room = capacity - sum(min(r) for r in weights)
    found = cost.knapsack(weights, costs, capacity, resolution=max(room, 1))
    if best is None:
        assert found is None
    else:
        assert sum(w[i] for w, i in zip(weights, found)) <= capacity
        np.testing.assert_allclose(sum(c[i] for c, i in zip(costs, found)), best[0], rtol=1e-12)


def test_a_coarse_solution_still_fits():
    """Bytes are rounded up to the resolution's unit: what the solver returns fits, never more."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        weights, costs = rng.uniform(0, 1e9, size=(12, 8)), rng.uniform(1e-3, 2e-3, size=(12, 8))
        capacity = float(rng.uniform(weights.min(1).sum(), weights.max(1).sum()))
        found = cost.knapsack(weights.tolist(), costs.tolist(), capacity, resolution=64)
        assert found is not None and sum(w[i] for w, i in zip(weights, found)) <= capacity


def test_probes_measure_every_option_and_variant():
    blocks = [f"b{i}" for i in range(4)]
    options = ["keep", "lean", "int4", "remat", "remat-dots", "remat-dots-all", "topk"]
    variants = [("lean", "plain"), ("keep", "chunked"), ("lean", "chunked")]
    found = cost.probes(blocks, options, variants)
    assert {o for choices, _, _ in found for o in choices} == {"lean", "int4", "remat-dots", "remat-dots-all", "topk"}
    assert [(rest, loss) for _, rest, loss in found] == variants  # three variants: three probes, options in turn
    assert cost.probes(blocks, ["keep", "remat"], []) == []  # the dense step and remat measure both


def _step(live, kernels, seconds, roofline_seconds=None):
    return CompiledStep(target="h100", peak=sum(b for _, b in live), temp=0, arguments=0, outputs=0, aliased=0, flops=None,
                        optimal_seconds=None, modelled_seconds=seconds, roofline_seconds=roofline_seconds or seconds,
                        live_at_peak=tuple(LiveBuffer(op, b) for op, b in live),
                        kernels=tuple(Kernel(op, op, s, 0.0, 0.0, 1) for op, s in kernels))  # fmt: skip


def test_shares_split_a_step_by_module_path():
    """``block_1`` is not ``block_10``'s prefix; anything outside the blocks is the rest's; times are
    scaled to the step's modelled time (XLA:TPU's, against the roofline's)."""
    blocks = [f"block_{i}" for i in (1, 10)]
    step = _step([("jvp(M)/block_1/fc/dot", 100), ("jvp(M)/block_10/fc/dot", 30), ("opt_state[0].mu", 7)],
                 [("transpose(jvp(M))/block_1/fc/dot", 2.0), ("jvp(M)/block_10/fc/dot", 1.0), ("head/dot", 1.0)], seconds=8.0,
                 roofline_seconds=4.0)  # fmt: skip
    found = cost.shares(step, blocks)
    assert found["block_1"] == cost.Share(100, 4.0, 0.0) and found["block_10"] == cost.Share(30, 2.0, 0.0)
    assert found[REST] == cost.Share(7, 2.0, 0.0)
    with pytest.raises(ValueError, match=r"no kernel of the compiled step names block\(s\) \['block_2'\]"):
        cost.shares(step, ["block_1", "block_2"])


def test_the_model_composes_and_solves_from_measured_shares():
    """Two blocks: dense keeps 100 + 100 (+50 of the rest) in 1 + 1 (+1) s; remat keeps 10 per block
    at 1.5 s. Each block's change is added to the dense step's peak and time."""
    blocks = ["b0", "b1"]
    dense = _step([("b0/x", 100), ("b1/x", 100), ("rest", 50)], [("b0/k", 1.0), ("b1/k", 1.0), ("rest", 1.0)], seconds=3.0)
    model = cost.CostModel(blocks, dense, cost.shares(dense, blocks))
    remat = _step([("b0/x", 10), ("b1/x", 10), ("rest", 50)], [("b0/k", 1.5), ("b1/k", 1.5), ("rest", 1.0)], seconds=4.0)
    model.add((("remat", "remat"), "keep", "plain"), cost.shares(remat, blocks))
    assert model.predict((("remat", "keep"), "keep", "plain")) == (160, 3.5)
    assert model.solve(200, ["keep", "remat"], [("keep", "plain")]) in {(("remat", "keep"), "keep", "plain"), (("keep", "remat"), "keep", "plain")}
    assert model.solve(100, ["keep", "remat"], [("keep", "plain")]) == (("remat", "remat"), "keep", "plain")
    assert model.solve(60, ["keep", "remat"], [("keep", "plain")]) is None
