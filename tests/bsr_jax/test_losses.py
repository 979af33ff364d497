"""bsr_jax.ops.losses.chunked_softmax_cross_entropy: the plain loss and gradients, without the logits array."""

from __future__ import annotations

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bsr_jax.ops.losses import chunked_softmax_cross_entropy

B, T, D, V = 2, 37, 16, 50


def inputs(dtype=jnp.float32):
    kh, kw, kl = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(kh, (B, T, D)).astype(dtype)
    w = jax.random.normal(kw, (D, V)) * 0.3
    labels = jax.random.randint(kl, (B, T), 0, V).at[0, :3].set(-1)  # a few ignored tokens
    return h, w, labels


def plain(h, w, labels):
    logits = jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
    return jnp.where(labels >= 0, losses, 0.0)


@pytest.mark.parametrize("chunk", [8, 37, 1000])  # 8: padded last chunk; 1000: one chunk
def test_loss_and_gradients_equal_the_plain_form(chunk):
    h, w, labels = inputs()
    weights = jax.random.uniform(jax.random.key(1), (B, T))  # a non-uniform cotangent per token
    losses = jax.jit(chunked_softmax_cross_entropy, static_argnames="chunk")(h, w, labels, chunk=chunk)
    np.testing.assert_allclose(losses, plain(h, w, labels), rtol=1e-6, atol=1e-6)
    grad = lambda f: jax.jit(jax.grad(lambda h, w: jnp.sum(f(h, w, labels) * weights), argnums=(0, 1)))(h, w)
    chunked = grad(lambda h, w, l: chunked_softmax_cross_entropy(h, w, l, chunk=chunk))
    for got, want in zip(chunked, grad(plain)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(chunked[0][0, :3]).max()) == 0.0  # ignored tokens get no gradient


def test_bf16_features_follow_a_bf16_dense():
    h, w, labels = inputs(jnp.bfloat16)
    loss = lambda f: lambda h, w: jnp.mean(f(h, w, labels))
    chunked = lambda h, w, l: chunked_softmax_cross_entropy(h, w, l, chunk=16)
    np.testing.assert_allclose(jax.jit(loss(chunked))(h, w), loss(plain)(h, w), rtol=1e-5)
    (dh, dw), (dh_ref, dw_ref) = (jax.jit(jax.grad(loss(f), argnums=(0, 1)))(h, w) for f in (chunked, plain))
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    np.testing.assert_allclose(dw, dw_ref, rtol=2e-2, atol=2e-4)
    np.testing.assert_allclose(dh.astype(jnp.float32), dh_ref.astype(jnp.float32), rtol=2e-2, atol=2e-3)


def test_logits_dtype_reads_the_logits_a_bf16_dense_returns():
    """A bf16 head rounds its logits to bf16; a loss on them cast to f32 is matched to f32 rounding
    (without the rounding, only to bf16's); gradients to bf16 rounding (reordered f32 sums)."""
    h, w, labels = inputs(jnp.bfloat16)
    labels = jnp.maximum(labels, 0)
    plain_bf16 = lambda h, w: optax.softmax_cross_entropy_with_integer_labels(jnp.dot(h, w.astype(h.dtype)).astype(jnp.float32), labels).mean()
    chunked = lambda dtype: lambda h, w: chunked_softmax_cross_entropy(h, w, labels, chunk=16, logits_dtype=dtype).mean()
    want = plain_bf16(h, w)
    np.testing.assert_allclose(jax.jit(chunked(jnp.bfloat16))(h, w), want, rtol=1e-6)
    assert abs(float(jax.jit(chunked(jnp.float32))(h, w)) - float(want)) > 1e-6 * float(want)  # the rounding matters
    (dh, dw), (dh_ref, dw_ref) = (jax.jit(jax.grad(f, argnums=(0, 1)))(h, w) for f in (chunked(jnp.bfloat16), plain_bf16))
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-2, atol=1e-2 * float(jnp.abs(dw_ref).max()))
    np.testing.assert_allclose(dh.astype(jnp.float32), dh_ref.astype(jnp.float32), rtol=1e-2, atol=1e-2 * float(jnp.abs(dh_ref).max()))
    with pytest.raises(ValueError, match="logits_dtype"):
        chunked_softmax_cross_entropy(h, w, labels, logits_dtype=jnp.int32)


@pytest.mark.parametrize("dtype, rtol, loss_rtol", [(jnp.float32, 1e-5, 1e-6), (jnp.bfloat16, 1e-2, 1e-3)])
def test_a_bias_is_added_and_differentiated_as_a_dense_does(dtype, rtol, loss_rtol):
    """``h @ w + b`` as ``nn.Dense(dtype=dtype)`` computes it (the bias added in ``dtype`` after the
    product's rounding). f32: the loss to f32 rounding, gradients (the bias' too) to summation
    order. bf16: XLA may fuse the product and the add and round once (measured 3e-5 of the loss
    apart): the loss within 1e-3, gradients within a bf16 step; the plain bias gradient is a sum
    over tokens in bf16 (the chunked one sums in f32): within 5% of its largest element."""
    h, w, labels = inputs(dtype)
    labels = jnp.maximum(labels, 0)
    b = jax.random.normal(jax.random.key(5), (V,))
    dense = lambda h, w, b: (jnp.dot(h, w.astype(dtype)) + b.astype(dtype)).astype(jnp.float32)
    plain_loss = lambda h, w, b: optax.softmax_cross_entropy_with_integer_labels(dense(h, w, b), labels).mean()
    chunked = lambda h, w, b: chunked_softmax_cross_entropy(h, w, labels, chunk=16, logits_dtype=dtype, bias=b).mean()
    np.testing.assert_allclose(jax.jit(chunked)(h, w, b), jax.jit(plain_loss)(h, w, b), rtol=loss_rtol)
    got, want = (jax.jit(jax.grad(f, argnums=(0, 1, 2)))(h, w, b) for f in (chunked, plain_loss))
    assert got[2].dtype == b.dtype and float(jnp.abs(got[2]).max()) > 0
    for g, r, tol in zip(got, want, (rtol, rtol, 1e-5 if dtype == jnp.float32 else 5e-2), strict=True):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol * np.abs(r).max())
    with pytest.raises(ValueError, match="bias must be"):
        chunked_softmax_cross_entropy(h, w, labels, bias=b[:-1])


def _largest_array(jaxpr) -> int:
    sizes = [0]
    for eqn in jaxpr.eqns:
        sizes += [int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            sizes.append(_largest_array(sub))
    return max(sizes)


def test_no_array_of_all_the_logits_exists():
    h, w, labels = inputs()
    step = lambda h, w: jax.value_and_grad(lambda h, w: chunked_softmax_cross_entropy(h, w, labels, chunk=8).mean(), argnums=(0, 1))(h, w)
    assert _largest_array(jax.make_jaxpr(step)(h, w).jaxpr) <= max(8 * V, (B * T + 8) * D, D * V)  # chunk logits, padded h, dw
    reference = lambda h, w: jax.value_and_grad(lambda h, w: plain(h, w, labels).mean(), argnums=(0, 1))(h, w)
    assert _largest_array(jax.make_jaxpr(reference)(h, w).jaxpr) >= B * T * V  # what the plain form holds


def test_inside_a_checkpoint_that_keeps_products_the_chunk_logits_are_not_kept():
    """compress_model's lean_graph runs the model (and a loss inside it) under jax.checkpoint with a
    policy keeping products: the forward keeps its lse (named), not every chunk's logits."""
    from bsr_jax.rewrite.lean_graph import policy

    h, w, labels = inputs()
    loss = jax.checkpoint(lambda h, w: chunked_softmax_cross_entropy(h, w, labels, chunk=8).mean(), policy=policy)
    assert _largest_array(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(h, w).jaxpr) <= max(8 * V, (B * T + 8) * D, D * V)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_summed_losses_take_their_gradient_from_the_forward(dtype):
    """``summed=True`` (the losses only summed with one weight): the same loss and gradients as the
    recomputing form (f32: summation order; bf16 h: each token's dlogits is rounded to bf16 before
    the cotangent's scale rather than after, so the weight gradient's sums of rounded terms differ
    by up to ~1% of its largest element), padded chunk, negative labels and bias included; no array
    of all the logits either."""
    h, w, labels = inputs()
    h = h.astype(dtype)
    labels = labels.at[0, 0].set(-1)
    b = jax.random.normal(jax.random.key(7), (V,))
    losses = lambda summed: lambda h, w, b: 3.0 * chunked_softmax_cross_entropy(h, w, labels, chunk=7, bias=b, summed=summed).mean()
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-3)  # largest dw element ~0.15
    got, want = (jax.jit(jax.value_and_grad(losses(s), argnums=(0, 1, 2)))(h, w, b) for s in (True, False))
    chex.assert_trees_all_close(got, want, **tol)
    assert _largest_array(jax.make_jaxpr(jax.grad(losses(True), argnums=(0, 1)))(h, w, b).jaxpr) <= max(7 * V, (B * T + 7) * D, D * V)


def test_bad_arguments_raise():
    h, w, labels = inputs()
    with pytest.raises(ValueError, match="labels"):
        chunked_softmax_cross_entropy(h, w, labels[:, :-1])
    with pytest.raises(ValueError, match="w must be"):
        chunked_softmax_cross_entropy(h, w.T, labels)
    with pytest.raises(ValueError, match="chunk"):
        chunked_softmax_cross_entropy(h, w, labels, chunk=0)


def test_inside_shard_map_as_a_data_parallel_step_calls_it():
    from jax.sharding import Mesh, PartitionSpec

    h, w, labels = inputs()
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("data",))

    def local(h, w, labels):
        w = jax.lax.pcast(w, "data", to="varying")  # replicated params as per-device values (train.sharding)
        grads = jax.grad(lambda h, w: chunked_softmax_cross_entropy(h, w, labels, chunk=8).mean(), argnums=(0, 1))(h, w)
        return grads[0], jax.lax.pmean(grads[1], "data")

    spec = PartitionSpec("data")
    mapped = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, PartitionSpec(), spec), out_specs=(spec, PartitionSpec())))
    want = jax.grad(lambda h, w: plain(h, w, labels).mean(), argnums=(0, 1))(h, w)
    for got, ref in zip(mapped(h, w, labels), want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
