"""bsr_jax.ops.head_loss: a head + optax softmax cross-entropy written as usual, recognised and chunked.

Tolerances: in f32 the chunked loss and gradients differ from the plain ones only by f32 summation
order (rtol 1e-5). A bf16 head's logits are rounded to bf16 in both forms (``logits_dtype``); where
the loss then reads them cast to f32 the loss is equal to f32 rounding, and a gradient element may
differ by one bf16 ulp where a reordered f32 sum crosses a rounding boundary (rtol 1e-2). Where
optax reads the bf16 logits themselves it computes its softmax in bf16 and the chunked form in f32
on the same logits: they differ by bf16 rounding (one bf16 ulp of the loss, ~1% of a gradient's
largest element)."""

from __future__ import annotations

import warnings

import bsr_jax  # before jax: deviceless H100 compiles need it first  # isort: skip
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bsr_jax.ops import head_loss
from bsr_jax.ops.head_loss import chunked_head_loss

V, T, B = 96, 12, 2


class NanoBlock(nn.Module):
    heads: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        b, t, c = x.shape
        q, k, v = jnp.split(nn.Dense(3 * c, dtype=self.dtype, name="c_attn")(nn.LayerNorm(dtype=self.dtype)(x)), 3, axis=-1)
        split = lambda a: a.reshape(b, t, self.heads, c // self.heads).transpose(0, 2, 1, 3)
        att = jnp.einsum("bhtd,bhsd->bhts", split(q), split(k)) / np.sqrt(c // self.heads)
        att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -jnp.inf), axis=-1)
        y = jnp.einsum("bhts,bhsd->bhtd", att, split(v)).transpose(0, 2, 1, 3).reshape(b, t, c)
        x = x + nn.Dense(c, dtype=self.dtype, name="c_proj")(y)
        h = nn.gelu(nn.Dense(4 * c, dtype=self.dtype, name="c_fc")(nn.LayerNorm(dtype=self.dtype)(x)))
        return x + nn.Dense(c, dtype=self.dtype, name="mlp_proj")(h)


class NanoGPT(nn.Module):
    """nanoGPT's layout: the head tied to the token embedding, the loss inside ``__call__``."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, idx, targets):
        wte = nn.Embed(V, 32, dtype=self.dtype, name="wte")
        x = wte(idx) + nn.Embed(T, 32, dtype=self.dtype, name="wpe")(jnp.arange(idx.shape[1]))
        x = NanoBlock(4, self.dtype, name="h_0")(x)
        logits = wte.attend(nn.LayerNorm(dtype=self.dtype, name="ln_f")(x))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return logits, loss


class Llama(nn.Module):
    """A Llama-ish decoder (RMSNorm by hand, SwiGLU, bf16 compute, f32 parameters) returning logits."""

    vocab: int = V
    dim: int = 32
    cast: jnp.dtype | None = None  # what the logits are cast to after the head
    head_bias: bool = False  # flax's lm1b example: the head has a bias

    @nn.compact
    def __call__(self, tokens):
        rms = lambda x, name: x * jax.lax.rsqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-6) * self.param(name, nn.initializers.ones, (x.shape[-1],))
        x = nn.Embed(self.vocab, self.dim, dtype=jnp.bfloat16, name="embed")(tokens)
        h = rms(x, "norm_0")
        gate, up = (nn.Dense(2 * self.dim, use_bias=False, dtype=jnp.bfloat16, name=n)(h) for n in ("gate", "up"))
        x = x + nn.Dense(self.dim, use_bias=False, dtype=jnp.bfloat16, name="down")(nn.silu(gate) * up)
        logits = nn.Dense(self.vocab, use_bias=self.head_bias, dtype=jnp.bfloat16, name="lm_head")(rms(x, "norm"))
        return logits if self.cast is None else logits.astype(self.cast)


def batch(vocab=V, tokens=T, rows=B):
    data = jax.random.randint(jax.random.key(3), (rows, tokens + 1), 0, vocab)
    return data[:, :-1], data[:, 1:]


def init(model, *args):
    return jax.jit(model.init)(jax.random.key(0), *args)  # op by op, an init takes seconds


def integer_loss(model):
    return lambda params, x, y: optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()


def one_hot_loss(model):
    return lambda params, x, y: optax.softmax_cross_entropy(model.apply(params, x), jax.nn.one_hot(y, model.vocab)).mean()


def assert_close(got, want, rtol, loss_rtol):
    np.testing.assert_allclose(np.float32(got[0]), np.float32(want[0]), rtol=loss_rtol)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max())


def no_warnings(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args)


@pytest.mark.parametrize("dtype, rtol, loss_rtol, compressed", [(jnp.float32, 1e-5, 1e-6, True), (jnp.bfloat16, 2e-2, 1e-2, False)])
def test_nanogpt_loss_inside_the_model(dtype, rtol, loss_rtol, compressed):
    """f32 through ``compress_model(..., loss_chunk=)`` (the tied head kept plain by a rule, every
    other layer int4: the same compressed model without loss_chunk is the reference); bf16 (optax
    on the bf16 logits) through ``chunked_head_loss`` around ``apply``."""
    x, y = batch()
    rules = [bsr_jax.Rule("wte", None), bsr_jax.Rule("*", bsr_jax.Pruning(0.0, block=16, storage_dtype="int4"))]
    params = init(NanoGPT(dtype), x, y)
    step = lambda model: jax.jit(jax.value_and_grad(lambda p: model.apply(p, x, y)[1]))
    if compressed:
        plain = step(bsr_jax.compress_model(NanoGPT(dtype), rules))(params)
        chunked = no_warnings(step(bsr_jax.compress_model(NanoGPT(dtype), rules, loss_chunk=8)), params)
    else:
        loss = lambda p: NanoGPT(dtype).apply(p, x, y)[1]
        plain = jax.jit(jax.value_and_grad(loss))(params)
        chunked = no_warnings(jax.jit(jax.value_and_grad(chunked_head_loss(loss, chunk=8))), params)
    assert chunked[0].dtype == plain[0].dtype == dtype  # the optax call's dtype
    assert_close(chunked, plain, rtol, loss_rtol)


@pytest.mark.parametrize("labels, head_bias", [(integer_loss, False), (one_hot_loss, False), (integer_loss, True)])
def test_llama_loss_outside_the_model_through_the_function_transform(labels, head_bias):
    """bf16 logits cast to f32 before the loss (a widening cast keeps them recognised); a head
    with a bias (flax's lm1b) too."""
    model = Llama(cast=jnp.float32, head_bias=head_bias)
    x, y = batch()
    params = init(model, x)
    loss = labels(model)
    plain = jax.jit(jax.value_and_grad(loss))(params, x, y)
    chunked = no_warnings(jax.jit(jax.value_and_grad(chunked_head_loss(loss, chunk=8))), params, x, y)
    assert_close(chunked, plain, rtol=1e-2, loss_rtol=1e-6)
    assert optax.softmax_cross_entropy_with_integer_labels is optax.losses._classification.softmax_cross_entropy_with_integer_labels


@pytest.mark.parametrize("after_head, reason", [
    (lambda logits: logits[:, :-1], "not a head projection's output"),
    (lambda logits: logits.astype(jnp.float16), "cast from bfloat16 to float16"),
])  # fmt: skip
def test_logits_computed_on_after_the_head_warn_and_run_exactly_as_written(after_head, reason):
    model = Llama()
    x, y = batch()
    params = init(model, x)

    def loss(p, x, y):
        logits = after_head(model.apply(p, x))
        return optax.softmax_cross_entropy_with_integer_labels(logits, y[:, : logits.shape[1]]).mean()

    with pytest.warns(UserWarning, match=reason):
        got, want = jax.jit(lambda *a: (chunked_head_loss(loss, chunk=8)(*a), loss(*a)))(params, x, y)
    assert np.array_equal(got, want)


def test_compress_model_warns_where_nothing_is_recognised_and_is_off_by_default(monkeypatch):
    calls = []
    chunked = head_loss.chunked_softmax_cross_entropy
    monkeypatch.setattr(head_loss, "chunked_softmax_cross_entropy", lambda *a, **k: calls.append(1) or chunked(*a, **k))
    x, y = batch()
    params = init(NanoGPT(), x, y)
    rules = [bsr_jax.Rule("wte", None), bsr_jax.Rule("*", bsr_jax.Pruning(0.5, block=16))]
    trace = lambda model: jax.eval_shape(jax.grad(lambda p: model.apply(p, x, y)[1]), params)
    no_warnings(trace, bsr_jax.compress_model(NanoGPT(), rules))  # off by default: optax's own loss
    assert calls == []
    no_warnings(trace, bsr_jax.compress_model(NanoGPT(), rules, loss_chunk=8))
    assert calls == [1]
    with pytest.warns(UserWarning, match="a compress_model rule compresses the head wte"):
        trace(bsr_jax.compress_model(NanoGPT(), rules[1:], loss_chunk=8))
    llama = Llama()
    with pytest.warns(UserWarning, match="no optax softmax cross-entropy was called in Llama.apply"):  # the loss is outside
        jax.eval_shape(bsr_jax.compress_model(llama, rules[1:], loss_chunk=8).apply, init(llama, x), x)
    assert calls == [1]
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="loss_chunk"):
            bsr_jax.compress_model(llama, rules, loss_chunk=bad)
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        chunked_head_loss(integer_loss(llama), chunk=0)


def test_a_compressed_models_head_is_recognised_through_its_lean_evaluation():
    """compress_model's lean neighbours evaluate the traced model again (bsr_jax.rewrite.lean_graph): the
    head's record follows its logits out; gradients are the compressed model's plain ones."""
    x, y = batch()
    rules = [bsr_jax.Rule("lm_head", None), bsr_jax.Rule("*", bsr_jax.Pruning(0.0, block=16, storage_dtype="int4"))]
    model = bsr_jax.compress_model(Llama(cast=jnp.float32), rules, remat=[("down", None)])
    params = init(Llama(), x)
    loss = integer_loss(model)
    plain = jax.jit(jax.value_and_grad(loss))(params, x, y)
    chunked = no_warnings(jax.jit(jax.value_and_grad(chunked_head_loss(loss, chunk=8))), params, x, y)
    assert_close(chunked, plain, rtol=1e-2, loss_rtol=1e-6)


@pytest.mark.parametrize("compressed", [False, True])
def test_h100_step_holds_no_logits_at_its_peak(compressed):
    """The compiled H100 step of a model whose logits dominate: the (B*T, V) arrays are gone (the
    model as written, and compress_model'd with its lean neighbours)."""
    vocab, rows, tokens = 16384, 4, 512  # bf16 logits 64 MiB: above cuBLAS's 32 MiB workspace
    model = Llama(vocab=vocab, cast=jnp.float32)
    if compressed:
        model = bsr_jax.compress_model(model, [bsr_jax.Rule("lm_head", None), bsr_jax.Rule("*", bsr_jax.Pruning(0.0, block=16, storage_dtype="int4"))])
    x, y = batch(vocab, tokens, rows)
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    loss = integer_loss(model)
    plain, chunked = (bsr_jax.compiled_memory(jax.grad(f), params, x, y, target="h100", breakdown=True)
                      for f in (loss, chunked_head_loss(loss, chunk=256)))  # fmt: skip
    logits_bytes = rows * tokens * vocab * 2  # bf16; the f32 ones are twice that
    assert max(b.bytes for b in plain.live_at_peak) >= logits_bytes  # the check can fail
    assert max(b.bytes for b in chunked.live_at_peak) < logits_bytes
    assert chunked.peak < 0.4 * plain.peak  # measured 60.3 MB against 211.0 MB (0.29x)


class _TinyLM(nn.Module):
    @nn.compact
    def __call__(self, idx):
        return nn.Dense(V, name="head")(nn.gelu(nn.Embed(V, 32)(idx)))


@pytest.mark.parametrize(
    "reduce, summed",
    [
        (lambda l, mask: l.mean(), True),
        (lambda l, mask: 2.0 * l.astype(jnp.float32).sum() / l.size, True),
        (lambda l, mask: (l * mask).sum() / mask.sum(), False),  # per-token weights
        (lambda l, mask: l[:, 1:].mean(), False),  # a slice: the first token's weight is 0
        (lambda l, mask: l.mean(axis=0).sum(), False),  # not one sum over every token
    ],
)
def test_losses_only_summed_get_their_gradient_in_the_forward(monkeypatch, reduce, summed):
    """Where only a sum over every token reads the losses, each token's cotangent is the same, and
    the gradient is computed in the forward (no second head product); otherwise the logits are
    recomputed in the backward. Both equal optax's gradients (f32 rounding)."""
    flags = []
    chunked = head_loss.chunked_softmax_cross_entropy
    monkeypatch.setattr(head_loss, "chunked_softmax_cross_entropy", lambda *a, **k: flags.append(k["summed"]) or chunked(*a, **k))
    model = _TinyLM()
    x, y = batch()
    params = init(model, x)
    mask = (jnp.arange(T) % 3 != 0).astype(jnp.float32)[None, :] * jnp.ones((B, 1))

    def loss(p, x, y):
        return reduce(optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y), mask)

    step = chunked_head_loss(loss, chunk=7)  # 24 tokens: the last chunk padded
    got = jax.jit(jax.grad(step))(params, x, y)
    chex.assert_trees_all_close(got, jax.jit(jax.grad(loss))(params, x, y), rtol=1e-5, atol=1e-7)
    assert flags == [False, summed]  # the look at the trace, then the step
    # Summed: three products per chunk (logits, dh, dw), all in the forward; else a fourth, the
    # logits again in the backward (besides, the head's own product, unused: XLA removes it).
    products = str(jax.make_jaxpr(jax.grad(step))(params, x, y)).count("dot_general[")
    assert products == (4 if summed else 5)
