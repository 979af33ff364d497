"""The planner (bsr_jax.plan) and what it builds on: compress_model's remat and lean rules by path."""

import dataclasses
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import bsr_jax
from bsr_jax import Rule
from bsr_jax.planning import candidates
from bsr_jax.planning import search as planner
from bsr_jax.planning import nnx as planner_nnx

# One xdist worker runs this module (--dist loadgroup, pyproject.toml): its compiled candidates
# (the module fixtures `compiled`, `nnx_plan`) are built once, not once per worker.
pytestmark = pytest.mark.xdist_group("test_planner")


class Block(nn.Module):
    width: int = 64

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x)))
        return x + nn.Dense(self.width)(h)


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return Block()(x), None


class Net(nn.Module):
    """A residual MLP as users write it: a stem, blocks in a Python loop (``blocks_i``) or under
    ``nn.scan`` (``layers``), a head."""

    depth: int = 4
    scan: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(64)(x)
        if self.scan:
            layers = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.depth)
            x, _ = layers(name="layers")(x, None)
        else:
            for i in range(self.depth):
                x = Block(name=f"blocks_{i}")(x)
        return nn.Dense(10)(x)


X = jax.random.normal(jax.random.key(0), (256, 32))


def _loss(module):
    return lambda v: jnp.mean(module.apply(v, X) ** 2)


@pytest.mark.parametrize("scan", [False, True])
def test_remat_by_path_is_exact_and_keeps_less(scan):
    net = Net(scan=scan)
    v = net.init(jax.random.key(1), X)
    remat = bsr_jax.compress_model(net, Rule("*", None), lean=False, remat=[("blocks_*", None), ("layers", None)])
    plain = bsr_jax.compress_model(net, Rule("*", None), lean=[("*", False)])
    chex.assert_trees_all_equal(jax.jit(remat.apply)(v, X), jax.jit(net.apply)(v, X))
    chex.assert_trees_all_close(jax.jit(jax.grad(_loss(remat)))(v), jax.jit(jax.grad(_loss(net)))(v), rtol=1e-5, atol=1e-7)
    kept = {name: bsr_jax.residual_bytes(_loss(m), v).total for name, m in (("dense", net), ("remat", remat), ("plain", plain))}
    assert kept["remat"] < kept["dense"] / 3
    # Lean off everywhere: what plain autodiff keeps (give or take a scalar).
    assert kept["dense"] - 64 <= kept["plain"] <= kept["dense"]


class OwnRematNet(nn.Module):
    """Layers under ``nn.scan``, each in the model's own ``nn.remat`` with a policy that keeps all
    (as train.lm's FSDP step wraps each layer to keep all but its gathered parameters)."""

    @nn.compact
    def __call__(self, x):
        layer = nn.remat(ScanBlock, policy=jax.checkpoint_policies.everything_saveable)
        x, _ = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)(name="layers")(nn.Dense(64)(x), None)
        return nn.Dense(10)(x)


def test_remat_of_a_block_the_model_remats_itself_keeps_what_both_policies_keep():
    """The plan's remat of a block inside the model's own ``nn.remat``: JAX lets the inner
    checkpoint's policy decide what its computation keeps, so the plan's remat kept all (train.lm's
    8b: remat per layer compiled to the dense program, 93.0 GiB); composed, it keeps the layer's input."""
    net = OwnRematNet()
    v = net.init(jax.random.key(1), X)
    remat = bsr_jax.compress_model(net, Rule("*", None), lean=False, remat=[("layers", None)])
    chex.assert_trees_all_close(jax.jit(jax.grad(_loss(remat)))(v), jax.jit(jax.grad(_loss(net)))(v), rtol=1e-5, atol=1e-7)
    kept = {name: bsr_jax.residual_bytes(_loss(m), v).total for name, m in (("own", net), ("remat", remat))}
    assert kept["remat"] < kept["own"] / 3


def test_remat_of_some_blocks_keeps_between_none_and_all():
    net = Net()
    v = net.init(jax.random.key(1), X)
    kept = [bsr_jax.residual_bytes(_loss(bsr_jax.compress_model(net, Rule("*", None), lean=False, remat=[(p, None)])), v).total
            for p in ("nothing", "blocks_[01]", "blocks_*")]  # fmt: skip
    assert kept[0] > kept[1] > kept[2]


@pytest.mark.parametrize("kwargs", [dict(remat=[("blocks_*", "none")]), dict(remat=["blocks_*"]), dict(remat=[("a", None, 1)]), dict(lean=[("*", 1)]), dict(lean=["*"])])
def test_bad_remat_and_lean_rules_are_named(kwargs):
    with pytest.raises(ValueError, match="remat must be|lean must be"):
        bsr_jax.compress_model(Net(), Rule("*", None), **kwargs)


@pytest.mark.parametrize("budget,expected", [(0.5, ("fraction", 0.5)), ("0.25", ("fraction", 0.25)), ("12GiB", ("bytes", 12 * 2**30)),
                                             ("800MB", ("bytes", 8e8)), (2**30, ("bytes", 2**30)), ("1e9B", ("bytes", 1e9)),
                                             ("1", ("fraction", 1.0))])  # fmt: skip
def test_budget_forms(budget, expected):
    assert planner.parse_budget(budget) == expected


# A number string is a fraction or carries a unit: "2.0", "100" and "1e9" were read as bytes (issue 39).
@pytest.mark.parametrize("budget", [0, 0.0, 1.5, -3, True, "x", "12 parsecs", "0", None, "1.5", "2.0", "100", "1e9"])
def test_bad_budgets_are_named(budget):
    with pytest.raises(ValueError, match="budget must be"):
        planner.parse_budget(budget)


@pytest.mark.parametrize("scan,expected", [(False, ("blocks_0", "blocks_1", "blocks_2", "blocks_3")), (True, ("layers",))])
def test_blocks_are_found_in_loops_and_scans(scan, expected):
    net = Net(scan=scan)
    v = net.init(jax.random.key(1), X)
    assert planner.find_blocks(jax.make_jaxpr(_loss(net))(v).jaxpr, "Net") == (expected, scan)


def test_kept_and_remat_blocks_stay_exact_under_a_compressed_rest():
    net = Net()
    v = net.init(jax.random.key(1), X)
    module = planner.assemble(net, [f"blocks_{i}" for i in range(4)], ["keep", "remat", "int8", "keep"], "int4")
    layers = bsr_jax.pruning_plan(lambda v, x: module.apply(v, x), v, X).layers
    assert {layer.path: layer.compression.storage_dtype for layer in layers} == {
        "Dense_0": "int4", "blocks_2/Dense_0": "int8", "blocks_2/Dense_1": "int8", "Dense_1": "int4"}


def test_a_model_without_repeated_blocks_is_named():
    mlp = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
    v = mlp.init(jax.random.key(0), X)
    with pytest.raises(ValueError, match="no repeated blocks"):
        planner.find_blocks(jax.make_jaxpr(_loss(mlp))(v).jaxpr, "Sequential")


def _labels_loss(module, variables, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(module.apply(variables, x), y).mean()


BATCH = (jax.ShapeDtypeStruct((16384, 32), jnp.float32), jax.ShapeDtypeStruct((16384,), jnp.int32))
# One option, the rest kept and one mixed candidate: three compiles per target.
FEW = dict(options=("remat",), rest_options=("keep",), verify=1, progress=False)


@pytest.fixture(scope="module")
def compiled():
    return {}  # compiled candidates, shared by this module's plans (same model, loss, batch, optimizer)


# TPU v5p (28 s of TPU compiles on 2 cores) repeats the H100 plan's mechanism for a second target,
# -m slow; plan passes target to compiled_memory, whose TPU v5p compiles test_compiled.py runs by default.
@pytest.mark.parametrize("target", ["h100", pytest.param("tpu-v5p", marks=pytest.mark.slow)])
def test_plan_fits_its_budget_and_keeps_the_model(target, compiled):
    net = Net()
    plan = planner.plan(net, _labels_loss, *BATCH, optimizer=optax.adamw(1e-3), budget=0.6, target=target, cache=compiled, **FEW)
    assert plan.peak <= plan.budget == int(0.6 * plan.dense.peak)
    assert plan.peak == plan.compiled.peak and plan.modelled_seconds == plan.compiled.modelled_seconds
    assert set(plan.choices.values()) <= {"keep", *FEW["options"]} and plan.choices.keys() >= {"blocks_0", planner.REST}
    # Fastest among what was compiled within the budget.
    assert plan.modelled_seconds == min(m.seconds for m in plan.tried if m.peak <= plan.budget)
    x = jax.random.normal(jax.random.key(2), (8, 32))
    v = net.init(jax.random.key(1), x)
    chex.assert_trees_all_equal_structs(plan.model.init(jax.random.key(1), x), v)
    np.testing.assert_array_equal(plan.model.apply(v, x), net.apply(v, x))
    assert "remat per block" in str(plan) and "blocks_0" in str(plan)


@pytest.mark.slow  # 17 s; the table's own claims hold in test_table, the plan's budget in test_plan_fits_its_budget_and_keeps_the_model
def test_the_plan_prints_its_per_layer_table_which_applies_as_is(compiled):
    """Issue 43: ``Plan.table`` is the chosen step's resolved table (traced, not compiled)."""
    net = Net()
    plan = planner.plan(net, _labels_loss, *BATCH, optimizer=optax.adamw(1e-3), budget=0.99, target="h100", cache=compiled,
                        **(FEW | dict(options=("int8",))))  # fmt: skip
    int8 = [block for block, name in plan.choices.items() if name == "int8"]
    assert int8 and str(plan).endswith(f"\n\n{plan.table}")
    assert {row.path for row in plan.table if row.compresses} == {f"{block}/Dense_{i}" for block in int8 for i in (0, 1)}
    x, y = X[:8], jnp.arange(8) % 10
    v = net.init(jax.random.key(1), x)
    grads = lambda module: jax.grad(lambda p: _labels_loss(module, {"params": p}, x, y))(v["params"])  # noqa: E731
    # The table alone (without the plan's lean neighbours, which are exact) gives the plan's gradients.
    chex.assert_trees_all_close(grads(bsr_jax.compress_model(net, plan.table, lean=False)), grads(plan.model), rtol=1e-5, atol=1e-7)


# TPU v5p: the same on XLA:TPU's cost model (5 TPU compiles on 2 cores), -m slow.
@pytest.mark.parametrize("target", ["h100", pytest.param("tpu-v5p", marks=pytest.mark.slow)])
def test_the_cost_model_predicts_what_compiles(target, compiled, capsys):
    """Issue 41: the candidates the cost model chooses are compiled, their predicted peak and time
    shown beside. Measured on this model: H100 96 MiB and 0.67 ms, both as predicted; TPU v5p 38 MiB
    and 0.53 ms against 42 MiB and 0.52 ms predicted (the peak 10.5% pessimistic, short of the
    issue's 5%): within 5% on H100, 15% on TPU v5p."""
    planner.plan(Net(), _labels_loss, *BATCH, optimizer=optax.adamw(1e-3), budget=0.6, target=target, cache=compiled,
                 **(FEW | dict(options=("remat", "remat-dots"), progress=True)))  # fmt: skip
    rows = [re.search(r" ([\d,]+) MiB +([\d.]+) ms .*\(predicted ([\d,]+) MiB, ([\d.]+) ms\)", row) for row in capsys.readouterr().err.splitlines()]
    pairs = [[float(g.replace(",", "")) for g in row.groups()] for row in rows if row]
    assert pairs
    within = 0.05 if target == "h100" else 0.15
    for peak, ms, predicted_peak, predicted_ms in pairs:
        assert abs(predicted_peak - peak) <= within * peak and abs(predicted_ms - ms) <= 0.05 * ms, pairs


def test_an_infeasible_budget_names_the_smallest_peak(compiled):
    with pytest.raises(ValueError, match=r"no candidate fits the budget of 0 MiB on h100; the smallest compiled peak was [\d,]+ MiB"):
        planner.plan(Net(), _labels_loss, *BATCH, optimizer=optax.adamw(1e-3), budget="1KiB", target="h100", cache=compiled, **FEW)


def test_choices_that_make_the_same_program_compile_once(capsys):
    """Net's blocks have no product with batch axes: dots_saveable keeps what
    dots_with_no_batch_dims_saveable keeps, the same lowered program, compiled once. Its progress
    row keeps the columns of the others (issue 39: 'same as ...' pushed them right)."""
    family = planner.Linen(Net(), _labels_loss, BATCH, None, None)
    search = planner.Candidates(family, {"plain": _labels_loss}, BATCH, optax.adamw(1e-3), "h100", True, None)
    for option in ("keep", "remat", "remat-dots", "remat-dots-all"):
        search.measure([option] * 4, "keep")
    uniform = {key[0][0]: step for key, (_, step) in search.cache.items()}
    assert uniform["remat-dots-all"] is uniform["remat-dots"]
    assert uniform["remat"] is not uniform["remat-dots"] and uniform["keep"] is not uniform["remat"]
    rows = [line for line in capsys.readouterr().err.splitlines() if " MiB " in line]
    assert any("same program as 4xremat-dots, rest keep" in row for row in rows)
    assert len({row.index(" MiB ") for row in rows}) == 1 and len({row.index(" ms ") for row in rows}) == 1, rows


def test_a_step_xla_cannot_time_takes_the_roofline_as_the_timed_steps_compare(monkeypatch, capsys):
    """XLA:TPU's cost model cannot time some programs (a probe of many options on ResMLP-S12: its
    time came back None and the search stopped with a TypeError): such a step takes the roofline's
    time scaled as XLA's model timed the first step, and says so."""
    real, untimed = candidates.compiled_memory, []

    def compiled_memory(*args, **kwargs):
        step = real(*args, **kwargs)
        return dataclasses.replace(step, modelled_seconds=None) if untimed else step

    monkeypatch.setattr(candidates, "compiled_memory", compiled_memory)
    search = planner.Candidates(planner.Linen(Net(), _labels_loss, BATCH, None, None), {"plain": _labels_loss}, BATCH, optax.adamw(1e-3),
                             "h100", True, None)  # fmt: skip
    dense = search.measure(["keep"] * 4, "keep")
    untimed.append(True)
    remat = search.measure(["remat"] * 4, "keep")
    step = search.compiled(remat)
    assert step.modelled_seconds is None
    scale = dense.seconds / search.compiled(dense).roofline_seconds
    assert remat.seconds == pytest.approx(step.roofline_seconds * scale)
    assert "XLA's cannot time this one" in capsys.readouterr().err
    # Untimed before any step was timed (train.lm's 8-device TPU steps): the roofline's, rescaled
    # once XLA's model times one, so that the search compares one instrument.
    made = [step, search.compiled(dense)]  # the two steps compiled above, handed out again in that order
    monkeypatch.setattr(candidates, "compiled_memory", lambda *args, **kwargs: made.pop(0))
    again = planner.Candidates(planner.Linen(Net(), _labels_loss, BATCH, None, None), {"plain": _labels_loss}, BATCH, optax.adamw(1e-3),
                               "h100", False, None)  # fmt: skip
    first = again.measure(["remat"] * 4, "keep")
    assert first.seconds == pytest.approx(step.roofline_seconds)  # no scale yet
    again.measure(["keep"] * 4, "keep")
    assert again.current(first).seconds == pytest.approx(step.roofline_seconds * scale)


def test_an_untimed_step_is_scaled_as_the_same_choices_at_the_nearest_count(monkeypatch, capsys):
    """XLA's modelled time over the roofline's grows with the micro-batch count (the 12 x 768 LM's
    dense step on TPU v5p: 1.24, 1.31, 1.36 at 1, 2, 4; untimed at 8, it took the roofline's time
    unscaled and looked 1.01x dense's, faster than every plan): an untimed step is scaled as the
    same choices at the nearest count, else as the first step timed at the nearest count."""
    real, untimed, ratios = candidates.compiled_memory, [], iter((1.1, 1.2, 1.3))

    def compiled_memory(*args, **kwargs):  # as XLA:TPU's model: each timed step its own ratio to the roofline
        step = real(*args, **kwargs)
        return dataclasses.replace(step, modelled_seconds=None if untimed else step.roofline_seconds * next(ratios))

    monkeypatch.setattr(candidates, "compiled_memory", compiled_memory)
    family, cache = planner.Linen(Net(), _labels_loss, BATCH, None, None), {}
    at = {k: planner.Candidates(family, {"plain": _labels_loss}, BATCH, optax.adamw(1e-3), "h100", True, cache, microbatches=k) for k in (1, 2)}
    dense_1, remat_1 = at[1].measure(["keep"] * 4, "keep"), at[1].measure(["remat"] * 4, "keep")
    dense_2 = at[2].measure(["keep"] * 4, "keep")
    untimed.append(True)
    remat_2 = at[2].measure(["remat"] * 4, "keep")
    ratio = {m.label: m.seconds / at[k].compiled(m).roofline_seconds for k, m in ((1, dense_1), (1, remat_1), (2, dense_2))}
    roofline = at[2].compiled(remat_2).roofline_seconds
    assert remat_2.seconds == pytest.approx(roofline * ratio[remat_1.label])
    assert f"on {remat_1.label}; XLA's cannot time this one" in capsys.readouterr().err
    # No step of the same choices timed at any count: the first step timed at the nearest count.
    topk = at[2].measure(["keep", "keep", "remat", "remat"], "keep")
    assert topk.seconds == pytest.approx(at[2].compiled(topk).roofline_seconds * ratio[dense_2.label])
    assert f"on {dense_2.label} at 2 micro-batches" in capsys.readouterr().err


class LMBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(64)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(x))))


class TinyLM(nn.Module):
    """Three blocks and a 4096-token head whose logits are most of the step's peak."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(4096, 64)(tokens)
        for i in range(3):
            x = LMBlock(name=f"block_{i}")(x)
        return nn.Dense(4096, use_bias=False, name="head")(nn.LayerNorm()(x))


@pytest.mark.slow  # 18 s of compiles; the chunked loss's own claims hold in test_losses and test_head_loss
def test_a_chunked_loss_is_chosen_where_only_it_fits():
    """Measured: dense 78 MiB, remat per block 75 MiB, with the chunked loss 46-50 MiB (H100)."""
    tokens = jax.ShapeDtypeStruct((8, 256), jnp.int32)
    args = dict(optimizer=optax.adamw(1e-3), budget=0.65, target="h100", cache={}, **(FEW | dict(verify=1)))
    with pytest.raises(ValueError, match="no candidate fits"):
        planner.plan(TinyLM(), _labels_loss, tokens, tokens, **args)
    plan = planner.plan(TinyLM(), _labels_loss, tokens, tokens, **args, loss_chunk=256)
    assert plan.choices[planner.LOSS] == "chunked" and plan.peak <= plan.budget and "chunked" in str(plan)
    x = jax.random.randint(jax.random.key(0), (2, 16), 0, 4096)
    v = TinyLM().init(jax.random.key(1), x)
    np.testing.assert_allclose(jax.jit(lambda v: plan.loss_fn(plan.model, v, x, x))(v), _labels_loss(TinyLM(), v, x, x), rtol=1e-5)
    with pytest.raises(ValueError, match="loss_chunk must be a positive int"):
        planner.plan(TinyLM(), _labels_loss, tokens, tokens, **args, loss_chunk=0)


@pytest.mark.slow  # 10 s of compiles at another batch shape
def test_a_shared_cache_keeps_other_batch_shapes_apart(compiled):
    half = tuple(jax.ShapeDtypeStruct((a.shape[0] // 2, *a.shape[1:]), a.dtype) for a in BATCH)
    few = FEW | dict(verify=0)  # the uniform candidates only: the cache's keys are what is tested
    full = planner.plan(Net(), _labels_loss, *BATCH, optimizer=optax.adamw(1e-3), budget=0.8, target="h100", cache=compiled, **few)
    small = planner.plan(Net(), _labels_loss, *half, optimizer=optax.adamw(1e-3), budget=0.8, target="h100", cache=compiled, **few)
    assert small.dense.peak < 0.75 * full.dense.peak  # its own compiles, not the full batch's


@pytest.mark.parametrize("kwargs,match", [(dict(target="a100"), "target must be"), (dict(options=("fast",)), "options"), (dict(rest_options=("remat",)), "rest_options"),
                                          (dict(verify=-1), "verify must be"), (dict(budget="lots"), "budget must be")])  # fmt: skip
def test_bad_arguments_are_named(kwargs, match):
    args = dict(optimizer=optax.adamw(1e-3), budget=0.5) | kwargs
    with pytest.raises(ValueError, match=match):
        planner.plan(Net(), _labels_loss, *BATCH, **args)


@pytest.fixture
def compiles(monkeypatch):
    """The candidates plan compiles, counted."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("target"))
        return bsr_jax.compiled_memory(*args, **kwargs)

    monkeypatch.setattr(candidates, "compiled_memory", counted)
    return calls


def test_a_budget_the_dense_step_fits_is_one_compile_of_exact_options(compiled, compiles, capsys):
    """Issue 39: budget="12GB" where dense needs 453 MiB searched for 4 min 42 s; and by default the
    search took approximate options (int4's dW) beside exact ones. Any case of the target's name."""
    plan = planner.plan(Net(), _labels_loss, *BATCH, optimizer=optax.adamw(1e-3), budget="1GiB", target="H100", cache=compiled)
    assert len(compiles) <= 1 and plan.target == "h100"  # the dense step, unless an earlier test compiled it
    assert set(plan.choices.values()) == {"keep"} and plan.peak == plan.dense.peak and plan.remat is None
    assert "not compiled (the dense step fits)" in str(plan)
    header = capsys.readouterr().err.splitlines()[0]
    assert "options ['keep', 'lean', 'remat', 'remat-dots', 'remat-dots-all', 'remat-offload'] (approximate ones left out" in header
    planner.plan(Net(), _labels_loss, *BATCH, optimizer=optax.adamw(1e-3), budget="1GiB", target="h100", cache=compiled, approximate=True)
    header = capsys.readouterr().err.splitlines()[0]
    # topk is opt-in (biased; mispriced); int4-outdense needs an attention output projection, which Net has not.
    assert "'int4', 'int4-dx8', 'int4-fused'" in header and "topk" not in header and "outdense" not in header and len(compiles) <= 1
    # Options named are searched as named (approximate=True adds nothing to them): no hint that it would.
    planner.plan(Net(), _labels_loss, *BATCH, optimizer=optax.adamw(1e-3), budget="1GiB", target="h100", cache=compiled, options=["keep", "remat"])
    assert "left out" not in capsys.readouterr().err.splitlines()[0] and len(compiles) <= 1


def test_prefetched_candidates_compile_once_in_threads_to_what_a_plain_compile_gives(compiles):
    """plan compiles remat and the probes while it lowers the next (XLA compiles outside Python's
    lock): the same peak, time and breakdown as compiled in the caller's thread, each once."""
    def candidates():
        return planner.Candidates(planner.Linen(Net(), _labels_loss, BATCH, None, None), {"plain": _labels_loss}, BATCH, optax.adamw(1e-3),
                                  "h100", False, None)  # fmt: skip

    ahead = candidates()
    keys = [(("remat",) * 4, "keep", "plain"), (("keep", "lean", "remat-dots", "keep"), "keep", "plain")]
    ahead.prefetch(keys, breakdown=True)
    ahead.prefetch(keys, breakdown=True)  # started already: nothing more
    assert len(ahead.pending) == 2 and len(compiles) == 2
    threaded = [ahead.measure(*key, breakdown=True) for key in keys]
    assert not ahead.pending and len(compiles) == 2
    again = candidates().measure(*keys[1], breakdown=True)
    assert (again.peak, again.seconds) == (threaded[1].peak, threaded[1].seconds) and len(compiles) == 3
    ahead.close()
    assert ahead._pool is None


def test_an_infeasible_budget_stops_at_remat_on_every_block(compiled, compiles):
    """Issue 39: budget=0.01 searched for 5 min 22 s to say that nothing fits. Measured with Triton
    GEMMs (compiled_memory's default): remat on every block 64 MiB, 0.37 of dense's (with cuBLAS:
    92 MiB, 0.46), the step's arguments 3.6 MiB."""
    with pytest.raises(ValueError, match=r"fits the budget of 9 MiB.* was 64 MiB \(0.37 of dense's\), with 4xremat, rest keep: remat on every"):
        planner.plan(Net(), _labels_loss, *BATCH, optimizer=optax.adamw(1e-3), budget=0.05, target="h100", cache=compiled,
                     rest_options=("keep",), progress=False)  # fmt: skip
    assert len(compiles) <= 2  # dense and remat (unless an earlier test compiled them)
    with pytest.raises(ValueError, match=r"the step's arguments alone \(parameters, optimizer state, batch\) take 4 MiB"):
        planner.plan(Net(), _labels_loss, *BATCH, optimizer=optax.adamw(1e-3), budget="2MiB", target="h100", cache=compiled, progress=False)
    assert len(compiles) <= 2


def test_a_candidate_over_the_devices_memory_is_remembered_as_not_fitting(compiled, monkeypatch):
    """XLA:TPU refuses to compile a program that needs more than the chip's HBM (train.lm's 1b step
    at T 8192 with XLA's attention: 117 GiB of temporaries): plan took it for a crash. Here the dense
    step is refused as XLA:TPU words it; the plan is remat's, the dense step named as too large."""
    real, calls = candidates.compiled_memory, []

    def refusing(lowered, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the dense step, compiled first
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (117.00G) "
                               "exceeds available HBM (95.74G).")  # fmt: skip
        return real(lowered, **kwargs)

    monkeypatch.setattr(candidates, "compiled_memory", refusing)
    remat_compiled = {key: entry for key, entry in compiled.items() if "remat" in key[1]}  # earlier tests' remat step; not dense
    plan = planner.plan(Net(), _labels_loss, *BATCH, optimizer=optax.adamw(1e-3), budget="1GiB", target="h100", cache=remat_compiled, **FEW)
    assert not plan.dense.compiled and plan.dense.peak >= 117 * 2**30 and plan.choices["blocks_0"] == "remat"
    assert "dense:  does not compile on h100: XLA needs at least 119,8" in str(plan)
    calls.clear()
    with pytest.raises(ValueError, match=r"the dense step does not compile on h100 .* give bytes"):
        planner.plan(Net(), _labels_loss, *BATCH, optimizer=optax.adamw(1e-3), budget=0.5, target="h100", cache={}, **FEW)


def test_the_step_takes_its_gradient_as_the_users_value_and_grad_says():
    """``value_and_grad``: the user's own gradient (train.lm's shard_map FSDP, here one that halves
    the loss), traced into every candidate; a hook for NNX or with micro-batches is refused."""
    used = []

    def halved(loss):
        used.append(loss)
        return jax.value_and_grad(lambda p, *batch: loss(p, *batch) / 2)

    plan = planner.plan(Net(), _labels_loss, *BATCH, optimizer=optax.adamw(1e-3), budget="1GiB", target="h100", progress=False,
                        value_and_grad=halved)  # fmt: skip
    assert used and plan.peak == plan.dense.peak
    with pytest.raises(ValueError, match="value_and_grad must be a callable, for a flax.linen model at microbatches=1"):
        planner.plan(Net(), _labels_loss, *BATCH, optimizer=optax.adamw(1e-3), budget="1GiB", target="h100", microbatches=2, value_and_grad=halved)


def test_the_table_marks_approximate_choices_with_their_error():
    dense, remat = planner.Measured({planner.REST: "keep"}, 2**30, 1.0), planner.Measured({planner.REST: "keep"}, 2**29, 1.2)
    plan = planner.Plan(model=None, loss_fn=None, choices={"blocks_0": "int4", "blocks_1": "remat", planner.REST: "int4"}, peak=2**28,
                        modelled_seconds=1.1, budget=2**29, target="h100", dense=dense, remat=remat, tried=(), compiled=None)  # fmt: skip
    lines = str(plan).splitlines()
    int4 = "approximate: dW from int4 inputs, error 0.04-0.23 (docs/RESULTS.md 3b)"
    assert [line.split()[0] for line in lines if int4 in line] == ["blocks_0", "everything"]
    assert not any("approximate" in line for line in lines if "remat" in line)


def _params_loss(params, x, y):
    return jnp.mean(x) + jnp.mean(y)


class KeywordNet(Net):
    @nn.compact
    def __call__(self, x, *, train):
        return super().__call__(x)


@pytest.mark.parametrize("model,loss_fn,error,match", [
    (Net(), _params_loss, TypeError, r"plan calls loss_fn\(module, variables, \*batch\) .* loss_fn\(params, x, y\) cannot take that .* e\.g\., def loss_fn\(module, variables, x, y\)"),
    (Net(), lambda module, variables, x, y: _labels_loss(Net(), variables, x, y), ValueError, "loss_fn never applies the module it is given"),
    (KeywordNet(), _labels_loss, TypeError, r"the default KeywordNet.init\(key, example_batch\[0\]\) failed .*'train'.*; pass variables=")])  # fmt: skip
def test_a_loss_or_model_plan_cannot_call_is_named_before_compiling(model, loss_fn, error, match, compiles):
    """Issue 39: JAX's usual loss(params, x, y) failed deep inside ('takes 3 positional arguments
    but 4 were given'); a loss applying its own module ended in 'no candidate fits' after the whole
    search; a model needing train= failed in model.init with a raw TypeError."""
    with pytest.raises(error, match=match):
        planner.plan(model, loss_fn, *BATCH, optimizer=optax.adamw(1e-3), budget=0.5, progress=False)
    assert not compiles


def test_only_the_options_given_are_chosen(compiled):
    # remat fits 0.8 of dense's peak and is compiled (cached) for the plan's remat figure, but not allowed.
    fits = planner.plan(Net(), _labels_loss, *BATCH, optimizer=optax.adamw(1e-3), budget=0.8, target="h100", cache=compiled, **FEW)
    assert "remat" in fits.choices.values()
    with pytest.raises(ValueError, match="no candidate fits"):
        planner.plan(Net(), _labels_loss, *BATCH, optimizer=optax.adamw(1e-3), budget=0.8, target="h100", cache=compiled,
                     **(FEW | dict(options=())))  # fmt: skip


# NNX: the same planner on a model written with flax.nnx (bsr_jax.planning.nnx).


class NnxBlock(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(self.norm(x))))


class NnxNet(nnx.Module):
    """Net as NNX users write it: a stem, a list of blocks, a head."""

    def __init__(self, rngs: nnx.Rngs, depth: int = 4):
        self.stem = nnx.Linear(32, 64, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(64, rngs) for _ in range(depth)])
        self.head = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class NnxNumbered(nnx.Module):
    """Blocks as numbered attributes, beside a row of single layers (not blocks: no submodules)."""

    def __init__(self, rngs: nnx.Rngs):
        self.block_0, self.block_1, self.block_2 = (NnxBlock(8, rngs) for _ in range(3))
        self.dense_0, self.dense_1 = nnx.Linear(8, 8, rngs=rngs), nnx.Linear(8, 8, rngs=rngs)


class NnxScanned(nnx.Module):
    """Blocks made under nnx.vmap (stacked parameters) and run by nnx.scan."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return NnxBlock(8, rngs)

        self.blocks = create(rngs)

    def __call__(self, x):
        return nnx.scan(lambda x, block: (block(x), None), in_axes=(nnx.Carry, 0))(x, self.blocks)[0]


def _nnx_loss(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def _arrays(model):
    return jax.tree.map(np.asarray, nnx.state(model))


def test_nnx_blocks_are_found_in_lists_and_numbered_attributes():
    assert planner_nnx.find_blocks(NnxNet(nnx.Rngs(0))) == ("blocks/0", "blocks/1", "blocks/2", "blocks/3")
    assert planner_nnx.find_blocks(nnx.eval_shape(lambda: NnxNumbered(nnx.Rngs(0)))) == ("block_0", "block_1", "block_2")
    with pytest.raises(ValueError, match="no repeated blocks"):
        planner_nnx.find_blocks(nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 8, rngs=nnx.Rngs(0))))


def test_nnx_blocks_stacked_for_scan_are_refused():
    with pytest.raises(ValueError, match=r"blocks/down \(Linear\) has a kernel of shape \(3, 32, 8\).*not supported"):
        planner.plan(NnxScanned(nnx.Rngs(0)), _nnx_loss, *BATCH, optimizer=optax.adamw(1e-3), budget=0.5)


@pytest.mark.parametrize("kwargs,match", [(dict(options=("remat", "lean")), r"options \['lean'\] not available for flax.nnx"),
                                          (dict(options=("int4-dx8",)), r"options \['int4-dx8'\] not available for flax.nnx.*dx"),
                                          (dict(rest_options=("lean", "int4")), r"rest_options \['lean'\] not available"),
                                          (dict(init_args=(X,)), "variables and init_args are for linen models")])  # fmt: skip
def test_nnx_linen_only_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        planner.plan(NnxNet(nnx.Rngs(0)), _nnx_loss, *BATCH, optimizer=optax.adamw(1e-3), budget=0.5, **kwargs)


def test_nnx_candidates_are_clones_with_the_users_params_and_forward():
    net = NnxNet(nnx.Rngs(0))
    before = _arrays(net)
    family = planner_nnx.Nnx(net, _nnx_loss, BATCH, None, None)
    module = family.assemble(["int4", "remat", "keep", "topk"], "int4")
    x = jax.random.normal(jax.random.key(2), (8, 32))
    np.testing.assert_array_equal(module(x), net(x))
    chex.assert_trees_all_equal_shapes_and_dtypes(nnx.state(module, nnx.Param), nnx.state(net, nnx.Param))
    # Each block its own treatment; the rest's int4 only outside the blocks. Every layer's product is
    # named (bsr_jax.core.names.tagged), compressed or not: the compressed ones are replaced.
    compressed = {path for path, m in bsr_jax.core.layer_choice.nnx_module_paths(module) if isinstance(m, nnx.Linear) and m.dot_general.untagged is not jax.lax.dot_general}
    assert compressed == {"stem", "head", "blocks/0/up", "blocks/0/down", "blocks/3/up", "blocks/3/down"}
    # Only the remat block recomputes (a subclass more); every block runs in its path's name scope,
    # which the cost model reads off the compiled step's op names.
    assert [len(type(b).__mro__) - len(NnxBlock.__mro__) for b in module.blocks] == [1, 2, 1, 1]
    graphdef, state = nnx.split(module)
    stacks = {str(e.source_info.name_stack) for e in jax.make_jaxpr(lambda state, x: nnx.merge(graphdef, state)(x))(state, x).jaxpr.eqns}
    assert {f"blocks/{i}" for i in range(4)} <= {stack.split("/up")[0].split("/down")[0] for stack in stacks}, stacks
    # The user's model: its classes, layers and arrays as they were.
    assert all(type(b) is NnxBlock for b in net.blocks) and net.stem.dot_general is jax.lax.dot_general
    chex.assert_trees_all_equal(_arrays(net), before)


class NnxDropoutBlock(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.up, self.down = nnx.Linear(width, 4 * width, rngs=rngs), nnx.Linear(4 * width, width, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, train, *, scale=1.0):
        return x + scale * self.down(self.dropout(nnx.gelu(self.up(x)), deterministic=not train))


class NnxDropoutNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([NnxDropoutBlock(16, rngs) for _ in range(3)])

    def __call__(self, x, train=True):
        for block in self.blocks:
            x = block(x, train, scale=0.5)
        return x


def test_nnx_remat_takes_flags_keywords_and_rng_state():
    net = NnxDropoutNet(nnx.Rngs(0, dropout=1))
    loss = lambda model, x: jnp.mean(model(x) ** 2)  # noqa: E731
    family = planner_nnx.Nnx(net, loss, (), None, None)
    module = family.assemble(["remat", "remat-dots", "keep"], "keep")
    x = jax.random.normal(jax.random.key(2), (8, 16))
    np.testing.assert_array_equal(module(x, train=False), net(x, train=False))
    # The step updates the dropout's rng count inside the remat blocks.
    opt_state = jax.eval_shape(optax.sgd(0.1).init, family.params)
    bsr_jax.compiled_memory(family.step(module, optax.sgd(0.1), loss), family.state, opt_state, jax.ShapeDtypeStruct((64, 16), jnp.float32),
                            target="h100", donate_argnums=(0, 1))  # fmt: skip


@pytest.fixture(scope="module")
def nnx_compiled():
    return {}  # the NNX model's candidates (a cache is for one model: its keys are the choices)


@pytest.fixture(scope="module")
def nnx_plan(nnx_compiled):
    net = NnxNet(nnx.Rngs(0))
    before = _arrays(net)
    plan = planner.plan(net, _nnx_loss, *BATCH, optimizer=optax.adamw(1e-3), budget=0.6, target="h100", cache=nnx_compiled, **FEW)
    return net, before, plan


@pytest.mark.slow  # 21 s of compiles; NNX candidates (clones, the user's params and forward) hold by default in the tests above
def test_nnx_plan_fits_its_budget_and_keeps_the_model(nnx_plan):
    net, before, plan = nnx_plan
    assert plan.peak <= plan.budget == int(0.6 * plan.dense.peak)
    assert plan.modelled_seconds == min(m.seconds for m in plan.tried if m.peak <= plan.budget)
    assert "remat" in plan.choices.values() and plan.choices.keys() == {f"blocks/{i}" for i in range(4)} | {planner.REST}
    assert "blocks/0" in str(plan) and "remat per block" in str(plan)
    chex.assert_trees_all_equal(_arrays(net), before)  # plan left the user's model as it was
    assert all(type(b) is NnxBlock for b in net.blocks)
    x, y = jax.random.normal(jax.random.key(2), (8, 32)), jnp.arange(8) % 10
    np.testing.assert_array_equal(plan.model(x), net(x))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), nnx.state(plan.model, nnx.Param)) == jax.tree.map(lambda a: (a.shape, a.dtype), nnx.state(net, nnx.Param))
    # Its remat blocks recompute (a lower compiled peak) and keep the gradient exact.
    assert plan.remat.peak < 0.7 * plan.dense.peak
    chex.assert_trees_all_close(nnx.grad(_nnx_loss)(plan.model, x, y), nnx.grad(_nnx_loss)(net, x, y), rtol=1e-6)


@pytest.mark.slow  # shares test_nnx_plan_fits_its_budget_and_keeps_the_model's compiles
@pytest.mark.usefixtures("nnx_plan")  # its compiles, cached
def test_nnx_an_infeasible_budget_names_the_smallest_peak(nnx_compiled):
    with pytest.raises(ValueError, match=r"no candidate fits the budget of 0 MiB on h100; the smallest compiled peak was [\d,]+ MiB"):
        planner.plan(NnxNet(nnx.Rngs(0)), _nnx_loss, *BATCH, optimizer=optax.adamw(1e-3), budget="1KiB", target="h100", cache=nnx_compiled,
                     **FEW)  # fmt: skip


class BlocksOnly(nn.Module):
    """Every layer inside a block: nothing for the rest's rule to match."""

    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = Block(width=32, name=f"blocks_{i}")(x)
        return x


def test_a_linen_model_with_nothing_outside_its_blocks_assembles_every_candidate():
    from bsr_jax.planning.linen import Linen

    loss = lambda module, variables, x: jnp.mean(module.apply(variables, x) ** 2)  # noqa: E731
    family = Linen(BlocksOnly(), loss, (X,), None, None)
    assert family.blocks == ("blocks_0", "blocks_1", "blocks_2")
    assert not family.outside
    for choices, rest in ((("remat", "keep", "lean"), "keep"), (("int4",) * 3, "lean"), (("remat",) * 3, "int4")):
        candidate = family.assemble(choices, rest)
        jax.eval_shape(lambda v: jax.grad(lambda p: loss(candidate, {"params": p}, X))(v["params"]), family.state)


def test_a_search_compiles_with_cublas_once_a_step_of_it_has_no_triton_gemm(monkeypatch):
    """ViT-B/16's H100 steps find no Triton tiling without the device: each compile tried Triton first
    (2.7 s of 11.3) and fell back. Once a step of the model (at any micro-batch count) has no Triton
    GEMM, the search's later compiles ask for cuBLAS; where one has, or on TPU, XLA's default."""
    asked = []

    def recorded(lowered, target, breakdown=False, triton_gemm=None):
        asked.append(triton_gemm)
        return dataclasses.replace(bsr_jax.compiled_memory(lowered, target=target, breakdown=breakdown), triton_gemm=False)

    monkeypatch.setattr(candidates, "compiled_memory", recorded)
    family = planner.Linen(Net(), _labels_loss, BATCH, None, None)
    search = planner.Candidates(family, {"plain": _labels_loss}, BATCH, optax.adamw(1e-3), "h100", False, {})
    search.measure(["keep"] * 4, "keep")
    search.prefetch([(("remat",) * 4, "keep", "plain")])
    search.measure(["remat"] * 4, "keep")
    assert asked == [None, False]
    other_count = planner.Candidates(family, {"plain": _labels_loss}, BATCH, optax.adamw(1e-3), "h100", False, search.shared, microbatches=2)
    assert other_count.triton_gemm() is False
    (key, (m, step)), = list(search.shared.items())[:1]
    search.shared[key] = (m, dataclasses.replace(step, triton_gemm=True))  # one step of the model has Triton GEMMs
    assert search.triton_gemm() is None
    tpu = planner.Candidates(family, {"plain": _labels_loss}, BATCH, optax.adamw(1e-3), "tpu-v5p", False, search.shared)
    assert tpu.triton_gemm() is None


class AttentionBlock(nn.Module):
    """A pre-norm transformer block as flax's lm1b example writes one (nn.MultiHeadDotProductAttention,
    whose output projection is named ``out``)."""

    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32)(nn.LayerNorm()(x))
        return x + nn.Dense(32)(nn.relu(nn.Dense(64)(nn.LayerNorm()(x))))


class AttentionNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32)(x)
        for i in range(3):
            x = AttentionBlock(name=f"blocks_{i}")(x)
        return nn.Dense(10)(x)


def test_int4_outdense_leaves_the_attentions_output_projection_exact_and_keeps_its_output():
    from bsr_jax.planning.linen import Linen

    tokens = jax.random.normal(jax.random.key(2), (4, 16, 8))
    loss = lambda module, variables, x: jnp.mean(module.apply(variables, x) ** 2)  # noqa: E731
    family = Linen(AttentionNet(), loss, (tokens,), None, None)
    assert "int4-outdense" not in family.unavailable
    v = AttentionNet().init(jax.random.key(1), tokens)
    module = family.assemble(["keep", "int4-outdense", "int4"], "keep")
    # The compressed layers (pruning_plan lists no exact one): blocks_1's but its out, all of blocks_2's.
    layers = {layer.path: layer.compression.storage_dtype for layer in bsr_jax.pruning_plan(lambda v, x: module.apply(v, x), v, tokens).layers}
    attention = "MultiHeadDotProductAttention_0"
    expected = [f"{b}/{layer}" for b in ("blocks_1", "blocks_2") for layer in (f"{attention}/query", f"{attention}/key", f"{attention}/value", "Dense_0", "Dense_1")]
    assert sorted(layers) == sorted([*expected, f"blocks_2/{attention}/out"])
    assert set(layers.values()) == {"int4"}
    # blocks_1's out layer takes dense's weight gradient; blocks_2's, int4's.
    grads = jax.grad(lambda p: loss(module, {"params": p}, tokens))(v["params"])
    dense = jax.grad(lambda p: loss(AttentionNet(), {"params": p}, tokens))(v["params"])
    chex.assert_trees_all_close(grads["blocks_1"][attention]["out"], dense["blocks_1"][attention]["out"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(grads["blocks_2"][attention]["out"]["kernel"], dense["blocks_2"][attention]["out"]["kernel"], rtol=1e-3)


def test_int4_outdense_is_not_offered_to_blocks_without_an_attention_output_projection():
    from bsr_jax.planning.linen import Linen

    family = Linen(Net(), lambda module, variables, x: jnp.mean(module.apply(variables, x) ** 2), (X,), None, None)
    assert "not every block has a layer matching ['*/out']" in family.unavailable["int4-outdense"]
    # A block without one could be given the option, whose rule compress_model would refuse: every block needs it.
    class Mixed(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(32)(x)
            x = AttentionBlock(name="blocks_0")(x)
            return Block(width=32, name="blocks_1")(x)

    tokens = jax.random.normal(jax.random.key(2), (4, 16, 8))
    mixed = Linen(Mixed(), lambda module, variables, x: jnp.mean(module.apply(variables, x) ** 2), (tokens,), None, None)
    assert mixed.blocks == ("blocks_0", "blocks_1") and "int4-outdense" in mixed.unavailable
    with pytest.raises(ValueError, match=r"options \['int4-outdense'\] not available for this model: int4-outdense: not every block"):
        planner.plan(Net(), lambda module, variables, x: jnp.mean(module.apply(variables, x) ** 2), X, optimizer=optax.adamw(1e-3),
                     budget=0.5, options=["remat", "int4-outdense"], progress=False)
