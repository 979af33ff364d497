"""bsr_jax.ops.attention: Flax's dot-product attention, bit for bit, with flash attention's backward."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import bsr_jax
from bsr_jax.ops.attention import dot_product_attention

BATCH, LENGTH, HEADS, DEPTH = 2, 24, 3, 8
F32_TOL = dict(atol=1e-5, rtol=1e-5)  # float rounding only: the softmax derivative's row sums taken another way

CASES = {
    "plain": {},
    "bias": {"bias": True},
    "causal mask": {"mask": True},
    "bias, mask, dropout": {"bias": True, "mask": True, "dropout_rate": 0.2},
    "dropout per element": {"dropout_rate": 0.3, "broadcast_dropout": False},
    "f32 softmax": {"mask": True, "force_fp32_for_softmax": True},
}


def _arrays(dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(keys[i], (BATCH, LENGTH, HEADS, DEPTH), dtype) for i in range(3))
    bias = jax.random.normal(keys[3], (1, HEADS, LENGTH, LENGTH), jnp.float32)  # broadcast over the batch
    return q, k, v, bias


def _call(attention, case):
    """loss(q, k, v, bias) through ``attention`` with ``case``'s arguments."""
    mask = nn.make_causal_mask(jnp.ones((BATCH, LENGTH))) if case.get("mask") else None
    extra = {name: value for name, value in case.items() if name not in ("bias", "mask")}
    if "dropout_rate" in extra:
        extra["dropout_rng"] = jax.random.key(5)

    def out(q, k, v, bias):
        return attention(q, k, v, bias=bias if case.get("bias") else None, mask=mask, **extra)

    return out


def _loss(out):
    return lambda *arrays: jnp.sum(jnp.sin(out(*arrays).astype(jnp.float32)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_is_flax_bit_for_bit(case, dtype):
    arrays = _arrays(dtype)
    ours = jax.jit(_call(dot_product_attention, CASES[case]))(*arrays)
    flax = jax.jit(_call(nn.dot_product_attention, CASES[case]))(*arrays)
    chex.assert_trees_all_equal(ours, flax)
    assert ours.dtype == flax.dtype


@pytest.mark.parametrize("keep_output", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_f32_gradients_are_autodiffs_of_flax(case, keep_output):
    arrays = _arrays(jnp.float32)
    grad = lambda attention: jax.jit(jax.grad(_loss(_call(attention, CASES[case])), argnums=(0, 1, 2, 3)))(*arrays)  # noqa: E731
    ours = functools.partial(dot_product_attention, keep_output=keep_output)
    chex.assert_trees_all_close(grad(ours), grad(nn.dot_product_attention), **F32_TOL)


def test_bf16_gradients_are_no_further_from_f32_than_autodiffs():
    """In bf16 the softmax derivative is formed in f32 here, in bf16 by autodiff: both are compared
    with the f32 gradient of the same (bf16-valued) inputs."""
    q, k, v, bias = _arrays(jnp.bfloat16, seed=1)
    case = CASES["causal mask"]
    exact = jax.grad(_loss(_call(nn.dot_product_attention, case)), argnums=(0, 1, 2))(*(a.astype(jnp.float32) for a in (q, k, v)), bias)

    def error(attention):
        grads = jax.grad(_loss(_call(attention, case)), argnums=(0, 1, 2))(q, k, v, bias)
        return [float(jnp.linalg.norm(g.astype(jnp.float32) - e) / jnp.linalg.norm(e)) for g, e in zip(grads, exact)]

    ours, autodiff = error(dot_product_attention), error(nn.dot_product_attention)
    assert all(o <= a * 1.05 for o, a in zip(ours, autodiff)), (ours, autodiff)
    assert max(ours) < 2e-2


def test_typed_and_raw_dropout_keys_drop_what_flax_drops():
    q, k, v, _ = _arrays(jnp.float32)
    for rng in (jax.random.key(3), jax.random.PRNGKey(3)):
        kwargs = dict(dropout_rng=rng, dropout_rate=0.5)
        chex.assert_trees_all_equal(dot_product_attention(q, k, v, **kwargs), nn.dot_product_attention(q, k, v, **kwargs))


@pytest.mark.parametrize("keep_output, kept", [(True, 4), (False, 3)])
def test_keeps_q_k_v_and_the_output_only_where_asked(keep_output, kept):
    q, k, v, _ = _arrays(jnp.float32)
    attention = functools.partial(dot_product_attention, keep_output=keep_output)
    residuals = bsr_jax.residual_bytes(lambda q, k, v: jnp.sum(attention(q * 2, k * 2, v * 2)), q, k, v).residuals
    assert [r.shape for r in residuals].count(q.shape) == kept


def test_compressed_output_projection_means_no_output_kept():
    """Inside compress_model, an nn.MultiHeadDotProductAttention whose out layer keeps int4 codes does
    not keep the attention's output beside them; with the out layer dense, it shares its input."""
    x = jax.random.normal(jax.random.key(0), (2, 10, 16))
    attention = nn.MultiHeadDotProductAttention(num_heads=2)
    params = attention.init(jax.random.key(1), x)
    int4 = bsr_jax.Pruning(0.0, block=16, storage_dtype="int4")

    def shapes(rules):
        model = bsr_jax.compress_model(attention, rules)
        kept = bsr_jax.residual_bytes(lambda p, x: jnp.sum(model.apply(p, x)), params, x).residuals
        return [tuple(r.shape) for r in kept]

    head_shape = (2, 10, 2, 8)  # (batch, length, heads, head_dim): q, k, v and the output
    assert shapes([bsr_jax.Rule("*out", int4), bsr_jax.Rule("*", None)]).count(head_shape) == 3  # q, k, v
    # The output too (the out layer's input, named once more for the attention: one buffer in XLA).
    assert shapes([bsr_jax.Rule("*", None)]).count(head_shape) >= 4


def test_keeps_no_scores_or_probabilities():
    q, k, v, bias = _arrays(jnp.float32)
    square = (BATCH, HEADS, LENGTH, LENGTH)
    for attention, most in ((dot_product_attention, 0), (nn.dot_product_attention, None)):
        kept = bsr_jax.residual_bytes(_loss(_call(attention, CASES["bias, mask, dropout"])), q, k, v, bias).residuals
        count = [r.shape for r in kept].count(square)
        assert count == most if most is not None else count >= 3  # Flax: scores, probabilities, dropout mask


@pytest.mark.parametrize("kwargs, match", [(dict(dropout_rate=1.0), "dropout_rate"), (dict(dropout_rate=-0.1), "dropout_rate"),
                                           (dict(dropout_rate=0.1), "dropout_rng")])  # fmt: skip
def test_bad_dropout_arguments_are_named(kwargs, match):
    q, k, v, _ = _arrays(jnp.float32)
    with pytest.raises(ValueError, match=match):
        dot_product_attention(q, k, v, **kwargs)


class _TwoAttentions(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = x + nn.MultiHeadDotProductAttention(num_heads=2, name=f"block_{i}")(x)
        return x


def test_lean_rules_by_path_give_lean_modules_this_attention_only():
    """compress_model's lean rules by path (what bsr_jax.plan assembles): the lean block's attention
    keeps no (B, heads, T, T) array, the block kept as traced keeps Flax's, with the same gradients."""
    x = jax.random.normal(jax.random.key(0), (2, 10, 16))
    model = _TwoAttentions()
    params = model.init(jax.random.key(1), x)
    square = (2, 2, 10, 10)

    def kept(lean):
        compressed = bsr_jax.compress_model(model, [bsr_jax.Rule("*", None)], lean=lean)
        loss = lambda p, x: jnp.sum(jnp.sin(compressed.apply(p, x)))  # noqa: E731
        ours = str(jax.make_jaxpr(loss)(params, x)).count("custom_vjp_call")  # this module's attention, as traced
        return ours, [tuple(r.shape) for r in bsr_jax.residual_bytes(loss, params, x).residuals], jax.grad(loss)(params, x)

    (ours, first_lean, grads), (none, neither, plain) = kept([("block_0", True), ("*", False)]), kept([("*", False)])
    assert (ours, none) == (1, 0)
    assert neither.count(square) >= 2 * 2  # Flax keeps at least the scores' and probabilities' arrays per block
    assert first_lean.count(square) == neither.count(square) // 2
    chex.assert_trees_all_close(grads, plain, **F32_TOL)
