"""residual_report: every kept array once, at the module that produced it, with the right kind."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
import third_party_models as tpm
from flax import nnx

import bsr_jax
from bsr_jax import Pruning, Rule
from bsr_jax.rewrite.lean import lean_neighbours
from bsr_jax.measure.report import KINDS, module_path, residual_report


class Block(nn.Module):
    """LayerNorm feeding q, k, v (one kept array read by three layers), a pruned layer, GELU."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = h + nn.MultiHeadDotProductAttention(num_heads=2)(h)
        h = bsr_jax.Dense(32, sparsity=0.5, block=4)(h)
        return nn.Dense(4)(nn.gelu(h))


def block_report():
    x = jax.ShapeDtypeStruct((2, 8, 16), jnp.float32)  # nothing runs: shapes are enough
    params = jax.eval_shape(Block().init, jax.random.key(0), x)
    loss = lambda p, x: jnp.sum(Block().apply(p, x) ** 2)
    return residual_report(loss, params, x), bsr_jax.residual_bytes(loss, params, x)


def test_rows_sum_to_residual_bytes_and_each_array_once():
    report, counted = block_report()
    assert report.total == counted.total == report.totals()["total"]
    assert len(report.rows) == len(counted.residuals)
    assert sum(v for k, v in report.totals().items() if k != "total") == report.total
    assert set(report.totals()) == {*KINDS, "total"}


def test_a_reused_kernel_is_one_parameter_row():
    w, x = jnp.ones((16, 16)), jnp.ones((4, 16))
    report = residual_report(lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w)), w, x)
    assert [(r.kind, r.shape) for r in report.rows if r.kind == "parameter"] == [("parameter", (16, 16))]


def test_kinds_and_paths():
    report, _ = block_report()
    rows = {(r.path, r.kind): r for r in report.rows}
    assert rows[("0/params/Dense_0/kernel", "parameter")].shape == (16, 32)
    compressed = [r for r in report.rows if r.kind == "compressed"]
    # Module paths as rules name them: the root's class name ("Block") is not part of them.
    assert compressed and {r.path for r in compressed} == {"Dense_0"}
    assert {r.readers for r in compressed} == {("Dense_0",)}
    (shared,) = [r for r in report.rows if r.kind == "shared"]
    attention = "MultiHeadDotProductAttention_0"
    assert shared.path == "LayerNorm_0" and shared.shape == (2, 8, 16)
    assert set(shared.readers) == {f"{attention}/query", f"{attention}/key", f"{attention}/value"}
    assert ("LayerNorm_0", "parameter") in rows  # the scale, reshaped for broadcasting
    assert [r for r in report.rows if r.kind == "input"] == []  # LayerNorm keeps x - mean, not x
    dense_paths = {r.path for r in report.rows if r.kind == "dense"}
    assert {"LayerNorm_0", attention, ""} <= dense_paths


def test_an_input_kept_as_is_or_reshaped_is_an_input():
    w, x = jnp.ones((16, 8)), jnp.ones((2, 4, 16))
    report = residual_report(lambda w, x: jnp.sum(x.reshape(8, 16) @ w), w, x)
    assert [(r.kind, r.path, r.shape) for r in report.rows if r.kind != "parameter"] == [("input", "", (8, 16))]


def test_module_path_removes_transform_wrappers_and_lifted_repeats():
    assert module_path("transpose(jvp(Net))/Dense_0/transpose()") == "Net/Dense_0"
    assert module_path("jvp(Net)/LayerNorm_0/LayerNorm_0.normalise/LayerNorm_0") == "Net/LayerNorm_0"
    assert module_path("transpose(jvp(Net))/LayerNorm_0/jvp(Net)/LayerNorm_0") == "Net/LayerNorm_0"
    assert module_path("jvp()") == ""
    assert module_path("jvp(Head)/wte.attend", frozenset({"Head"})) == "wte"  # a method scope is its module
    assert module_path("Head/attn/bqhd,bkhd->bhqk", frozenset({"Head"})) == "attn"  # an einsum's scope is none


def test_format_groups_by_path_and_kind():
    report, _ = block_report()
    text = str(report)
    assert text == f"{report.format()}\n\n{report.layers}"  # then the per-layer table: bsr_jax.Dense's row
    assert [(row.path, row.compresses) for row in report.layers] == [("Dense_0", True)]
    lines = report.format().splitlines()
    legend = any(r.path == "" or "" in r.readers for r in report.rows)  # the "(top level): ..." line
    assert len(lines) == 1 + len(report.by_path()) + legend + 1
    assert any(line.startswith("Dense_0") and " compressed " in line for line in lines)
    assert lines[-1].endswith(f"total {report.total / 2**20:.3f} MiB")
    assert len(report.format(group=False).splitlines()) == 1 + len(report.rows) + legend + 1


def test_arrays_outside_every_submodule_print_as_top_level_with_what_that_is():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="head")(jnp.tanh(nn.Dense(8, name="fc")(x)))  # tanh: the root's own

    model, x = Net(), jnp.ones((2, 6))
    params = model.init(jax.random.key(0), x)
    report = residual_report(lambda p, x: jnp.sum(model.apply(p, x) ** 2), params, x)
    # The root's tanh output (read by head's dW) and the logits (read by the loss's own square).
    top_rows = [r for r in report.rows if r.path == ""]
    assert {r.shape for r in top_rows} == {(2, 4), (2, 8)}
    for group in (True, False):
        lines = report.format(group=group).splitlines()
        top = [line for line in lines if line.startswith("(top level) ")]
        assert len(top) == (len({r.kind for r in top_rows}) if group else len(top_rows))
        assert not any(line.startswith("- ") or " -> -" in line or ", -" in line for line in lines)
        assert lines[-2] == (
            "(top level): made or read outside every submodule: by the loss function itself or the root module's own code"
        )


def test_lean_vit_keeps_no_attention_probabilities_per_the_report():
    c = tpm.TINY
    model, x, labels = tpm.vit(c), jax.ShapeDtypeStruct((c.batch, c.image, c.image, 3), jnp.float32), tpm.labels(c)
    params = jax.eval_shape(model.init, jax.random.key(0), x)

    def loss(params, x, lean):
        with lean_neighbours(lean):
            return tpm.classifier_loss(model.apply(params, x), labels)

    tokens = (c.image // c.patch) ** 2 + 1
    probabilities = (c.batch, c.heads, tokens, tokens)
    plain, lean = (residual_report(lambda p, x: loss(p, x, lean), params, x) for lean in (False, True))
    attention_rows = [r for r in plain.rows if r.shape == probabilities]
    assert attention_rows and all(r.path.endswith("MultiHeadDotProductAttention_0") for r in attention_rows)
    assert all(r.path.startswith("encoderblock_") for r in attention_rows)  # as rules name them
    assert not [r for r in lean.rows if r.shape == probabilities]
    assert lean.totals()["parameter"] >= plain.totals()["parameter"]  # lean norms keep their scales
    assert lean.totals()["dense"] < 0.5 * plain.totals()["dense"]


def test_named_blocks_stay_compressed_through_views():
    from jax.ad_checkpoint import checkpoint_name

    from bsr_jax.core.names import RESIDUAL_NAME

    def loss(w, x):
        blocks = jax.lax.stop_gradient(checkpoint_name(jnp.tanh(x), RESIDUAL_NAME)).reshape(4, 4, 4)
        return jnp.sum(blocks * w)  # dw needs the blocks

    report = residual_report(loss, jnp.ones((4, 4, 4)), jnp.ones((16, 4)))
    assert [(r.kind, r.shape) for r in report.rows] == [("compressed", (4, 4, 4))]


def test_a_batch_closed_over_by_the_loss_is_data_not_parameters():
    """``loss = lambda p: ...(x)``: activations depend on the closed-over batch, so they are
    activations (and the batch an input), the same table as with the batch passed."""
    report, _ = block_report()
    x = jax.random.normal(jax.random.key(0), (2, 8, 16))
    params = Block().init(jax.random.key(1), x)
    closed = residual_report(lambda p: jnp.sum(Block().apply(p, x) ** 2), params)
    passed = residual_report(lambda p, x: jnp.sum(Block().apply(p, x) ** 2), params, x)
    # Without dx of the batch to compute, a little less is kept; the activations are the same kinds.
    assert 0.8 * passed.totals()["dense"] <= closed.totals()["dense"] <= passed.totals()["dense"]
    assert closed.totals()["compressed"] == passed.totals()["compressed"] > 0
    assert closed.totals()["parameter"] <= passed.totals()["parameter"]
    parameters = lambda report: {(r.path, r.shape) for r in report.rows if r.kind == "parameter"}
    assert parameters(closed) <= parameters(passed)


@pytest.mark.parametrize("nested", [False, True])
def test_nnx_rows_name_the_modules_as_rules_do(nested):
    """NNX modules record no name stack of their own: the rows still carry their attribute paths,
    the paths compress_model's rules matched (nested: ``layers/0/fc1``)."""
    c = tpm.TINY
    model, at = (nnx.Sequential(tpm.nnx_mlp(c)), "layers/0/") if nested else (tpm.nnx_mlp(c), "")
    # lean=False: lean norms run under nnx.remat, whose module copies take their caller's path.
    model = bsr_jax.compress_model(model, [Rule(f"{at}fc2", None), Rule(f"{at}fc1", Pruning(0.5, block=4))], lean=False)
    graph, state = nnx.split(model)
    report = residual_report(lambda state, x: jnp.sum(nnx.merge(graph, state)(x) ** 2), state, tpm.features(c))
    compressed = [r for r in report.rows if r.kind == "compressed"]
    assert compressed and {r.path for r in compressed} == {f"{at}fc1"}
    assert {r.readers for r in compressed} == {(f"{at}fc1",)}
    assert {(f"{at}norm", "parameter"), (f"{at}norm", "dense"), (f"{at}fc1", "dense")} <= set(report.by_path())
    mlp = at.rstrip("/")  # the MLP's own code (gelu) and the loss's (``** 2``: the root's, "")
    assert {reader for r in report.rows for reader in r.readers} == {"", mlp, f"{at}norm", f"{at}fc1", f"{at}fc2"}
