"""Micro-batching (``bsr_jax.accumulated_value_and_grad``, ``plan(microbatches=)``): the gradient
of k slices one at a time equals the whole batch's, and the compiled step holds less."""

import dataclasses
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import bsr_jax
from bsr_jax.planning import search as planner
from bsr_jax.planning.microbatch import check_microbatches


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(64)(nn.gelu(nn.Dense(256)(nn.LayerNorm()(x))))


class Net(nn.Module):
    blocks: int = 3

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(64)(x)
        for i in range(self.blocks):
            x = Block(name=f"blocks_{i}")(x)
        return nn.Dense(10)(x)


def _loss(module, variables, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(module.apply(variables, x), y).mean()


X = jax.random.normal(jax.random.key(0), (32, 16))
Y = jnp.arange(32) % 10


@pytest.mark.parametrize("k", [2, 4])
def test_the_accumulated_gradient_is_the_whole_batchs(k):
    net = Net()
    variables = net.init(jax.random.key(1), X)
    loss = lambda p, x, y: _loss(net, {"params": p}, x, y)  # noqa: E731
    whole = jax.jit(jax.value_and_grad(loss))(variables["params"], X, Y)
    sliced = jax.jit(bsr_jax.accumulated_value_and_grad(loss, k))(variables["params"], X, Y)
    chex.assert_trees_all_close(sliced, whole, rtol=1e-5, atol=1e-7)


def test_a_count_that_does_not_divide_the_batch_is_named():
    with pytest.raises(ValueError, match=r"microbatches must be an int dividing the batch's leading axis \[32\]: one of \[1, 2, 4, 8, 16, 32\], got 3"):
        check_microbatches(3, (X, Y))
    with pytest.raises(ValueError, match="got True"):
        check_microbatches(True, (X, Y))


def test_a_micro_batched_plan_measures_micro_batched_steps():
    """Dense fits the budget at each count: one compile each. Two micro-batches of 2048 rows keep
    less than the whole 4096 at once."""
    x, y = jax.ShapeDtypeStruct((4096, 16), jnp.float32), jax.ShapeDtypeStruct((4096,), jnp.int32)
    common = dict(optimizer=optax.adamw(1e-3), budget="4GiB", target="h100", progress=False)
    whole = bsr_jax.plan(Net(), _loss, x, y, **common)
    halves = bsr_jax.plan(Net(), _loss, x, y, microbatches=2, **common)
    assert (whole.microbatches, halves.microbatches) == (1, 2)
    assert halves.peak < whole.peak
    assert "over 2 micro-batches" in str(halves) and "micro-batches" not in str(whole)
    with pytest.raises(ValueError, match="microbatches must be an int dividing"):
        bsr_jax.plan(Net(), _loss, x, y, microbatches=3, **common)


def test_nnx_models_are_refused_before_anything_compiles():
    class Tiny(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(2)])

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    with pytest.raises(ValueError, match=r"microbatches > 1 needs a flax.linen model"):
        bsr_jax.plan(Tiny(nnx.Rngs(0)), lambda m, x: m(x).mean(), X, optimizer=optax.adamw(1e-3), budget=0.5, microbatches=2, progress=False)


@pytest.mark.slow  # 11 s of compiles; micro-batched plans hold by default in test_a_micro_batched_plan_measures_micro_batched_steps
def test_auto_falls_back_to_the_fewest_micro_batches_whose_dense_step_fits(monkeypatch):
    """Blocks may only be kept: at 0.7 of the whole batch's dense peak nothing fits at one
    micro-batch, and "auto" returns the dense step at two, as plan(microbatches=2) measures it.
    Lowering only that step: plan's check that the loss applies its module (it lowers remat on
    every block beside the dense step) was made at each count "auto" tried, not once per step."""
    from bsr_jax.planning import candidates

    x, y = jax.ShapeDtypeStruct((4096, 16), jnp.float32), jax.ShapeDtypeStruct((4096,), jnp.int32)
    common = dict(optimizer=optax.adamw(1e-3), target="h100", progress=False, options=["keep"], rest_options=["keep"], cache={})
    with pytest.raises(ValueError, match="no candidate fits"):
        bsr_jax.plan(Net(), _loss, x, y, budget=0.7, **common)
    lowered, lower_for = [], candidates.lower_for
    monkeypatch.setattr(candidates, "lower_for", lambda *a, **k: lowered.append(1) or lower_for(*a, **k))
    chosen = bsr_jax.plan(Net(), _loss, x, y, budget=0.7, microbatches="auto", **common)
    assert len(lowered) == 1  # the dense step at two micro-batches
    halves = bsr_jax.plan(Net(), _loss, x, y, budget="1GiB", microbatches=2, **common)
    assert chosen.microbatches == 2 and (chosen.peak, chosen.modelled_seconds) == (halves.peak, halves.modelled_seconds)
    assert chosen.peak <= 0.7 * chosen.dense.peak and chosen.dense.peak > halves.peak  # dense: the whole batch's
    with pytest.raises(ValueError, match=r"one of \[1, 2, 4, .*\] or 'auto', got 'all'"):
        bsr_jax.plan(Net(), _loss, x, y, budget=0.7, microbatches="all", **common)


@pytest.mark.slow
def test_auto_takes_remat_at_fewer_micro_batches_where_it_is_faster_than_the_dense_step_at_more():
    """Where nothing fits at one micro-batch, "auto" compares keep/remat per block at the fewest
    counts with the dense step at the fewest count where it fits: twelve wide blocks, whose remat
    keeps their inputs, 12 x (B, 64), at 2 micro-batches is faster than the dense step at 8."""
    x, y = jax.ShapeDtypeStruct((4096, 16), jnp.float32), jax.ShapeDtypeStruct((4096,), jnp.int32)
    cache = {}

    def step(k, option):  # as plan measures it, into the cache plan reads
        family = planner.Linen(Net(blocks=12), _loss, (x, y), None, None)
        return planner.Candidates(family, {"plain": _loss}, (x, y), optax.adamw(1e-3), "h100", False, cache, microbatches=k).measure(
            [option] * 12, "keep")  # fmt: skip

    remat1, remat2, dense4, dense8 = step(1, "remat"), step(2, "remat"), step(4, "keep"), step(8, "keep")
    budget = (remat1.peak + dense8.peak) // 2
    assert remat2.peak <= budget < min(remat1.peak, dense4.peak) and dense8.peak <= budget, (remat2.peak, remat1.peak, dense4.peak, dense8.peak)
    assert remat2.seconds < dense8.seconds  # what makes this test: the old rule (dense at the fewest count) took dense8
    chosen = bsr_jax.plan(Net(blocks=12), _loss, x, y, budget=budget, microbatches="auto", options=["keep", "remat"], optimizer=optax.adamw(1e-3),
                          target="h100", progress=False, rest_options=["keep"], cache=cache)  # fmt: skip
    assert chosen.microbatches == 2 and chosen.peak <= budget and chosen.modelled_seconds <= remat2.seconds
    assert "remat" in chosen.choices.values()


@pytest.mark.slow
def test_auto_stops_at_a_count_whose_dense_step_is_slower_than_the_plan_found():
    """The dense step is the fastest step at its count: where the dense step at 2 micro-batches is
    slower than the plan at one (remat on small blocks, whose weights each slice reads again), no
    remat at 2 is compiled (the search used to compile remat on every block and probes there)."""
    x, y = jax.ShapeDtypeStruct((256, 16), jnp.float32), jax.ShapeDtypeStruct((256,), jnp.int32)
    cache = {}

    def step(k, option):  # as plan measures it, into the cache plan reads
        family = planner.Linen(Net(), _loss, (x, y), None, None)
        return planner.Candidates(family, {"plain": _loss}, (x, y), optax.adamw(1e-3), "h100", False, cache, microbatches=k).measure(
            [option] * 3, "keep")  # fmt: skip

    remat1, dense2 = step(1, "remat"), step(2, "keep")
    budget = (remat1.peak + dense2.peak) // 2
    assert remat1.peak <= budget < dense2.peak and dense2.seconds > remat1.seconds, (remat1, dense2)
    chosen = bsr_jax.plan(Net(), _loss, x, y, budget=budget, microbatches="auto", options=["keep", "remat"], rest_options=["keep"],
                          optimizer=optax.adamw(1e-3), target="h100", progress=False, cache=cache)  # fmt: skip
    assert chosen.microbatches == 1 and chosen.peak <= budget
    at_two = [choices for (scope, choices, *_) in cache if scope[4] == 2]
    assert at_two == [("keep",) * 3], at_two


def test_auto_lowers_and_traces_only_what_its_search_uses(monkeypatch):
    """Lowering and tracing are Python and cost as much as a compile on 2 cores: where the dense
    step fits, "auto" lowers the dense step and remat on every block (plan's check that the loss
    applies its module) and nothing else, and traces the per-layer table only when it is read."""
    from bsr_jax.planning import candidates, search

    lowered, traced = [], []
    lower_for, layer_table = candidates.lower_for, search.layer_table
    monkeypatch.setattr(candidates, "lower_for", lambda *a, **k: lowered.append(1) or lower_for(*a, **k))
    monkeypatch.setattr(search, "layer_table", lambda *a, **k: traced.append(1) or layer_table(*a, **k))
    chosen = bsr_jax.plan(Net(), _loss, X, Y, budget=1.0, microbatches="auto", options=["keep", "remat", "int8"], optimizer=optax.adamw(1e-3),
                          target="h100", progress=False)  # fmt: skip
    assert chosen.remat is None and set(chosen.choices.values()) == {"keep"}
    assert (len(lowered), len(traced)) == (2, 0)
    assert chosen.table == chosen.table and len(traced) == 1  # traced once, when first read


def test_auto_where_nothing_fits_names_the_least_peak_of_every_count():
    """ViT-B/16 on TPU v5p at 0.2: the error named one micro-batch's least peak (2,043 MiB) where
    remat at 8 had compiled to 1,710: it names the least of every count searched, and that count."""
    x, y = jax.ShapeDtypeStruct((4096, 16), jnp.float32), jax.ShapeDtypeStruct((4096,), jnp.int32)
    cache = {}
    every_count = r"no candidate fits .* at 1, 2, 4, 8 micro-batch\(es\); the smallest compiled peak .* at 8 micro-batch"
    with pytest.raises(planner.NoFit, match=every_count) as refused:
        bsr_jax.plan(Net(), _loss, x, y, budget="4MiB", microbatches="auto", options=["keep"], rest_options=["keep"], optimizer=optax.adamw(1e-3),
                     target="h100", progress=False, cache=cache)  # fmt: skip
    compiled = [m.peak for m, _ in cache.values() if m.compiled]
    assert len(compiled) == 4 and refused.value.smallest.peak == min(compiled) and refused.value.microbatches == 8


def test_auto_passes_over_a_count_where_no_mix_of_keep_and_remat_can_be_faster():
    """The 12 x 768 LM at 0.3 (H100; MiB, ms): the plan at one micro-batch took 68.13 ms; the dense
    step at 2 (62.47) is faster, but fitting 8,053 MiB there needs remat on at least 7 of 12 blocks
    (each saves (26,844 - 5,167) / 12 / 2 MiB), 62.47 + 7 x 17.2 / 12 = 72.5 ms at least: remat on
    every block at 2 (12 s of compiling) and a candidate were compiled for nothing. Where the dense
    step at 2 is faster still, the count is searched."""
    from bsr_jax.planning.microbatch import fastest_count, remat_bound
    from bsr_jax.planning.options import REST
    from bsr_jax.planning.result import Measured, Plan

    blocks = {f"b{i}": "keep" for i in range(12)} | {REST: "keep"}
    mib, ms = 2**20, 1e-3

    def plan_of(peak, seconds, choices=blocks, remat=None, k=1):
        measured = Measured(dict(choices), peak * mib, seconds * ms)
        return Plan(model=None, loss_fn=None, choices=measured.choices, peak=measured.peak, modelled_seconds=measured.seconds, budget=0,
                    target="h100", dense=measured, remat=remat, tried=(), compiled=None, microbatches=k)  # fmt: skip

    dense1, remat1 = plan_of(26844, 59.28), plan_of(5167, 76.49, dict.fromkeys(blocks, "remat"))
    one = dataclasses.replace(plan_of(8016, 68.13), dense=dense1.dense, remat=remat1.dense)
    limit = int(0.3 * dense1.peak)
    assert remat_bound(one, plan_of(14775, 62.47, k=2).dense, 2, limit) == pytest.approx((62.47 + 7 * (76.49 - 59.28) / 12) * ms)
    for dense2, searched in ((62.47, []), (55.0, [2])):
        calls = []

        def plan_at(budget, microbatches, beat=math.inf, **narrowed):
            if narrowed.get("options") == ["keep"] and budget == 1.0:  # the dense step alone
                return {1: dense1, 2: plan_of(14775, dense2, k=2), 4: plan_of(8525, 68.31, k=4)}[microbatches]
            calls.append(microbatches)
            if microbatches == 1:
                return one
            raise planner.NoFit("nothing fits", one.dense, microbatches)

        chosen = fastest_count(plan_at, 0.3, (jax.ShapeDtypeStruct((8, 2048), jnp.int32),), ["keep", "remat"])
        assert chosen.modelled_seconds == one.modelled_seconds and calls == [1, *searched], (dense2, calls)
