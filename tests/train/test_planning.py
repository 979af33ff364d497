"""--memory-budget/--target: the trainers' flags for bsr_jax.plan (the planner itself: tests/bsr_jax/test_planner.py)."""

import chex
import jax
import pytest

from bsr_jax.planning import search as planner
from train import planning
from train.config import TrainConfig, UsageError
from train.lm_config import LMConfig
from train.lm_loop import create_model as create_lm, loss_function, model_shape


@pytest.mark.parametrize("config", [TrainConfig, LMConfig])
@pytest.mark.parametrize("flags", [dict(storage_dtype="int4"), dict(sparsity=0.5), dict(dx="int8"), dict(target="a100")])
def test_the_plan_chooses_compression_alone(config, flags):
    with pytest.raises(ValueError, match="memory_budget|target"):
        config(memory_budget="0.5", **flags)


@pytest.mark.parametrize("budget", ["lots", "0", "1.5x", "2.0", "100"])
def test_a_bad_budget_is_a_usage_error_naming_the_flag(budget):
    with pytest.raises(UsageError, match="--memory-budget: budget must be"):
        planning.check_budget(budget, UsageError)
    planning.check_budget("12GiB", UsageError)


def test_a_resumed_run_rebuilds_its_plan_without_compiling():
    config = LMConfig(model="cpu", dim=32, depth=2, heads=2, seq_len=16)
    shape = model_shape(config, 64)
    model = create_lm(config, shape, compressed=False)
    saved = dict(target="h100", peak_bytes=2**20, choices={"layer_0": "remat", "layer_1": "int4", planner.REST: "keep"})
    planned, record = planning.planned_model(model, lambda m: loss_function(m, config), {}, None, None, "0.5", "h100", UsageError, saved)
    assert record is saved and type(planned) is not type(model)  # compress_model's subclass, not the plain LM
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 64)
    variables = model.init(jax.random.key(1), tokens)
    chex.assert_trees_all_equal(planned.apply(variables, tokens), model.apply(variables, tokens))
