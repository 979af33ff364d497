"""The per-layer table (issue 43): rules resolved once per layer into a LayerTable, which
compress_model applies as it is; pruning_plan, residual_report and the planner read the same table."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import bsr_jax
from bsr_jax import LayerTable, Pooling, Pruning, Rule, compress_model, layer_table
from bsr_jax.core.layer_table import LayerRow
from bsr_jax.rewrite import rules as rules_lib

pytestmark = pytest.mark.filterwarnings("ignore:bsr_jax. fc2 stays dense:UserWarning")  # asserted where it matters
INT8 = Pruning(0.5, block=4, storage_dtype="int8")
POOLING_ON_DENSE = "Dense is not a convolution, and Pooling compresses convolution inputs only"


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(32, name="fc1")(nn.LayerNorm()(x)))
        h = nn.Dense(16, name="fc2")(h)  # a Pooling rule: dense, with why
        h = bsr_jax.Dense(16, sparsity=0.5, block=4, name="own")(h)  # no rule: its own options
        h = nn.Dense(16, name="plain")(h)  # no rule: dense
        return nn.Dense(4, name="head")(h)  # Rule(head, None): dense


RULES = [Rule("head", None), Rule("fc2", Pooling(2)), Rule("fc*", INT8)]


@pytest.fixture(scope="module")
def linen():
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    params = Net().init(jax.random.key(0), x)
    with pytest.warns(UserWarning, match=f"fc2 stays dense: {POOLING_ON_DENSE}"):
        table = layer_table(compress_model(Net(), RULES).apply, params, x)
    return x, params, table


def test_the_table_lists_dense_and_compressed_layers_with_why(linen):
    _, _, table = linen
    assert [(r.path, r.layer, r.compression, r.reason) for r in table] == [
        ("fc1", "Dense", INT8, None),
        ("fc2", "Dense", None, POOLING_ON_DENSE),
        ("own", "Dense", Pruning(0.5, block=4), None),
        ("plain", "Dense", None, None),
        ("head", "Dense", None, None)]  # fmt: skip
    assert table[0].input == jax.ShapeDtypeStruct((2, 8, 16), jnp.float32)
    assert table[0].kept_bytes < table[0].dense_bytes == 2 * 8 * 16 * 4
    assert table[1].input is None and table[1].kept_bytes is None
    lines = str(table).splitlines()
    assert lines[0].split() == ["module", "path", "layer", "keeps", "input", "dense", "KiB", "kept", "KiB", "why", "dense"]
    assert lines[2].split()[:3] == ["fc2", "Dense", "dense"] and lines[2].endswith(POOLING_ON_DENSE)
    assert lines[-1] == "5 layer call(s): 2 compressed, 3 keep their input"


def test_pruning_plan_is_the_tables_compressing_rows(linen):
    x, params, table = linen
    plan = bsr_jax.pruning_plan(compress_model(Net(), RULES).apply, params, x)
    assert list(plan) == [table[0], table[2]] and plan.layers == (table[0], table[2])
    assert str(plan).splitlines()[1:3] == str(table).splitlines()[1:4:2]  # one formatter


def _linen_step(model, params, x):
    return jax.jit(jax.value_and_grad(lambda p: jnp.sum(model.apply(p, x) ** 2)))(params)


def test_a_linen_table_applies_as_its_rules_did(linen):
    x, params, table = linen
    by_rules, by_table = compress_model(Net(), RULES), compress_model(Net(), table)
    chex.assert_trees_all_equal(by_table.apply(params, x), by_rules.apply(params, x))  # forward bit-identical
    chex.assert_trees_all_equal(_linen_step(by_table, params, x), _linen_step(by_rules, params, x))
    assert layer_table(by_table.apply, params, x) == table  # an applied table resolves to itself, reasons included
    # The table, not a rule, decides: fc1's row made dense gives fc1 its exact weight gradient.
    dense_fc1 = LayerTable((LayerRow("fc1", "Dense", None), *table[1:]))
    exact = _linen_step(compress_model(Net(), [Rule("fc1", None), *RULES[:2]]), params, x)[1]["params"]["fc1"]
    chex.assert_trees_all_equal(_linen_step(compress_model(Net(), dense_fc1), params, x)[1]["params"]["fc1"], exact)
    assert not jnp.array_equal(exact["kernel"], _linen_step(by_rules, params, x)[1]["params"]["fc1"]["kernel"])


def test_a_table_row_the_model_does_not_have_is_named(linen):
    x, params, table = linen
    for path in ("blocks/fc1", "fc*"):  # a path it lacks; and no globbing: "fc*" in fc1's place names no layer
        wrong = LayerTable((*(row for row in table if row.path != "fc1"), LayerRow(path, "Dense", INT8)))
        with pytest.raises(ValueError, match=rf"table row\(s\) for \[{path!r}\] match no layer".replace("*", r"\*")):
            compress_model(Net(), wrong).apply(params, x)


class Shared(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(16, name="shared")
        w = self.param("w", nn.initializers.lecun_normal(), (16, 16))
        return dense(dense(x) @ w)  # one layer called twice; the root's own product on a parameter


def test_each_path_is_resolved_once_per_trace_and_each_call_has_a_row(monkeypatch):
    x = jax.random.normal(jax.random.key(1), (4, 16))
    model = compress_model(Shared(), Rule("*", INT8))
    params = model.init(jax.random.key(0), x)
    calls = []
    resolve = rules_lib.resolve
    monkeypatch.setattr(rules_lib, "resolve", lambda rules, path, *a: calls.append(path) or resolve(rules, path, *a))
    table = layer_table(lambda p: jax.grad(lambda p: jnp.sum(model.apply(p, x)))(p), params)
    assert sorted(calls) == ["", "shared"]  # uncached: shared per call, the root per product and as its call ends
    assert [(row.path, row.layer, row.compression) for row in table] == [("shared", "Dense", INT8), ("", "Shared", INT8), ("shared", "Dense", INT8)]


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(16, 32, rngs=rngs)
        self.conv = nnx.Conv(32, 16, (3,), rngs=rngs)
        self.fc2 = nnx.Linear(16, 16, rngs=rngs)  # a Pooling rule: dense, with why
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(self.fc2(self.conv(nnx.gelu(self.fc1(x)))))


NNX_RULES = [Rule("head", None), Rule("conv", Pooling(2)), Rule("fc2", Pooling(2)), Rule("*", INT8)]


def _nnx_step(model, x):
    return nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)


def test_an_nnx_table_applies_as_its_rules_did():
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    with pytest.warns(UserWarning, match="fc2 stays dense: Linear is not a convolution"):
        by_rules = compress_model(NnxNet(nnx.Rngs(0)), NNX_RULES)
    table = layer_table(lambda x: by_rules(x), x)
    # In module order (NNX layers resolve before any call), with inputs where a call compressed.
    assert [(r.path, r.layer, r.compression, r.reason is not None, r.input is not None) for r in table] == [
        ("conv", "Conv", Pooling(2), False, True),
        ("fc1", "Linear", INT8, False, True),
        ("fc2", "Linear", None, True, False),
        ("head", "Linear", None, False, False)]  # fmt: skip
    with pytest.warns(UserWarning, match="fc2 stays dense: Linear is not a convolution"):
        by_table = compress_model(NnxNet(nnx.Rngs(0)), table)
    chex.assert_trees_all_equal(by_table(x), by_rules(x))
    chex.assert_trees_all_equal(_nnx_step(by_table, x), _nnx_step(by_rules, x))
    assert layer_table(lambda x: by_table(x), x) == table
    with pytest.raises(ValueError, match=r"table row\(s\) for \['mlp/fc1'\] match no nnx.Linear"):
        compress_model(NnxNet(nnx.Rngs(0)), LayerTable((*table, LayerRow("mlp/fc1", "Linear", INT8))))


def test_residual_report_prints_the_table_after_the_residuals(linen):
    x, params, table = linen
    model = compress_model(Net(), table)
    with pytest.warns(UserWarning, match="fc2 stays dense"):
        report = bsr_jax.residual_report(lambda p, x: jnp.sum(model.apply(p, x) ** 2), params, x)
    assert report.layers == table
    assert str(report) == f"{report.format()}\n\n{table}"
