"""Approximate input gradients (bsr_jax.ops.dx): the forward pass exact, the backward pass plain
autodiff's at the stored (int8/int4) inputs, within the formats' rounding; the compiled step keeps
the stored codes instead of the input."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bsr_jax
from bsr_jax.ops import dx as dx_lib
from train import models

_gelu = lambda x: jax.nn.gelu(x, approximate=False)  # noqa: E731


def _relative(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _inputs():
    x = jax.random.normal(jax.random.key(0), (256, 512)) * 3.0
    return x, jax.random.normal(jax.random.key(1), (256, 512))


def test_without_a_format_the_function_is_returned_as_it_is():
    assert dx_lib.stored_compressed(_gelu, None) is _gelu


@pytest.mark.parametrize("dx,bound", [("int8", 0.02), ("int4", 0.2)])
def test_forward_is_exact_and_dx_is_autodiff_at_the_stored_input(dx, bound):
    x, w = _inputs()
    f = dx_lib.stored_compressed(_gelu, dx)
    chex.assert_trees_all_equal(f(x), _gelu(x))
    got = jax.grad(lambda x: jnp.sum(w * f(x)))(x)
    exact = jax.grad(lambda x: jnp.sum(w * _gelu(x)))(x)
    stored = dx_lib.decompress(dx_lib.compress(x, dx), x.shape)
    at_stored = jax.vjp(_gelu, stored)[1](w)[0]
    chex.assert_trees_all_close(got, at_stored, rtol=1e-6, atol=1e-6)  # what it computes, exactly
    error = _relative(got, exact)
    assert 0 < error < bound  # approximate, within the format's documented bound


def test_int4_is_coarser_than_int8():
    x, w = _inputs()
    exact = jax.grad(lambda x: jnp.sum(w * _gelu(x)))(x)
    errors = [_relative(jax.grad(lambda x: jnp.sum(w * dx_lib.stored_compressed(_gelu, f)(x)))(x), exact) for f in ("int8", "int4")]
    assert errors[0] < errors[1] / 4


def test_keys_masks_and_small_inputs_are_kept_as_they_are():
    x, w = _inputs()

    def attention(q, k, scale, key):
        p = jax.nn.softmax(q @ k.T * scale)
        return jax.random.bernoulli(key, 0.9, p.shape) * p

    f = dx_lib.stored_compressed(attention, "int8")
    q, k, scale, key = x[:, :64], w[:, :64], jnp.float32(0.125), jax.random.key(3)
    chex.assert_trees_all_equal(f(q, k, scale, key), attention(q, k, scale, key))
    got = jax.grad(lambda q, k, s: jnp.sum(f(q, k, s, key) * 2.0), argnums=(0, 1, 2))(q, k, scale)
    exact = jax.grad(lambda q, k, s: jnp.sum(attention(q, k, s, key) * 2.0), argnums=(0, 1, 2))(q, k, scale)
    for g, e in zip(got, exact):
        assert _relative(g, e) < 0.05


def test_bad_formats_are_named():
    with pytest.raises(ValueError, match=r"dx must be None \(exact\) or one of \('int8', 'int4'\), got 'int2'"):
        dx_lib.stored_compressed(_gelu, "int2")


def test_the_compiled_step_keeps_int8_codes_not_the_input():
    """A GELU MLP compiled for H100: with dx int8, the f32 GELU input is not what the backward
    keeps; the peak falls by most of its bytes."""
    w1 = jax.ShapeDtypeStruct((256, 1024), jnp.float32)
    x = jax.ShapeDtypeStruct((8192, 256), jnp.float32)

    def step(dx):
        act = dx_lib.stored_compressed(_gelu, dx) if dx else jax.checkpoint(_gelu)
        return jax.grad(lambda w, x: jnp.sum(act(x @ w) ** 2))

    exact = bsr_jax.compiled_memory(step(None), w1, x, target="h100")
    int8 = bsr_jax.compiled_memory(step("int8"), w1, x, target="h100")
    hidden = 8192 * 1024 * 4
    assert int8.peak < exact.peak - 0.6 * hidden
    text = bsr_jax.measure.compiled.compile_for(step("int8"), w1, x, target="h100").as_text()
    assert "s8[65536,1,128]" in text  # the stored codes, 1 x 128 blocks kept lane-dense as they are (barriers.Stored)


def test_resmlp_with_approximate_dx_keeps_its_forward_and_parameters():
    x = jax.random.normal(jax.random.key(2), (4, 32, 32, 3))
    common = dict(num_classes=10, dim=64, depth=2, patch_size=4)
    exact, approx = models.ResMLP(**common), models.ResMLP(**common, dx="int8")
    params = jax.jit(exact.init)(jax.random.key(0), x)  # jitted: one compile, not op by op
    chex.assert_trees_all_equal(jax.tree.structure(params), jax.tree.structure(jax.eval_shape(approx.init, jax.random.key(0), x)))
    chex.assert_trees_all_equal(jax.jit(approx.apply)(params, x), jax.jit(exact.apply)(params, x))
    loss = lambda m: (lambda p: jnp.mean(m.apply(p, x) ** 2))  # noqa: E731
    got, want = jax.jit(jax.grad(loss(approx)))(params), jax.jit(jax.grad(loss(exact)))(params)
    flat_got, flat_want = jax.tree.leaves(got), jax.tree.leaves(want)
    errors = [_relative(g, w) for g, w in zip(flat_got, flat_want) if float(jnp.linalg.norm(w)) > 0]
    assert max(errors) < 0.05 and np.mean(errors) > 0  # approximate, close


def _vit_case():
    from tests import third_party_models as tpm

    c = tpm.Config(layers=2, width=128, mlp=512, heads=4, batch=8, image=32, patch=4, classes=10)
    model, x = tpm.vit(c), jax.random.normal(jax.random.key(0), (8, 32, 32, 3))
    return model, x, tpm.jitter(jax.jit(model.init)(jax.random.key(1), x))  # the head starts at zero: no gradient


def test_compress_model_stores_every_recognised_dx_residual_in_the_format():
    """vision_transformer's ViT: LayerNorm inputs, q/k/v and the GELU input kept in int8; the
    forward bit-identical, every gradient close to exact, fewer residual bytes than exact dx."""
    model, x, params = _vit_case()
    rules = [bsr_jax.Rule("*", None)]
    exact = bsr_jax.compress_model(model, rules)
    approx = bsr_jax.compress_model(model, rules, dx="int8")
    chex.assert_trees_all_equal(jax.jit(approx.apply)(params, x), jax.jit(model.apply)(params, x))
    loss = lambda m: (lambda p: jnp.mean(m.apply(p, x) ** 2))  # noqa: E731
    want = jax.jit(jax.grad(loss(model)))(params)
    got = jax.jit(jax.grad(loss(approx)))(params)
    # The key bias's exact gradient is zero up to rounding (softmax ignores a shift of every
    # logit), so its relative error means nothing: leaves below 1e-6 are left out.
    errors = [_relative(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)) if float(jnp.linalg.norm(w)) > 1e-6]
    assert 0 < max(errors) < 0.05
    exact_bytes = bsr_jax.residual_bytes(loss(exact), params).activations
    # Measured 0.69: the Dense layers' own inputs stay f32 under Rule("*", None) (0.58 while exact
    # dx kept each GELU's output beside its input, before the second Dense recomputed it).
    assert bsr_jax.residual_bytes(loss(approx), params).activations < 0.75 * exact_bytes


def test_dx_rules_by_module_path_turn_it_off_per_layer():
    model, x, params = _vit_case()
    rules = [bsr_jax.Rule("*", None)]
    loss = lambda m: (lambda p: jnp.mean(m.apply(p, x) ** 2))  # noqa: E731
    grad = lambda dx: jax.jit(jax.grad(loss(bsr_jax.compress_model(model, rules, dx=dx))))(params)  # noqa: E731
    exact, off = grad(None), grad([("*", None)])
    chex.assert_trees_all_equal(off, exact)
    mlp_only = grad([("*ViTMlpBlock*", "int8")])
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(mlp_only), jax.tree.leaves(exact)))


def test_dx_needs_lean_linen_and_a_known_format():
    model, _, _ = _vit_case()
    with pytest.raises(ValueError, match="dx needs lean=True"):
        bsr_jax.compress_model(model, [bsr_jax.Rule("*", None)], lean=False, dx="int8")
    with pytest.raises(ValueError, match="dx must be None"):
        bsr_jax.compress_model(model, [bsr_jax.Rule("*", None)], dx=[("*", "fp2")])


def test_inputs_the_backward_does_not_read_are_not_kept():
    """``gelu(x) + y``: the backward reads x (kept in int8), not y (linear): one array of their size
    among the residuals, x's int8 codes, and y's gradient exact."""
    x, w = _inputs()
    f = dx_lib.stored_compressed(lambda x, y: _gelu(x) + y, "int8", unread=[False, True])
    loss = lambda x, y: jnp.sum(f(x, y))  # noqa: E731
    _, vjp = jax.vjp(loss, x, w)
    (codes,) = [r for r in jax.tree.leaves(vjp) if getattr(r, "size", 0) == x.size]
    assert codes.dtype == jnp.int8
    gx, gy = jax.grad(loss, argnums=(0, 1))(x, w)
    chex.assert_trees_all_equal(gy, jnp.ones_like(w))
    assert _relative(gx, jax.grad(lambda x: jnp.sum(_gelu(x)))(x)) < 0.02


# ---- one test per approximation kind, on hand-written modules, against plain autodiff ----
# Each model is Dense -> one module of a kind -> Dense, written as model libraries write them (no
# flax norm, activation or attention): its only segment lean_graph gives dx is that module's own
# computation. With dx on (``dx="int8"`` / ``"int4"``) every parameter gradient is within the bound
# docs/memory.md gives for the kind and format, and differs from plain autodiff; with the module's
# path turned off by a dx rule (every other module on) the gradients are plain autodiff's up to float
# reassociation; and what the backward keeps of the module is its input(s) in int8 codes.

# docs/memory.md, "Approximate dx": the bound on any gradient's relative error, per kind and format
# (benchmarks/accuracy/dx_error.py and these modules measured at most about half of each).
DX_BOUND = {"norm": {"int8": 0.02, "int4": 0.25}, "swiglu": {"int8": 0.02, "int4": 0.25}, "attention": {"int8": 0.05, "int4": 0.6}}


class _RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, h):
        weight = self.param("weight", nn.initializers.ones, (h.shape[-1],))
        return weight * h * jax.lax.rsqrt(jnp.mean(h**2, axis=-1, keepdims=True) + 1e-6)


class _SwiGLU(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, h):
        gate, up = nn.Dense(self.hidden, name="gate")(h), nn.Dense(self.hidden, name="up")(h)
        return nn.Dense(h.shape[-1], name="down")(jax.nn.silu(gate) * up)


class _EinsumAttention(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, h):
        b, t, d = h.shape
        q, k, v = (nn.Dense(d, name=n)(h).reshape(b, t, self.heads, d // self.heads) for n in ("q", "k", "v"))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(d // self.heads))
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return nn.Dense(d, name="o")(out.reshape(b, t, d))


_KINDS = {
    "norm": (lambda: _RMSNorm(name="norm"), 1),  # the norm's input
    "swiglu": (lambda: _SwiGLU(256, name="mlp"), 2),  # gate and up
    "attention": (lambda: _EinsumAttention(4, name="attn"), 3),  # q, k, v
}


class _Net(nn.Module):
    kind: str

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(128, name="inp")(x)
        return nn.Dense(8, name="out")(_KINDS[self.kind][0]()(h))


def _kind_case(kind):
    model = _Net(kind)
    x = jax.random.normal(jax.random.key(0), (2, 32, 64))
    params = model.init(jax.random.key(1), x)
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(2), p.shape), params)
    target = jax.random.normal(jax.random.key(3), (2, 32, 8))
    loss = lambda m: (lambda p: jnp.mean((m.apply(p, x) - target) ** 2))  # noqa: E731
    return model, params, loss


def _grad_errors(got, want):
    # The key bias's exact gradient is zero up to rounding (softmax ignores a shift of every logit).
    return [_relative(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)) if float(jnp.linalg.norm(w)) > 1e-6]


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_each_kind_is_approximate_within_its_bound_and_exact_when_its_path_is_off(kind):
    model, params, loss = _kind_case(kind)
    rules = [bsr_jax.Rule("*", None)]
    plain = jax.jit(jax.grad(loss(model)))(params)
    name = {"norm": "norm", "swiglu": "mlp", "attention": "attn"}[kind]
    for fmt, bound in DX_BOUND[kind].items():
        approx = jax.jit(jax.grad(loss(bsr_jax.compress_model(model, rules, dx=fmt))))(params)
        errors = _grad_errors(approx, plain)
        assert 0 < max(errors) < bound, (fmt, errors)
    # Off by a rule naming its path (every other module on): plain autodiff's, reassociated.
    off = bsr_jax.compress_model(model, rules, dx=[(name, None), ("*", "int8")])
    chex.assert_trees_all_close(jax.jit(jax.grad(loss(off)))(params), plain, rtol=1e-5, atol=1e-7)
    # What the backward keeps of the module: its input(s) as int8 codes, nothing else of their size.
    _, vjp = jax.vjp(loss(bsr_jax.compress_model(model, rules, dx="int8")), params)
    codes = [r for r in jax.tree.leaves(vjp) if getattr(r, "dtype", None) == jnp.int8]
    assert len(codes) == _KINDS[kind][1] and all(c.size == 2 * 32 * (128 if kind != "swiglu" else 256) for c in codes)
