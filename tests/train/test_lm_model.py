"""train.lm_model: shapes, parameter counts, scan = loop, and compress_model on scanned, remat'd layers
(rules by path, compressed residuals, the lean pass inside the scan's body)."""

from __future__ import annotations

import dataclasses
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

import bsr_jax
from bsr_jax import Pruning, Rule
from train import lm_config, lm_data
from train.lm_attention import causal_attention
from train.lm_model import LM, PRESETS, LMShape, num_params

TINY = LMShape(dim=32, depth=3, heads=2, hidden=64, vocab_size=97, seq_len=16)
TOKENS = jax.random.randint(jax.random.key(0), (2, 16), 0, 97)
INT8 = Pruning(0.0, block=16, storage_dtype="int8")


def stacked(params: dict, depth: int) -> dict:
    """The Python-loop model's ``layer_{i}`` parameters as the scanned model's ``layers``."""
    layers = [params[f"layer_{i}"] for i in range(depth)]
    rest = {k: v for k, v in params.items() if not k.startswith("layer_")}
    return {**rest, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}


def test_names_match_the_flag_lists():
    assert tuple(PRESETS) == lm_config.LM_MODELS and lm_data.TOKENIZERS == lm_config.TOKENIZERS


@pytest.mark.parametrize("tie", [False, True])
def test_shapes_dtypes_and_parameter_count(tie):
    model = LM(TINY, tie=tie)
    params = model.init(jax.random.key(1), TOKENS)["params"]
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    assert sum(x.size for x in jax.tree.leaves(params)) == num_params(TINY, tie)
    assert ("head" in params) != tie
    logits = model.apply({"params": params}, TOKENS)
    assert logits.shape == (2, 16, 97) and logits.dtype == jnp.float32
    features = model.apply({"params": params}, TOKENS, features_only=True)
    assert features.shape == (2, 16, 32) and features.dtype == jnp.bfloat16


def test_presets_sizes():
    assert 5e6 < num_params(PRESETS["cpu"]) < 1e7
    assert 0.9e9 < num_params(PRESETS["1b"]) < 1.3e9
    assert PRESETS["gpt2-small"].depth == 12 and PRESETS["gpt2-small"].dim == 768


def test_causal_attention_ignores_later_positions():
    q, k, v = jax.random.normal(jax.random.key(2), (3, 1, 5, 2, 4))
    out = causal_attention(q, k, v)
    changed = causal_attention(q, k.at[:, 3:].set(7.0), v.at[:, 3:].set(-7.0))
    np.testing.assert_array_equal(out[:, :3], changed[:, :3])
    assert not np.allclose(out[:, 3:], changed[:, 3:])


@pytest.mark.parametrize("remat", [False, True])
def test_scan_computes_what_the_loop_computes(remat):
    loop = LM(TINY, dtype=jnp.float32)
    params = loop.init(jax.random.key(1), TOKENS)["params"]
    scanned = LM(TINY, scan=True, remat=remat, dtype=jnp.float32)
    init = scanned.init(jax.random.key(1), TOKENS)["params"]
    assert jax.tree.map(jnp.shape, init) == jax.tree.map(jnp.shape, stacked(params, TINY.depth))
    np.testing.assert_allclose(scanned.apply({"params": stacked(params, TINY.depth)}, TOKENS), loop.apply({"params": params}, TOKENS),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def _loss(model, params, rngs=None):
    logits = model.apply({"params": params}, TOKENS[:, :-1], rngs=rngs)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), TOKENS[:, 1:, None], -1))


def test_compress_model_reaches_every_layer_inside_scan_and_remat():
    model = LM(TINY, scan=True, remat=True)
    params = model.init(jax.random.key(1), TOKENS)["params"]
    # A rule by path for one layer kind, another for the rest, the head left dense.
    rules = [Rule("layers/mlp/down", Pruning(0.5, block=16, storage_dtype="int8")), Rule("head", None), Rule("*", INT8)]
    compressed = bsr_jax.compress_model(model, rules)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer reported dense
        out = jax.jit(compressed.apply)({"params": params}, TOKENS)
    np.testing.assert_array_equal(out, jax.jit(model.apply)({"params": params}, TOKENS))  # forward bit-identical

    plan = bsr_jax.pruning_plan(compressed.apply, {"params": params}, TOKENS)
    by_path = {layer.path: layer.compression for layer in plan}
    assert set(by_path) == {f"layers/{m}" for m in ("attn/q", "attn/k", "attn/v", "attn/o", "mlp/gate", "mlp/up", "mlp/down")}
    assert by_path["layers/mlp/down"].sparsity == 0.5 and by_path["layers/attn/o"] == INT8

    grads = jax.jit(jax.grad(lambda p: _loss(model, p)))(params)
    compressed_grads = jax.jit(jax.grad(lambda p: _loss(compressed, p)))(params)
    for name in ("q", "k", "v", "o"):
        a, b = grads["layers"]["attn"][name]["kernel"], compressed_grads["layers"]["attn"][name]["kernel"]
        assert a.shape[0] == TINY.depth
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) < 0.05  # int8 residuals: close
        assert not np.array_equal(a, b)  # and really from the compressed residual
    np.testing.assert_allclose(compressed_grads["embed"]["embedding"], grads["embed"]["embedding"], rtol=0.05, atol=1e-4)


def test_residuals_stay_compressed_inside_scan():
    model = LM(TINY, scan=True, dtype=jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(1), TOKENS)["params"]
    compressed = bsr_jax.compress_model(model, [Rule("head", None), Rule("*", Pruning(0.0, block=16, storage_dtype="int4"))])
    kept = lambda m: bsr_jax.residual_bytes(lambda p, t: _loss(m, p), params, TOKENS).activations
    assert kept(compressed) < 0.6 * kept(model)


def _scan_outputs(jaxpr) -> list[tuple[int, ...]]:
    """Shapes of what every ``scan`` in ``jaxpr``, at any depth, returns (its carries and stacks)."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            shapes += [tuple(v.aval.shape) for v in eqn.outvars]
        for sub in jex_core.jaxprs_in_params(eqn.params):
            shapes += _scan_outputs(sub)
    return shapes


@pytest.mark.parametrize("remat", [False, True])
def test_lean_pass_reaches_inside_scan(remat):
    """compress_model's lean pass (bsr_jax.rewrite.lean_graph) evaluates the scan's body segment by
    segment, as it does a Python loop of layers: no scan of the backward pass stacks the layers'
    attention probabilities (B, heads, T, T), which a checkpoint around the whole scan recomputes
    for all layers at once before the backward scan reads them (issue 34: gpt2-small's int4 step
    at 0.96 of dense's compiled H100 peak with scan, 0.41 with a loop). Forward bits and gradients
    stay plain autodiff's."""
    model = LM(TINY, scan=True, remat=remat, dtype=jnp.float32)
    params = model.init(jax.random.key(1), TOKENS)["params"]
    compressed = bsr_jax.compress_model(model, [Rule("*", None)])  # the lean pass alone
    batch, seq_len = TOKENS.shape[0], TOKENS.shape[1] - 1  # _loss's inputs
    probabilities = (TINY.depth, batch, TINY.heads, seq_len, seq_len)
    stacks = lambda m: _scan_outputs(jax.make_jaxpr(jax.grad(lambda p: _loss(m, p)))(params).jaxpr)
    assert (probabilities in stacks(model)) != remat  # the plain model's backward reads them unless remat'd
    assert probabilities not in stacks(compressed)

    np.testing.assert_array_equal(jax.jit(compressed.apply)({"params": params}, TOKENS), jax.jit(model.apply)({"params": params}, TOKENS))
    grads = jax.jit(jax.grad(lambda p: _loss(model, p)))(params)
    chex.assert_trees_all_close(jax.jit(jax.grad(lambda p: _loss(compressed, p)))(params), grads, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # test_dx holds the stored formats, test_compress_model_reaches_every_layer_inside_scan_and_remat the scan
def test_dx_inside_scan_stores_what_the_loop_stores():
    """``compress_model(..., dx=...)`` reaches the scan's body: the scanned model's gradients are
    the Python loop's under the same approximate-dx format (int8 inputs of norms, activations and
    attention, carries included), not plain autodiff's."""
    shape = dataclasses.replace(TINY, dim=160, hidden=320, depth=2)  # (B, T, D) inputs over dx's MIN_COMPRESSED
    loop, scanned = LM(shape, dtype=jnp.float32), LM(shape, scan=True, dtype=jnp.float32)
    params = loop.init(jax.random.key(1), TOKENS)["params"]
    grad = lambda model, p: jax.jit(jax.grad(lambda p: _loss(model, p)))(p)
    lean = lambda model: bsr_jax.compress_model(model, [Rule("*", None)], dx="int8")
    approx = grad(lean(scanned), stacked(params, shape.depth))
    chex.assert_trees_all_close(approx, stacked(grad(lean(loop), params), shape.depth), rtol=1e-5, atol=1e-7)
    exact = grad(scanned, stacked(params, shape.depth))["layers"]["attn"]["q"]["kernel"]
    assert float(jnp.linalg.norm(approx["layers"]["attn"]["q"]["kernel"] - exact) / jnp.linalg.norm(exact)) > 1e-3
