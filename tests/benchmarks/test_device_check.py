"""benchmarks/memory/device_check.py's ``plan:LABEL`` steps: a label as plan_table writes it, built as the
planner builds its candidates (lowered here, not run: the script runs them on a GPU)."""

import jax
import pytest

from benchmarks.memory.device_check import plan_step


def _text(label):
    _, _, _, context, step, args = plan_step("resmlp-s12", label, 1024)
    with context:
        return jax.jit(step).lower(*args).as_text()


def test_a_label_gives_its_blocks_choices_and_micro_batches():
    dense, remat = _text("12xkeep, rest keep"), _text("1xkeep + 10xremat + 1xkeep, rest keep")
    barrier = "stablehlo.optimization_barrier"  # one more for each rematerialized block (jax.checkpoint's)
    assert remat.count(barrier) == dense.count(barrier) + 10
    assert "stablehlo.while" not in dense and "stablehlo.while" in _text("12xkeep, rest keep, 4 micro-batches")


def test_a_label_of_the_wrong_block_count_is_refused():
    with pytest.raises(ValueError, match="11 choices for 12 blocks"):
        plan_step("resmlp-s12", "11xkeep, rest keep", 1024)
